"""What the Q-model is trained to predict, on which queries, and how well it does on held-out ones.

Target (§4 "Query assignment function", eq. 1): with A the attention of the queries over the keys and H_k the
keys' one-hot bucket assignment, row i of A·H_k is the share of query i's attention in each bucket, and the loss is
KLDiv(f_q(Q), A·H_k), the divergence of the model's distribution from that row (PyTorch's argument order:
Σ_c t_c (log t_c - log f_q(q)_c)). A is the model's own attention (post-RoPE q·k, the layer's scale and
softcapping) per query head, over the key pairs the paper trains on, renormalised over them:
- long range: "(key, query) pairs that are more than 2047 steps apart" (§4), i.e. the keys the sparse part chooses
  from beside a dense window of `gap` keys; "all the key vectors from the same prompt ... except the attention sink"
  (Appendix A);
- causal by default, earlier keys only: a decode step can only read keys before its query. This departs from the
  paper, which trains without a causal mask ("using causal masking in the training batches" is among the variants
  that "did not yield consistent improvements", §6.5); `causal=False` gives its pairs, both ways. On SmolLM2-135M
  most of a query's two-way long-range target lies on keys after it, so a Q-model fitted to it learns where keys a
  decode never reads would be, and ranks earlier keys' buckets below the centroids; fitted causally it ranks them as
  well as the centroids (the held-out report, which always scores causal pairs, shows both);
- long-range queries: "queries for which the nearest key in the prompt is more than 1024 tokens away" (Appendix A;
  §6.1 "the top-1 matching key"): a query (per layer and query head) trains only if the key of its largest logit,
  among all the keys it may pair with, sits at least `min_range` positions away.
Queries of a KV head's group train its one model, each against its own target (the model is per KV head, the
group's outputs are summed only at search time, §5).

Held-out report, always on causal pairs (what a decode step can read, whatever the training pairs): the KL, and at
ℓ probes the group's choice (summed distributions, top-ℓ, as the method picks):
`hit` = the share of queries whose heaviest long-range key lies in a visited bucket, `mass` = the share of their
long-range attention the visited buckets hold; beside the same for the centroid baseline (queries ranked by their
inner product with the centroids). Buckets: sizes of held-out keys per bucket, imbalance factor C·Σ n_c² / N² (the
faiss library's definition, 1 for equal buckets; the paper uses the term without a formula).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

import torch

from ..offline import targets
from ..offline.data import DumpExamples, Example
from ..patterns import AttentionPattern
from .model import QueryModel, centroid_scores, pooled


@dataclass(frozen=True)
class LongRange:
    """Which (query, key) pairs the target covers and which queries train (module docstring)."""

    gap: int  # pairs at least this many positions apart (the dense window)
    min_range: int  # a query trains when its top-1 key is at least this far
    sink: int = 1  # the first keys of a sequence never pair
    causal: bool = True  # earlier keys only (the paper: False, module docstring)

    def masks(self, q_pos: torch.Tensor, nk: int, span: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """bool [nq, nk]: the keys each query may pair with (any distance), and those far enough."""
        j = torch.arange(nk, device=q_pos.device)
        d = q_pos[:, None] - j[None, :]
        dist = d if self.causal else d.abs()
        ok = (j[None, :] >= self.sink) & (d >= 0 if self.causal else torch.ones_like(d, dtype=torch.bool))
        if span:  # a sliding-window layer: only pairs its window holds
            ok &= dist < span
        return ok, ok & (dist >= self.gap)


@dataclass
class Targets:
    t: torch.Tensor  # [L, Hq, nq, C]: each query's long-range attention per bucket (sums to 1 where it trains)
    keep: torch.Tensor  # bool [L, Hq, nq]: long-range queries (they train and are scored)
    top_bucket: torch.Tensor  # [L, Hq, nq]: the bucket of the query's heaviest long-range key


class SaapObjective:
    """The Q-model's loss for a step and its held-out metrics, over the layers of a DumpExamples (pre-RoPE inputs
    with post-RoPE copies for the attention) whose keys are bucketed by `buckets` [L, Hkv, T].

    A query's target depends on the frozen LLM's attention and the fixed buckets alone, so it is the same at every
    step that samples the query: the targets of a fit sequence's queries are computed once, when a step first
    samples it, and looked up after (`cache_targets`; by default when all of them fit in a quarter of the free
    memory of the data's device). Computing them (two attention passes per layer) is what a step otherwise costs.
    Cached targets are kept in bf16 (half the memory and half the bytes a step gathers; each share of attention
    within 0.4 % of itself), their KL constants Σ t log t and Σ t in fp32 from the exact values."""

    def __init__(self, data: DumpExamples, patterns: Sequence[AttentionPattern], buckets: torch.Tensor,
                 clusters: int, pairs: LongRange, queries_per_step: int, seed: int = 0,
                 cache_targets: bool | None = None):
        self.data, self.patterns, self.buckets = data, list(patterns), buckets
        self.clusters, self.pairs = clusters, pairs
        self.queries_per_step, self.seed = queries_per_step, seed
        self.cache_targets = self._fits() if cache_targets is None else cache_targets
        self._cache: dict[int, tuple[torch.Tensor, ...]] = {}  # seq -> (rows, t, keep, Σ t log t, Σ t)

    def _fits(self) -> bool:
        """Whether every fit query's targets (bf16 [L, Hq, C] each) take at most a quarter of the free memory."""
        L, Hq = self.data.q.shape[:2]
        n = sum(len(self.data.rows_of(s)) for s in self.data.fit_seqs)
        need = 2 * L * Hq * n * self.clusters
        dev = self.data.device
        if dev.type == "cuda":
            free = torch.cuda.mem_get_info(dev)[0]
        else:
            free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        return need <= free // 4

    def step_targets(self, ex: Example) -> tuple[torch.Tensor, ...]:
        """(t, keep, Σ t log t, Σ t) of a step's example (the last two per query: the constant part of its KL, and
        1 where it has long-range keys, else 0), from the cache of its sequence's targets when caching."""
        if not self.cache_targets or ex.rows is None:
            tg = self.targets(ex)
            return (tg.t, tg.keep, *target_sums(tg.t))
        if ex.seq not in self._cache:
            rows = self.data.rows_of(ex.seq)
            tg = self.targets(self.data.example(ex.seq, rows))
            self._cache[ex.seq] = (rows.to(tg.t.device), tg.t.to(torch.bfloat16), tg.keep, *target_sums(tg.t))
        rows, *cached = self._cache[ex.seq]
        cols = torch.searchsorted(rows, ex.rows.to(rows.device))  # the example's queries among the sequence's
        return tuple(x[:, :, cols] for x in cached)

    def targets(self, ex: Example) -> Targets:
        """The targets of an example's queries, one layer at a time (a layer's logits are the largest tensor)."""
        q, k = ex.attention_qk()
        L, Hq, nq, _ = q.shape
        Hkv, nk = k.shape[1], k.shape[2]
        off = self.data.offsets[ex.seq]
        ts, keeps, tops = [], [], []
        for li, pat in enumerate(self.patterns):
            near, far = self.pairs.masks(ex.q_pos, nk, pat.span)
            one = (q[li : li + 1], k[li : li + 1], ex.q_pos, [pat], "head")
            top1 = targets.attention_probs(*one, mask=near[None, None])[0][0].argmax(-1)  # [Hq, nq]
            dist = (ex.q_pos[None, :] - top1).abs()
            p = targets.attention_probs(*one, mask=far[None, None])[0][0].nan_to_num(0.0)  # [Hq, nq, nk]
            keeps.append((dist >= self.pairs.min_range) & far.any(-1)[None, :])
            bk = self.buckets[li, :, off : off + nk].repeat_interleave(Hq // Hkv, dim=0)  # [Hq, nk]
            t = torch.zeros(Hq, nq, self.clusters, device=p.device)
            ts.append(t.scatter_add_(-1, bk[:, None, :].expand(Hq, nq, nk), p))
            tops.append(bk.gather(-1, p.argmax(-1)))
        return Targets(torch.stack(ts), torch.stack(keeps), torch.stack(tops))

    def sample(self, step: int) -> Example:
        """Step `step`'s example: queries of one fit sequence that have long-range keys at all."""
        return self.data.sample(self.seed, step, self.queries_per_step,
                                keep=lambda q_pos, nk: self.pairs.masks(q_pos, nk)[1].any(-1))

    def loss(self, model: QueryModel, step: int) -> torch.Tensor:
        """Eq. 1 for step `step`: each KV head's model's mean KL over its group's long-range queries; summed over
        the heads (each keeps its own gradient)."""
        ex = self.sample(step)
        with torch.no_grad():
            t, keep, tlogt, tsum = self.step_targets(ex)
        L, Hq, nq, C = t.shape
        Hkv = ex.k.shape[1]
        mask = keep.reshape(L, Hkv, -1)  # rows (g, i) of each KV head's group
        logits = model(ex.q.reshape(L, Hkv, -1, ex.q.shape[-1]), mask)
        kl = kl_div(logits.reshape(L, Hq, nq, C), t, tlogt, tsum)
        per_head = (kl.reshape(L, Hkv, -1) * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        return per_head.sum()

    @torch.no_grad()
    def evaluate(self, examples: Sequence[Example], model: QueryModel | None, centroids: torch.Tensor,
                 probes: int) -> dict[str, torch.Tensor]:
        """Held-out metrics per (layer, KV head), [L, Hkv] each: kl (the model's), hit/mass (the model's group
        choice at `probes` buckets), hit_centroids/mass_centroids (the centroid baseline's), queries (that train)."""
        was = model.training if model is not None else False
        if model is not None:
            model.eval()
        sums: dict[str, torch.Tensor] = {}
        for ex in examples:
            tg = self.targets(ex)
            L, Hq, nq, C = tg.t.shape
            Hkv = ex.k.shape[1]
            got = {"queries": torch.ones_like(tg.t[..., 0])}
            scores = {"centroids": centroid_scores(ex.q, centroids)}
            if model is not None:
                logits = model(ex.q.reshape(L, Hkv, -1, ex.q.shape[-1])).reshape(L, Hq, nq, C)
                got["kl"] = kl_div(logits, tg.t)
                scores["model"] = torch.softmax(logits, -1)
            for name, s in scores.items():
                chosen = visited(s, Hkv, probes, C)
                suffix = "" if name == "model" else "_centroids"
                got["hit" + suffix] = chosen.gather(-1, tg.top_bucket[..., None])[..., 0].float()
                got["mass" + suffix] = (tg.t * chosen).sum(-1)
            for key, v in got.items():  # summed over the group's heads and the queries that train
                sums[key] = sums.get(key, 0) + (v * tg.keep).reshape(L, Hkv, -1).sum(-1)
        if model is not None and was:
            model.train()
        n = sums.pop("queries")
        return {"queries": n, **{k: v / n.clamp(min=1) for k, v in sums.items()}}


def kl_div(logits: torch.Tensor, t: torch.Tensor, tlogt: torch.Tensor | None = None,
           tsum: torch.Tensor | None = None) -> torch.Tensor:
    """KL(t || softmax(logits)) over the last dim: Σ t (log t - log_softmax) = Σ t log t + logsumexp · Σ t - Σ t ·
    logits, 0 log 0 = 0. tlogt, tsum: Σ t log t and Σ t when known (the cached targets'): the logits then take a
    logsumexp and one product with t, no [.., C] log-softmax."""
    if tlogt is None or tsum is None:
        tlogt, tsum = target_sums(t)
    return tlogt + torch.logsumexp(logits, -1) * tsum - (t * logits).sum(-1)


def target_sums(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ t log t and Σ t over the last dim (0 log 0 = 0): the parts of a KL that depend on the target alone."""
    return torch.xlogy(t, t).sum(-1), t.sum(-1)


def visited(scores: torch.Tensor, kv_heads: int, probes: int, clusters: int) -> torch.Tensor:
    """bool [L, Hq, nq, C]: the buckets each query's group visits: the top `probes` of the group's summed scores
    [L, Hq, nq, C] (§5), repeated for each query head of the group."""
    group = pooled(scores, kv_heads, True)  # [L, Hkv, nq, C]
    top = group.topk(min(probes, clusters), dim=-1).indices
    chosen = torch.zeros_like(group, dtype=torch.bool).scatter_(-1, top, True)
    return chosen.repeat_interleave(scores.shape[1] // kv_heads, dim=1)


def bucket_sizes(buckets: torch.Tensor, clusters: int) -> dict:
    """The report's bucket sizes of keys `buckets` [L, H, n]: imbalance factor C·Σ n_c² / N² per (layer, head), the
    largest bucket over the mean one, and a histogram of every bucket's size over the mean (log2 bins)."""
    L, H, n = buckets.shape
    counts = torch.zeros(L, H, clusters, device=buckets.device).scatter_add_(
        -1, buckets.long(), torch.ones_like(buckets, dtype=torch.float32))
    mean = max(n, 1) / clusters
    imbalance = clusters * counts.pow(2).sum(-1) / max(n, 1) ** 2
    edges = [0, 1 / 8, 1 / 4, 1 / 2, 1, 2, 4, 8, 16, float("inf")]
    ratio = (counts / mean).flatten()
    hist = [int(((ratio >= a) & (ratio < b)).sum()) for a, b in zip(edges[:-1], edges[1:])]
    return {"keys_per_head": n, "clusters": clusters, "empty": int((counts == 0).sum()),
            "imbalance": {"mean": round(float(imbalance.mean()), 4), "max": round(float(imbalance.max()), 4),
                          "per_head": [[round(float(x), 4) for x in row] for row in imbalance.tolist()]},
            "largest_over_mean": round(float(counts.amax(-1).max() / mean), 3),
            "histogram": {"size_over_mean_from": edges[:-1], "buckets": hist}}
