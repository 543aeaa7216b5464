"""What one decode step reads: the `Selection` every method returns, the budget split, and the shared top-k.

A selection has a sparse part (token indices, fixed-size blocks, or CSR bucket lists) and a dense part (the first
`sink` tokens the layer may see and the last `window` tokens). The sparse part never overlaps the dense part:
methods choose only among positions [start + sink, length - window), so the kernel can simply add the two without
de-duplication. `start` is 0 unless the layer attends a sliding window (`span`: the last `span` keys): then every
part, the dense one included, lies in the window (sparsekv/patterns.py).

Graph-replayed decode steps (sparsekv/step.py; the rules: sparsekv/methods/base.py) read lengths from the device:
a selection then carries `lengths` (valid keys per batch row, on the device) and `extent` (the cache slots its
kernels' grids are sized to), and the sparse part is chosen over a region that holds for every length the graph is
replayed at, with the positions outside the step's own region masked out on the device (`BudgetSplit.keep`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from sparsekv.kernels.reference import RowBounds, check_positions, decode_positions, head_top_reference

from . import ops
from .errors import SparseKVError
from .ops import topk
from .patterns import window_start
from .pooling import Pooling

# Integer code distances (Adamas' L1 of 2-bit codes, Hamming distances of lsh and Spotlight) take a few hundred
# values, so many keys share the k-th smallest; of those, the newest are taken. Attention decays with distance on
# average, so a tie goes to the key likelier to matter: on held-out text it raised the attention mass of the chosen
# keys by 3.9 (Adamas), 0.7 (lsh) and 0.3 (Spotlight) points at 2 % (benchmarks/BENCHMARKS.md, "Ties in code
# distances").
CODE_TIES = "high"


@dataclass
class Selection:
    """Keys to read for one decode step, per (batch row, selection head).

    Selection heads are the KV heads (pooling "group": one choice per GQA group) or the query heads ("head").
    Padding entries in `indices` / `blocks` / `buckets` are -1.
    """

    length: int  # valid keys in the cache
    sink: int = 0  # dense part: positions [start, start + sink) ...
    window: int = 0  # ... and [length - window, length)
    dense: bool = False  # attend every key the layer may see, [start, length) (budget >= visible context)
    indices: torch.Tensor | None = None  # [B, H, k] token positions
    blocks: torch.Tensor | None = None  # [B, H, nb] block ids, block b covers [b*block_size, (b+1)*block_size)
    block_size: int = 0
    buckets: torch.Tensor | None = None  # [B, H, nl] chosen bucket ids (CSR)
    bucket_offsets: torch.Tensor | None = None  # [B, H, n_buckets + 1] CSR offsets into bucket_tokens
    bucket_tokens: torch.Tensor | None = None  # [B, H, T] token positions grouped by bucket
    padded: bool = True  # False when `indices` holds no -1 (a top-k result): its count is known on the host
    count: torch.Tensor | None = None  # 0-dim on the device: `indices`' keys summed over rows and heads, if counted
    span: int = 0  # the layer's sliding window (keys the newest one may see), 0 = all: start = length - span
    lengths: torch.Tensor | None = None  # [B] valid keys per row on the device: what the kernels read when given
    extent: int | None = None  # a graph-replayed step: kernel grids span this many cache slots, not `length`
    _positions: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)  # memo
    _count: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)  # blocks' memo

    @property
    def start(self) -> int:
        """First position the layer may attend at this step."""
        return window_start(self.length, self.span)

    @property
    def visible(self) -> int:
        """Keys the layer may attend at this step."""
        return self.length - self.start

    @property
    def n_selected(self) -> int:
        """Sparse-part keys per selection head (padding counted out, averaged over rows and heads)."""
        return round(float(self.selected_count()))

    def selected_count(self) -> int | torch.Tensor:
        """n_selected without a host sync where the count lives on the device (a 0-dim tensor then)."""
        on_device = self.device_count()
        if on_device is not None:
            total, scale = on_device
            return total.float() * scale if scale != 1 else total
        if self.dense:
            return self.visible - self.sink - self.window
        return self.indices.shape[-1] if self.has_sparse else 0  # unpadded indices: their width

    def device_count(self) -> tuple[torch.Tensor, float] | None:
        """(0-dim tensor, scale) whose product is n_selected where the count lives on the device, else None (known
        on the host): the decode loop adds it to its statistics every layer and step (`add_(total, alpha=scale)`,
        one launch), and a sync there would stall the launch queue."""
        if not self.counts_on_device():
            return None
        if self.count is not None:
            return self.count, 1.0 / (self.indices.shape[0] * self.indices.shape[1])  # it comes with indices
        if self.blocks is not None and self.indices is None:
            self.sparse_positions()  # counted where the positions are made
            if self._count is not None:
                return self._count, 1.0
        return self.sparse_positions().ge(0).sum(-1).float().mean(), 1.0

    @property
    def device(self) -> torch.device | None:
        """Where the sparse part lives (None without one)."""
        return next((t.device for t in (self.indices, self.blocks, self.buckets) if t is not None), None)

    def counts_on_device(self) -> bool:
        """Whether n_selected is known only on the device (`device_count`, `add_count`)."""
        return not (self.dense or not self.has_sparse or (self.indices is not None and not self.padded))

    def add_count(self, total: torch.Tensor) -> None:
        """Add n_selected into `total` (0-dim, on the device; a decode loop's running sum) without a host sync.
        Blocks not yet expanded count themselves into it in the launch that expands them (`block_positions`):
        no scratch count to zero and no add after it, two launches a layer fewer. Else one add."""
        if self.blocks is not None and self.indices is None and self._positions is None:
            self._positions, _ = ops.block_positions(self.blocks, self.block_size, self._lengths(), self.span,
                                                     self.sink, self.window, count=total)
            return
        count, scale = self.device_count()
        total.add_(count, alpha=scale)

    @property
    def has_sparse(self) -> bool:
        return self.indices is not None or self.blocks is not None or self.buckets is not None

    def heads(self, kv_heads: int) -> int:
        """Selection heads: the sparse part's head count, else (dense part only) one per KV head."""
        for t in (self.indices, self.blocks, self.buckets):
            if t is not None:
                return t.shape[1]
        return kv_heads

    def attended(self) -> int:
        """Keys attended per selection head (sink + window + selected)."""
        return self.visible if self.dense else self.sink + self.window + self.n_selected

    def decode_args(self) -> dict:
        """The step as the kernels take it (plain tensors, kernels/sparse_decode.py): the device lengths when the
        selection has them (a graph-replayed step) else the host length, the sparse part as token positions."""
        lengths = self.lengths if self.lengths is not None else self.length
        extent = self.extent if self.extent is not None or self.lengths is None else self.length
        indices = self.sparse_positions() if self.has_sparse and not self.dense else None
        return dict(lengths=lengths, indices=indices, sink=self.sink, window=self.window, span=self.span,
                    dense=self.dense, extent=extent)

    def positions(self, batch: int, heads: int, lengths: torch.Tensor | None = None, device=None) -> torch.Tensor:
        """Every position the step reads, [B, H, n] int64 (-1: a slot that reads nothing), in the kernels' slot
        order; `lengths` [B] overrides the selection's own per-row lengths."""
        a = self.decode_args()
        if lengths is not None:
            a["lengths"] = lengths
        return decode_positions(batch, heads, a["lengths"], a["indices"], a["sink"], a["window"], a["span"],
                                a["dense"], device=device)

    def check(self, batch: int, heads: int, lengths: torch.Tensor | None = None) -> None:
        """Reject duplicate positions (a key attended twice): a sort and a host sync, for tests and debugging."""
        check_positions(self.positions(batch, heads, lengths, device=self.device))

    def _lengths(self) -> int | torch.Tensor:
        """Each row's valid keys on the device where given, else the host length."""
        return self.lengths if self.lengths is not None else self.length

    def sparse_positions(self) -> torch.Tensor:
        """The sparse part as padded token positions [B, H, n] (-1 = none), whatever its form."""
        if self.indices is not None:
            return self.indices
        if self.blocks is not None:  # clipped to each row's sparse region (device lengths when given)
            if self._positions is None:  # made once: the attention and the step's statistics both read them
                self._positions, self._count = ops.block_positions(self.blocks, self.block_size, self._lengths(),
                                                                   self.span, self.sink, self.window)
            return self._positions
        if self.buckets is not None:
            if self._positions is None:
                self._positions = _csr_positions(self)
            return self._positions
        raise ValueError("selection has no sparse part")


def _csr_positions(sel: Selection) -> torch.Tensor:
    """CSR bucket lists -> padded token positions [B, H, n] (-1 pads), on the device, without a Python loop."""
    B, H, nl = sel.buckets.shape
    off = sel.bucket_offsets.long()
    valid = sel.buckets >= 0
    bk = sel.buckets.clamp(min=0).long()
    starts = off.gather(-1, bk)
    counts = torch.where(valid, off.gather(-1, bk + 1) - starts, 0)
    # n is data-dependent; a bound keeps shapes static: every token belongs to at most one bucket
    n = sel.bucket_tokens.shape[-1]
    ends = counts.cumsum(-1)  # [B, H, nl]
    slot = torch.arange(n, device=bk.device).view(1, 1, -1)
    which = torch.searchsorted(ends, slot.expand(B, H, -1).contiguous(), right=True)  # bucket of each slot
    ok = which < nl
    which = which.clamp(max=nl - 1)
    before = torch.where(which > 0, ends.gather(-1, (which - 1).clamp(min=0)), 0)
    src = starts.gather(-1, which) + (slot - before)
    tok = sel.bucket_tokens.long().gather(-1, src.clamp(max=n - 1))
    return torch.where(ok, tok, -1)


def resolve_budget(budget: float, length: int) -> int:
    """`--budget` is a token count (>= 1) or a fraction (0, 1) of the context; the result is a token count."""
    if budget <= 0:
        raise SparseKVError(f"budget must be positive, got {budget}")
    if budget < 1:
        return max(1, int(round(budget * length)))
    if budget != int(budget):
        raise SparseKVError(f"budget {budget} is neither a whole token count nor a fraction below 1")
    return int(budget)


def check_budget(budget: float, context: int) -> int:
    """A run's budget in tokens at `context`, refused before any work when it is larger than the context."""
    b = resolve_budget(budget, context)
    if b > context:
        raise SparseKVError(f"budget {b} tokens is larger than the context ({context} tokens)")
    return b


@dataclass(frozen=True)
class BudgetSplit:
    """How one step's budget is spent: `sink` + `window` dense tokens, `k` chosen from the rest, all among the keys
    [start, length) the layer may see (`span`: its sliding window, 0 = every key).

    The sparse part is chosen from positions [lo, hi). An eager step knows its length, so that region is exact. A
    graph-replayed step (`extent` set: the cache slots the graph covers) cannot: its region is the one that holds for
    every length up to `extent`, and `keep` marks, on the device from `lengths`, the positions of this step's own."""

    sink: int
    window: int
    k: int
    dense: bool
    length: int = 0
    span: int = 0
    lengths: torch.Tensor | None = None
    extent: int | None = None

    @property
    def start(self) -> int:
        return window_start(self.length, self.span)

    @property
    def lo(self) -> int:
        """First position of the region the sparse part is chosen from ..."""
        return self.sink if self.extent is not None else self.start + self.sink

    @property
    def hi(self) -> int:
        """... and one past its last."""
        return (self.extent if self.extent is not None else self.length) - self.window

    def bounds(self) -> RowBounds | None:
        """Each row's own region of [lo, hi) as the kernels take it (from the device lengths; no mask is built),
        or None when the region is exact."""
        if self.extent is None:
            return None
        return RowBounds(self.lengths.view(-1), self.span, self.sink, self.window, self.lo)

    def keep(self) -> torch.Tensor | None:
        """bool [B, 1, hi - lo]: which positions of [lo, hi) this step may choose (per batch row, from the device
        lengths), or None when the region is exact."""
        b = self.bounds()
        return None if b is None else b.mask(self.hi - self.lo)

    def masked(self, scores: torch.Tensor, worst: float | int) -> torch.Tensor:
        """`scores` [B, H, hi - lo] with the positions this step may not choose set to `worst`."""
        keep = self.keep()
        return scores if keep is None else scores.masked_fill(~keep, worst)

    def selection(self, **sparse) -> Selection:
        """The step's Selection: every visible key when dense, else the dense part plus `sparse` (indices=, ...)."""
        where = dict(span=self.span, lengths=self.lengths, extent=self.extent)
        if self.dense:
            return Selection(self.length, dense=True, **where)
        return Selection(self.length, self.sink, self.window, **where, **sparse)

    def widened(self, k: int) -> "BudgetSplit":
        return replace(self, k=k)


def split_budget(budget: float, sink: int, window: int, length: int, span: int = 0,
                 lengths: torch.Tensor | None = None, extent: int | None = None,
                 context: int | None = None, method: str = "") -> BudgetSplit:
    """Carve sink and window out of the budget (as Quest/Adamas count it), within the keys the layer may see at this
    step: all `length`, or its last `span`. A fractional budget is a fraction of `context` (fixed for a generation)
    or else of those. `lengths`/`extent`: a graph-replayed step's device lengths and the slots its graph covers
    (BudgetSplit). `method`: whose sink and window these are, named in the error when they exceed the budget."""
    visible = length - window_start(length, span)
    b = resolve_budget(budget, context or visible)
    where = dict(length=length, span=span, lengths=lengths, extent=extent)
    if b >= visible:
        return BudgetSplit(0, 0, 0, dense=True, **where)
    if sink + window > b:
        raise sink_window_error(method, sink, window, f"the budget ({b} tokens)")
    return BudgetSplit(sink, window, b - sink - window, dense=False, **where)


def sink_window_error(method: str, sink: int, window: int, budget: str) -> SparseKVError:
    """The one wording of sink + window over a budget, before any work (`validate.sink_window`: `budget` is the
    option as given) or at a step (split_budget: the tokens it resolved); with the method named, what to change."""
    who, hint = (f"{method}: ", "; lower --sink/--window or raise --budget") if method else ("", "")
    return SparseKVError(f"{who}sink {sink} + window {window} exceed {budget}{hint}")


def topk_selection(scores: torch.Tensor, split: BudgetSplit, ties: str = "low", in_region: bool = False) -> Selection:
    """Top-k of `scores` [B, H, split.hi - split.lo] (higher is better) over the region the sparse part comes from;
    ties to the lower index, or to the higher (the newer key) with `ties="high"` (code distances: CODE_TIES).
    `in_region`: the scores are already -inf outside each row's region (no mask to apply)."""
    k = min(split.k, scores.shape[-1])
    if k <= 0:
        return split.selection()
    ranked = scores if in_region else split.masked(scores, float("-inf"))
    return split.selection(indices=topk(ranked, k, ties) + split.lo, padded=False)


def exact_scores(q: torch.Tensor, keys: torch.Tensor, pooling: Pooling | str, indices: torch.Tensor | None = None,
                 scale: float | None = None, softcap: float | None = None,
                 bounds: RowBounds | None = None) -> torch.Tensor:
    """The oracle's ranking: the log of the softmax of the layer's attention logits (q·k x scale, default 1/sqrt(D),
    softcapped when the layer is) per query head, summed over the group with pooling "group" (the log keeps the
    ranking and no key underflows to a tie). q [B, Hq, 1, D]; keys [B, Hkv, L, D]; the keys
    scored are all L, or per selection head those at `indices` [B, H, m] (H = Hkv: a group's query heads score the
    same keys; H = Hq: each query head its own). Returns [B, H, m]: per query head with pooling "head", per KV head
    ("group" sums the group's softmax). On the GPU q·k comes from the sparse-decode kernel
    (`kernels/sparse_decode.py::qk_logits`: each key read once for its group, fp32 sums), elsewhere from its torch
    reference. `bounds` (RowBounds, BudgetSplit.bounds; all L keys scored): keys outside each row's region get no
    probability (-inf). The softmax and the group's sum are `kernels/exact_scores.py::pooled_log_probs` (its
    reference off the GPU)."""
    group = Pooling.parse(pooling).group_size(q.shape[1], keys.shape[1])
    return ops.pooled_log_probs(ops.qk_logits(q, keys, indices), group,
                                q.shape[-1] ** -0.5 if scale is None else scale, softcap, bounds)


def rerank_exact(sel: Selection, q: torch.Tensor, keys: torch.Tensor, k: int, scale: float | None = None,
                 softcap: float | None = None) -> Selection:
    """Keep the k of `sel`'s token indices [B, H, m] that the oracle's scores (`exact_scores`) rank highest among
    them, reading their keys from the cache [B, Hkv, L, D]: per query head (H = Hq), or per KV head by the group's
    summed softmax over the m candidates (H = Hkv). A method's cheap score picks m = rerank x k candidates, this
    re-ranks them by reading m full keys per selection head (--rerank). With every key a candidate it is the
    oracle's choice."""
    idx = sel.indices
    if idx is None or idx.shape[-1] <= k:
        return sel
    scores = exact_scores(q, keys, Pooling.HEAD if idx.shape[1] == q.shape[1] else Pooling.GROUP, idx, scale, softcap)
    return replace(sel, indices=torch.gather(idx, 2, topk(scores, k)), padded=False, count=None)


def code_selection(q_words: torch.Tensor, codes: torch.Tensor, d: int, bits: int, metric: str, pooling: Pooling,
                   split: BudgetSplit, head_top: int = 0) -> Selection:
    """The selection of methods that rank keys by code distance (Adamas, LSH, Spotlight): the k = split.k keys of
    [split.lo, split.hi) whose codes [B, Hkv, Lmax, W] lie nearest the query codes q_words [B, Hq, 1, W],
    summed over each GQA group with pooling "group", ties to the newer key (CODE_TIES). `head_top` m (pooling
    "group"): each query head's own m nearest keys are chosen first, the rest by the group's sum (a sharp match of
    one head, diluted in the sum, is kept). `ops.code_topk` where its kernel runs (int16 distances, then the
    counting select); elsewhere (the references, or distances too wide for it) `ops.code_scores` ranked by
    `topk_selection`, which chooses the same keys."""
    pool = pooling.kernel_pool("sum")
    # pooling "head", or a group of one: each query head chooses its own keys anyway
    head_top = head_top if pool and q_words.shape[1] > codes.shape[1] else 0
    lo, hi = split.lo, split.hi
    k = min(split.k, hi - lo)
    if k <= 0:
        return split.selection()
    idx = ops.code_topk(q_words, codes[:, :, lo:], hi - lo, d, k, bits, metric, pool, offset=lo,
                        bounds=split.bounds(), ties=CODE_TIES, head_top=head_top)
    if idx is not None:
        return split.selection(indices=idx, padded=False)
    if not head_top:
        scores = ops.code_scores(q_words, codes[:, :, lo:], hi - lo, d, bits=bits, metric=metric, pool=pool)
    else:  # the per-head scores, read once: the group's sum comes from them (integers: exact)
        per_head = ops.code_scores(q_words, codes[:, :, lo:], hi - lo, d, bits=bits, metric=metric).float()
        B, Hq, n = per_head.shape
        forced = head_top_reference(per_head, codes.shape[1], head_top, split.keep(), CODE_TIES)
        scores = per_head.view(B, codes.shape[1], -1, n).sum(2).masked_fill(forced, float("inf"))
    return topk_selection(scores, split, ties=CODE_TIES)  # -distance: closer scores higher
