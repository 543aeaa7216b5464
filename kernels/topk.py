"""Exact top-k over long score rows by selection (no sort), in Triton: one launch, one read of the rows.

Each score has an int32 key whose signed order is the scores' order (float bits: negative -> low 31 bits flipped;
-0.0 reads as +0.0 and every NaN as the largest key, torch.sort's order). `u` below is the same key as an unsigned
number (u = key + 2**31 for fp32, u = key for fp16/bf16, whose keys are 16 bits); a masked lane has u = 0, which no
score has. One launch of `rows x P` programs, about one per multiprocessor, each owning a CHUNK of one row and
streaming it in TILEs (AIR top-k's single pass and "last block", RadiK's sampled bound, PyTorch's multi-block radix
select, rebuilt around register-resident tiles):

1. bound    the first program of a row to arrive (an atomic ticket: it is running, so waiting on it cannot
            deadlock) reads a strided sample of the row (S scores in groups of 8 adjacent ones) and finds L, the
            floor of an interval holding the sample's J-th largest key with at most J_HI sample keys >= L.
            J = e + z sqrt(e) + 2 for the e = k S / N sample keys expected above the k-th largest key T, so L <= T
            but for bad luck and ~1.5-1.6 k scores pass it (S = 4096, z = 4 for 32 x 131072, k 2048: `_plan`). The
            other programs of the row spin on it (atomic reads) with their first two tiles already in flight.
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
   unlucky  rows the sample misjudged (session 23): more than CAP candidates but at most CAP2 = 2 CAP, the same
            search over CAP2 lanes; fewer than k, a second bound from the sample (its J2-th key, z2 = 10), the row
            streamed again by this program into the slices (~45 us), then the select (CAP2 or CAP lanes).
   fallback fewer than k candidates even so, or more than CAP2 (ties, constant rows, -inf padding, NaN-heavy
            rows): the same program runs the same search tile by tile from memory, over the
            candidate slices (or the row, if they are too few), shrinking the interval to the min and max of the
            keys inside it after every pass (a constant row takes one pass), then writes in index order. Over the
            slices it starts at the bound (clamped to +-inf's keys) and each pass first counts the keys above lo,
            so ties at the k-th value end it early. Forced in the tests with `_cap` (too many), `_z` (too few:
            the second bound) and `_z2` (too few for the second bound as well).

CAP = next_pow2(2k) (<= 16384, so k <= 8192; larger k takes the older multi-launch radix path, `_radix_topk`); on
CUDA a row of at most 16384 scores gets CAP = next_pow2(n), every score a candidate and step 1 skipped, unless the
sampled bound's CAP is at most half that and the row is over 2048 scores (`_short_row_plan`).
Counters are cleared by the programs that finish with them: no memset, no host sync, no data-dependent shape, so a
call can be captured in a CUDA graph. Scratch buffers are cached per (device, rows, chunks, chunk size) and left
clean by every call; calls that share them must be ordered (one stream, or one CUDA graph).
Reference: `kernels/reference.py::topk_reference`.

Measured on the H100 (CUDA-graph replays, same buffers; 32 x 131072 fp32, k 2048; torch.topk 91-94 us, 100 us on
rotated buffers). The older radix path: 85.8 us. This design, exact on every check (random, uniform, exponential,
ties, constant, sorted, NaN-heavy, -inf-padded rows; both fallbacks forced; graphs; 300 repeats), in its earlier
form (keys converted in the loop, S = 16384): 48.7 us (50.0 rotated); 8 x 131072: 39.4; bf16: 49.9; k 8192: 76.4
(torch 95.2); 32 x 32768: 23.4 (torch 59.6). A globaltimer trace of that form (S = 16384: 45.2 us) showed the bound
ready after 15.4 us (9.2 at S = 8192), 17 us of streaming per program (8 tiles) and 8.5 us of selection. The
streaming loop then spent a third of its instructions and most of its barriers on layout conversions before the
scattered stores (the loads' 4-per-thread layout against the stores' 1-per-thread one); `_scatter_offsets`
removes them, the candidates are picked by one float compare, the bound's thresholds need no division or guard,
the selection loads indices with the keys and takes max and min in one reduction, and S is 8192 (37.7 us
measured with S alone changed). That final form, on the H100 (.scratch-style correctness + timing script, same
checks as above plus 200 fresh 32 x 131072 rows, graph capture and 300 repeats: all exact): 31.9 us (33.0
rotated; torch.topk 94.3 / 101.5), 29.1 us with 2048-score tiles; 8 x 131072: 26.6 (torch 65.6); bf16: 32.6
(torch 70.1); k 8192: 45.1 (torch 96.7); 32 x 32768: 18.9 (torch 59.9). Fallback costs (earlier form): a constant
row 197 us, every row from its candidate slices 103 us, every row from the row itself 1.05 ms.

Where the time goes (H100, `results/topk-tuning-h100-session6.json`; 32 x 131072 fp32, k 2048, L2-cold inputs): with
2048-score tiles, now the default when the candidates fit 4096, 30.4 us (33.0 with 4096-score tiles; torch.topk 119).
The `_trace` timeline: the row's bound is known after 7.8 us (median), chunks are compacted by 18.3 (the last 19.3),
and the selecting program then takes 2.3 us to gather its candidates, 4.4 to search (six rounds) and 1.5 to write.
Each phase is bound by instruction issue and dependent reduction rounds, not by memory: the bound's search issues
~510 instructions per thread per round (32 sample keys each, about seven rounds), the streaming loop ~310 per
2048-score tile. Accordingly, none of these helped: asking L2 for each chunk while the bound is computed
(prefetch.global.L2: 33.0 us), 16 warps (33.7), 2 or 4 programs per SM (34.6-46: a second wave), loading the first
tiles after the ticket (no change). The 25 us target needs fewer or cheaper rounds in the bound and the search.
Also tried (`results/topk-warp-local-h100-session7.json`, patch beside it): warp-local compaction, each warp scanning
its own contiguous sub-chunks into their own slices (no barrier in the streaming loop; compaction done ~3 us sooner
with 16 warps), lost the gain to the gather over 16-32x more slices (3.4-3.9 us against 2.3) and to the slower bound
of 16 warps: 30.4 us again. A 9-way search (eight thresholds per reduction) slowed the bound and the search: their
rounds are bound by per-key compares and the scalar chain, not by the reductions.
Session 8 (`results/topk-imad-h100-session8.json`): the masked lanes' store offset is a runtime value (see
`_scatter_offsets`), so each candidate's address is one IMAD.WIDE: 264 instructions per streaming tile instead of 310,
chunks compacted ~1 us sooner. 32 x 131072 fp32, k 2048: 28.9 us against 30.0 before (same run; 29.7 / 30.4 and
28.9 / 30.5 in two other runs; `sparsekv bench`: 29.5); bf16 30.4 / 30.9; 8 rows 22.8 / 23.1; 32 x 32768 17.7 / 17.9;
k 8192 44.6 / 45.6. Tried and dropped (patch beside the JSON): [TILE / 128, 128] tiles with in-warp row scans (fewer
instructions, more barriers: 30.5-34.9 us); chunk 0's program loading the sample before its ticket (29.5, no gain); a
first bound round cut at the sample's Gaussian quantiles (mean + z sd): the bound known 2.4 us sooner on Gaussian-like
rows (27.3 us) but 2.6-3.8 us later on exponential and uniform ones (32.9, 34.1), so not robust.
Session 9 (`results/topk-session9-h100.json`, `results/kernels-h100.md`): an Nsight Compute profile shows the streaming
loop bound by dependent-instruction latency at 8 warps (a quarter of its samples in the running count's reduction), not
by memory, and L2-cold traces put the bound at 9.8 us (likely the sample's HBM reads queued behind the first tiles).
Measured and dropped: every program computing the bound, deeper prefetch, counts in the ticket, and per-program bounds
from sub-samples (28.2 us on this shape with 32-score sample groups; slower on 32 x 32768 and k 8192 with 8-score ones).
Session 15 (`results/topk-histogram-search-h100-session15.json`, patch beside it): the bound's and the select's searches
by tl.histogram (254 equal bins a round; Triton lowers it to a ballot per bin bit per value): 43.0 us, the select's
alone 33.5; two programs per SM 34.1; 4096- / 1024-score tiles 32.4 / 35.5 (this kernel: 29.7-29.8 in the same runs).
Session 18 (`results/topk-session18-h100.json`, patch beside it): with the bound given this kernel takes 21.9-22.0
us, so the sampled bound costs ~7.4 us (six search rounds of ~0.85 us, mostly fixed cost per round). Tried, not
adopted: the search from the sample's [min, max] (2-3 us faster on rows offset from zero, 0.8 slower on randn),
value-space thresholds (4 rounds instead of 6, no faster), compacting the keys left in the interval (slower), the
ticket before the tile loads, 3-4 tiles in flight, register caps.
Session 19 (`results/topk-session19-h100.json`, patch beside it): a call ends with its slowest row, whose select search
takes 7-10 rounds where the median row's takes 6 (rows whose k-th and (k+1)-th keys lie close). Ranking the last <= 32
keys directly (4 rounds for every row) trims that tail but costs the median row as much; sample groups of 32 scores
are 0.3-0.7 us faster but make the bound fail on rows whose top scores come in runs; a max / min folded into the
bound's first round, the ticket or the sample moved ahead of the tiles, and counters on their own lines: no faster.
Sessions 20-21 (`results/topk-session21-h100.json`, patch beside it): the select's search ends when one key more is
needed, on the interval's largest key (`_search`'s FIN), which cuts the slow rows' last rounds. Same run, against the
kernel before it: randn 29.06 / 29.81 us, logits 30.45 / 31.10, scaled 31.45 / 31.85, uniform 29.81 / 30.23,
exponential 28.84 / 29.79, attention-like 29.03 / 29.98, negative offset 32.16 / 32.15; 8 x 131072 22.2 / 22.9; bf16
30.5 / 30.7; 32 x 32768 17.0 / 17.8; k 4096 32.5 / 33.7; k 8192 41.7 / 44.6 (40 checks and the GPU tests pass). Tried:
each program's whole chunk in registers, loaded before the bound is known and compacted in one step (33.55-38.24 us on
the seven row kinds): the bound comes later (known at 11.0 us instead of 7.9) and the compaction still takes ~8.5
us with every score already in registers, as long as the streaming loop: it is bound by per-score instructions, not by
the loads. (Session 20 also measured per-tile candidate slots instead of the running count, and the running count's
reduction left out: slower, and < 1 us off the compaction; its output files were lost, so no figures here.)
Tiles two at a time (`_tile_pairs`): one scan and one sum serve two tiles, their flags packed 16 bits apiece. Measured
first in the experimental copy (session 21: `_pk` in its patch), then in this form.
Session 22 (`results/topk-session22-h100.json`, scripts `topk_session22.py`, `topk_window_counts.py`,
`topk_sample_size.py`): the defaults are now `_loop_rule`'s. Tiles two at a time on fp32 rows past a sampled bound
(with 224 registers at 8 warps), and the select's candidate window (lane j holds slot j % WIN of chunk j // WIN, loaded
with the counts instead of after them; a chunk with more than WIN candidates is gathered again, packed) on rows of 8
chunks or more. Against session 21's defaults in the same run: 32 x 131072 fp32, k 2048 randn 27.65 / 29.09 us, the six
other row kinds 0.4-1.4 faster; 8 x 131072 21.3 / 23.5; 1 x 131072 20.7 / 24.7; k 4096 30.1 / 32.7; k 8192 40.6 /
42.7; 32 x 32768 16.1 / 17.0; bf16 29.3 / 29.4 (no pairs there: 34.5 with them). The window loses 0.25-0.65 us on rows
of 4 chunks at k 2048 and 3.6-3.9 at k 8192 (with each lane's count taken from the scalar counts instead of a load,
`_wsel` in the session's patch, 27.5 against 27.5 without the window), so the packed gather's second L2 round trip is
not what costs there; it wins where the packed gather's address chain runs over 16-64 chunks. Paired tiles still make
the bound known ~1.3-1.5 us later (9.2-9.5 against 7.9, at 128, 168, 224 or 255 registers alike; their SASS differs
only in scheduling there).
Measured, not adopted: a bound from S = 4096 samples instead of 8192 is known at 6.1 us instead of 9.2 and the call
takes 24.7-26.9 us on the seven row kinds (z = 4), but 3-7 of 1024 rows then overflow CAP = 4096 and take the slices
fallback (about one 32-row call in seven would hold one; at z = 4.5, 10-26 rows of 1024, two row kinds took 35.5 and
44.6), and with CAP = 8192 instead the select costs more than the bound saves (29.3-31.6).
Nor a bound in two stages (`_b2` in the session's patch: the first rounds on half the sample bracket the full sample's
J-th key, one count of the full sample checks the bracket, the full sample's rounds finish): L2-warm traces put the
bound 0.25 us sooner, but over rotated inputs the call is 1.0-2.1 us slower on six row kinds (randn 29.07 / 27.44)
and 0.1-0.4 faster on negative offset rows: the bracket takes only about one round fewer than the whole search did
(modelled on CPU, b = 4: 5.0-9.6 half-sample rounds, a count and 1.4-2 full rounds, against 5.9-10.9 full rounds),
and every round keeps its fixed cost.
Session 23 (`results/topk-session23-h100.json`, script `topk_session23.py`; H100, us graph over rotated inputs, the
kernel before the session in the same runs): `_count4` builds each packed word by two nested selects (0, 1 or 0x10001)
instead of flags shifted and or-ed: 25.5 against 27.6 on 32 x 131072 randn, 2.1-3.1 faster on the other row kinds (the
bound known at 7.7 us instead of 9.2, the select's search 0.5 faster; SASS of the counting rounds 505 against 553
instructions). Then the rows a small sample misjudges got paths of their own (above: CAP2 lanes, the second bound),
which makes S = 4096 safe: the plan (`_plan`) takes, where its strict sample (z = 5, 4 deviations below CAP) holds 4096
scores or more, the smallest one that leaves 2 deviations below CAP and 5 below CAP2, J at z = 4. Over 16384 rows of
each of the seven kinds at S = 4096, z = 4: 0.3-0.8% of rows over CAP (none over 4819 candidates), none too few.
32 x 131072, k 2048: randn 23.3-23.5 (27.6 before), logits 24.5, neg 25.4, scaled 25.1, unif 24.1, exp 23.6, attn
23.6 (29.2, 31.7, 30.6, 28.5, 27.2, 27.8); 8 x 131072 17.1 (21.2); 1 x 131072 16.2 (20.6); bf16 27.8 (29.3); k 1024
24.7 (32.3); k 4096 26.8 (30.0); k 8192 40.4 (40.5); 32 x 32768 15.3 (16.0); short rows 0.06-0.6 faster. A row taking
the second bound costs ~48 us more (all 32 rows forced: 71.1 us; the row fallback it replaces: ~1 ms).
"""

