"""Exact k smallest of small non-negative integers by counting, in Triton: no sort, no candidate cap, ties exact.

Adamas' and LSH's scores are integer code distances in [0, 2^NBITS) (L1 of 2-bit codes over 128 dims, summed over a
GQA group of 4, is below 2^11). Ties are the rule there (a few hundred distinct values over 131072 keys), which is
what sends the float top-k's sampled bound to its fallback (`topk.py`). Counting handles them exactly in three
launches of rows x P programs (two or more per multiprocessor, each owning a CHUNK of one row, read in TILEs; `plan`):

1. coarse  the top 6 bits of every value into a 64-bin histogram per program (`tl.histogram`: a warp ballot per
           bit; cheap at 64 bins, where 2048 fine bins would cost ~600 instructions per value). The program keeps
           its histogram, cumulated, in PH1 and adds it to the row's, GH1, with atomics.
2. fine    every program reads GH1 and finds the coarse bin tb holding the k-th smallest value (a 64-entry scan;
           program 0 records tb), then histograms the low bits of its values inside tb the same way (PH2, GH2).
3. emit    every program finds the threshold t and c_lt (how many values are < t) from GH2, and how many values
           < t and == t lie in the chunks before its own from their cumulative histograms, without a scan across
           programs: PH1[q, tb - 1] + PH2[q, lo - 1] and PH2[q, lo] - PH2[q, lo - 1] summed over q < p (lo: t's
           low bits). It writes every value < t and the first k - c_lt values == t (ties to the lower index) at
           pos = how many are taken before it, so each row's indices come out in ascending index order, as from
           `topk.topk`.

No program waits for another: each pass reads what the previous launch left. The row histograms are cleared where
nobody reads them any more (GH1 by pass 3, GH2 by the next call's pass 1), so there is no memset and no host sync
and a call can be captured in a CUDA graph. Scratch is cached per (device, rows, chunks, fine bins); calls that
share it must be ordered (one stream or one graph). Values outside [0, 2^NBITS) are clamped into it.
Reference: the k smallest by (value, index), e.g. `tests/test_count_select.py::smallest_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .device import num_sms
from .topk import _scatter_offsets, rows_and_out

COARSE_BITS = 6
NB1 = 1 << COARSE_BITS  # coarse bins
MAX_BITS = 14  # values < 2^14: int16 storage, <= 256 fine bins
_P_MAX = 1024  # chunks per row (emit sums over the earlier ones in one vector)
_TILE = 2048  # values per tile
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
def _find(GHr, need, NB: tl.constexpr):
    """From the row's histogram: the bin holding the need-th smallest value, and how many values lie below it."""
    bins = tl.arange(0, NB)
    g = tl.load(GHr + bins, cache_modifier=".cg")  # filled by atomics (L2), maybe by this program
    b = tl.sum((tl.cumsum(g, 0) < need).to(tl.int32), 0)  # the first bin whose cumulative count reaches need
    return b, tl.sum(tl.where(bins < b, g, 0), 0)


@triton.jit
def _values(Dr, idx, ok, VMAX: tl.constexpr):
    return tl.minimum(tl.maximum(tl.load(Dr + idx, mask=ok, other=0).to(tl.int32), 0), VMAX)


