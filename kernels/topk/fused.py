"""The fused select: exact top-k over long score rows in one launch and one read of the rows, no sort.

Each score has an int32 key whose signed order is the scores' order (float bits: negative -> low 31 bits flipped;
-0.0 reads as +0.0 and every NaN as the largest key, torch.sort's order). `u` below is the same key as an unsigned
number (u = key + 2**31 for fp32, u = key for fp16/bf16, whose keys are 16 bits); a masked lane has u = 0, which no
score has. One launch of `rows x P` programs, about one per multiprocessor, each owning a CHUNK of one row and
streaming it in TILEs (after AIR top-k's single pass and "last block", RadiK's sampled bound and PyTorch's
multi-block radix select, rebuilt around register-resident tiles); sizes come from `plan.py`:

1. bound    the first program of a row to arrive (an atomic ticket: it is running, so waiting on it cannot
            deadlock) reads a strided sample of the row (S scores in groups of 8 adjacent ones) and finds L, the
            floor of an interval holding the sample's J-th largest key with at most J_HI sample keys >= L.
            J = e + z sqrt(e) + 2 for the e = k S / N sample keys expected above the k-th largest key T, so L <= T
            but for bad luck, and not many more than k scores pass it. The other programs of the row spin on it
            (atomic reads) with their first two tiles already in flight.
2. compact  every program streams its chunk (next tile's load in flight while this one is processed) and keeps
            the scores >= L (one float compare: x >= L's score, or NaN) in index order (tl.cumsum), bits and index,
            in its own slice of a candidate buffer, and publishes how many.
3. select   the row's last program to finish (a ticket) gathers the candidates into registers (<= CAP; in index
            order: slice after slice) and finds T by a 5-way interval search in u-space (4 thresholds per reduction:
            their counts packed 16 bits apiece, two int32 words summed by one two-operand reduction), from the
            candidates' [min, max] until the keys above the interval plus those in it are exactly k, or the interval
            is one value, or one key more is needed: then T is the interval's largest key (one max reduction instead
            of the rounds that would part it from the next one down). It writes the indices above the interval and
            the first `need` inside it (ties to the lower index) at cumsum positions: ascending index order, no sort.
   unlucky  rows the sample misjudged: more than CAP candidates but at most CAP2 = 2 CAP, the same search over CAP2
            lanes; fewer than k, a second, lower bound from the sample (its J2-th key), the row streamed again by
            this program into the slices, then the select (CAP2 or CAP lanes).
   fallback fewer than k candidates even so, or more than CAP2 (ties, constant rows, -inf padding, NaN-heavy
            rows): the same program runs the same search tile by tile from memory, over the candidate slices (or
            the row, if they are too few), shrinking the interval to the min and max of the keys inside it after
            every pass (a constant row takes one pass), then writes in index order. Over the slices it starts at
            the bound (clamped to +-inf's keys) and each pass first counts the keys above lo, so ties at the k-th
            value end it early. The tests force it with TopkConfig's `cap` (too many), `z` (too few: the second
            bound) and `z2` (too few for the second bound as well).

CAP = next_pow2(2k) <= 16384, so k <= 8192 (larger k take the radix path). On CUDA a row of at most 16384 scores
gets CAP = next_pow2(n), every score a candidate and step 1 skipped (any k), unless the sampled bound's CAP is at
most half that and the row is over 2048 scores. Counters are cleared by the programs that finish with them: no memset, no
host sync, no data-dependent shape, so a call can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..device import dependent_launch, wait_for_prior
from .launch import DTYPE_KEY_BITS, DTYPE_NAN_EXP, cached_scratch, scatter_offsets
from .plan import CAP_MAX, Plan, loop_rule, next_pow2

# Sizes of the plan that move with a row's length (the grid's chunks per row, the sample's stride and ranks). Triton
# would specialise them on divisibility by 16, so a cache of another capacity would compile the kernel again. Left
# unspecialised, the sample's loads lose only their alignment hint (no measurable cost to the oracle's step, H100).
PLAN_SCALARS = ["P", "STRIDE", "J", "J_HI", "J2", "J2_HI"]

_I32_MIN = -2147483648


@triton.jit
def _load_bits(X, offs, m, KEY_BITS: tl.constexpr):
    """The scores' bits (int32 view of fp32, int16 view of fp16 / bf16: bf16 works in the interpreter)."""
    return tl.load(X + offs, mask=m, other=0)