from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl

from .device import num_sms

_I32_MIN = -2147483648
_I32_MAX = 2147483647
_CAP_MAX = 16384  # candidates held in registers by the selecting program
_P_MAX = 64  # chunks per row (the gather is unrolled over them)


@triton.jit
def _scatter_offsets(pos, mask, other):
    """Offsets of masked scattered stores, marked contiguous in runs of 4. A lie the store tolerates: its mask is
    data-dependent, so its vector width stays 1 and every lane stores at its own offset, but the compiler now gives
    the store the 4-per-thread layout of the loads feeding it. Without the mark it picks one score per thread for
    the store and converts the pointers, values and mask through shared memory on every tile (round trips with
    barriers that made up a third of the streaming loop).
    `other` (the masked lanes' offset; no store uses it) must be a runtime value, such as the running count: with
    a constant 0, LLVM moves the 64-bit sign extension above the select and builds each address by hand (sign, two
    selects and a 64-bit shift per offset, a 64-bit add per store: ~9 instructions for a candidate's two stores);
    with a runtime value the select stays 32-bit and each address is one IMAD.WIDE (the streaming loop on sm_90:
    310 -> 264 instructions per tile; timings in the module docstring)."""
    pos = tl.where(mask, pos, other)  # an op the canonicaliser keeps, to carry the marks
    return tl.max_contiguous(tl.multiple_of(pos, 4), 4)


