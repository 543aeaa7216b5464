"""What the learned stages are fitted to: each dumped query's exact attention over the keys its layer lets it see.

For an Example (sparsekv/offline/data.py) of layers with their AttentionPatterns: the keys a query at position p
sees are [start, p] (start > 0 under a sliding window), its attention is softmax(q·k · scale, softcapped as the layer
does) over them, per query head. Pooled "group" sums the group's probabilities (one choice per KV head, the oracle's
choice with that pooling), "head" keeps each query head's own.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from ..patterns import AttentionPattern
from .precision import tf32_matmul


def visible(q_pos: torch.Tensor, nk: int, spans: Sequence[int]) -> torch.Tensor:
    """bool [L, 1, nq, nk]: key j is seen by the query at q_pos[i] in layer l (causal, and the layer's window)."""
    j = torch.arange(nk, device=q_pos.device)
    out = []
    for span in spans:
        m = j[None, :] <= q_pos[:, None]
        if span:
            m &= j[None, :] > q_pos[:, None] - span
        out.append(m)
    return torch.stack(out)[:, None]


def attention_probs(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, patterns: Sequence[AttentionPattern],
                    pooling: str = "group", mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention of queries q [L, Hq, nq, D] over keys k [L, Hkv, nk, D] (fp32): returns the probabilities
    [L, Hsel, nq, nk] (Hsel = Hkv pooled "group", Hq for "head") and the visible mask [L, 1, nq, nk]. `mask` (bool
    [L or 1, 1, nq, nk]) replaces the visible keys: the softmax over those keys only (SAAP's long-range pairs); a
    query with none gets NaN."""
    L, Hq, nq, D = q.shape
    Hkv, nk = k.shape[1], k.shape[2]
    g = Hq // Hkv
    vis = visible(q_pos, nk, [p.span for p in patterns]) if mask is None else mask
    with tf32_matmul(False):  # exact: a training loop may have TF32 on for its model
        logits = torch.einsum("lhgqd,lhkd->lhgqk", q.float().view(L, Hkv, g, nq, D), k.float())
    scale = torch.tensor([p.scaling or D ** -0.5 for p in patterns], device=q.device).view(L, 1, 1, 1, 1)
    logits = logits * scale
    caps = [p.softcap for p in patterns]
    if any(caps):
        cap = torch.tensor([c or math.inf for c in caps], device=q.device).view(L, 1, 1, 1, 1)
        logits = torch.where(torch.isinf(cap), logits, torch.tanh(logits / cap) * cap)
    probs = torch.softmax(logits.masked_fill(~vis[:, :, None], -math.inf), dim=-1)
    if pooling == "group":
        return probs.sum(2), vis
    return probs.reshape(L, Hq, nq, nk), vis


def keep_count(n_visible: torch.Tensor, keep: float) -> torch.Tensor:
    """Keys kept per query at a keep rate (Spotlight: 1 - pruning rate): ceil(keep * visible), at least 1."""
    return torch.clamp(torch.ceil(n_visible.float() * keep), min=1).long()


def topk_sets(scores: torch.Tensor, vis: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query's top-k[i] visible keys by `scores` [L, H, nq, nk] (k [nq]): indices [L, H, nq, kmax] and the mask
    of the ones that count [1, 1, nq, kmax] (a query's first k[i]); ties break toward the lower position."""
    kmax = int(k.max())
    s = scores.masked_fill(~vis, -math.inf)
    idx = torch.topk(s, kmax, dim=-1, sorted=True).indices
    valid = torch.arange(kmax, device=k.device)[None, :] < k[:, None]
    return idx, valid[None, None]


def set_mask(idx: torch.Tensor, valid: torch.Tensor, nk: int) -> torch.Tensor:
    """bool [L, H, nq, nk]: the keys of each query's set."""
    m = torch.zeros(*idx.shape[:-1], nk, dtype=torch.bool, device=idx.device)
    return m.scatter_(-1, idx, valid.expand_as(idx))


def iou(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|A ∩ B| / |A ∪ B| of two set masks [..., nk] -> [...]."""
    inter = (a & b).sum(-1).float()
    union = (a | b).sum(-1).float().clamp(min=1)
    return inter / union
