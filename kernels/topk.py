"""Exact top-k over long score rows by radix *selection* (no sort), in Triton.

Each score becomes an order-preserving unsigned key (float bits: negative -> all bits flipped, positive -> sign bit
flipped; -0.0 is read as +0.0 and every NaN as the largest key, so the order is torch.sort's). The k-th largest key
T of a row is then found digit by digit, most significant first, as in PyTorch's radix select and AIR top-k
(SC'23): a pass histograms the current digit of the keys that still match the prefix found so far, and the bin
holding the k-th largest becomes the next part of the prefix. fp32 takes three digits (12 + 10 + 10 bits), fp16 and
bf16 two (11 + 5). A last pass writes, in ascending index order, every index with key > T and the first `need`
indices with key == T (ties go to the lower index, deterministically).

Every pass spreads a row over C programs (a 32 x 131072 batch fills the GPU with ~500 of them). The programs of a
row merge their shared-memory histograms (tl.histogram) into one global histogram with atomics; the last program of
the row to finish (an atomic ticket, AIR top-k's "last block" trick) scans it, writes the row's new prefix, and
clears the histogram and ticket for the next pass. So one call is 3 (fp32) or 2 (16-bit) histogram launches plus the
write, with no memset, no host sync and no data-dependent shape: it can be captured in a CUDA graph. After the first
pass reads the row from HBM, the later passes find it in L2 (16.8 MB for 32 x 131072 fp32, L2 is 50 MB on an H100).

The last histogram pass also keeps each program's own digit histogram, so its last program knows how many indices
every program of the row will write (> T, and the ties it may take) and hands each one its output offset: the
write pass needs no atomics and its output is deterministic.

Scratch buffers are cached per (device, rows, programs per row) and left clean by every call; calls that share them
must be ordered (one stream, or a CUDA graph). Reference: `kernels/reference.py::topk_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_KEY_BITS = {torch.float32: 32, torch.float16: 16, torch.bfloat16: 16}
_DIGITS = {32: (12, 10, 10), 16: (11, 5)}  # bits per pass, most significant first; the sum is the key width
_MAX_BINS = 1 << 12
_NAN_EXP = {torch.float16: 0x7C00, torch.bfloat16: 0x7F80}  # |bits| above this is a NaN


@triton.jit
def _keys(X, offs, m, KEY_BITS: tl.constexpr, NAN16: tl.constexpr):
    """Order-preserving uint32 keys of the scores at X + offs (bits read as ints, so bf16 works in the interpreter)."""
    if KEY_BITS == 32:
        b = tl.load(X + offs, mask=m, other=0)  # int32 view of fp32
        b = tl.where(b == -2147483648, 0, b)  # -0.0 ties with +0.0, as in torch.sort
        key = b ^ ((b >> 31) | -2147483648)  # negative: flip all bits, positive: flip the sign bit
        key = tl.where((b & 0x7FFFFFFF) > 0x7F800000, -1, key)  # NaN ranks above +inf, as in torch.topk
        return key.to(tl.uint32, bitcast=True)
    else:
        b = tl.load(X + offs, mask=m, other=0).to(tl.int32) & 0xFFFF  # int16 view of fp16 / bf16
        b = tl.where(b == 0x8000, 0, b)
        key = b ^ tl.where(b >= 0x8000, 0xFFFF, 0x8000)
        key = tl.where((b & 0x7FFF) > NAN16, 0xFFFF, key)
        return key.to(tl.uint32)


@triton.jit
def _radix_pass(X, STATE, GHIST, TICKET, LOCAL, GTP, OFFS, N, chunk, k, stride_x, C,
                KEY_BITS: tl.constexpr, NAN16: tl.constexpr, SHIFT: tl.constexpr, BITS: tl.constexpr,
                MAX_BINS: tl.constexpr, FIRST: tl.constexpr, LAST: tl.constexpr, BLOCK: tl.constexpr):
    c = tl.program_id(0)
    r = tl.program_id(1)
    NB: tl.constexpr = 1 << BITS
    bins = tl.arange(0, NB)
    if FIRST:
        prefix = tl.full([], 0, tl.uint32)
        k_rem = k
    else:
        prefix = tl.load(STATE + 2 * r).to(tl.uint32, bitcast=True)
        k_rem = tl.load(STATE + 2 * r + 1)
    x_row = X + r.to(tl.int64) * stride_x
    start = c * chunk
    end = tl.minimum(start + chunk, N)
    hist = tl.zeros([NB], tl.int32)
    above = tl.zeros([], tl.int32)  # keys of this program whose already-fixed high digits beat the prefix (LAST only)
    for off in range(start, end, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        m = idx < end
        key = _keys(x_row, idx, m, KEY_BITS, NAN16)
        digit = ((key >> SHIFT) & (NB - 1)).to(tl.int32)
        if FIRST:
            cand = m
        else:
            high = key >> (SHIFT + BITS)
            cand = m & (high == prefix)
            if LAST:
                above += tl.sum((m & (high > prefix)).to(tl.int32), 0)
        hist += tl.histogram(digit, NB, mask=cand)

    if LAST:  # this program's own histogram: the row's last program turns it into output offsets
        tl.store(LOCAL + (r * C + c) * NB + bins, hist)
        tl.store(GTP + r * C + c, above)
    tl.atomic_add(GHIST + r * MAX_BINS + bins, hist, mask=hist > 0, sem="relaxed")
    tl.debug_barrier()  # every thread's atomics are issued before the ticket releases them (cf. grid.sync)
    ticket = tl.atomic_add(TICKET + r, 1, sem="acq_rel")
    if ticket == C - 1:  # the row's last program: all histograms are in
        h = tl.atomic_xchg(GHIST + r * MAX_BINS + bins, tl.zeros([NB], tl.int32), sem="relaxed")  # read, clear
        tl.atomic_xchg(TICKET + r, 0, sem="relaxed")
        total = tl.sum(h, 0)
        at_least = total - tl.cumsum(h, 0) + h  # candidates with digit >= bin
        b = tl.max(tl.where(at_least >= k_rem, bins, -1), 0)  # the bin holding the k_rem-th largest
        k_rem -= tl.sum(tl.where(bins > b, h, 0), 0)
        prefix = (prefix << BITS) | b.to(tl.uint32)
        tl.store(STATE + 2 * r, prefix.to(tl.int32, bitcast=True))
        tl.store(STATE + 2 * r + 1, k_rem)  # after the last pass: T = prefix, take the first k_rem keys == T
        if LAST:
            sel_before = tl.zeros([], tl.int32)
            eq_before = tl.zeros([], tl.int32)
            for j in range(0, C):
                loc = tl.load(LOCAL + (r * C + j) * NB + bins, cache_modifier=".cg")
                gt = tl.load(GTP + r * C + j, cache_modifier=".cg") + tl.sum(tl.where(bins > b, loc, 0), 0)
                eq = tl.sum(tl.where(bins == b, loc, 0), 0)
                tl.store(OFFS + 2 * (r * C + j), sel_before)
                tl.store(OFFS + 2 * (r * C + j) + 1, eq_before)
                sel_before += gt + tl.minimum(tl.maximum(k_rem - eq_before, 0), eq)
                eq_before += eq


@triton.jit
def _write_pass(X, STATE, OFFS, OUT, N, chunk, stride_x, stride_o, C,
                KEY_BITS: tl.constexpr, NAN16: tl.constexpr, BLOCK: tl.constexpr):
    c = tl.program_id(0)
    r = tl.program_id(1)
    t = tl.load(STATE + 2 * r).to(tl.uint32, bitcast=True)
    need = tl.load(STATE + 2 * r + 1)
    sel_run = tl.load(OFFS + 2 * (r * C + c))  # indices written by the row's earlier programs
    eq_run = tl.load(OFFS + 2 * (r * C + c) + 1)  # keys == T in the row's earlier programs
    x_row = X + r.to(tl.int64) * stride_x
    o_row = OUT + r.to(tl.int64) * stride_o
    start = c * chunk
    end = tl.minimum(start + chunk, N)
    for off in range(start, end, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        m = idx < end
        key = _keys(x_row, idx, m, KEY_BITS, NAN16)
        gt = (m & (key > t)).to(tl.int32)
        eq = (m & (key == t)).to(tl.int32)
        both = gt + (eq << 16)  # one scan for both counts (BLOCK < 2**16)
        before = tl.cumsum(both, 0) - both
        room = tl.maximum(need - eq_run, 0)  # ties still to take
        eq_before = before >> 16
        take = (gt > 0) | ((eq > 0) & (eq_before < room))
        pos = sel_run + (before & 0xFFFF) + tl.minimum(eq_before, room)
        tl.store(o_row + pos, idx.to(tl.int64), mask=take)
        n_gt = tl.sum(gt, 0)
        n_eq = tl.sum(eq, 0)
        sel_run += n_gt + tl.minimum(n_eq, room)
        eq_run += n_eq


_SCRATCH: dict[tuple, tuple[torch.Tensor, ...]] = {}


def _scratch(device: torch.device, rows: int, ctas: int, last_bins: int) -> tuple[torch.Tensor, ...]:
    key = (device, rows, ctas, last_bins)
    if key not in _SCRATCH:
        i32 = dict(dtype=torch.int32, device=device)
        _SCRATCH[key] = (
            torch.empty(rows, 2, **i32),  # STATE: prefix, k still to take
            torch.zeros(rows, _MAX_BINS, **i32),  # GHIST: zero between calls (the last program clears it)
            torch.zeros(rows, **i32),  # TICKET: zero between calls
            torch.empty(rows, ctas, last_bins, **i32),  # LOCAL
            torch.empty(rows, ctas, **i32),  # GTP
            torch.empty(rows, ctas, 2, **i32),  # OFFS
        )
    return _SCRATCH[key]


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # interpreter: a few programs per row, so the multi-program merge is exercised


def topk(scores: torch.Tensor, k: int, *, out: torch.Tensor | None = None,
         _block: int | None = None, _ctas_per_sm: int = 4, _num_warps: int = 8) -> torch.Tensor:
    """scores [..., N] (fp32/fp16/bf16, contiguous last dim) -> int64 indices [..., k] of the k largest per row.

    Exact: ties go to the lower index; each row's k indices come in ascending index order (not by score).
    NaN ranks above +inf and -0.0 ties with +0.0, as in torch.sort / torch.topk. No host sync, so it can be
    captured in a CUDA graph. Works on CUDA and under TRITON_INTERPRET=1 on the CPU.
    """
    if scores.dtype not in _KEY_BITS:
        raise ValueError(f"topk: scores must be float32, float16 or bfloat16, got {scores.dtype}")
    if scores.dim() < 1:
        raise ValueError("topk: scores needs at least one dimension")
    n = scores.shape[-1]
    if not 0 <= k <= n:
        raise ValueError(f"topk: k={k} must be between 0 and the row length {n}")
    lead = scores.shape[:-1]
    x = scores.reshape(-1, n)
    if n > 1 and x.stride(-1) != 1:
        x = x.contiguous()
    rows = x.shape[0]
    if out is None:
        out = torch.empty(*lead, k, dtype=torch.int64, device=scores.device)
    elif out.shape != (*lead, k) or out.dtype != torch.int64 or out.device != scores.device:
        raise ValueError(f"topk: out must be int64 {(*lead, k)} on {scores.device}")
    if not out.is_contiguous():
        raise ValueError("topk: out must be contiguous")
    if rows == 0 or k == 0:
        return out
    o = out.view(rows, k)

    key_bits = _KEY_BITS[scores.dtype]
    digits = _DIGITS[key_bits]
    block = _block or (4096 if scores.is_cuda else 256)
    block = min(block, triton.next_power_of_2(n))
    # programs per row: enough for the whole GPU, but no fewer than one block of scores each
    ctas = max(1, min(triton.cdiv(n, block), triton.cdiv(_ctas_per_sm * _sm_count(scores.device), rows)))
    chunk = triton.cdiv(triton.cdiv(n, ctas), block) * block
    ctas = triton.cdiv(n, chunk)
    state, ghist, ticket, local, gtp, offs = _scratch(scores.device, rows, ctas, 1 << digits[-1])
    xv = x.view(torch.int32 if key_bits == 32 else torch.int16)
    nan16 = _NAN_EXP.get(scores.dtype, 0)
    grid = (ctas, rows)
    shift = key_bits
    for p, bits in enumerate(digits):
        shift -= bits
        _radix_pass[grid](xv, state, ghist, ticket, local, gtp, offs, n, chunk, k, xv.stride(0), ctas,
                          KEY_BITS=key_bits, NAN16=nan16, SHIFT=shift, BITS=bits, MAX_BINS=_MAX_BINS,
                          FIRST=p == 0, LAST=p == len(digits) - 1, BLOCK=block, num_warps=_num_warps)
    _write_pass[grid](xv, state, offs, o, n, chunk, xv.stride(0), o.stride(0), ctas,
                      KEY_BITS=key_bits, NAN16=nan16, BLOCK=block, num_warps=_num_warps)
    return out


__all__ = ["topk"]