@triton.jit
def _now():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


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
    routine on the GPU). (Interpolated thresholds, modelled on CPU with these rows' keys, saved no steps: the keys'
    density over a wide interval is far from even.)"""
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
    fewer instructions than 0/1 flags shifted and or-ed (sm_90 SASS of the counting rounds, S 8192: 505 against 553,
    `results/scripts/topk_count_sass.py`)."""
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
    reduction instead of the rounds that would separate that key from the next (H100, 32 x 131072, k 2048: 0.4-1.0 us
    off the call on six row kinds, none on negative offset rows; k 8192: 3.0 us). The bound's search, whose stop is a
    window rather than one rank, keeps FIN = 0."""
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
            pos = _scatter_offsets(sel_run + (pre & 0xFFFF) + tl.minimum(eq_pre, room), take, sel_run)
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
def _select_regs(bits, valid, i, C, k, Or, TRq, KEY_BITS: tl.constexpr, NAN16: tl.constexpr, OFF: tl.constexpr,
                 PAIR: tl.constexpr, TRACE: tl.constexpr):
    """The row's top-k from its C candidates held in lanes (bits, indices; `valid` lanes in index order): the search
    from their [min, max], then the indices above the interval and the first `need` inside it, at cumsum positions."""
    s = _to_skeys(bits, valid, KEY_BITS, NAN16)
    mx, mn = _maxmin(s, valid, PAIR)  # the search starts from the candidates' [min, max]
    if TRACE:
        tl.store(TRq + 4, _now())
    zero = tl.zeros([], tl.int32)
    lo, hi, above, need, binc = _search(s, mn.to(tl.int64) + OFF, mx.to(tl.int64) + OFF, zero, zero + k, C,
                                        k, OFF, PAIR, 1)
    if TRACE:
        tl.store(TRq + 7, _now())
    lo_s = (lo - OFF).to(tl.int32)
    hi_s = (hi - OFF).to(tl.int32)
    a = (valid & (s > hi_s)).to(tl.int32)
    e = (valid & (s >= lo_s) & (s <= hi_s)).to(tl.int32)
    both = a + (e << 16)  # one scan for both counts (lanes < 2**16)
    pre = tl.cumsum(both, 0) - both
    eq_pre = pre >> 16
    take = (a > 0) | ((e > 0) & (eq_pre < need))
    pos = _scatter_offsets((pre & 0xFFFF) + tl.minimum(eq_pre, need), take, need)
    tl.store(Or + pos, i.to(tl.int64), mask=take)


@triton.jit
def _select(Xr, CKr, CIr, CNTr, Or, N, k, P, TRq, KEY_BITS: tl.constexpr, NAN16: tl.constexpr,
            CHUNK: tl.constexpr, CAP: tl.constexpr, PP: tl.constexpr, TILE: tl.constexpr, OFF: tl.constexpr,
            UMAX: tl.constexpr, MASKED: tl.constexpr, PAIR: tl.constexpr, TRACE: tl.constexpr, LB,
            WIN: tl.constexpr, CAP2: tl.constexpr, STRIDE, J2, J2_HI, S: tl.constexpr, FLIP: tl.constexpr,
            RESTREAM: tl.constexpr):
    """The row's last program: its top-k from the candidate slices (LB: the bound they passed, u).
    WIN > 0: lane j holds slot j % WIN of chunk j // WIN (WIN = CAP / PP), loaded with the counts instead of after
    them (one L2 round trip less); a row with a chunk of more than WIN candidates gathers them again, packed.
    Rows the sample misjudged: RESTREAM, a row of fewer than k candidates gets a lower bound from the sample (its
    J2-th key instead of its J-th) and streams the row again into the slices (~tens of us instead of the row
    fallback's ~1 ms); CAP2 > CAP, a row of CAP < C <= CAP2 candidates is held in CAP2 lanes instead of taking the
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
        _select_regs(bits, valid, i, C, k, Or, TRq, KEY_BITS, NAN16, OFF, PAIR, TRACE)
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
                _select_regs(bits2, valid2, i2, C2, k, Or, TRq, KEY_BITS, NAN16, OFF, PAIR, TRACE)
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
    _put(CKs, CIs, _scatter_offsets(run + tl.cumsum(c, 0) - c, cand, run), b, idx, cand)
    return run + tl.sum(c, 0)


@triton.jit
def _topk_kernel(X, OUT, CK, CI, CNT, BOUND, ARRIVE, DONE, TR, N, k, stride_x, stride_o, P, STRIDE, J, J_HI, J2,
                 J2_HI, KEY_BITS: tl.constexpr, NAN16: tl.constexpr, CHUNK: tl.constexpr, CAP: tl.constexpr,
                 S: tl.constexpr, PP: tl.constexpr, TILE: tl.constexpr, HAS_BOUND: tl.constexpr,
                 OFF: tl.constexpr, UMAX: tl.constexpr, MASKED: tl.constexpr, FLIP: tl.constexpr,
                 PAIR: tl.constexpr, EVEN: tl.constexpr, TRACE: tl.constexpr, TILE_PAIRS: tl.constexpr,
                 WIN: tl.constexpr, CAP2: tl.constexpr, RESTREAM: tl.constexpr):
    q = tl.program_id(0)
    if TRACE:  # timeline for tuning (GPU only), per program: start, bound known, chunk compacted, selected; the
        # selecting program also its candidates gathered (slot 4) and its search done (slot 7)
        tl.store(TR + 8 * q, _now())
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
            if TRACE:
                tl.store(TR + 8 * q + 5, 1)
        lb = tl.atomic_add(BOUND + r, 0, sem="relaxed")  # u bits of L; 0 = not yet
        while lb == 0:
            lb = tl.atomic_add(BOUND + r, 0, sem="relaxed")
        low = _key_as_f32(lb ^ FLIP, KEY_BITS, NAN16)
        low_u = _clamp_key(lb ^ FLIP, KEY_BITS, NAN16).to(tl.int64) + OFF  # every candidate's u is >= this
        if TRACE:
            tl.store(TR + 8 * q + 1, _now())
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
            _put(CKs, CIs, _scatter_offsets(run + (pre & 0xFFFF), ca, run), b0, ia, ca)
            _put(CKs, CIs, _scatter_offsets(run + na + (pre >> 16), cb, run), b1, ib, cb)
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
    if TRACE:
        tl.store(TR + 8 * q + 2, _now())
    tl.debug_barrier()  # every thread's stores are issued before the ticket releases them
    if tl.atomic_add(DONE + r, 1, sem="acq_rel") == P - 1:  # the row's last program
        tl.atomic_xchg(DONE + r, 0, sem="relaxed")
        if HAS_BOUND:
            tl.atomic_xchg(ARRIVE + r, 0, sem="relaxed")
            tl.atomic_xchg(BOUND + r, 0, sem="relaxed")
        _select(Xr, CK + r64 * P * CHUNK, CI + r64 * P * CHUNK, CNTr, OUT + r64 * stride_o, N, k, P, TR + 8 * q,
                KEY_BITS, NAN16, CHUNK, CAP, PP, TILE, OFF, UMAX, MASKED, PAIR, TRACE, low_u, WIN, CAP2, STRIDE, J2,
                J2_HI, S, FLIP, RESTREAM)
        if TRACE:
            tl.store(TR + 8 * q + 3, _now())
            tl.store(TR + 8 * q + 6, 1)


# ---------------------------------------------------------------------------------------------------------------
# The older radix path (k > 8192, or rows of more than _P_MAX chunks): five to six launches, digit histograms over
# a candidate set bounded by group maxima. Kept as it was measured (88 us for 32 x 131072 fp32, k 2048).

_KEY_BITS = {torch.float32: 32, torch.float16: 16, torch.bfloat16: 16}
_FIRST = 12  # bits of the first digit (bound and compact passes)
_FINE = 16  # bits of the bound: the bound pass also histograms the maxima's top 16 bits
_REFINE = {32: (12, 8), 16: (4,)}  # bits of the later digits (candidates only); they add up to the key width
_COPIES = 4  # first-digit histograms per row, spread over the programs to cut atomic contention
_NAN_EXP = {torch.float16: 0x7C00, torch.bfloat16: 0x7F80}  # |bits| above this is a NaN


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


_SCRATCH: dict[tuple, dict[str, torch.Tensor]] = {}


def _radix_scratch(device: torch.device, rows: int, blocks: int, block: int, key_bits: int) -> dict[str, torch.Tensor]:
    key = ("radix", device, rows, blocks, block, key_bits)
    if key not in _SCRATCH:
        i32 = dict(dtype=torch.int32, device=device)
        _SCRATCH[key] = dict(
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
    return _SCRATCH[key]


def _radix_topk(x: torch.Tensor, k: int, o: torch.Tensor, block: int | None, num_warps: int | None) -> None:
    """The older multi-launch radix path (any k), for x [rows, n] contiguous into o [rows, k]."""
    rows, n = x.shape
    bits = _KEY_BITS[x.dtype]
    block = min(block or (4096 if x.is_cuda else 512), triton.next_power_of_2(n))
    warps = num_warps or (8 if block >= 4096 else 4)
    sub = min(block, 256)
    blocks = triton.cdiv(n, block)
    # groups of G scores give >= 2k maxima: their k-th largest is a tight lower bound on the k-th largest score
    g = 1 << max(0, min(4, (n // (2 * k)).bit_length() - 1))
    t = _radix_scratch(x.device, rows, blocks, block, bits)
    xv = x.view(torch.int32 if bits == 32 else torch.int16)
    nan16 = _NAN_EXP.get(x.dtype, 0)
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


def _sample_size(n: int, k: int, cap: int, cap2: int, z: float, sample: int | None) -> tuple[int, int, int, float]:
    """(S, J, J_HI, 0 or the candidates' mean + 4 deviations when no sample fits): the smallest sample (or `sample`)
    whose bound leaves <= cap candidates with 4 deviations to spare, or with cap2 > 0, <= cap with 2 and <= cap2
    with 5; J = e + z sqrt(e) + 2 for the e = k S / n sample keys expected above the k-th largest score."""
    best = None
    s = 8
    while s * 8 <= n and s <= 16384:
        e = k * s / n
        j = max(1, min(s, math.ceil(e + z * math.sqrt(e)) + 2))
        j_hi = min(s, j + max(2, j // 16))
        mean = j_hi * n / s
        sd = math.sqrt(mean * n / s)
        fits = mean + 4 * sd <= cap or (cap2 > 0 and mean + 2 * sd <= cap and mean + 5 * sd <= cap2)
        best = (s, j, j_hi, 0.0 if fits else mean + 4 * sd)
        if (sample is None and fits) or s == sample:
            break
        s *= 2
    return best


@functools.lru_cache(maxsize=1024)  # 25-34 µs of Python per build (results/topk-plan-cost-cpu.json); read-only result
def _plan(n: int, k: int, rows: int, n_sm: int, chunk: int | None = None, tile: int | None = None,
          cap: int | None = None, sample: int | None = None, z: float | None = None, z2: float = 10.0) -> dict | None:
    """Sizes for the one-launch path, or None when it does not apply (k > 8192). About one program per
    multiprocessor: each row gets n_sm // rows chunks (at most _P_MAX), a power of two each."""
    fixed_cap = cap is not None
    cap = triton.next_power_of_2(cap or max(256, 2 * k))
    if cap > _CAP_MAX or k > cap:
        return None
    chunk = chunk or triton.next_power_of_2(triton.cdiv(n, min(_P_MAX, max(1, n_sm // rows))))
    chunk = min(max(chunk, triton.next_power_of_2(triton.cdiv(n, _P_MAX))), max(16, triton.next_power_of_2(n)))
    plan = dict(chunk=chunk, p=triton.cdiv(n, chunk), tile=min(tile or 4096, chunk), has_bound=False, s=8, stride=8,
                j=1, j_hi=1, j2=1, j2_hi=1, cap2=0)
    if n <= cap:  # every score is a candidate
        plan["cap"] = max(16, triton.next_power_of_2(n))
        return plan
    # The smallest strided sample (S scores in groups of 8, S <= n / 8) whose bound leaves <= cap candidates with 4
    # standard deviations to spare, J z = 5 deviations above the e = k S / n sample keys expected above T (fewer than
    # k candidates in ~3e-7 of rows); a larger cap if none does. Where that sample holds 4096 scores or more, its
    # rounds cost more than the rare rows it spares (below): then the smallest sample that leaves <= cap with 2
    # deviations and <= cap2 = 2 cap with 5, J at z = 4 (too few in ~1e-5 of rows: 0 of 114688 measured, S = 4096).
    # Rows over cap take cap2 lanes, not the slices fallback (unless a cap is forced: the tests' way to reach it);
    # rows with too few stream again from the sample's J2-th key (z2 = 10 deviations) instead of the row fallback.
    # H100, session 23 (`results/topk-session23-h100.json`), against z = 5 with 4 deviations: 32 x 131072, k 2048
    # (S 8192 -> 4096) 25.7 -> 23.4 us; k 4096 (4096 -> 2048) 28.1 -> 26.8; 32 x 32768 (2048 -> 1024) 15.5 -> 15.9.
    cap2 = 2 * cap if 2 * cap <= _CAP_MAX and not fixed_cap else 0
    strict = _sample_size(n, k, cap, 0, 5.0 if z is None else z, sample)
    if cap2 and (sample is not None or strict[0] >= 4096):
        s, j, j_hi, worst = _sample_size(n, k, cap, cap2, 4.0 if z is None else z, sample)
    else:  # rows over cap are rare enough for the slices fallback (the second lane count cost 0.15-0.23 us there)
        s, j, j_hi, worst = strict
        cap2 = 0
    while worst > cap and cap < _CAP_MAX and not sample and not fixed_cap:
        cap *= 2
        cap2 = 2 * cap if cap2 and 2 * cap <= _CAP_MAX else 0
    e = k * s / n
    j2 = max(1, min(s, math.ceil(e + z2 * math.sqrt(e)) + 2))
    # 2048-score tiles stream faster than 4096 when the candidates fit 4096 (H100, L2-cold, 32 x 131072 fp32, k 2048:
    # 30.4 against 33.0 us; 8 rows 23.3 / 26.5; bf16 30.9 / 33.4; 32 x 32768 18.0 / 20.2), slower above (k 4096:
    # 34.9 / 34.0; k 8192: 47.4 / 45.6). results/topk-tuning-h100-session6.json
    plan.update(cap=cap, cap2=cap2, has_bound=True, s=s, stride=n // (s // 8), j=j, j_hi=j_hi, j2=j2,
                j2_hi=min(s, j2 + max(2, j2 // 16)), tile=min(tile or (2048 if cap <= 4096 else 4096), chunk))
    return plan


@functools.lru_cache(maxsize=1024)
def _short_row_plan(n: int, k: int, rows: int, n_sm: int, chunk: int | None = None, tile: int | None = None,
                    z: float | None = None, z2: float = 10.0) -> dict | None:
    """Rows of at most _CAP_MAX scores: the sampled bound when its candidates fit half the registers that every score
    would take (rows over 2048 scores), else every score a candidate. Session 17 (H100, µs graph, exact on every
    input; `results/topk-short-rows-h100.json`), every score a candidate -> this rule: 32 x 8192, k 128 20.3 -> 10.6;
    9 x 8191, k 127 21.2 -> 9.7; 32 x 8188, k 2047 (--rerank 4's second top-k) 25.9 -> 15.1; 32 x 16383, k 2047
    45.8 -> 16.8; 1 x 16384, k 512 140.6 -> 14.7; integer rows in [0, 40) 25.9 -> 14.7 (32 x 8192, k 128); constant
    rows lose (9.3 -> 23.4: every score ties the bound, the select falls back to the slices). Rows of 1024 scores
    took 8.0 with every score and 8.5 with the bound, so short rows keep every score."""
    whole = _plan(n, k, rows, n_sm, chunk, tile, n, None, z, z2)
    if n > 2048:
        bounded = _plan(n, k, rows, n_sm, chunk, tile, None, None, z, z2)
        if bounded is not None and bounded["has_bound"] and 2 * bounded["cap"] <= whole["cap"]:
            return bounded
    return whole


def _fused_plan(device: torch.device, rows: int, n: int, k: int, chunk: int | None = None, tile: int | None = None,
                cap: int | None = None, sample: int | None = None, z: float | None = None,
                z2: float = 10.0) -> dict | None:
    """The plan `topk` runs on rows x n scores on `device` with these knobs (None: the radix path)."""
    if device.type == "cuda":
        n_sm = num_sms(device)
        if cap is None and sample is None and n <= _CAP_MAX:
            return _short_row_plan(n, k, rows, n_sm, chunk, tile, z, z2)
        return _plan(n, k, rows, n_sm, chunk, tile, cap, sample, z, z2)
    # the interpreter: small chunks and tiles, so that the loops and the gather run
    return _plan(n, k, rows, 4 * rows, chunk or 512, tile or 128, cap, sample, z, z2)


def _loop_rule(plan: dict, bits: int, tile_pairs: bool | None = None, window: bool | None = None) -> tuple[bool, int]:
    """(tiles two at a time, the select's candidate window WIN or 0) for a plan; None = the measured default. H100,
    session 22 (`results/topk-session22-h100.json`, µs graph over rotated inputs, each against the same kernel without
    it in the same run): tiles two at a time on fp32 rows past a sampled bound (32 x 131072, k 2048: 27.5 / 29.0 on
    randn, 0.4-1.5 faster on six more row kinds; k 4096 30.2 / 32.9; k 8192 40.6 / 42.7; 32 x 32768 16.1 / 17.0;
    8 x 131072 21.3 / 22.0) but not on bf16 rows (34.5 / 29.3); it needs an even number of tiles per chunk. The
    window when a row has 8 chunks or more (8 x 131072: 22.0 / 23.5; 1 x 131072: 20.6 / 24.6) but not 4 (32 x 131072,
    k 2048: 29.6 / 29.0; k 8192: 46.3 / 42.7)."""
    pairs = (bits == 32 and plan["has_bound"]) if tile_pairs is None else tile_pairs
    pp = triton.next_power_of_2(plan["p"])
    window = pp >= 8 if window is None else window
    win = plan["cap"] // pp if window and plan["cap"] >= pp else 0
    return bool(pairs and (plan["chunk"] // plan["tile"]) % 2 == 0), win


def _fused_scratch(device: torch.device, rows: int, p: int, chunk: int) -> dict[str, torch.Tensor]:
    key = ("fused", device, rows, p, chunk)
    if key not in _SCRATCH:
        i32 = dict(dtype=torch.int32, device=device)
        _SCRATCH[key] = dict(
            bound=torch.zeros(rows, **i32),  # u bits of the row's bound L; 0 between calls
            arrive=torch.zeros(rows, **i32),  # tickets: first program of a row computes the bound; 0 between calls
            done=torch.zeros(rows, **i32),  # tickets: last program of a row selects; 0 between calls
            cnt=torch.empty(rows, p, **i32),  # candidates per chunk
            ck=torch.empty(rows, p * chunk, **i32),  # candidate scores (bits), each chunk in its own slice
            ci=torch.empty(rows, p * chunk, **i32),  # candidate indices
        )
    return _SCRATCH[key]


def rows_and_out(scores: torch.Tensor, k: int, out: torch.Tensor | None, name: str):
    """A selection's argument checks: scores [..., n] as rows x [R, n] with unit stride, the int64 output out
    [..., k] (made, or `out` checked: contiguous, on the scores' device), and out viewed as rows [R, k]."""
    if scores.dim() < 1:
        raise ValueError(f"{name}: the input needs at least one dimension")
    n = scores.shape[-1]
    if not 0 <= k <= n:
        raise ValueError(f"{name}: k={k} must be between 0 and the row length {n}")
    lead = scores.shape[:-1]
    x = scores.reshape(-1, n)
    if n > 1 and x.stride(-1) != 1:
        x = x.contiguous()
    if out is None:
        out = torch.empty(*lead, k, dtype=torch.int64, device=scores.device)
    elif out.shape != (*lead, k) or out.dtype != torch.int64 or out.device != scores.device:
        raise ValueError(f"{name}: out must be int64 {(*lead, k)} on {scores.device}")
    if not out.is_contiguous():
        raise ValueError(f"{name}: out must be contiguous")
    return x, out, out.view(x.shape[0], k)


def default_path() -> str:
    """The path `topk` takes when not told: $SPARSEKV_TOPK, else "fused" (which hands k > 8192 to the radix path
    itself; see topk's docstring), on every device and row length."""
    env = os.environ.get("SPARSEKV_TOPK")
    if env:
        return env
    return "fused"


def describe_default() -> str:
    """default_path's rule in words, for result files."""
    if os.environ.get("SPARSEKV_TOPK"):
        return f"{default_path()} path"
    return "fused path (radix for k > 8192)"


def topk(scores: torch.Tensor, k: int, *, out: torch.Tensor | None = None,
         _block: int | None = None, _num_warps: int | None = None, _path: str | None = None,
         _chunk: int | None = None, _cap: int | None = None, _sample: int | None = None,
         _tile: int | None = None, _z: float | None = None, _z2: float = 10.0, _maxnreg: int | None = None,
         _trace: torch.Tensor | None = None, _pair: bool | None = None,
         _tile_pairs: bool | None = None, _window: bool | None = None, _cap2: int | None = None,
         _restream: bool | None = None) -> torch.Tensor:
    """scores [..., N] (fp32/fp16/bf16) -> int64 indices [..., k] of the k largest per row.

    Exact: ties go to the lower index; each row's k indices come in ascending index order (not by score).
    NaN ranks above +inf and -0.0 ties with +0.0, as in torch.sort / torch.topk. No host sync, so it can be
    captured in a CUDA graph. Works on CUDA and under TRITON_INTERPRET=1 on the CPU. The underscored arguments
    are tuning knobs. Path: the one-launch fused kernel, or the multi-launch radix select (`_path`, else
    $SPARSEKV_TOPK). The default is "fused" (k > 8192 goes to the radix path). Until session 9 CUDA took "radix" for
    rows longer than _CAP_MAX, because an earlier fused kernel fell to its slow paths on tie-heavy rows
    (Adamas' and LSH's pooled integer code distances: adamas step 306 µs vs 117 with radix at 131072; those
    methods now use the counting select). Measured in session 9 (H100, 32 x 131072, k 2048, µs graph,
    `results/topk-ties-h100-session9.json`), fused against radix: randn 29.7 / 90.1; integers in [0, 3) 94.8 /
    106.7, [0, 40) 46.4 / 93.1, [0, 600) 36.9 / 87.2; negated Adamas-like distances 39.9 / 90.1; half-steps 31.5 /
    88.7; bf16 integers 50.6 / 94.5; only constant rows lose (223 / 148). `_tile_pairs` (stream tiles two at a time)
    and `_window` (the select's candidate window): None = `_loop_rule`'s measured default (module docstring, sessions
    20-22). `_z` / `_z2`: the deviations of the bound's J and the second bound's J2 (None: `_plan`'s rule); `_cap2`:
    the second lane count (None: the plan's, 0: none); `_restream`: False turns the second bound off (session 23).
    Rows of at most _CAP_MAX scores take the
    fused kernel too (one launch instead of six, which is what an eager decode step pays for: ~40 µs of Python per
    Triton launch on the H100 machine), with the sampled bound or every score a candidate (`_short_row_plan`).
    """
    if scores.dtype not in _KEY_BITS:
        raise ValueError(f"topk: scores must be float32, float16 or bfloat16, got {scores.dtype}")
    x, out, o = rows_and_out(scores, k, out, "topk")
    rows, n = x.shape
    if rows == 0 or k == 0:
        return out
    plan = None
    path = _path or default_path()
    if path not in ("radix", "fused"):
        raise ValueError(f"topk: path must be 'radix' or 'fused', got {path!r}")
    if path == "fused":
        plan = _fused_plan(scores.device, rows, n, k, _chunk, _tile, _cap, _sample, _z, _z2)
    if plan is None:
        _radix_topk(x, k, o, _block, _num_warps)
        return out

    bits = _KEY_BITS[scores.dtype]
    chunk, p, cap = plan["chunk"], plan["p"], plan["cap"]
    cap2 = plan["cap2"] if _cap2 is None else _cap2
    if cap2 and (cap2 <= cap or cap2 > _CAP_MAX or cap2 & (cap2 - 1)):
        raise ValueError(f"topk: _cap2={cap2} must be a power of two above the plan's cap {cap}, at most {_CAP_MAX}")
    t = _fused_scratch(scores.device, rows, p, chunk)
    xv = x.view(torch.int32 if bits == 32 else torch.int16)
    warps = _num_warps or (16 if cap >= 16384 else 8)
    tile = plan["tile"]
    pairs, win = _loop_rule(plan, bits, _tile_pairs, _window)
    pp = triton.next_power_of_2(p)
    if _maxnreg is None and pairs and warps == 8 and scores.is_cuda:
        _maxnreg = 224  # the paired loop at ptxas' own register choice (128) spills; 224 measured ~0.3 us faster
    extra = {} if _maxnreg is None else dict(maxnreg=_maxnreg)
    _topk_kernel[(rows * p,)](
        xv, o, t["ck"], t["ci"], t["cnt"], t["bound"], t["arrive"], t["done"], t["cnt"] if _trace is None else _trace,
        n, k, xv.stride(0), o.stride(0), p,
        plan["stride"], plan["j"], plan["j_hi"], plan["j2"], plan["j2_hi"], KEY_BITS=bits,
        NAN16=_NAN_EXP.get(scores.dtype, 0), CHUNK=chunk,
        CAP=cap, S=plan["s"], PP=pp, TILE=tile, HAS_BOUND=plan["has_bound"],
        OFF=(1 << 31) if bits == 32 else 0, UMAX=(1 << bits) - 1, MASKED=_I32_MIN if bits == 32 else 0,
        FLIP=_I32_MIN if bits == 32 else 0, PAIR=scores.is_cuda if _pair is None else _pair, EVEN=n % chunk == 0,
        TRACE=_trace is not None, TILE_PAIRS=pairs, WIN=win, CAP2=cap2,
        RESTREAM=plan["has_bound"] if _restream is None else _restream and plan["has_bound"], num_warps=warps, **extra)
    return out


__all__ = ["default_path", "describe_default", "topk"]
