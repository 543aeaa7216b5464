"""Exact k smallest of small non-negative integers by counting, in Triton: no sort, no candidate cap, ties exact.

Adamas' and LSH's scores are integer code distances in [0, 2^NBITS) (L1 of 2-bit codes over 128 dims, summed over a
GQA group of 4, is below 2^11). Ties are the rule there (a few hundred distinct values over 131072 keys), which is
what sends the float top-k's sampled bound to its fallback (`topk.py`). Counting handles them exactly in three
launches (`plan`: rows x P programs for the last two, two or more per multiprocessor, each owning a CHUNK of one row,
read in TILEs):

1. base    one program per row takes the ks-th smallest of S values sampled at a stride (S = 1024, up to 16384 when
           k / n is small; ks = k S / n: its estimate of the row's k-th smallest value; exact, from a histogram of
           their top 6 bits and one of the low bits in the bin that holds it, `tl.histogram`: a warp ballot per
           bit) and records the base of a window of 14 or 62 values around it (`sample_plan`: centred; higher when
           ks is small, as a sample's few smallest overestimate the row's). It also clears the row's window
           histogram GH. A caller may run this step in a launch of its own beside other work
           (`smallest_k(first=)`: code_topk's head_top forcing step).
2. window  every program histograms its values into WIN = 16 or 64 bins: bin 0 below the base, one bin per value
           of the window, the last bin above it (the ballots per value grow with the bins). It keeps the
           histogram, cumulated, in PH and adds it to GH with atomics.
           This replaces the two full passes of the first design (top 6 bits of every value, then the low bits in
           the bin that holds the k-th), which took 14.1 + 12.3 µs of the 44.0 for 32 x 131071 values on the H100.
3. emit    every program reads GH: when the k-th smallest lies in the window (bin b, 0 < b < WIN - 1), it is the
           threshold t = base + b - 1, c_lt (values < t) is the count below bin b, and how many values < t and
           == t lie in the chunks before this one come from their cumulative histograms (PH[q, b - 1], PH[q, b] -
           PH[q, b - 1], q < p), without a scan across programs. Otherwise (the sample misled: a miss) the program
           finds t, c_lt and those counts from the row itself, tile by tile: exact, but it reads the row three
           times in every program of the row (32 x 131071 values, every row missing: 1.7 ms instead of 36 µs).
           It writes every value < t and the first k - c_lt values == t (ties to the lower index; the last ones,
           with c_eq, the row's count of t, from the same histograms, when `ties="high"`) at pos = how many are
           taken before it, so each row's indices come out in ascending index order, as from `topk.topk`. A chunk
           whose ties at t are all taken or none (every chunk but the one or two where the taken ties begin and
           end) writes the values below t + 1 or t: one comparison and one scan per value, where ranking the ties
           costs a second comparison, a wider scan and a dozen more operations per value.

On the H100 (CUDA-graph replay; the int16 distances of 131071 keys of random codes, k 2047, where the sample's 16
values below the estimate give the narrow window) the narrow window and that emit took this select from 36.8 to
29.4 µs on 32 rows (2-bit codes per query head, Adamas) and from 15.4 to 13.3 on 8 rows of 1-bit codes pooled
(lsh); on 8 rows of the 2-bit codes pooled (values up to 1536: the wide window, `sample_plan`) the emit alone took it
from 15.7 to 15.1.

On the H100 (CUDA-graph replay, bell-shaped values like code distances) the window made the select faster than
those two passes on 8-64 rows of 131071 values and 32 rows of 32767, and left 8 rows of 32767 and 32 of 8191
unchanged. The base launch costs a few µs whatever the size (one program per row, a chain of two histograms).

Rows whose stride and storage reach past n to a multiple of ALIGN = 64 values (code_topk's distances:
`padded_rows`) are loaded up to there (`readable`), the values past n never counted: with an odd row length (131071
keys) Triton loads value by value and scans 16 strided values per thread with shuffles; padded, it loads 16-byte
vectors and scans in-thread. On the H200, 32 rows of 131071 (Adamas per query head): emit 14.5 -> 11.7 µs, the
select 27.8 -> 25.0; 8 rows of 2-bit codes summed over groups of 4: 13.3 -> 12.9 (BENCHMARKS.md, "Distance rows
padded to 64 values").

No program waits for another: each step reads what the previous launch left. GH is cleared by the next call's first
step, so there is no memset and no host sync and a call can be captured in a CUDA graph. Rows of one chunk (eager
calls on rows of at most 16384, `plan`) take one launch instead, one program per row, which finds the row's exact
k-th smallest from two histograms of its own values (no sample, no scratch) and emits. Scratch is cached per
(device, rows, chunks); calls that share it must be ordered (one stream or one graph). Values outside [0, 2^NBITS)
are clamped into it.
Reference: the k smallest by (value, index), e.g. `tests/test_count_select.py::smallest_reference`.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import triton
import triton.language as tl

from .device import dependent_launch, num_sms, wait_for_prior
from .reference import check_ties
from .topk.launch import rows_and_out, scatter_offsets

COARSE_BITS = 6  # the sample's (and the fallback's) first histogram: the top 6 bits
WIN_MAX = tl.constexpr(64)  # bins of the window histogram at most: 62 single values around the estimate, and both sides
WIN_NARROW = 16  # ... when the sample ranks the k-th smallest closely (sample_plan)
_RANKS_NARROW = 16  # sampled values on the near side of the estimate that a narrow window needs
_RANKS_FEW = 8  # fewer sampled values below the estimate than this: a larger sample
_NARROW_BITS = 10  # the narrow window only for values below 2^10 (wider ranges spread them thinner)
_SAMPLE = 1024  # values sampled per row for the window's base, at least ...
_SAMPLE_MAX = 16384  # ... and at most (more when k / n is small: sample_plan)
MAX_BITS = 14  # values < 2^14: int16 storage, <= 256 fine bins
_P_MAX = 1024  # chunks per row (emit sums over the earlier ones in one vector)
_TILE = 2048  # values per tile
ALIGN = 64  # values: rows padded to a multiple of it load as 16-byte vectors (`readable`: the kernels' NP)
_CHUNK_MAX = 2048  # values per program on CUDA (plan)
_ROW_MAX = 16384  # on CUDA, rows up to this long take the one-launch row kernel when not captured in a graph


@triton.jit
def _hist(v, valid, NB: tl.constexpr):
    """NB-bin histogram of v (each in [0, NB)) over the valid lanes: the others are counted into bin 0 and taken
    back out, which works on every Triton version (`mask=` is newer)."""
    h = tl.histogram(tl.where(valid, v, 0), NB)
    return h - tl.where(tl.arange(0, NB) == 0, tl.sum((valid == 0).to(tl.int32), 0), 0)


@triton.jit
def _publish(h, PHp, GHr, NB: tl.constexpr):
    """Keep this program's cumulative histogram at PHp and add h to the row's (atomics; read by the next pass)."""
    bins = tl.arange(0, NB)
    tl.store(PHp + bins, tl.cumsum(h, 0))
    tl.atomic_add(GHr + bins, h, mask=h > 0, sem="relaxed")


@triton.jit
def _find_in(g, need, NB: tl.constexpr):
    """From a row histogram g [NB]: the bin holding the need-th smallest value, and how many values lie below it."""
    bins = tl.arange(0, NB)
    b = tl.sum((tl.cumsum(g, 0) < need).to(tl.int32), 0)  # the first bin whose cumulative count reaches need
    return b, tl.sum(tl.where(bins < b, g, 0), 0)


@triton.jit
def _values(Dr, idx, ok, VMAX: tl.constexpr):
    return tl.minimum(tl.maximum(tl.load(Dr + idx, mask=ok, other=0).to(tl.int32), 0), VMAX)


@triton.jit
def _tile(Dr, idx, N, NP, VMAX: tl.constexpr):
    """A tile of a row: its values, read up to the padded length NP (whole vectors), and which of them count
    (idx < N, the row's own length)."""
    return _values(Dr, idx, idx < NP, VMAX), idx < N


@triton.jit
def _kth(Dr, pos, ok, need, SHIFT: tl.constexpr, VMAX: tl.constexpr, NB2: tl.constexpr):
    """The need-th smallest of the values at pos (exact: coarse bins of the top 6 bits, then the low bits of the bin
    that holds it), and how many are below it."""
    v = _values(Dr, pos, ok, VMAX)
    tb, c1 = _find_in(_hist(v >> SHIFT, ok, 64), need, 64)
    lo, c2 = _find_in(_hist(v & ((1 << SHIFT) - 1), ok & ((v >> SHIFT) == tb), NB2), need - c1, NB2)
    return (tb << SHIFT) + lo, c1 + c2


@triton.jit
def _bin(h, b, NB: tl.constexpr):
    """h[b] of a histogram h [NB]."""
    return tl.sum(tl.where(tl.arange(0, NB) == b, h, 0), 0)


@triton.jit
def _row_kth(Dr, N, NP, need, SHIFT: tl.constexpr, VMAX: tl.constexpr, NB2: tl.constexpr, TILE: tl.constexpr):
    """_kth over a whole row, tile by tile (two passes): the row kernel's threshold, and emit's when the window
    missed; also how many values equal it."""
    h = tl.zeros([64], tl.int32)
    for off in range(0, N, TILE):
        idx = off + tl.arange(0, TILE)
        v, ok = _tile(Dr, idx, N, NP, VMAX)
        h += _hist(v >> SHIFT, ok, 64)
    tb, c1 = _find_in(h, need, 64)
    h2 = tl.zeros([NB2], tl.int32)
    for off in range(0, N, TILE):
        idx = off + tl.arange(0, TILE)
        v, ok = _tile(Dr, idx, N, NP, VMAX)
        h2 += _hist(v & ((1 << SHIFT) - 1), ok & ((v >> SHIFT) == tb), NB2)
    lo, c2 = _find_in(h2, need - c1, NB2)
    return (tb << SHIFT) + lo, c1 + c2, _bin(h2, lo, NB2)


@triton.jit
def _window_base(D, GH, STATE, N, ks, below, stride_d, STRIDE, r, S: tl.constexpr, SHIFT: tl.constexpr,
                 VMAX: tl.constexpr, NB2: tl.constexpr, FORCE_MISS: tl.constexpr):
    """Row r: the ks-th smallest of S values sampled every STRIDE, minus `below` (>= 0): the base of the window
    histogram. Also clears the row's window histogram (the last call's emit is done with it)."""
    r64 = r.to(tl.int64)
    tl.store(GH + r64 * WIN_MAX + tl.arange(0, WIN_MAX), tl.zeros([WIN_MAX], tl.int32))  # covers any WIN's rows
    pos = tl.arange(0, S) * STRIDE
    est, _ = _kth(D + r64 * stride_d, pos, pos < N, ks, SHIFT, VMAX, NB2)
    base = tl.maximum(est - below, 0)
    if FORCE_MISS:  # tests: a window above every value, so that emit takes its fallback
        base = VMAX + 1
    tl.store(STATE + r64, base)


@triton.jit
def _window(D, PH, GH, STATE, N, NP, stride_d, r, p, P, VMAX: tl.constexpr, CHUNK: tl.constexpr, TILE: tl.constexpr,
            WIN: tl.constexpr):
    """Chunk p of row r: histogram of the values around the base, WIN bins: bin 0 < base, bin i (1 <= i < WIN - 1)
    = base + i - 1, bin WIN - 1 >= base + WIN - 2."""
    r64 = r.to(tl.int64)
    Dr = D + r64 * stride_d
    base = tl.load(STATE + r64, cache_modifier=".cg")
    h = tl.zeros([WIN], tl.int32)
    for t in range(CHUNK // TILE):
        idx = p * CHUNK + t * TILE + tl.arange(0, TILE)
        v, ok = _tile(Dr, idx, N, NP, VMAX)
        h += _hist(tl.minimum(tl.maximum(v - base + 1, 0), WIN - 1), ok, WIN)
    _publish(h, PH + (r64 * P + p) * WIN, GH + r64 * WIN, WIN)


@triton.jit
def _emit(D, PH, GH, STATE, OUT, N, NP, k, offset, stride_d, stride_o, r, p, P, high, SHIFT: tl.constexpr,
          VMAX: tl.constexpr, NB2: tl.constexpr, PP: tl.constexpr, CHUNK: tl.constexpr, TILE: tl.constexpr,
          WIN: tl.constexpr):
    """Chunk p of row r: the threshold t (the k-th smallest), c_lt (how many values are < t) and c_eq (how many
    == t) from the row's window histogram, and how many values < t and == t lie in the chunks before this one from
    their cumulative histograms (no scan across programs); the indices (+ offset) of the values < t and of k - c_lt
    of the values == t (the first ones, or the last ones when `high`), in index order (`_emit_below` when the
    chunk's ties are all taken or none). When the k-th smallest fell outside the window, the program finds t and
    those counts from the row itself (slow, exact)."""
    r64 = r.to(tl.int64)
    Dr = D + r64 * stride_d
    Or = OUT + r64 * stride_o
    base = tl.load(STATE + r64, cache_modifier=".cg")
    g = tl.load(GH + r64 * WIN + tl.arange(0, WIN), cache_modifier=".cg")  # filled by atomics (L2)
    b, c_lt = _find_in(g, k, WIN)
    if (b > 0) & (b < WIN - 1):  # inside the window: t = base + b - 1
        thr = base + b - 1
        c_eq = _bin(g, b, WIN)
        qs = tl.arange(0, PP)
        before = qs < p
        rows = r64 * P + qs
        lt_run = tl.sum(tl.load(PH + rows * WIN + b - 1, mask=before, other=0), 0)
        eq_run = tl.sum(tl.load(PH + rows * WIN + b, mask=before, other=0), 0) - lt_run
        mine = tl.load(PH + (r64 * P + p) * WIN + b) - tl.load(PH + (r64 * P + p) * WIN + b - 1)
    else:
        thr, c_lt, c_eq = _row_kth(Dr, N, NP, k, SHIFT, VMAX, NB2, TILE)
        lt_run = tl.zeros([], tl.int32)
        eq_run = tl.zeros([], tl.int32)
        for off in range(0, p * CHUNK, TILE):
            idx = off + tl.arange(0, TILE)
            v, ok = _tile(Dr, idx, N, NP, VMAX)
            lt_run += tl.sum((ok & (v < thr)).to(tl.int32), 0)
            eq_run += tl.sum((ok & (v == thr)).to(tl.int32), 0)
        mine = tl.full([], -1, tl.int32)  # unknown: the general emit below
    need = k - c_lt
    skip = high * (c_eq - need)  # the ties taken are those of rank [skip, skip + need) in index order
    # this chunk's ties have ranks [eq_run, eq_run + mine): when all or none of them are taken, emit is "values
    # below a limit" (thr + 1 or thr), one comparison and one scan per value; only a chunk the taken ties'
    # boundary crosses (at most one per row per boundary) ranks its ties
    every = (eq_run >= skip) & (eq_run + mine <= skip + need)
    none = (eq_run + mine <= skip) | (eq_run >= skip + need)
    lim = thr + every.to(tl.int32)
    if (mine >= 0) & (every | none) & (lim > 0) & (lim <= VMAX):
        _emit_below(Dr, Or, N, NP, lim, lt_run + tl.minimum(tl.maximum(eq_run - skip, 0), need), offset, p, CHUNK,
                    TILE)
    else:
        _emit_tiles(Dr, Or, N, NP, thr, need, skip, lt_run, eq_run, offset, p, VMAX, CHUNK, TILE)


@triton.jit
def _emit_below(Dr, Or, N, NP, lim, run, offset, p, CHUNK: tl.constexpr, TILE: tl.constexpr):
    """Chunk p: the indices (+ offset) of its values below lim, at run + their rank among them: ascending index
    order. For 0 < lim <= VMAX a value is below lim exactly when its clamp into [0, VMAX] is, so the values are
    compared as loaded (int16 stays int16, no clamp)."""
    for t in range(CHUNK // TILE):
        idx = p * CHUNK + t * TILE + tl.arange(0, TILE)
        ok = idx < N
        v = tl.load(Dr + idx, mask=idx < NP, other=0)
        take = ok & (v < lim.to(v.dtype))
        a = take.to(tl.int32)
        pos = scatter_offsets(run + tl.cumsum(a, 0) - a, take, run)
        tl.store(Or + pos, (idx + offset).to(tl.int64), mask=take)
        run += tl.sum(a, 0)


@triton.jit
def _emit_tiles(Dr, Or, N, NP, thr, need, skip, lt_run, eq_run, offset, p, VMAX: tl.constexpr, CHUNK: tl.constexpr,
                TILE: tl.constexpr):
    """Chunk p: the indices (+ offset) of its values < thr and of its values == thr whose rank among the row's
    values == thr is in [skip, skip + need) (lt_run / eq_run: how many values < thr / == thr lie before the chunk),
    at their rank among the taken ones: ascending index order. skip 0 takes the first `need` ties, skip = (ties
    in the row) - need the last."""
    for t in range(CHUNK // TILE):
        idx = p * CHUNK + t * TILE + tl.arange(0, TILE)
        v, ok = _tile(Dr, idx, N, NP, VMAX)
        a = (ok & (v < thr)).to(tl.int32)
        e = (ok & (v == thr)).to(tl.int32)
        both = a + (e << 16)  # one scan for both counts (TILE < 2**16)
        pre = tl.cumsum(both, 0) - both
        eq_pre = eq_run + (pre >> 16) - skip  # rank among the ties, from the first one taken
        take = (a > 0) | ((e > 0) & (eq_pre >= 0) & (eq_pre < need))
        pos = scatter_offsets(lt_run + (pre & 0xFFFF) + tl.minimum(tl.maximum(eq_pre, 0), need), take, lt_run)
        tl.store(Or + pos, (idx + offset).to(tl.int64), mask=take)
        lt_run += tl.sum(a, 0)
        eq_run += tl.sum(e, 0)


# the sample plan and the chunk count move with a row's length: not specialised (kernels/topk/fused.py, PLAN_SCALARS)
@triton.jit(do_not_specialize=["ks", "below", "STRIDE"])
def _base_kernel(D, GH, STATE, N, ks, below, stride_d, STRIDE, S: tl.constexpr, SHIFT: tl.constexpr,
                 VMAX: tl.constexpr, NB2: tl.constexpr, FORCE_MISS: tl.constexpr, PDL: tl.constexpr = 0):
    wait_for_prior(PDL)
    _window_base(D, GH, STATE, N, ks, below, stride_d, STRIDE, tl.program_id(0), S, SHIFT, VMAX, NB2, FORCE_MISS)


@triton.jit(do_not_specialize=["P"])
def _window_kernel(D, PH, GH, STATE, N, NP, stride_d, P, VMAX: tl.constexpr, CHUNK: tl.constexpr, TILE: tl.constexpr,
                   WIN: tl.constexpr, PDL: tl.constexpr = 0):
    wait_for_prior(PDL)
    q = tl.program_id(0)
    r = q // P
    _window(D, PH, GH, STATE, N, NP, stride_d, r, q - r * P, P, VMAX, CHUNK, TILE, WIN)


@triton.jit(do_not_specialize=["P"])
def _emit_kernel(D, PH, GH, STATE, OUT, N, NP, k, offset, stride_d, stride_o, P, high, SHIFT: tl.constexpr,
                 VMAX: tl.constexpr, NB2: tl.constexpr, PP: tl.constexpr, CHUNK: tl.constexpr, TILE: tl.constexpr,
                 WIN: tl.constexpr, PDL: tl.constexpr = 0):
    wait_for_prior(PDL)
    q = tl.program_id(0)
    r = q // P
    _emit(D, PH, GH, STATE, OUT, N, NP, k, offset, stride_d, stride_o, r, q - r * P, P, high, SHIFT, VMAX, NB2, PP,
          CHUNK, TILE, WIN)


@triton.jit
def _row_kernel(D, OUT, N, NP, k, offset, stride_d, stride_o, high, SHIFT: tl.constexpr, VMAX: tl.constexpr,
                NB2: tl.constexpr, CHUNK: tl.constexpr, TILE: tl.constexpr, PDL: tl.constexpr = 0):
    """Rows of one chunk, one program each: the exact k-th smallest from the row itself (a histogram of the top 6
    bits, then one of the low bits in the bin that holds it), then emit. One launch, which is what an eager decode
    step pays for (~40 µs of Python per launch), no scratch, and no sample: with one program per row every step is
    on the critical path, and a sampled window would add one. On the H100 (CUDA-graph replay) it is faster than
    the first design's three passes through scratch on rows of 4K-16K values (SmolLM2 at 4K and 8K, 32 rows of
    16K)."""
    wait_for_prior(PDL)
    r = tl.program_id(0).to(tl.int64)
    Dr = D + r * stride_d
    thr, c_lt, c_eq = _row_kth(Dr, N, NP, k, SHIFT, VMAX, NB2, TILE)
    zero = tl.zeros([], tl.int32)
    need = k - c_lt
    _emit_tiles(Dr, OUT + r * stride_o, N, NP, thr, need, high * (c_eq - need), zero, zero, offset, 0, VMAX, CHUNK,
                TILE)


# --------------------------------------------------------------------------------------------------------------
# host side

_SCRATCH: dict[tuple, dict[str, torch.Tensor]] = {}


def tie_flag(ties: str) -> int:
    """1 when ties go to the higher index, 0 to the lower; ValueError otherwise."""
    return int(check_ties(ties) == "high")


def value_bits(max_value: int) -> int:
    """Bits the values of [0, max_value] need (at least 1); ValueError past MAX_BITS."""
    bits = max(1, int(max_value).bit_length())
    if bits > MAX_BITS:
        raise ValueError(f"counting select handles values below 2^{MAX_BITS}, got a maximum of {max_value}")
    return bits


def plan(n: int, rows: int, device: torch.device, chunk: int | None = None, tile: int | None = None) -> dict:
    """Chunk size (a power of two) and chunks per row. On CUDA a longer row gets about two programs per
    multiprocessor, in chunks of at most _CHUNK_MAX values: the passes are bound by instructions per value, and with
    many rows (one per query head, pooling "head") two programs per SM meant 16K-value chunks, markedly slower
    than 2048-value chunks on 32 x 131071 values (H100 sweep of chunk, tile and warps over 8-64 rows of 8K-128K
    values, with the first design's passes). A row of at most
    _ROW_MAX values is one chunk, the one-launch row kernel, unless a CUDA graph is being captured: eagerly,
    launches cost the host ~40-100 µs each, and the row kernel saves two; in a graph they cost ~1 µs, and the three
    parallel launches took 7-9 µs of GPU time where the row kernel's serial steps took 15-27 (H100, 3-32 rows of
    4K-16K values, with the first design's three full passes). In the interpreter chunks are small, so that its
    tests cross chunk and tile boundaries."""
    if chunk is None:
        if device.type == "cuda":
            per_row = max(1, 2 * num_sms(device) // max(rows, 1))
            one = n <= _ROW_MAX and not torch.cuda.is_current_stream_capturing()
            chunk = n if one else min(_CHUNK_MAX, max(256, triton.cdiv(n, per_row)))
        else:
            chunk = 128
    chunk = triton.next_power_of_2(max(chunk, triton.cdiv(n, _P_MAX), 16))
    tile = tile or (_TILE if device.type == "cuda" else 64)
    return dict(chunk=chunk, p=max(1, triton.cdiv(n, chunk)), tile=min(chunk, triton.next_power_of_2(tile)))


def scratch(device: torch.device, rows: int, p: int) -> dict[str, torch.Tensor]:
    key = (device, rows, p)
    if key not in _SCRATCH:
        i32 = dict(dtype=torch.int32, device=device)
        _SCRATCH[key] = dict(
            ph=torch.empty(rows, p, WIN_MAX.value, **i32),  # per chunk: cumulative window histogram (WIN used)
            gh=torch.empty(rows, WIN_MAX.value, **i32),  # the row's window histogram (each call's first step clears it)
            state=torch.empty(rows, **i32),  # the row's window base
        )
    return _SCRATCH[key]


def sample_plan(n: int, k: int, bits: int, win: int | None = None) -> tuple[int, int, int, int, int]:
    """(S, stride, ks, below, win): S (a power of two) positions every `stride` values, the rank among the sampled
    values that estimates the row's k-th smallest (all values are sampled when the row has at most S), how far below
    that estimate the window starts, and the window's bins. Centred, but near its top when ks is small (the sample's
    few smallest overestimate the row's k-th smallest when k / n is below a few / S) and near its bottom when ks is
    near the sample's size. The window is narrow (WIN_NARROW bins: the histogram's cost per value grows with its
    bins) when the estimate is exact (every value sampled) or when _SAMPLE values put _RANKS_NARROW of them on
    either side and the values (of `bits` bits) lie below 2^_NARROW_BITS, and WIN_MAX wide otherwise, with more
    samples when fewer than _RANKS_FEW of 1024 would lie below the estimate. The bound on the values is caution: a
    wider range (Adamas' distances summed over a group of 4 reach 1536) can spread the values near the k-th smallest
    thinner than the rows measured below. A miss costs time (every program of the row reads it whole), never
    exactness. On dumped SmolLM2 rows of 16384 keys (Adamas per query head, 1440 rows; lsh pooled over its group,
    480), k from 8 to 16084, no k-th smallest fell outside the window this plan places. Other plans missed on lsh
    rows: 1024 samples at k 32 (364 of 480 rows, even with the wide window), the narrow window with 8 and 12 of 1024
    samples below the estimate (10 and 2 of 480), and with 32 of 4096 at k 128 (3). One layer's lsh step at 262144
    keys, budget 256 (`sparsekv bench`, H100; BENCHMARKS.md, "The counting select's narrow window and chunk emit"):
    1242.7 µs with 1024 samples (rows missed), 75.2 with 16384. S and the width are compiled into the base and
    window steps: a generation whose k / n falls into another plan compiles those once more. `bits`: the values'
    (value_bits of smallest_k's max_value); `win` forces the width (tests)."""
    # when _SAMPLE values would put fewer than _RANKS_FEW below the k-th smallest, enough for 2 * _RANKS_NARROW: with
    # so few the estimate strays further than even the wide window reaches, and a miss reads whole rows
    s = _SAMPLE
    if round(k * _SAMPLE / max(n, 1)) < _RANKS_FEW:
        s = triton.next_power_of_2(triton.cdiv(2 * _RANKS_NARROW * n, max(k, 1)))
    s = min(s, _SAMPLE_MAX, triton.next_power_of_2(max(n, 1)))
    stride = max(1, n // s)
    m = min(s, triton.cdiv(n, stride))  # sampled positions inside the row
    ks = min(m, max(1, round(k * m / n)))
    if win is None:  # narrow when exact, or in the bulk of the values (not a far tail, where they lie sparse)
        close = s == _SAMPLE and min(ks, m - ks) >= _RANKS_NARROW and bits <= _NARROW_BITS
        win = WIN_NARROW if m == n or close else WIN_MAX.value
    if win not in (WIN_NARROW, WIN_MAX.value):
        raise ValueError(f"window bins must be {WIN_NARROW} or {WIN_MAX.value}, got {win}")
    below = win - 3 if ks < 8 and m < n else 1 if ks > m - 8 and m < n else win // 2 - 1
    return s, stride, ks, below, win


def readable(x: torch.Tensor) -> int:
    """How many values of each row [rows, n] the kernels may load: n rounded up to a multiple of ALIGN when the
    rows' stride and storage hold that many, else n. The values past n are loaded and never counted. When the rows
    also start on ALIGN boundaries (padded_rows), every row's start and load bound are multiples of ALIGN values and
    Triton loads 16-byte vectors and scans in-thread (the emit step's tile: 568 instructions instead of 824, sm_90);
    with an odd row length it loads value by value."""
    rows, n = x.shape
    padded = _aligned(n)
    room = x.untyped_storage().nbytes() // x.element_size() - x.storage_offset()
    if rows and x.stride(0) % ALIGN == 0 and x.stride(0) >= padded and room >= (rows - 1) * x.stride(0) + padded:
        return padded
    return n


def padded_rows(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An empty [..., n] tensor whose rows start every multiple of ALIGN values: `readable` loads them whole."""
    n = shape[-1]
    return torch.empty(*shape[:-1], _aligned(max(n, 1)), dtype=dtype, device=device)[..., :n]


def _aligned(n: int) -> int:
    """n rounded up to a multiple of ALIGN."""
    return triton.cdiv(n, ALIGN) * ALIGN


def fine_bins(bits: int) -> int:
    """Bins of the second histogram of _kth: one per low-bit value, at least 32 (one per lane: what tl.histogram
    lays out)."""
    return max(32, 1 << max(0, bits - COARSE_BITS))


def shift(bits: int) -> int:
    """Low bits left to _kth's second histogram (0 when the coarse bins are the values)."""
    return max(0, bits - COARSE_BITS)


class BaseStep(NamedTuple):
    """The first step (`_window_base`, one program per row) for a caller that runs it inside a launch of its own
    (`smallest_k(first=)`): `args` are _window_base's arguments before the row, `consts` its constexprs."""
    rows: int
    args: tuple  # D, GH, STATE, N, ks, below, stride_d, STRIDE
    consts: dict  # S, SHIFT, VMAX, NB2, FORCE_MISS
    num_warps: int


def smallest_k(values: torch.Tensor, k: int, max_value: int, *, offset: int = 0, out: torch.Tensor | None = None,
               ties: str = "low", first: Callable[[BaseStep | None], None] | None = None,
               _chunk: int | None = None, _tile: int | None = None, _num_warps: int | None = None,
               _force_miss: bool = False, _base_warps: int = 8, _window_warps: int = 2,
               _win: int | None = None) -> torch.Tensor:
    """Indices (+ offset), int64 [..., k], of the k smallest of integer values [..., n] in [0, max_value] (int16 or
    int32; others are clamped into the range). Exact, ties to the lower index (`ties="high"`: to the higher one),
    ascending index order in each row; no host sync, so it can be captured in a CUDA graph. CUDA or
    TRITON_INTERPRET=1.
    `first` (a caller's last launch before the select, folded into the select's first one): called once, before
    the select's launches, with the BaseStep it must run for rows 0..rows - 1 in the same launch (programs of their
    own, `_window_base`), or with None when this call takes the one-launch row kernel, which has no such step. The
    base step only estimates where the window lies from a sample: values the same launch writes change how fast
    the select runs, never what it selects."""
    if values.dtype not in (torch.int16, torch.int32):
        raise ValueError(f"smallest_k: values must be int16 or int32, got {values.dtype}")
    high = tie_flag(ties)
    bits = value_bits(max_value)
    x, out, o = rows_and_out(values, k, out, "smallest_k")
    rows, n = x.shape
    if rows == 0 or k == 0:
        if first is not None:
            first(None)
        return out
    pl = plan(n, rows, values.device, chunk=_chunk, tile=_tile)
    npad = readable(x)
    sh, nb2, vmax = shift(bits), fine_bins(bits), (1 << bits) - 1
    common = dict(VMAX=vmax, CHUNK=pl["chunk"], TILE=pl["tile"], num_warps=_num_warps or 4,
                  **dependent_launch(values.device))
    if pl["p"] == 1:
        if first is not None:
            first(None)
        _row_kernel[(rows,)](x, o, n, npad, k, offset, x.stride(0), o.stride(0), high, SHIFT=sh, NB2=nb2, **common)
        return out
    t = scratch(values.device, rows, pl["p"])
    S, stride, ks, below, win = sample_plan(n, k, bits, _win)
    grid = (rows * pl["p"],)
    base = BaseStep(rows, (x, t["gh"], t["state"], n, ks, below, x.stride(0), stride),
                    dict(S=S, SHIFT=sh, VMAX=vmax, NB2=nb2, FORCE_MISS=_force_miss), _base_warps)
    if first is not None:
        first(base)
    else:
        _base_kernel[(rows,)](*base.args, **base.consts, num_warps=base.num_warps, **dependent_launch(values.device))
    # the window step at 2 warps, emit at 4 (H200, padded rows of 131071, chunks of 2048: window 10.8 -> 10.6 µs on
    # 32 rows, 4.9 -> 4.2 on 8; emit at 2 warps 11.6 -> 15.0 and 4.5 -> 5.8)
    _window_kernel[grid](x, t["ph"], t["gh"], t["state"], n, npad, x.stride(0), pl["p"], WIN=win,
                         **dict(common, num_warps=_num_warps or _window_warps))
    _emit_kernel[grid](x, t["ph"], t["gh"], t["state"], o, n, npad, k, offset, x.stride(0), o.stride(0), pl["p"], high,
                       SHIFT=sh, NB2=nb2, PP=triton.next_power_of_2(pl["p"]), WIN=win, **common)
    return out


__all__ = ["MAX_BITS", "BaseStep", "smallest_k", "value_bits"]
