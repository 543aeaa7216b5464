"""SAAP's two assignment functions: keys to their nearest centroid, queries through the query model (Q-model).

Keys (§4 "Asymmetric assignment"): a key belongs to the one bucket whose (unit) centroid has the largest inner
product with it: the assignment of faiss' spherical k-means (IndexFlatIP over normalised centroids), which does not
depend on the key's norm.

Queries (§6.1): an MLP per (layer, KV head), "two layers with an intermediate dimension of 1024, batch normalization
and a ReLU": Linear(D, M) -> BatchNorm -> ReLU -> Linear(M, C), whose softmax is the query's distribution over the
C buckets (f_q of eq. 1). A query head uses its KV head's model; "Batched queries" (§5) sums the group's
distributions before the top-ℓ buckets are chosen. Without a Q-model (the paper's k-means baselines) a query scores
each bucket by its inner product with the centroid (IVF's search side).

`QueryModel` trains every (layer, KV head)'s MLP at once (parameters [L, H, ...], each head's an independent
slice); its batch norm takes statistics over the queries a step trains on (a mask leaves the others out) and is
folded into the first layer for inference (`folded`): the runtime runs Linear -> ReLU -> Linear.
"""

from __future__ import annotations

import math

import torch
from torch import nn

BN_EPS = 1e-5
BN_MOMENTUM = 0.1  # torch's BatchNorm default


class QueryModel(nn.Module):
    """Every (layer, KV head)'s Q-model: x [L, H, n, D] -> bucket logits [L, H, n, C]."""

    def __init__(self, layers: int, heads: int, d: int, hidden: int, clusters: int, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)

        def uniform(*shape, fan_in):  # nn.Linear's default init, drawn from our generator
            bound = 1 / math.sqrt(fan_in)
            return nn.Parameter((torch.rand(*shape, generator=g) * 2 - 1) * bound)

        self.w1, self.b1 = uniform(layers, heads, d, hidden, fan_in=d), uniform(layers, heads, hidden, fan_in=d)
        self.gamma = nn.Parameter(torch.ones(layers, heads, hidden))
        self.beta = nn.Parameter(torch.zeros(layers, heads, hidden))
        self.w2 = uniform(layers, heads, hidden, clusters, fan_in=hidden)
        self.b2 = uniform(layers, heads, clusters, fan_in=hidden)
        self.register_buffer("running_mean", torch.zeros(layers, heads, hidden))
        self.register_buffer("running_var", torch.ones(layers, heads, hidden))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """x [L, H, n, D]; mask bool [L, H, n]: the rows a training step's batch statistics come from (all when
        None). In eval mode the running statistics are used, as the folded model does.

        Batch norm of an affine layer is an affine layer: h = x w1 + b1 has, over the masked rows, mean
        mu_x w1 + b1 and per hidden unit the variance w1_m' S_x w1_m (S_x the rows' D x D covariance, in fp64), so
        the statistics come from x and the normalisation folds into w1 and b1. The step runs two matrix products
        and one ReLU over the [n, M] hidden activations instead of a dozen elementwise passes; the gradients are
        those of the unfolded layers (the same function)."""
        if self.training:
            m = torch.ones(x.shape[:-1], dtype=torch.bool, device=x.device) if mask is None else mask
            w = m.unsqueeze(-1).to(torch.float64)
            n = w.sum(2, keepdim=True)  # [L, H, 1, 1]
            x64, w1 = x.to(torch.float64), self.w1.to(torch.float64)
            mu = (x64 * w).sum(2, keepdim=True) / n.clamp(min=1)  # [L, H, 1, D]
            xc = (x64 - mu) * w
            cov = xc.transpose(-1, -2) @ xc / n.clamp(min=1)  # [L, H, D, D]
            some = (n > 0).squeeze(-1)  # [L, H, 1]: a head without rows has mean 0 and variance 0, as before
            mean = ((mu @ w1).squeeze(2) + self.b1.to(torch.float64)) * some  # [L, H, M]
            var = ((cov @ w1) * w1).sum(-2).clamp(min=0)
            with torch.no_grad():  # heads with fewer than two rows this step keep their running statistics
                upd = (n > 1).squeeze(-1)
                cnt = n.squeeze(-1)
                unbiased = (var * cnt / (cnt - 1).clamp(min=1)).float()
                self.running_mean.copy_(torch.where(upd, torch.lerp(self.running_mean, mean.float(), BN_MOMENTUM),
                                                    self.running_mean))
                self.running_var.copy_(torch.where(upd, torch.lerp(self.running_var, unbiased, BN_MOMENTUM),
                                                   self.running_var))
            s = self.gamma / torch.sqrt(var.float() + BN_EPS)  # [L, H, M]
            # (x w1 + b1 - mean) s + beta with the rows centred first: (x - mu) w1 s + beta (+ b1 s without rows)
            x_in = x - mu.to(x.dtype)
            b1 = self.beta + self.b1 * s * ~some
        else:
            s = self.gamma / torch.sqrt(self.running_var + BN_EPS)
            x_in, b1 = x, (self.b1 - self.running_mean) * s + self.beta
        h = torch.relu(torch.baddbmm(b1.flatten(0, 1)[:, None], x_in.flatten(0, 1),
                                     (self.w1 * s[:, :, None]).flatten(0, 1)))
        out = torch.baddbmm(self.b2.flatten(0, 1)[:, None], h, self.w2.flatten(0, 1))
        return out.view(*x.shape[:-1], -1)

    @torch.no_grad()
    def folded(self) -> dict[str, torch.Tensor]:
        """The inference weights, batch norm folded into the first layer: relu(x @ w1 + b1) @ w2 + b2 equals the
        eval-mode forward. fp32 on the CPU: w1 [L, H, D, M], b1 [L, H, M], w2 [L, H, M, C], b2 [L, H, C]."""
        s = self.gamma / torch.sqrt(self.running_var + BN_EPS)
        w1 = self.w1 * s[:, :, None]
        b1 = (self.b1 - self.running_mean) * s + self.beta
        return {k: v.detach().float().cpu().contiguous() for k, v in
                (("w1", w1), ("b1", b1), ("w2", self.w2), ("b2", self.b2))}


