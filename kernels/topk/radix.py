"""The multi-launch radix select: any k, exact, ties to the lower index, each row's indices in ascending order.

Five to six launches over rows x blocks programs. The bound pass histograms the maxima of groups of G scores (G
chosen so that there are >= 2k of them: their k-th largest is a tight lower bound L on the row's k-th largest
score); the compact pass keeps each block's keys >= L in its own slice, in index order, and histograms their first
digit; each refine pass takes one more digit of the k-th largest key T from the candidates that share its prefix;
the count and write passes place every key > T and the first `need` keys == T at their index-ordered positions.
Histograms, counters and tickets are cleared by the programs that finish with them (the last program of a row,
known by an atomic ticket), so there is no memset and no host sync. `topk` takes this path for k > 8192.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import DTYPE_KEY_BITS, DTYPE_NAN_EXP, cached_scratch

_FIRST = 12  # bits of the first digit (bound and compact passes)
_FINE = 16  # bits of the bound: the bound pass also histograms the maxima's top 16 bits
_REFINE = {32: (12, 8), 16: (4,)}  # bits of the later digits (candidates only); they add up to the key width
_COPIES = 4  # first-digit histograms per row, spread over the programs to cut atomic contention


@triton.jit
def _keys(X, offs, m, KEY_BITS: tl.constexpr, NAN16: tl.constexpr):
    """Order-preserving uint32 keys of the scores at X + offs (bits read as ints, so bf16 works in the
    interpreter). Masked lanes get key 0, which no score has (its bits would be a NaN)."""
    if KEY_BITS == 32:
        b = tl.load(X + offs, mask=m, other=-1)  # int32 view of fp32; -1 is a NaN bit pattern -> key 0 below
        b = tl.where(b == -2147483648, 0, b)  # -0.0 ties with +0.0, as in torch.sort
        key = b ^ ((b >> 31) | -2147483648)  # negative: flip all bits, positive: flip the sign bit
        key = tl.where(((b & 0x7FFFFFFF) > 0x7F800000) & m, -1, key)  # NaN ranks above +inf, as in torch.topk
        return key.to(tl.uint32, bitcast=True)
    else:
        b = tl.load(X + offs, mask=m, other=-1).to(tl.int32) & 0xFFFF  # int16 view of fp16 / bf16
        b = tl.where(b == 0x8000, 0, b)
        key = b ^ tl.where(b >= 0x8000, 0xFFFF, 0x8000)
        key = tl.where(((b & 0x7FFF) > NAN16) & m, 0xFFFF, key)
        return key.to(tl.uint32)


@triton.jit
def _hist_add(H, digit, valid):
    """Add the valid digits to the histogram at H with global atomics; one atomic when they share a bin."""
    n = tl.sum(valid.to(tl.int32), 0)
    lo = tl.min(tl.where(valid, digit, 1 << 30), 0)
    hi = tl.max(tl.where(valid, digit, -1), 0)
    if lo == hi:
        tl.atomic_add(H + lo, n, sem="relaxed")
    else:
        tl.atomic_add(H + digit, tl.full(digit.shape, 1, tl.int32), mask=valid, sem="relaxed")


@triton.jit
def _is_last(TICKET, n_programs):
    """True in the last program of a row to get here (its ticket also publishes the others' atomics)."""
    tl.debug_barrier()  # every thread's atomics are issued before the ticket releases them (as in grid.sync)
    return tl.atomic_add(TICKET, 1, sem="acq_rel") == n_programs - 1


@triton.jit
def _find_bin(h, bins, k_rem):
    """The bin holding the k_rem-th largest of histogram h, and the rank of that element inside the bin."""
    at_least = tl.sum(h, 0) - tl.cumsum(h, 0) + h  # counts in this bin and above
    b = tl.maximum(tl.max(tl.where(at_least >= k_rem, bins, -1), 0), 0)
    return b, k_rem - tl.sum(tl.where(bins > b, h, 0), 0)


@triton.jit
def _take_first_digit(GH, TICKET, r, bins, k_rem, NB: tl.constexpr, COPIES: tl.constexpr):
    """Last program of a row: read and clear the first-digit histograms and the ticket."""
    h = tl.zeros([NB], tl.int32)
    for p in tl.static_range(COPIES):
        h += tl.atomic_xchg(GH + (r * COPIES + p) * NB + bins, tl.zeros([NB], tl.int32), sem="relaxed")
    tl.atomic_xchg(TICKET + r, 0, sem="relaxed")
    return _find_bin(h, bins, k_rem)


@triton.jit
def _group_max(key, s, N, G: tl.constexpr, BLOCK: tl.constexpr):
    """Maxima of the block's groups of G keys, and which groups hold any score."""
    return tl.max(tl.reshape(key, [BLOCK // G, G]), 1), s * BLOCK + tl.arange(0, BLOCK // G) * G < N


@triton.jit
def _bound_kernel(X, GH, GF, TICKET, STATE, N, k, stride_x, S,
                  KEY_BITS: tl.constexpr, NAN16: tl.constexpr, FIRST: tl.constexpr, FINE: tl.constexpr,
                  G: tl.constexpr, COPIES: tl.constexpr, BLOCK: tl.constexpr):
    s = tl.program_id(0)
    r = tl.program_id(1)
    NB: tl.constexpr = 1 << FIRST
    SUBF: tl.constexpr = 1 << (FINE - FIRST)
    idx = s * BLOCK + tl.arange(0, BLOCK)
    key = _keys(X + r.to(tl.int64) * stride_x, idx, idx < N, KEY_BITS, NAN16)
    gmax, g_ok = _group_max(key, s, N, G, BLOCK)
    _hist_add(GH + (r * COPIES + s % COPIES) * NB, (gmax >> (KEY_BITS - FIRST)).to(tl.int32), g_ok)
    _hist_add(GF + r * (NB * SUBF), (gmax >> (KEY_BITS - FINE)).to(tl.int32), g_ok)
    if _is_last(TICKET + r, S):
        c, rank = _take_first_digit(GH, TICKET, r, tl.arange(0, NB), k, NB, COPIES)
        fine = tl.arange(0, SUBF)  # the coarse bin's fine bins (the compact pass clears them)
        f, _ = _find_bin(tl.load(GF + r * (NB * SUBF) + c * SUBF + fine, cache_modifier=".cg"), fine, rank)
        tl.store(STATE + 8 * r, c * SUBF + f)


@triton.jit
def _compact_kernel(X, GH, GF, TICKET, STATE, CNT, CK, CI, N, k, stride_x, S,
                    KEY_BITS: tl.constexpr, NAN16: tl.constexpr, FIRST: tl.constexpr, FINE: tl.constexpr,
                    G: tl.constexpr, COPIES: tl.constexpr, BLOCK: tl.constexpr):
    s = tl.program_id(0)
    r = tl.program_id(1)
    NB: tl.constexpr = 1 << FIRST
    low = tl.load(STATE + 8 * r).to(tl.uint32) << (KEY_BITS - FINE)  # L: at least k keys are >= it
    idx = s * BLOCK + tl.arange(0, BLOCK)
    key = _keys(X + r.to(tl.int64) * stride_x, idx, idx < N, KEY_BITS, NAN16)
    gmax, g_ok = _group_max(key, s, N, G, BLOCK)  # clear what the bound pass added: clean for the next call
    tl.store(GF + r * (1 << FINE) + (gmax >> (KEY_BITS - FINE)).to(tl.int32), tl.zeros_like(g_ok.to(tl.int32)),
             mask=g_ok)
    cand = (idx < N) & (key >= low)
    c = cand.to(tl.int32)
    pos = tl.cumsum(c, 0) - c  # keep index order inside the block
    base = r.to(tl.int64) * S * BLOCK + s * BLOCK
    tl.store(CK + base + pos, key.to(tl.int32, bitcast=True), mask=cand)
    tl.store(CI + base + pos, idx, mask=cand)
    tl.store(CNT + r * S + s, tl.sum(c, 0))
    _hist_add(GH + (r * COPIES + s % COPIES) * NB, (key >> (KEY_BITS - FIRST)).to(tl.int32), cand)
    if _is_last(TICKET + r, S):
        b, k_rem = _take_first_digit(GH, TICKET, r, tl.arange(0, NB), k, NB, COPIES)
        tl.store(STATE + 8 * r + 1, b)  # prefix of T so far
        tl.store(STATE + 8 * r + 2, k_rem)  # rank of T among the keys with that prefix


@triton.jit
def _refine_kernel(STATE, GH2, TICKET, CNT, CK, S,
                   SHIFT: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr, SUB: tl.constexpr):
    """One more digit of T from the candidates that match its prefix; SHIFT == 0 gives T itself."""
    s = tl.program_id(0)
    r = tl.program_id(1)
    NB: tl.constexpr = 1 << BITS
    prefix = tl.load(STATE + 8 * r + 1).to(tl.uint32, bitcast=True)
    k_rem = tl.load(STATE + 8 * r + 2)
    cnt = tl.load(CNT + r * S + s)
    base = r.to(tl.int64) * S * BLOCK + s * BLOCK
    for off in range(0, cnt, SUB):
        j = off + tl.arange(0, SUB)
        key = tl.load(CK + base + j, mask=j < cnt, other=0).to(tl.uint32, bitcast=True)
        cand = (j < cnt) & ((key >> (SHIFT + BITS)) == prefix)
        _hist_add(GH2 + r * NB, ((key >> SHIFT) & (NB - 1)).to(tl.int32), cand)
    if _is_last(TICKET + r, S):
        bins = tl.arange(0, NB)
        h = tl.atomic_xchg(GH2 + r * NB + bins, tl.zeros([NB], tl.int32), sem="relaxed")
        tl.atomic_xchg(TICKET + r, 0, sem="relaxed")
        b, k_rem = _find_bin(h, bins, k_rem)
        longer = ((prefix << BITS) | b.to(tl.uint32)).to(tl.int32, bitcast=True)
        if SHIFT == 0:
            tl.store(STATE + 8 * r + 3, longer)  # T
            tl.store(STATE + 8 * r + 4, k_rem)  # how many keys equal to T to take, lowest indices first
        else:
            tl.store(STATE + 8 * r + 1, longer)
            tl.store(STATE + 8 * r + 2, k_rem)


@triton.jit
def _count_kernel(STATE, CNT, CK, CNT2, S, BLOCK: tl.constexpr, SUB: tl.constexpr):
    """Per block: its candidates with key > T and key == T (for the output offsets)."""
    s = tl.program_id(0)
    r = tl.program_id(1)
    t = tl.load(STATE + 8 * r + 3).to(tl.uint32, bitcast=True)
    cnt = tl.load(CNT + r * S + s)
    base = r.to(tl.int64) * S * BLOCK + s * BLOCK
    gt = tl.zeros([], tl.int32)
    eq = tl.zeros([], tl.int32)
    for off in range(0, cnt, SUB):
        j = off + tl.arange(0, SUB)
        key = tl.load(CK + base + j, mask=j < cnt, other=0).to(tl.uint32, bitcast=True)
        gt += tl.sum(((j < cnt) & (key > t)).to(tl.int32), 0)
        eq += tl.sum(((j < cnt) & (key == t)).to(tl.int32), 0)
    tl.store(CNT2 + 2 * (r * S + s), gt)
    tl.store(CNT2 + 2 * (r * S + s) + 1, eq)


@triton.jit
def _write_kernel(STATE, CNT2, CNT, CK, CI, OUT, S, stride_o,
                  BLOCK: tl.constexpr, SUB: tl.constexpr, S_POW2: tl.constexpr):
    s = tl.program_id(0)
    r = tl.program_id(1)
    t = tl.load(STATE + 8 * r + 3).to(tl.uint32, bitcast=True)
    need = tl.load(STATE + 8 * r + 4)
    blk = tl.arange(0, S_POW2)
    before = blk < s  # the row's earlier blocks
    gt_before = tl.sum(tl.load(CNT2 + 2 * (r * S + blk), mask=before, other=0), 0)
    eq_run = tl.sum(tl.load(CNT2 + 2 * (r * S + blk) + 1, mask=before, other=0), 0)
    sel_run = gt_before + tl.minimum(eq_run, need)  # indices the earlier blocks write
    cnt = tl.load(CNT + r * S + s)
    base = r.to(tl.int64) * S * BLOCK + s * BLOCK
    o_row = OUT + r.to(tl.int64) * stride_o
    for off in range(0, cnt, SUB):
        j = off + tl.arange(0, SUB)
        key = tl.load(CK + base + j, mask=j < cnt, other=0).to(tl.uint32, bitcast=True)
        gt = ((j < cnt) & (key > t)).to(tl.int32)
        eq = ((j < cnt) & (key == t)).to(tl.int32)
        both = gt + (eq << 16)  # one scan for both counts (SUB < 2**16)
        pre = tl.cumsum(both, 0) - both
        room = tl.maximum(need - eq_run, 0)  # ties still to take
        eq_pre = pre >> 16
        take = (gt > 0) | ((eq > 0) & (eq_pre < room))
        pos = sel_run + (pre & 0xFFFF) + tl.minimum(eq_pre, room)
        i = tl.load(CI + base + j, mask=take, other=0)
        tl.store(o_row + pos, i.to(tl.int64), mask=take)
        n_eq = tl.sum(eq, 0)
        sel_run += tl.sum(gt, 0) + tl.minimum(n_eq, room)
        eq_run += n_eq


def _radix_scratch(device: torch.device, rows: int, blocks: int, block: int, key_bits: int) -> dict[str, torch.Tensor]:
    def build():
        i32 = dict(dtype=torch.int32, device=device)
        return dict(
            state=torch.zeros(rows, 8, **i32),  # b1, prefix, k still to take, T, need
            gh=torch.zeros(rows, _COPIES, 1 << _FIRST, **i32),  # zero between calls (last programs clear)
            gf=torch.zeros(rows, 1 << _FINE, **i32),  # zero between calls (the compact pass clears)
            gh2=torch.zeros(rows, 1 << max(_REFINE[key_bits]), **i32),  # zero between calls
            ticket=torch.zeros(rows, **i32),  # zero between calls
            cnt=torch.empty(rows, blocks, **i32),  # candidates per block
            cnt2=torch.empty(rows, blocks, 2, **i32),  # per block: candidates > T, == T
            ck=torch.empty(rows, blocks * block, **i32),  # candidate keys, each block in its own slice
            ci=torch.empty(rows, blocks * block, **i32),  # candidate indices
        )

    return cached_scratch(("radix", device, rows, blocks, block, key_bits), build)


def radix_topk(x: torch.Tensor, k: int, o: torch.Tensor, block: int | None = None,
               num_warps: int | None = None) -> None:
    """The radix select (any k) of x [rows, n] (unit stride) into o [rows, k]; `block`, `num_warps`: TopkConfig's."""
    rows, n = x.shape
    bits = DTYPE_KEY_BITS[x.dtype]
    block = min(block or (4096 if x.is_cuda else 512), triton.next_power_of_2(n))
    warps = num_warps or (8 if block >= 4096 else 4)
    sub = min(block, 256)
    blocks = triton.cdiv(n, block)
    # groups of G scores give >= 2k maxima: their k-th largest is a tight lower bound on the k-th largest score
    g = 1 << max(0, min(4, (n // (2 * k)).bit_length() - 1))
    t = _radix_scratch(x.device, rows, blocks, block, bits)
    xv = x.view(torch.int32 if bits == 32 else torch.int16)
    nan16 = DTYPE_NAN_EXP.get(x.dtype, 0)
    grid = (blocks, rows)
    common = dict(KEY_BITS=bits, NAN16=nan16, FIRST=_FIRST, FINE=min(_FINE, bits), G=g, COPIES=_COPIES,
                  BLOCK=block, num_warps=warps)
    _bound_kernel[grid](xv, t["gh"], t["gf"], t["ticket"], t["state"], n, k, xv.stride(0), blocks, **common)
    _compact_kernel[grid](xv, t["gh"], t["gf"], t["ticket"], t["state"], t["cnt"], t["ck"], t["ci"], n, k,
                          xv.stride(0), blocks, **common)
    shift = bits - _FIRST
    for digit in _REFINE[bits]:
        shift -= digit
        _refine_kernel[grid](t["state"], t["gh2"], t["ticket"], t["cnt"], t["ck"], blocks,
                             SHIFT=shift, BITS=digit, BLOCK=block, SUB=sub, num_warps=8)
    _count_kernel[grid](t["state"], t["cnt"], t["ck"], t["cnt2"], blocks, BLOCK=block, SUB=sub, num_warps=4)
    _write_kernel[grid](t["state"], t["cnt2"], t["cnt"], t["ck"], t["ci"], o, blocks, o.stride(0),
                        BLOCK=block, SUB=sub, S_POW2=triton.next_power_of_2(blocks), num_warps=4)
