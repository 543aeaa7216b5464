"""Oracle top-k: exact q·k scores over every cached key, top-k per KV head. The accuracy upper bound.

GQA: with pooling "group" the query heads of a group share one choice, made on the sum of their softmax
probabilities (the choice that keeps the most attention mass for the group); "head" chooses per query head.
On the GPU q·k comes from the sparse-decode kernel (kernels/sparse_decode.py::qk_logits, every key read once for its
group), several times faster than torch's einsum: a decode step at 131072 tokens, budget 2048, takes about what
dense flash-decoding does on the H100 (BENCHMARKS.md, "Decode step of one layer").
"""

import torch

from ..selection import Selection, exact_scores, topk_selection
from .base import LayerState, Method, register


@register
class Oracle(Method):
    name = "oracle"
    summary = "exact top-k of q·k (upper bound)"

    def select(self, state: LayerState, q: torch.Tensor, q_pre_rope) -> Selection:
        split = self.split(state)
        if split.dense:
            return split.selection()
        keys = state.keys[:, :, split.lo : split.hi]  # [B, Hkv, n, D]
        p = state.pattern
        scores = exact_scores(q, keys, self.pooling, scale=p.scaling, softcap=p.softcap, bounds=split.bounds())
        return topk_selection(scores, split, in_region=True)