def centroid_scores(x: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """Inner products fp32 [..., H, n, C] of x [..., H, n, D] with its KV head's centroids [..., Hkv, C, D] (H a
    multiple of Hkv), computed in the centroids' dtype: the key assignment's scores, and the queries' without a
    Q-model."""
    Hkv = centroids.shape[-3]
    *lead, H, n, D = x.shape
    xg = x.to(centroids.dtype).reshape(*lead, Hkv, (H // Hkv) * n, D)
    return (xg @ centroids.transpose(-1, -2)).float().reshape(*lead, H, n, -1)


def assign(x: torch.Tensor, centroids: torch.Tensor, chunk: int = 8192) -> torch.Tensor:
    """The bucket of each key x [..., Hkv, n, D]: argmax of its fp32 inner products with the centroids [..., Hkv, C,
    D] (ties to the lower bucket, as a decode step's kernel assigns), int64 [..., Hkv, n]; in chunks of keys, so a
    long prefill never holds n x C scores."""
    ct = centroids.float().transpose(-1, -2)
    out = [(x[..., i : i + chunk, :].float() @ ct).argmax(-1) for i in range(0, x.shape[-2], chunk)]
    return torch.cat(out, dim=-1) if out else torch.zeros(x.shape[:-1], dtype=torch.long, device=x.device)


def pooled(scores: torch.Tensor, kv_heads: int, group: bool) -> torch.Tensor:
    """Per query head scores [..., Hq, n, C] -> per selection head: the group's sum with `group` (§5 "Batched
    queries"), else unchanged."""
    if not group:
        return scores
    *lead, Hq, n, C = scores.shape
    return scores.reshape(*lead, kv_heads, Hq // kv_heads, n, C).sum(-3)


def random_index(num_layers: int, kv_heads: int, head_dim: int, clusters: int = 1024, hidden: int = 1024,
                 query_model: bool = True, seed: int = 0) -> dict[str, torch.Tensor]:
    """An index of random unit centroids and an untrained Q-model for every layer (`index=` of the method): for speed
    runs, whose timing does not depend on the weights, and for tests."""
    g = torch.Generator().manual_seed(seed)
    c = torch.nn.functional.normalize(torch.randn(num_layers, kv_heads, clusters, head_dim, generator=g), dim=-1)
    out = {"centroids": c, "layers": torch.arange(num_layers)}
    if query_model:
        out.update(QueryModel(num_layers, kv_heads, head_dim, hidden, clusters, seed=seed).folded())
    return out