@triton.jit
def _pass1(D, PH1, GH1, GH2, N, stride_d, r, p, P, SHIFT: tl.constexpr, VMAX: tl.constexpr, NB2: tl.constexpr,
           CHUNK: tl.constexpr, TILE: tl.constexpr):
    """Chunk p of row r: histogram of the values' top 6 bits. Chunk 0 clears GH2 (the last call's pass 3 is done
    with it; pass 2 fills it)."""
    r64 = r.to(tl.int64)
    Dr = D + r64 * stride_d
    if p == 0:
        tl.store(GH2 + r64 * NB2 + tl.arange(0, NB2), tl.zeros([NB2], tl.int32))
    h = tl.zeros([64], tl.int32)
    for t in range(CHUNK // TILE):
        idx = p * CHUNK + t * TILE + tl.arange(0, TILE)
        ok = idx < N
        h += _hist(_values(Dr, idx, ok, VMAX) >> SHIFT, ok, 64)
    _publish(h, PH1 + (r64 * P + p) * 64, GH1 + r64 * 64, 64)


@triton.jit
def _pass2(D, PH2, GH1, GH2, STATE, N, k, stride_d, r, p, P, SHIFT: tl.constexpr, VMAX: tl.constexpr,
           NB2: tl.constexpr, CHUNK: tl.constexpr, TILE: tl.constexpr):
    """Chunk p of row r: the coarse bin tb from GH1 (chunk 0 records it), then the histogram of the low SHIFT bits
    of the values inside tb."""
    r64 = r.to(tl.int64)
    Dr = D + r64 * stride_d
    tb, c1 = _find(GH1 + r64 * 64, k, 64)
    if p == 0:
        tl.store(STATE + r64 * 2, tb)
        tl.store(STATE + r64 * 2 + 1, c1)
    h = tl.zeros([NB2], tl.int32)
    for t in range(CHUNK // TILE):
        idx = p * CHUNK + t * TILE + tl.arange(0, TILE)
        ok = idx < N
        v = _values(Dr, idx, ok, VMAX)
        h += _hist(v & ((1 << SHIFT) - 1), ok & ((v >> SHIFT) == tb), NB2)
    _publish(h, PH2 + (r64 * P + p) * NB2, GH2 + r64 * NB2, NB2)


@triton.jit
def _pass3(D, PH1, PH2, GH1, GH2, STATE, OUT, N, k, offset, stride_d, stride_o, r, p, P, SHIFT: tl.constexpr,
           VMAX: tl.constexpr, NB2: tl.constexpr, PP: tl.constexpr, CHUNK: tl.constexpr, TILE: tl.constexpr):
    """Chunk p of row r: the threshold t = tb·2^SHIFT + lo from GH2; the indices (+ offset) of the values < t and of
    the first k - c_lt values == t, in index order. Chunk 0 clears GH1 (pass 2 is done with it)."""
    r64 = r.to(tl.int64)
    Dr = D + r64 * stride_d
    Or = OUT + r64 * stride_o
    if p == 0:
        tl.store(GH1 + r64 * 64 + tl.arange(0, 64), tl.zeros([64], tl.int32))
    tb = tl.load(STATE + r64 * 2, cache_modifier=".cg")
    c1 = tl.load(STATE + r64 * 2 + 1, cache_modifier=".cg")
    lo, c2 = _find(GH2 + r64 * NB2, k - c1, NB2)
    thr = (tb << SHIFT) + lo
    need = k - c1 - c2
    # how many values < t and == t lie in the chunks before this one, from their cumulative histograms
    qs = tl.arange(0, PP)
    before = qs < p
    rows = r64 * P + qs
    lt_run = tl.sum(tl.load(PH1 + rows * 64 + tb - 1, mask=before & (qs * 0 + tb > 0), other=0), 0)
    below = tl.sum(tl.load(PH2 + rows * NB2 + lo - 1, mask=before & (qs * 0 + lo > 0), other=0), 0)
    eq_run = tl.sum(tl.load(PH2 + rows * NB2 + lo, mask=before, other=0), 0) - below
    lt_run += below
    for t in range(CHUNK // TILE):
        idx = p * CHUNK + t * TILE + tl.arange(0, TILE)
        ok = idx < N
        v = _values(Dr, idx, ok, VMAX)
        a = (ok & (v < thr)).to(tl.int32)
        e = (ok & (v == thr)).to(tl.int32)
        both = a + (e << 16)  # one scan for both counts (TILE < 2**16)
        pre = tl.cumsum(both, 0) - both
        eq_pre = eq_run + (pre >> 16)
        take = (a > 0) | ((e > 0) & (eq_pre < need))
        pos = _scatter_offsets(lt_run + (pre & 0xFFFF) + tl.minimum(eq_pre, need), take, lt_run)
        tl.store(Or + pos, (idx + offset).to(tl.int64), mask=take)
        lt_run += tl.sum(a, 0)
        eq_run += tl.sum(e, 0)


@triton.jit
def _coarse_kernel(D, PH1, GH1, GH2, N, stride_d, P, SHIFT: tl.constexpr, VMAX: tl.constexpr, NB2: tl.constexpr,
                   CHUNK: tl.constexpr, TILE: tl.constexpr):
    q = tl.program_id(0)
    r = q // P
    _pass1(D, PH1, GH1, GH2, N, stride_d, r, q - r * P, P, SHIFT, VMAX, NB2, CHUNK, TILE)


@triton.jit
def _fine_kernel(D, PH2, GH1, GH2, STATE, N, k, stride_d, P, SHIFT: tl.constexpr, VMAX: tl.constexpr,
                 NB2: tl.constexpr, CHUNK: tl.constexpr, TILE: tl.constexpr):
    q = tl.program_id(0)
    r = q // P
    _pass2(D, PH2, GH1, GH2, STATE, N, k, stride_d, r, q - r * P, P, SHIFT, VMAX, NB2, CHUNK, TILE)


@triton.jit
def _emit_kernel(D, PH1, PH2, GH1, GH2, STATE, OUT, N, k, offset, stride_d, stride_o, P, SHIFT: tl.constexpr,
                 VMAX: tl.constexpr, NB2: tl.constexpr, PP: tl.constexpr, CHUNK: tl.constexpr, TILE: tl.constexpr):
    q = tl.program_id(0)
    r = q // P
    _pass3(D, PH1, PH2, GH1, GH2, STATE, OUT, N, k, offset, stride_d, stride_o, r, q - r * P, P, SHIFT, VMAX, NB2,
           PP, CHUNK, TILE)


@triton.jit
def _row_kernel(D, PH1, PH2, GH1, GH2, STATE, OUT, N, k, offset, stride_d, stride_o, SHIFT: tl.constexpr,
                VMAX: tl.constexpr, NB2: tl.constexpr, CHUNK: tl.constexpr, TILE: tl.constexpr):
    """All three passes in one program per row, for rows of one chunk: one launch, which is what an eager decode
    step pays for (~40 µs of Python per launch), and no other program to wait for. The barriers order each pass's
    histogram atomics before the next pass reads them."""
    r = tl.program_id(0)
    _pass1(D, PH1, GH1, GH2, N, stride_d, r, 0, 1, SHIFT, VMAX, NB2, CHUNK, TILE)
    tl.debug_barrier()
    _pass2(D, PH2, GH1, GH2, STATE, N, k, stride_d, r, 0, 1, SHIFT, VMAX, NB2, CHUNK, TILE)
    tl.debug_barrier()
    _pass3(D, PH1, PH2, GH1, GH2, STATE, OUT, N, k, offset, stride_d, stride_o, r, 0, 1, SHIFT, VMAX, NB2, 1, CHUNK,
           TILE)


# --------------------------------------------------------------------------------------------------------------
# host side

_SCRATCH: dict[tuple, dict[str, torch.Tensor]] = {}


def value_bits(max_value: int) -> int:
    """Bits the values of [0, max_value] need (at least 1); ValueError past MAX_BITS."""
    bits = max(1, int(max_value).bit_length())
    if bits > MAX_BITS:
        raise ValueError(f"counting select handles values below 2^{MAX_BITS}, got a maximum of {max_value}")
    return bits


def plan(n: int, rows: int, device: torch.device, chunk: int | None = None, tile: int | None = None) -> dict:
    """Chunk size (a power of two) and chunks per row. On CUDA a longer row gets about two programs per
    multiprocessor, in chunks of at most _CHUNK_MAX values: the passes are bound by instructions per value, and with
    many rows (one per query head, pooling "head") two programs per SM meant 16K-value chunks: 64 µs for 32 x 131071
    values, where 2048-value chunks take 44 (H100 sweep of chunk, tile and warps over 8-64 rows of 8K-128K values:
    results/count-select-chunks-h100.json; the first sweep: results/count-select-h100.json). A row of at most
    _ROW_MAX values is one chunk, the one-launch row kernel, unless a CUDA graph is being captured: eagerly,
    launches cost the host ~40-100 µs each, and the row kernel saves two; in a graph they cost ~1 µs, and the three
    parallel passes take 7-9 µs of GPU time where the row kernel's serial passes take 15-27 (H100, 3-32 rows of
    4K-16K values). In the interpreter chunks are small, so that its tests cross chunk and tile boundaries."""
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


def scratch(device: torch.device, rows: int, p: int, bits: int) -> dict[str, torch.Tensor]:
    nb2 = fine_bins(bits)
    key = (device, rows, p, nb2)
    if key not in _SCRATCH:
        i32 = dict(dtype=torch.int32, device=device)
        _SCRATCH[key] = dict(
            ph1=torch.empty(rows, p, NB1, **i32),  # per chunk: cumulative coarse histogram
            ph2=torch.empty(rows, p, nb2, **i32),  # per chunk: cumulative fine histogram of bin tb
            gh1=torch.zeros(rows, NB1, **i32),  # the row's histograms: zero between calls (passes 3 / 1 clear)
            gh2=torch.zeros(rows, nb2, **i32),
            state=torch.empty(rows, 2, **i32),  # tb, how many values lie below bin tb
        )
    return _SCRATCH[key]


def fine_bins(bits: int) -> int:
    """Bins of pass 2: one per low-bit value, at least 32 (one per lane: what tl.histogram lays out)."""
    return max(32, 1 << max(0, bits - COARSE_BITS))


def shift(bits: int) -> int:
    """Low bits left to pass 2 (0 when the coarse bins are the values: pass 2 then just counts bin tb)."""
    return max(0, bits - COARSE_BITS)


def smallest_k(values: torch.Tensor, k: int, max_value: int, *, offset: int = 0, out: torch.Tensor | None = None,
               _chunk: int | None = None, _tile: int | None = None, _num_warps: int | None = None) -> torch.Tensor:
    """Indices (+ offset), int64 [..., k], of the k smallest of integer values [..., n] in [0, max_value] (int16 or
    int32; others are clamped into the range). Exact, ties to the lower index, ascending index order in each row;
    no host sync, so it can be captured in a CUDA graph. CUDA or TRITON_INTERPRET=1."""
    if values.dtype not in (torch.int16, torch.int32):
        raise ValueError(f"smallest_k: values must be int16 or int32, got {values.dtype}")
    bits = value_bits(max_value)
    x, out, o = rows_and_out(values, k, out, "smallest_k")
    rows, n = x.shape
    if rows == 0 or k == 0:
        return out
    pl = plan(n, rows, values.device, chunk=_chunk, tile=_tile)
    t = scratch(values.device, rows, pl["p"], bits)
    s, nb2, vmax = shift(bits), fine_bins(bits), (1 << bits) - 1
    common = dict(SHIFT=s, VMAX=vmax, NB2=nb2, CHUNK=pl["chunk"], TILE=pl["tile"], num_warps=_num_warps or 4)
    if pl["p"] == 1:
        _row_kernel[(rows,)](x, t["ph1"], t["ph2"], t["gh1"], t["gh2"], t["state"], o, n, k, offset, x.stride(0),
                             o.stride(0), **common)
        return out
    grid = (rows * pl["p"],)
    _coarse_kernel[grid](x, t["ph1"], t["gh1"], t["gh2"], n, x.stride(0), pl["p"], **common)
    _fine_kernel[grid](x, t["ph2"], t["gh1"], t["gh2"], t["state"], n, k, x.stride(0), pl["p"], **common)
    _emit_kernel[grid](x, t["ph1"], t["ph2"], t["gh1"], t["gh2"], t["state"], o, n, k, offset, x.stride(0),
                       o.stride(0), pl["p"], PP=triton.next_power_of_2(pl["p"]), **common)
    return out


__all__ = ["MAX_BITS", "smallest_k", "value_bits"]
