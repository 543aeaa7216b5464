"""Quest (Tang et al., ICML 2024, "Query-Aware Sparsity for Efficient Long-Context LLM Inference"): page bounds.

The cache is cut into pages of `page_size` tokens (page p = positions [p·S, (p+1)·S), aligned at position 0 as the
authors' paged cache is). For every page and channel i, `append` keeps the elementwise max M_i and min m_i of the
page's post-RoPE keys (§3.4, Algorithm 1 "when inserting new token to KV cache"), updated in place as prefill chunks
and single decode tokens arrive, including the partially filled last page. At a decode step each page gets the upper
bound U = Σ_i max(q_i·m_i, q_i·M_i) >= q·k for every key k of the page (Algorithm 1 "when perform self-attention"),
the top pages are attended, and nothing else is read.

Defaults and where they come from:
- page_size 16: the paper's kernels and examples use "a 16 page size" (§3.5, §4), and so do the authors' scripts
  (mit-han-lab/Quest: evaluation/passkey/passkey.py `--chunk_size 16`).
- The budget is in tokens, as the paper counts it ("the number of tokens in selected pages as the Token Budget",
  §3.4): B tokens = B // S pages *including* the last page, which holds the current token and is always attended
  (the authors' InferenceController: `page_budget` is the "real page budget including the last page", the top-k
  runs over `kv_indices_without_last`). Here the last page is the dense `window`: its 1..S tokens change every step,
  the other (B - window) // S pages are chosen by U, so a step reads at most B keys. (The authors' HF evaluation path,
  evaluation/quest_attention.py, instead ranks every page and keeps at least 3; we follow the kernel path.) A window
  given explicitly replaces the last page; pages then are chosen among those that overlap [sink, length - window)
  and are clipped to it (Selection.sparse_positions, the sparse-decode kernel), so the sparse part never re-reads
  the dense part and the count stays within the budget. A budget below one page keeps only the newest budget - sink
  tokens of the last page.
- sink 0: Quest has no attention sink.
- The paper leaves the first two layers dense ("we only apply Quest and all baselines on later layers", §3.4; the
  authors' code: `layer_id < 2`): here that is the runtime's `--dense-layers 0,1`.
GQA: Quest was built for multi-head models, one choice per query head (pooling "head" does that). Pooling "group"
takes the max of the group's bounds per page, max_h U_h >= max_h max_k q_h·k: still an upper bound, now of the
largest logit any head of the group has in the page, which is Quest's criticality for the group. (A sum would bound
a sum of per-head maxima that no single key need reach; softmax normalisation is not available for bounds.)

Bounds are kept in the cache's dtype (min and max of stored values are stored values: exact) as one [max | min] row
per page, and scored in fp32 by `kernels/quest.py` on the GPU (reads each page's row once for the whole GQA group),
by its torch reference elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from sparsekv.kernels.reference import quest_scores_reference

from ..errors import SparseKVError
from ..selection import Selection, resolve_budget, topk
from ..sparse_attention import use_kernels
from .base import CacheShape, LayerState, Method, register


@dataclass
class QuestState(LayerState):
    bounds: torch.Tensor | None = None  # [B, Hkv, max_pages, 2D]: per page, max of its keys then min, in key dtype

    @property
    def page_max(self) -> torch.Tensor:
        return self.bounds[..., : self.bounds.shape[-1] // 2]

    @property
    def page_min(self) -> torch.Tensor:
        return self.bounds[..., self.bounds.shape[-1] // 2 :]


@register
class Quest(Method):
    name = "quest"
    summary = "page min/max bounds -> top pages (Quest)"
    default_sink = 0

    def __init__(self, budget: float = 1.0, sink: int | None = None, window: int | None = None,
                 pooling: str | None = None, page_size: int = 16, **options: Any):
        """`window` None (default) is Quest's: the last, partially filled page."""
        super().__init__(budget=budget, sink=sink, window=window, pooling=pooling, **options)
        self.auto_window = window is None
        self.page_size = int(page_size)
        if self.page_size < 1:
            raise SparseKVError(f"quest: page_size must be >= 1, got {page_size}")

    def new_state(self, layer: int, shape: CacheShape) -> QuestState:
        pages = -(-shape.max_len // self.page_size)
        bounds = torch.zeros(shape.batch, shape.kv_heads, pages, 2 * shape.head_dim, dtype=shape.dtype,
                             device=shape.device)
        return QuestState(bounds=bounds)

    def append(self, state: QuestState, k: torch.Tensor, v: torch.Tensor, k_pre_rope, pos: int) -> None:
        """Fold keys [B, Hkv, n, D] at positions [pos, pos + n) into their pages' max/min (Algorithm 1)."""
        B, H, n, D = k.shape
        if n == 0:
            return
        S = self.page_size
        off, first = pos % S, pos // S
        M, m = state.page_max, state.page_min
        if n == 1:  # a decode step: one key into one page, in place
            k1 = k[:, :, 0].to(M.dtype)
            if off:
                torch.maximum(M[:, :, first], k1, out=M[:, :, first])
                torch.minimum(m[:, :, first], k1, out=m[:, :, first])
            else:
                M[:, :, first] = k1
                m[:, :, first] = k1
            return
        pages = (off + n + S - 1) // S
        tail = pages * S - off - n  # pad the chunk to whole pages with values that never win the max / min
        kmax = torch.nn.functional.pad(k, (0, 0, off, tail), value=float("-inf")).view(B, H, pages, S, D).amax(3)
        kmin = torch.nn.functional.pad(k, (0, 0, off, tail), value=float("inf")).view(B, H, pages, S, D).amin(3)
        kmax, kmin = kmax.to(M.dtype), kmin.to(M.dtype)
        if off:  # the first page already holds keys before pos: merge with its bounds
            kmax[:, :, 0] = torch.maximum(kmax[:, :, 0], M[:, :, first])
            kmin[:, :, 0] = torch.minimum(kmin[:, :, 0], m[:, :, first])
        M[:, :, first : first + pages] = kmax
        m[:, :, first : first + pages] = kmin

    def select(self, state: QuestState, q: torch.Tensor, q_pre_rope) -> Selection:
        n, S, span, start = state.length, self.page_size, state.pattern.span, state.start
        b = resolve_budget(self.budget, n - start)
        if b >= n - start:
            return Selection(n, dense=True, span=span)
        sink = self.sink
        if self.auto_window:  # the last page, always attended; within the budget
            window = min(n - (n - 1) // S * S, b - sink)
        else:
            window = self.window
        if window < 0 or sink + window > b:
            raise SparseKVError(f"quest: sink ({sink}) + window ({window}) exceed the budget ({b} tokens)")
        lo, hi = start + sink, n - window
        k = (b - sink - window) // S
        p_lo, p_hi = lo // S, -(-hi // S)  # pages overlapping [lo, hi): the kernel clips them to it
        if k <= 0 or hi <= lo:
            return Selection(n, sink, window, span=span)
        scores = self.page_scores(state, q, p_lo, p_hi)
        pick = topk(scores, min(k, p_hi - p_lo)) + p_lo
        return Selection(n, sink, window, blocks=pick, block_size=S, span=span)

    def page_scores(self, state: QuestState, q: torch.Tensor, p_lo: int, p_hi: int) -> torch.Tensor:
        """Upper bounds of pages [p_lo, p_hi), fp32 [B, Hsel, pages]: pooling "group" takes the group's max."""
        pool = "max" if self.pooling == "group" else None
        if use_kernels(q.device):
            from sparsekv.kernels.quest import page_scores

            return page_scores(q, state.bounds[:, :, p_lo:], p_hi - p_lo, pool)
        return quest_scores_reference(q, state.bounds[:, :, p_lo:], p_hi - p_lo, pool)

    def config(self) -> dict[str, Any]:
        cfg = super().config()
        cfg["page_size"] = self.page_size
        cfg["window"] = "last page" if self.auto_window else self.window
        return cfg