@triton.jit
def _to_skeys(b, m, KEY_BITS: tl.constexpr, NAN16: tl.constexpr):
    """int32 keys whose signed order is the scores' order; masked lanes get u = 0, below every score."""
    if KEY_BITS == 32:
        b = tl.where(b == -2147483648, 0, b)  # -0.0 ties with +0.0, as in torch.sort
        s = b ^ ((b >> 31) & 0x7FFFFFFF)  # negative: flip the low 31 bits
        s = tl.where((b & 0x7FFFFFFF) > 0x7F800000, 2147483647, s)  # NaN ranks above +inf, as in torch.topk
        return tl.where(m, s, -2147483648)
    else:
        b = b.to(tl.int32) & 0xFFFF
        b = tl.where(b == 0x8000, 0, b)
        u = b ^ tl.where(b >= 0x8000, 0xFFFF, 0x8000)
        u = tl.where((b & 0x7FFF) > NAN16, 0xFFFF, u)
        return tl.where(m, u, 0)


@triton.jit
def _skeys(X, offs, m, KEY_BITS: tl.constexpr, NAN16: tl.constexpr):
    return _to_skeys(_load_bits(X, offs, m, KEY_BITS), m, KEY_BITS, NAN16)


@triton.jit
def _as_f32(b, KEY_BITS: tl.constexpr, NAN16: tl.constexpr):
    """The scores as fp32 values, from their bits (exact for fp16 / bf16)."""
    if KEY_BITS == 32:
        return b.to(tl.float32, bitcast=True)
    elif NAN16 == 0x7F80:  # bf16: the top half of an fp32
        return (b.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        return b.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _clamp_key(s, KEY_BITS: tl.constexpr, NAN16: tl.constexpr):
    """s clamped to [key(-inf), key(+inf)]."""
    if KEY_BITS == 32:
        return tl.minimum(tl.maximum(s, -2139095041), 2139095040)
    else:
        return tl.minimum(tl.maximum(s, (0x8000 | NAN16) ^ 0xFFFF), 0x8000 | NAN16)


@triton.jit
def _key_as_f32(s, KEY_BITS: tl.constexpr, NAN16: tl.constexpr):
    """The score whose key is s, as an fp32 value, s clamped to [key(-inf), key(+inf)]: x >= it (or NaN) holds
    for every score with key >= s (all NaNs and +infs when s is above +inf's key), and only for scores whose key
    is >= the clamped s."""
    sc = _clamp_key(s, KEY_BITS, NAN16)
    if KEY_BITS == 32:
        return tl.where(sc >= 0, sc, sc ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)
    else:
        return _as_f32(tl.where(sc >= 0x8000, sc ^ 0x8000, sc ^ 0xFFFF), KEY_BITS, NAN16)


@triton.jit
def _maxmin2(a0, b0, a1, b1):
    return tl.maximum(a0, a1), tl.minimum(b0, b1)


@triton.jit
def _maxmin(s, valid, PAIR: tl.constexpr):
    """max and min of the valid keys: one two-operand reduction on the GPU."""
    if PAIR:
        mx, mn = tl.reduce((s, tl.where(valid, s, 2147483647)), 0, _maxmin2)
    else:
        mx = tl.max(s, 0)
        mn = tl.min(tl.where(valid, s, 2147483647), 0)
    return mx, mn


@triton.jit
def _thresholds(lo, hi):
    """Four thresholds (u, int64) that cut [lo, hi] into five parts (the top one slightly larger): each is > lo,
    <= hi + 1 and non-decreasing, the first <= hi when lo < hi. No division (int64 division is a long software
    routine on the GPU). Even cuts, not interpolated ones: the keys' density over a wide interval is far from
    even."""
    q = tl.maximum(((hi - lo + 1) * 858993459) >> 32, 1)  # ~(hi - lo + 1) / 5, for widths up to 2**32
    top = hi + 1
    return (tl.minimum(lo + q, top), tl.minimum(lo + 2 * q, top), tl.minimum(lo + 3 * q, top),
            tl.minimum(lo + 4 * q, top))


@triton.jit
def _ge(s, t, OFF: tl.constexpr):
    """1 (int32) where u >= t, as u > t - 1: t may be UMAX + 1, which no key reaches."""
    return (s > (t - 1 - OFF).to(tl.int32)).to(tl.int32)


@triton.jit
def _add2(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@triton.jit
def _count4(s, t1, t2, t3, t4, OFF: tl.constexpr, PAIR: tl.constexpr):
    """How many keys are >= each threshold (t1 <= t2 <= t3 <= t4): two 16-bit counts per int32 (s has at most 16384
    lanes), each word 0, 1 or 0x10001 by two nested selects, both words summed in one two-operand reduction on the
    GPU (PAIR), by two sums in the interpreter (where a two-operand reduction is a Python loop). The selects take
    fewer instructions than 0/1 flags shifted and or-ed."""
    va = tl.where(_ge(s, t2, OFF) != 0, 0x10001, _ge(s, t1, OFF))
    vb = tl.where(_ge(s, t4, OFF) != 0, 0x10001, _ge(s, t3, OFF))
    if PAIR:
        ta, tb = tl.reduce((va, vb), 0, _add2)
    else:
        ta = tl.sum(va, 0)
        tb = tl.sum(vb, 0)
    return ta & 0xFFFF, ta >> 16, tb & 0xFFFF, tb >> 16


@triton.jit
def _choose(lo, hi, t1, t2, t3, t4, c1, c2, c3, c4, above, need, binc):
    """Narrow [lo, hi] to the part that holds the need-th largest key in it. c_i: keys in [lo, hi] that are
    >= t_i (non-increasing). State: `above` keys are > hi, `binc` are in [lo, hi], above < k <= above + binc."""
    d1 = c1 >= need
    d2 = c2 >= need
    d3 = c3 >= need
    d4 = c4 >= need
    new_lo = tl.where(d4, t4, tl.where(d3, t3, tl.where(d2, t2, tl.where(d1, t1, lo))))
    new_hi = tl.where(d4, hi, tl.where(d3, t4 - 1, tl.where(d2, t3 - 1, tl.where(d1, t2 - 1, t1 - 1))))
    n_in = tl.where(d4, c4, tl.where(d3, c3, tl.where(d2, c2, tl.where(d1, c1, binc))))
    n_up = tl.where(d4, 0, tl.where(d3, c4, tl.where(d2, c3, tl.where(d1, c2, c1))))
    return new_lo, new_hi, above + n_up, need - n_up, n_in - n_up


@triton.jit
def _search(s, lo, hi, above, need, binc, stop, OFF: tl.constexpr, PAIR: tl.constexpr, FIN: tl.constexpr = 0):
    """Interval search over register-resident keys until the interval is one value or above + binc <= stop.
    FIN = 1 (the select, stop = k): also when need is 1, and then the interval becomes its largest key, one max
    reduction instead of the rounds that would separate that key from the next (which cuts the slowest rows'
    last rounds). The bound's search, whose stop is a window rather than one rank, keeps FIN = 0."""
    while (lo < hi) & (above + binc > stop) & (need > FIN):
        t1, t2, t3, t4 = _thresholds(lo, hi)
        n1, n2, n3, n4 = _count4(s, t1, t2, t3, t4, OFF, PAIR)
        lo, hi, above, need, binc = _choose(lo, hi, t1, t2, t3, t4, n1 - above, n2 - above, n3 - above,
                                            n4 - above, above, need, binc)
    if FIN:
        if (lo < hi) & (above + binc > stop):  # need is 1: the k-th largest key is the interval's largest
            t = tl.max(tl.where(s <= (hi - OFF).to(tl.int32), s, -2147483648), 0)  # keys above hi are `above`
            lo = t.to(tl.int64) + OFF
            hi = lo
    return lo, hi, above, need, binc


@triton.jit
def _bound(Xr, N, STRIDE, J, J_HI, S: tl.constexpr, KEY_BITS: tl.constexpr, NAN16: tl.constexpr,
           OFF: tl.constexpr, UMAX: tl.constexpr, PAIR: tl.constexpr):
    """L (u, >= 1): at least J of the row's S sampled keys are >= L, at most J_HI unless ties forbid it."""
    i = tl.arange(0, S)
    pos = (i // 8) * STRIDE + (i % 8)  # groups of 8 adjacent scores: whole 32-byte sectors
    s = _skeys(Xr, pos, pos < N, KEY_BITS, NAN16)
    lo = tl.full([], 1, tl.int64)
    hi = tl.full([], UMAX, tl.int64)
    zero = tl.zeros([], tl.int32)
    lo, hi, above, need, binc = _search(s, lo, hi, zero, zero + J, zero + S, J_HI, OFF, PAIR)
    return lo


@triton.jit
def _source(Xr, CKr, p, jj, mm, from_x, CHUNK: tl.constexpr, KEY_BITS: tl.constexpr, NAN16: tl.constexpr,
            MASKED: tl.constexpr):
    """Fallback: keys of tile jj of chunk p, from the row itself or from the chunk's candidate slice (bits)."""
    if from_x:
        s = _skeys(Xr, p * CHUNK + jj, mm, KEY_BITS, NAN16)
    else:
        s = _to_skeys(tl.load(CKr + p * CHUNK + jj, mask=mm, other=0, cache_modifier=".cg"), mm, KEY_BITS, NAN16)
    return s


@triton.jit
def _fallback_count(CNTr, N, p, from_x, CHUNK: tl.constexpr):
    """Fallback: how many keys chunk p holds (the row's chunk, or its candidate slice)."""
    if from_x:
        n_p = tl.minimum(N - p * CHUNK, CHUNK)
    else:
        n_p = tl.load(CNTr + p, cache_modifier=".cg")
    return n_p


@triton.jit
def _fallback(Xr, CKr, CIr, CNTr, Or, N, k, P, C, LB, KEY_BITS: tl.constexpr, NAN16: tl.constexpr,
              CHUNK: tl.constexpr, TILE: tl.constexpr, OFF: tl.constexpr, UMAX: tl.constexpr,
              MASKED: tl.constexpr, PAIR: tl.constexpr):
    """The row's selection from memory: the candidate slices when they hold >= k keys, else the whole row.
    LB (u, >= 1): no candidate's key is below it. From the slices, the search starts at LB and each pass's first
    threshold is lo + 1, so a pass that finds fewer than `need` keys above lo ends it: on tie-heavy rows (many
    scores equal to the k-th largest, e.g. integer-valued ones, where the candidates overflow CAP) that is often the
    first pass, instead of a 5-way narrowing pass after pass."""
    from_x = C < k
    zero = tl.zeros([], tl.int32)
    lo = tl.where(from_x, 1, LB).to(tl.int64)  # every score's u is >= 1, every candidate's >= LB
    hi = tl.full([], UMAX, tl.int64)
    binc = tl.where(from_x, zero + N, C)
    above = zero
    need = zero + k
    jt = tl.arange(0, TILE)
    while (lo < hi) & (above + binc > k):
        t1, t2, t3, t4 = _thresholds(lo, hi)
        t1 = tl.where(from_x, t1, lo + 1)  # < t2: from the slices, the keys above lo, to catch ties at lo
        lo_s = (lo - OFF).to(tl.int32)
        hi_s = (hi - OFF).to(tl.int32)
        a1 = zero
        a2 = zero
        a3 = zero
        a4 = zero
        mx_in = zero - 2147483647 - 1
        mn_in = zero + 2147483647
        for p in range(0, P):
            n_p = _fallback_count(CNTr, N, p, from_x, CHUNK)
            for off in range(0, n_p, TILE):
                jj = off + jt
                mm = jj < n_p
                s = _source(Xr, CKr, p, jj, mm, from_x, CHUNK, KEY_BITS, NAN16, MASKED)
                n1, n2, n3, n4 = _count4(s, t1, t2, t3, t4, OFF, PAIR)
                a1 += n1
                a2 += n2
                a3 += n3
                a4 += n4
                inb = (s >= lo_s) & (s <= hi_s)
                mx_in = tl.maximum(mx_in, tl.max(tl.where(inb, s, -2147483648), 0))
                mn_in = tl.minimum(mn_in, tl.min(tl.where(inb, s, 2147483647), 0))
        lo, hi, above, need, binc = _choose(lo, hi, t1, t2, t3, t4, a1 - above, a2 - above, a3 - above,
                                            a4 - above, above, need, binc)
        lo = tl.maximum(lo, mn_in.to(tl.int64) + OFF)  # no key of the old interval lies outside [mn_in, mx_in]
        hi = tl.minimum(hi, mx_in.to(tl.int64) + OFF)
    # write: keys above the interval, then the first `need` inside it, in index order
    lo_s = (lo - OFF).to(tl.int32)
    hi_s = (hi - OFF).to(tl.int32)
    sel_run = zero
    eq_run = zero
    for p in range(0, P):
        n_p = _fallback_count(CNTr, N, p, from_x, CHUNK)
        for off in range(0, n_p, TILE):
            jj = off + jt
            mm = jj < n_p
            s = _source(Xr, CKr, p, jj, mm, from_x, CHUNK, KEY_BITS, NAN16, MASKED)
            a = (mm & (s > hi_s)).to(tl.int32)
            e = (mm & (s >= lo_s) & (s <= hi_s)).to(tl.int32)
            both = a + (e << 16)  # one scan for both counts (TILE < 2**16)
            pre = tl.cumsum(both, 0) - both
            tot = tl.sum(both, 0)
            room = tl.maximum(need - eq_run, 0)  # ties still to take
            eq_pre = pre >> 16
            take = (a > 0) | ((e > 0) & (eq_pre < room))
            pos = scatter_offsets(sel_run + (pre & 0xFFFF) + tl.minimum(eq_pre, room), take, sel_run)
            if from_x:
                i = p * CHUNK + jj
            else:
                i = tl.load(CIr + p * CHUNK + jj, mask=take, other=0, cache_modifier=".cg")
            tl.store(Or + pos, i.to(tl.int64), mask=take)
            sel_run += (tot & 0xFFFF) + tl.minimum(tot >> 16, room)
            eq_run += tot >> 16


@triton.jit
def _gather_packed(CKr, CIr, CNTr, P, j, CHUNK: tl.constexpr, PP: tl.constexpr):
    """The row's C candidates in lanes 0..C-1, in index order (slice after slice): valid, bits, indices, C."""
    addr = j  # where candidate j lies: its chunk's slice, after that slice's earlier ones
    C = tl.zeros([], tl.int32)
    for q in tl.static_range(PP):  # unrolled: the P count loads are in flight together
        c_q = tl.load(CNTr + q, mask=q < P, other=0, cache_modifier=".cg")
        C += c_q
        addr += tl.where(j >= C, CHUNK - c_q, 0)
    valid = j < C
    bits = tl.load(CKr + addr, mask=valid, other=0, cache_modifier=".cg")
    i = tl.load(CIr + addr, mask=valid, other=0, cache_modifier=".cg")  # in flight with the keys
    return valid, bits, i, C


@triton.jit
def _restream(Xr, CKr, CIr, CNTr, N, P, low, CHUNK: tl.constexpr, TILE: tl.constexpr, KEY_BITS: tl.constexpr,
              NAN16: tl.constexpr):
    """The whole row again, by one program: every chunk's scores >= low (its fp32 score) into the chunk's candidate
    slice, in index order, and the new counts; returns their total. The next tile's load is issued before this
    one's compaction."""
    jt = tl.arange(0, TILE)
    NT: tl.constexpr = CHUNK // TILE
    total = tl.zeros([], tl.int32)
    for p in range(0, P):
        run = tl.zeros([], tl.int32)
        i0 = p * CHUNK + jt
        b1 = _tile_load(Xr, i0, jt, 0, N, NT, TILE, False)
        for t in range(NT):
            b0 = b1
            b1 = _tile_load(Xr, i0 + (t + 1) * TILE, jt, t + 1, N, NT, TILE, False)
            run = _compact(CKr + p * CHUNK, CIr + p * CHUNK, b0, i0 + t * TILE, low, N, run, KEY_BITS, NAN16, False)
        tl.store(CNTr + p, run)
        total += run
    tl.debug_barrier()  # the slices' stores are done before any thread gathers them
    return total


@triton.jit
def _select_regs(bits, valid, i, C, k, Or, KEY_BITS: tl.constexpr, NAN16: tl.constexpr, OFF: tl.constexpr,
                 PAIR: tl.constexpr):
    """The row's top-k from its C candidates held in lanes (bits, indices; `valid` lanes in index order): the search
    from their [min, max], then the indices above the interval and the first `need` inside it, at cumsum positions."""
    s = _to_skeys(bits, valid, KEY_BITS, NAN16)
    mx, mn = _maxmin(s, valid, PAIR)  # the search starts from the candidates' [min, max]
    zero = tl.zeros([], tl.int32)
    lo, hi, above, need, binc = _search(s, mn.to(tl.int64) + OFF, mx.to(tl.int64) + OFF, zero, zero + k, C,
                                        k, OFF, PAIR, 1)
    lo_s = (lo - OFF).to(tl.int32)
    hi_s = (hi - OFF).to(tl.int32)
    a = (valid & (s > hi_s)).to(tl.int32)
    e = (valid & (s >= lo_s) & (s <= hi_s)).to(tl.int32)
    both = a + (e << 16)  # one scan for both counts (lanes < 2**16)
    pre = tl.cumsum(both, 0) - both
    eq_pre = pre >> 16
    take = (a > 0) | ((e > 0) & (eq_pre < need))
    pos = scatter_offsets((pre & 0xFFFF) + tl.minimum(eq_pre, need), take, need)
    tl.store(Or + pos, i.to(tl.int64), mask=take)


@triton.jit
def _select(Xr, CKr, CIr, CNTr, Or, N, k, P, KEY_BITS: tl.constexpr, NAN16: tl.constexpr,
            CHUNK: tl.constexpr, CAP: tl.constexpr, PP: tl.constexpr, TILE: tl.constexpr, OFF: tl.constexpr,
            UMAX: tl.constexpr, MASKED: tl.constexpr, PAIR: tl.constexpr, LB,
            WIN: tl.constexpr, CAP2: tl.constexpr, STRIDE, J2, J2_HI, S: tl.constexpr, FLIP: tl.constexpr,
            RESTREAM: tl.constexpr):
    """The row's last program: its top-k from the candidate slices (LB: the bound they passed, u).
    WIN > 0: lane j holds slot j % WIN of chunk j // WIN (WIN = CAP / PP), loaded with the counts instead of after
    them (one L2 round trip less); a row with a chunk of more than WIN candidates gathers them again, packed.
    Rows the sample misjudged: RESTREAM, a row of fewer than k candidates gets a lower bound from the sample (its
    J2-th key instead of its J-th) and streams the row again into the slices (far cheaper than the fallback from
    the row); CAP2 > CAP, a row of CAP < C <= CAP2 candidates is held in CAP2 lanes instead of taking the
    slices fallback."""
    j = tl.arange(0, CAP)
    if WIN > 0:
        qj = j // WIN
        slot = j - qj * WIN
        valid = slot < tl.load(CNTr + qj, mask=qj < P, other=0, cache_modifier=".cg")
        bits = tl.load(CKr + qj * CHUNK + slot, mask=qj < P, other=0, cache_modifier=".cg")
        i = tl.load(CIr + qj * CHUNK + slot, mask=qj < P, other=0, cache_modifier=".cg")
        C = tl.zeros([], tl.int32)
        most = tl.zeros([], tl.int32)
        for q in tl.static_range(PP):
            c_q = tl.load(CNTr + q, mask=q < P, other=0, cache_modifier=".cg")
            C += c_q
            most = tl.maximum(most, c_q)
    else:
        valid, bits, i, C = _gather_packed(CKr, CIr, CNTr, P, j, CHUNK, PP)
    if (C >= k) & (C <= CAP):
        if WIN > 0:
            if most > WIN:
                valid, bits, i, C = _gather_packed(CKr, CIr, CNTr, P, j, CHUNK, PP)
        _select_regs(bits, valid, i, C, k, Or, KEY_BITS, NAN16, OFF, PAIR)
    else:
        if RESTREAM:
            if C < k:
                lb2 = _bound(Xr, N, STRIDE, J2, J2_HI, S, KEY_BITS, NAN16, OFF, UMAX, PAIR).to(tl.int32) ^ FLIP
                C = _restream(Xr, CKr, CIr, CNTr, N, P, _key_as_f32(lb2, KEY_BITS, NAN16), CHUNK, TILE, KEY_BITS,
                              NAN16)
                LB = _clamp_key(lb2, KEY_BITS, NAN16).to(tl.int64) + OFF
        if (CAP2 > CAP) or RESTREAM:
            LANES: tl.constexpr = CAP2 if CAP2 > CAP else CAP
            if (C >= k) & (C <= LANES):
                valid2, bits2, i2, C2 = _gather_packed(CKr, CIr, CNTr, P, tl.arange(0, LANES), CHUNK, PP)
                _select_regs(bits2, valid2, i2, C2, k, Or, KEY_BITS, NAN16, OFF, PAIR)
            else:
                _fallback(Xr, CKr, CIr, CNTr, Or, N, k, P, C, LB, KEY_BITS, NAN16, CHUNK, TILE, OFF, UMAX, MASKED,
                          PAIR)
        else:
            _fallback(Xr, CKr, CIr, CNTr, Or, N, k, P, C, LB, KEY_BITS, NAN16, CHUNK, TILE, OFF, UMAX, MASKED, PAIR)


@triton.jit
def _tile_load(Xr, offs, jt, t, N, NT: tl.constexpr, TILE: tl.constexpr, EVEN: tl.constexpr):
    """Tile t of the chunk (its scores' bits at offs): zeros where it lies past the row's end, or everywhere when t is
    past the chunk's last tile."""
    if EVEN:
        return tl.load(Xr + offs, mask=(jt < TILE) & (t < NT), other=0)
    else:
        return tl.load(Xr + offs, mask=(offs < N) & (t < NT), other=0)


@triton.jit
def _passes(b, idx, low, N, KEY_BITS: tl.constexpr, NAN16: tl.constexpr, EVEN: tl.constexpr):
    """Key >= L: x >= L's score, or NaN (one float compare), inside the row."""
    cand = (_as_f32(b, KEY_BITS, NAN16) < low) == 0
    if not EVEN:
        cand = cand & (idx < N)
    return cand


@triton.jit
def _put(CKs, CIs, pos, b, idx, cand):
    """Store the passing scores' bits (the selecting program makes their keys) and indices at pos."""
    tl.store(CKs + pos, b.to(tl.int32), mask=cand)
    tl.store(CIs + pos, idx, mask=cand)


@triton.jit
def _compact(CKs, CIs, b, idx, low, N, run, KEY_BITS: tl.constexpr, NAN16: tl.constexpr, EVEN: tl.constexpr):
    """One tile's scores >= L stored after the `run` earlier ones of its chunk's slice, in index order; returns the
    new running count."""
    cand = _passes(b, idx, low, N, KEY_BITS, NAN16, EVEN)
    c = cand.to(tl.int32)
    _put(CKs, CIs, scatter_offsets(run + tl.cumsum(c, 0) - c, cand, run), b, idx, cand)
    return run + tl.sum(c, 0)


@triton.jit(do_not_specialize=PLAN_SCALARS)
def _topk_kernel(X, OUT, CK, CI, CNT, BOUND, ARRIVE, DONE, N, k, stride_x, stride_o, P, STRIDE, J, J_HI, J2,
                 J2_HI, KEY_BITS: tl.constexpr, NAN16: tl.constexpr, CHUNK: tl.constexpr, CAP: tl.constexpr,
                 S: tl.constexpr, PP: tl.constexpr, TILE: tl.constexpr, HAS_BOUND: tl.constexpr,
                 OFF: tl.constexpr, UMAX: tl.constexpr, MASKED: tl.constexpr, FLIP: tl.constexpr,
                 PAIR: tl.constexpr, EVEN: tl.constexpr, TILE_PAIRS: tl.constexpr,
                 WIN: tl.constexpr, CAP2: tl.constexpr, RESTREAM: tl.constexpr, PDL: tl.constexpr = 0):
    wait_for_prior(PDL)
    q = tl.program_id(0)
    r = q // P
    p = q - r * P
    r64 = r.to(tl.int64)
    Xr = X + r64 * stride_x
    NT: tl.constexpr = CHUNK // TILE
    jt = tl.arange(0, TILE)
    i0 = p * CHUNK + jt
    if EVEN:  # N is a multiple of CHUNK: no masks in the streaming loop
        b0 = tl.load(Xr + i0)  # the first two tiles are in flight before any wait
    else:
        b0 = tl.load(Xr + i0, mask=i0 < N, other=0)
    b1 = _tile_load(Xr, i0 + TILE, jt, 1, N, NT, TILE, EVEN)
    if HAS_BOUND:
        if tl.atomic_add(ARRIVE + r, 1, sem="relaxed") == 0:  # first of its row: running, so safe to wait on
            lb0 = _bound(Xr, N, STRIDE, J, J_HI, S, KEY_BITS, NAN16, OFF, UMAX, PAIR)
            tl.atomic_xchg(BOUND + r, lb0.to(tl.int32), sem="relaxed")
        lb = tl.atomic_add(BOUND + r, 0, sem="relaxed")  # u bits of L; 0 = not yet
        while lb == 0:
            lb = tl.atomic_add(BOUND + r, 0, sem="relaxed")
        low = _key_as_f32(lb ^ FLIP, KEY_BITS, NAN16)
        low_u = _clamp_key(lb ^ FLIP, KEY_BITS, NAN16).to(tl.int64) + OFF  # every candidate's u is >= this
    else:
        low = _key_as_f32(tl.zeros([], tl.int32) + MASKED + 1, KEY_BITS, NAN16)  # -inf: every score
        low_u = tl.full([], 1, tl.int64)
    CKs = CK + r64 * P * CHUNK + p * CHUNK  # this chunk's slice
    CIs = CI + r64 * P * CHUNK + p * CHUNK
    run = tl.zeros([], tl.int32)
    if TILE_PAIRS:  # tiles two at a time: one scan and one sum for both tiles' flags, 16 bits apiece (TILE < 2**16)
        for t in range(0, NT, 2):
            n2 = i0 + (t + 2) * TILE
            b2 = _tile_load(Xr, n2, jt, t + 2, N, NT, TILE, EVEN)
            b3 = _tile_load(Xr, n2 + TILE, jt, t + 3, N, NT, TILE, EVEN)
            ia = i0 + t * TILE
            ib = ia + TILE
            ca = _passes(b0, ia, low, N, KEY_BITS, NAN16, EVEN)
            cb = _passes(b1, ib, low, N, KEY_BITS, NAN16, EVEN)
            both = ca.to(tl.int32) | (cb.to(tl.int32) << 16)
            pre = tl.cumsum(both, 0) - both
            tot = tl.sum(both, 0)
            na = tot & 0xFFFF
            _put(CKs, CIs, scatter_offsets(run + (pre & 0xFFFF), ca, run), b0, ia, ca)
            _put(CKs, CIs, scatter_offsets(run + na + (pre >> 16), cb, run), b1, ib, cb)
            run += na + (tot >> 16)
            b0 = b2
            b1 = b3
    else:  # one tile at a time
        for t in range(NT):
            b2 = _tile_load(Xr, i0 + (t + 2) * TILE, jt, t + 2, N, NT, TILE, EVEN)
            run = _compact(CKs, CIs, b0, i0 + t * TILE, low, N, run, KEY_BITS, NAN16, EVEN)
            b0 = b1
            b1 = b2
    CNTr = CNT + r64 * P
    tl.store(CNTr + p, run)
    tl.debug_barrier()  # every thread's stores are issued before the ticket releases them
    if tl.atomic_add(DONE + r, 1, sem="acq_rel") == P - 1:  # the row's last program
        tl.atomic_xchg(DONE + r, 0, sem="relaxed")
        if HAS_BOUND:
            tl.atomic_xchg(ARRIVE + r, 0, sem="relaxed")
            tl.atomic_xchg(BOUND + r, 0, sem="relaxed")
        _select(Xr, CK + r64 * P * CHUNK, CI + r64 * P * CHUNK, CNTr, OUT + r64 * stride_o, N, k, P,
                KEY_BITS, NAN16, CHUNK, CAP, PP, TILE, OFF, UMAX, MASKED, PAIR, low_u, WIN, CAP2, STRIDE, J2,
                J2_HI, S, FLIP, RESTREAM)



def fused_scratch(device: torch.device, rows: int, p: int, chunk: int) -> dict[str, torch.Tensor]:
    """The fused kernel's buffers for rows x p chunks of `chunk` scores (cached; left clean by every call)."""
    def build():
        i32 = dict(dtype=torch.int32, device=device)
        return dict(
            bound=torch.zeros(rows, **i32),  # u bits of the row's bound L; 0 between calls
            arrive=torch.zeros(rows, **i32),  # tickets: first program of a row computes the bound; 0 between calls
            done=torch.zeros(rows, **i32),  # tickets: last program of a row selects; 0 between calls
            cnt=torch.empty(rows, p, **i32),  # candidates per chunk
            ck=torch.empty(rows, p * chunk, **i32),  # candidate scores (bits), each chunk in its own slice
            ci=torch.empty(rows, p * chunk, **i32),  # candidate indices
        )

    return cached_scratch(("fused", device, rows, p, chunk), build)


def fused_topk(x: torch.Tensor, k: int, o: torch.Tensor, plan: Plan, config) -> None:
    """The fused select of x [rows, n] (unit stride) into o [rows, k] with `plan`; `config`: a TopkConfig."""
    rows, n = x.shape
    bits = DTYPE_KEY_BITS[x.dtype]
    chunk, p, cap = plan.chunk, plan.p, plan.cap
    cap2 = plan.cap2 if config.cap2 is None else config.cap2
    if cap2 and (cap2 <= cap or cap2 > CAP_MAX or cap2 & (cap2 - 1)):
        raise ValueError(f"topk: cap2={cap2} must be a power of two above the plan's cap {cap}, at most {CAP_MAX}")
    t = fused_scratch(x.device, rows, p, chunk)
    xv = x.view(torch.int32 if bits == 32 else torch.int16)
    warps = config.num_warps or (16 if cap >= 16384 else 8)
    tile = plan.tile
    pairs, win = loop_rule(plan, bits, config.tile_pairs, config.window)
    pp = next_pow2(p)
    maxnreg = config.maxnreg
    if maxnreg is None and pairs and warps == 8 and x.is_cuda:
        maxnreg = 224  # the paired loop spills at ptxas' own register choice (128); 224 measured faster
    extra = {} if maxnreg is None else dict(maxnreg=maxnreg)
    restream = plan.has_bound if config.restream is None else config.restream and plan.has_bound
    _topk_kernel[(rows * p,)](
        xv, o, t["ck"], t["ci"], t["cnt"], t["bound"], t["arrive"], t["done"],
        n, k, xv.stride(0), o.stride(0), p,
        plan.stride, plan.j, plan.j_hi, plan.j2, plan.j2_hi, KEY_BITS=bits,
        NAN16=DTYPE_NAN_EXP.get(x.dtype, 0), CHUNK=chunk,
        CAP=cap, S=plan.s, PP=pp, TILE=tile, HAS_BOUND=plan.has_bound,
        OFF=(1 << 31) if bits == 32 else 0, UMAX=(1 << bits) - 1, MASKED=_I32_MIN if bits == 32 else 0,
        FLIP=_I32_MIN if bits == 32 else 0, PAIR=x.is_cuda if config.pair is None else config.pair, EVEN=n % chunk == 0,
        TILE_PAIRS=pairs, WIN=win, CAP2=cap2, RESTREAM=restream, num_warps=warps, **extra,
        **dependent_launch(x.device))
