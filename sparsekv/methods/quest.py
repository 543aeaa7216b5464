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
  runs over `kv_indices_without_last`). Here the last page is one more block beside the B // S - 1 pages chosen by
  U among the others, clipped to the keys that exist; a step reads at most B keys (fewer while the last page fills).
  (The authors' HF evaluation path, evaluation/quest_attention.py, instead ranks every page and keeps at least 3; we
  follow the kernel path.) A window given explicitly replaces the last page; pages then are chosen among those that
  overlap [sink, length - window) and are clipped to it (Selection.sparse_positions, the sparse-decode kernel), so
  the sparse part never re-reads the dense part and the count stays within the budget. A budget below one page
  beside the sink keeps only the newest budget - sink tokens. The page count is fixed for a generation, so a decode
  step can be replayed as a CUDA graph while the last page fills.
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

from sparsekv.kernels.reference import PageRegion, RowBounds

from .. import ops
from ..errors import SparseKVError
from ..pooling import Pooling
from ..selection import BudgetSplit, Selection, sink_window_error
from .base import CacheShape, LayerState, Method, register

PAGE_ALIGN = 16  # the bounds buffer's pages come in multiples of this (`new_state`)


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
                 pooling: Pooling | str | None = None, page_size: int = 16, **options: Any):
        """`window` None (default) is Quest's: the last, partially filled page."""
        super().__init__(budget=budget, sink=sink, window=window, pooling=pooling, **options)
        self.auto_window = window is None
        self.page_size = int(page_size)
        if self.page_size < 1:
            raise SparseKVError(f"quest: page_size must be >= 1, got {page_size} (--page-size)")

    def new_state(self, layer: int, shape: CacheShape) -> QuestState:
        # pages rounded up to a multiple of 16: a graph-replayed step scores them all (`select`), so the kernels'
        # page counts and strides keep one divisibility class, which Triton specialises on, whatever the capacity
        pages = -(-shape.max_len // (self.page_size * PAGE_ALIGN)) * PAGE_ALIGN
        bounds = torch.zeros(shape.batch, shape.kv_heads, pages, 2 * shape.head_dim, dtype=shape.dtype,
                             device=shape.device)
        return QuestState(bounds=bounds)

    def append(self, state: QuestState, k: torch.Tensor, v: torch.Tensor, k_pre_rope, pos) -> None:
        """Fold keys [B, Hkv, n, D] at positions [pos, pos + n) into their pages' max/min (Algorithm 1)."""
        B, H, n, D = k.shape
        if n == 0:
            return
        S = self.page_size
        M, m = state.page_max, state.page_min
        if n == 1:  # a decode step (at a host position or at device write slots [B]): one key into its page
            ops.quest_append(state.bounds, k, pos, S)
            return
        off, first = pos % S, pos // S
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
        n, S, sink = state.length, self.page_size, self.sink
        visible = n - state.start
        b = self.budget_tokens(state)
        if b >= visible:
            return state.selection(dense=True)
        window = 0 if self.auto_window else self.window
        if sink + window > b:
            raise sink_window_error(self.name, sink, window, f"the budget ({b} tokens)")
        k = (b - sink - window) // S - (1 if self.auto_window else 0)  # the last page counts against the budget
        if k < 0:  # below one page beside the sink: the newest b - sink tokens
            return state.selection(sink=sink, window=b - sink)
        split = BudgetSplit(sink, window, k, False, n, state.pattern.span, state.lengths, state.extent)
        p_lo, p_hi = split.lo // S, -(-split.hi // S)  # pages overlapping [lo, hi): the kernel clips them to it
        if split.extent is not None:  # replayed: every page of the buffer (those past a row's length score -inf)
            p_hi = state.bounds.shape[2]
        lengths = split.lengths.view(-1) if split.lengths is not None else torch.full((1,), n, device=q.device)
        rows = RowBounds(lengths, split.span, split.sink, split.window)
        region = PageRegion(rows, S, p_lo, skip_last=self.auto_window)  # the newest page: attended anyway
        if k > 0 and p_hi > p_lo:
            scores = self.page_scores(state, q, p_lo, p_hi, region)
            blocks = ops.page_blocks(scores, ops.topk(scores, min(k, p_hi - p_lo)), region)
        elif self.auto_window:  # no page to choose: the newest page alone
            heads = q.shape[1] if self.pooling is Pooling.HEAD else state.bounds.shape[1]
            blocks = ((rows.lengths.long() - 1) // S).view(-1, 1, 1).expand(q.shape[0], heads, 1)
        else:
            return state.selection(sink=sink, window=window)
        return state.selection(sink=sink, window=window, blocks=blocks, block_size=S)

    def page_scores(self, state: QuestState, q: torch.Tensor, p_lo: int, p_hi: int,
                    region: PageRegion | None = None) -> torch.Tensor:
        """Upper bounds of pages [p_lo, p_hi), fp32 [B, Hsel, pages]: pooling "group" takes the group's max; the
        pages outside `region` (those a row may not choose) -inf."""
        return ops.page_scores(q, state.bounds[:, :, p_lo:], p_hi - p_lo, self.pooling.kernel_pool("max"), region)

    def config(self) -> dict[str, Any]:
        cfg = super().config()
        cfg["page_size"] = self.page_size
        cfg["window"] = "last page" if self.auto_window else self.window
        return cfg
