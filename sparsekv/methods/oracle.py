"""Oracle top-k: exact q·k scores over every cached key, top-k per KV head. The accuracy upper bound.

GQA: with pooling "group" the query heads of a group share one choice, made on the sum of their softmax
probabilities (the choice that keeps the most attention mass for the group); "head" chooses per query head.
"""

import torch

from ..selection import Selection, pool_scores, topk_selection
from .base import LayerState, Method, register


@register
class Oracle(Method):
    name = "oracle"
    summary = "exact top-k of q·k (upper bound)"

    def select(self, state: LayerState, q: torch.Tensor, q_pre_rope) -> Selection:
        split = self.split(state.length)
        if split.dense:
            return Selection(state.length, dense=True)
        B, Hq, _, D = q.shape
        Hkv = state.keys.shape[1]
        lo, hi = split.sink, state.length - split.window
        keys = state.keys[:, :, lo:hi].float()  # [B, Hkv, n, D]
        qg = q.float().view(B, Hkv, Hq // Hkv, D)
        logits = torch.einsum("bhgd,bhnd->bhgn", qg, keys).reshape(B, Hq, hi - lo)
        probs = torch.softmax(logits * D**-0.5, dim=-1)
        return topk_selection(pool_scores(probs, Hkv, self.pooling), split, state.length)
