"""The fused select's plan, in plain Python: how a call on rows x n scores is cut into chunks and tiles, how large
the row's sample is and which of its ranks bound the candidates, how many candidates the select holds in registers,
and which loop variants the kernel compiles. No Triton here: the rules are unit-tested on their own.

About one program per multiprocessor: each row gets n_sm // rows chunks (at most P_MAX), a power of two each. Rows
that fit the select's lanes (n <= cap) skip the bound: every score is a candidate.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

CAP_MAX = 16384  # candidates held in registers by the selecting program (so k <= 8192 on this path)
P_MAX = 64  # chunks per row (the select's gather is unrolled over them)
Z2 = 10.0  # deviations of the second bound's J2: a row rarely needs a third


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (0 for n <= 0, as triton.next_power_of_2)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


@dataclass(frozen=True)
class Plan:
    """Sizes of one fused launch. A row is p chunks of `chunk` scores, streamed in tiles of `tile`; its select holds
    `cap` candidates in lanes (and `cap2` > cap for rows the sample misjudged, 0: none). With a bound (has_bound),
    the sample is s scores in groups of 8 at `stride`, and the bound is the j-th largest sample key with at most j_hi
    keys at or above it (j2 / j2_hi: the lower second bound)."""

    chunk: int
    p: int
    tile: int
    cap: int
    cap2: int = 0
    has_bound: bool = False
    s: int = 8
    stride: int = 8
    j: int = 1
    j_hi: int = 1
    j2: int = 1
    j2_hi: int = 1


def _j_hi(j: int, s: int) -> int:
    """At most this many sample keys above the bound: a window over J, so that the bound's search stops early."""
    return min(s, j + max(2, j // 16))


def sample_size(n: int, k: int, cap: int, cap2: int, z: float, sample: int | None) -> tuple[int, int, int, float]:
    """(S, J, J_HI, 0 or the candidates' mean + 4 deviations when no sample fits): the smallest sample (or `sample`)
    whose bound leaves <= cap candidates with 4 deviations to spare, or with cap2 > 0, <= cap with 2 and <= cap2
    with 5; J = e + z sqrt(e) + 2 for the e = k S / n sample keys expected above the k-th largest score."""
    best = None
    s = 8
    while s * 8 <= n and s <= 16384:
        e = k * s / n
        j = max(1, min(s, math.ceil(e + z * math.sqrt(e)) + 2))
        j_hi = _j_hi(j, s)
        mean = j_hi * n / s
        sd = math.sqrt(mean * n / s)
        fits = mean + 4 * sd <= cap or (cap2 > 0 and mean + 2 * sd <= cap and mean + 5 * sd <= cap2)
        best = (s, j, j_hi, 0.0 if fits else mean + 4 * sd)
        if (sample is None and fits) or s == sample:
            break
        s *= 2
    return best


@functools.lru_cache(maxsize=1024)  # plans are built per call, on the decode step's path; the Plan is immutable
def long_row_plan(n: int, k: int, rows: int, n_sm: int, chunk: int | None = None, tile: int | None = None,
                  cap: int | None = None, sample: int | None = None, z: float | None = None,
                  z2: float | None = None) -> Plan | None:
    """The plan for rows of any length, or None when the fused path does not apply (k > CAP_MAX / 2)."""
    z2 = Z2 if z2 is None else z2
    fixed_cap = cap is not None
    cap = next_pow2(cap or max(256, 2 * k))
    if cap > CAP_MAX or k > cap:
        return None
    chunk = chunk or next_pow2(cdiv(n, min(P_MAX, max(1, n_sm // rows))))
    chunk = min(max(chunk, next_pow2(cdiv(n, P_MAX))), max(16, next_pow2(n)))
    p = cdiv(n, chunk)
    if n <= cap:  # every score is a candidate
        return Plan(chunk=chunk, p=p, tile=min(tile or 4096, chunk), cap=max(16, next_pow2(n)))
    # The smallest strided sample (S scores in groups of 8, S <= n / 8) whose bound leaves <= cap candidates with 4
    # standard deviations to spare, J z = 5 deviations above the e = k S / n sample keys expected above T (fewer than
    # k candidates in ~3e-7 of rows); a larger cap if none does. Where that sample holds 4096 scores or more, its
    # search rounds cost more than the rare rows it spares: then the smallest sample that leaves <= cap with 2
    # deviations and <= cap2 = 2 cap with 5, J at z = 4. Rows over cap take cap2 lanes, not the slices fallback
    # (unless a cap is forced: the tests' way to reach it); rows with too few stream again from the sample's J2-th
    # key (z2 deviations) instead of the fallback from the row.
    cap2 = 2 * cap if 2 * cap <= CAP_MAX and not fixed_cap else 0
    strict = sample_size(n, k, cap, 0, 5.0 if z is None else z, sample)
    if cap2 and (sample is not None or strict[0] >= 4096):
        s, j, j_hi, worst = sample_size(n, k, cap, cap2, 4.0 if z is None else z, sample)
    else:  # rows over cap are rare enough for the slices fallback, which spares the second lane count's cost
        s, j, j_hi, worst = strict
        cap2 = 0
    while worst > cap and cap < CAP_MAX and not sample and not fixed_cap:
        cap *= 2
        cap2 = 2 * cap if cap2 and 2 * cap <= CAP_MAX else 0
    e = k * s / n
    j2 = max(1, min(s, math.ceil(e + z2 * math.sqrt(e)) + 2))
    # 2048-score tiles stream faster than 4096 while the select's lanes fit 4096, slower above (measured on the H100)
    return Plan(chunk=chunk, p=p, tile=min(tile or (2048 if cap <= 4096 else 4096), chunk), cap=cap, cap2=cap2,
                has_bound=True, s=s, stride=n // (s // 8), j=j, j_hi=j_hi, j2=j2, j2_hi=_j_hi(j2, s))


@functools.lru_cache(maxsize=1024)
def short_row_plan(n: int, k: int, rows: int, n_sm: int, chunk: int | None = None, tile: int | None = None,
                   z: float | None = None, z2: float | None = None) -> Plan | None:
    """Rows of at most CAP_MAX scores: the sampled bound when its candidates fit half the lanes that every score
    would take and the row is over 2048 scores, else every score a candidate (the bound's rounds cost more than
    they save on short rows, and every score tied to the bound on constant rows)."""
    whole = long_row_plan(n, k, rows, n_sm, chunk, tile, n, None, z, z2)
    if n > 2048:
        bounded = long_row_plan(n, k, rows, n_sm, chunk, tile, None, None, z, z2)
        if bounded is not None and bounded.has_bound and 2 * bounded.cap <= whole.cap:
            return bounded
    return whole


def fused_plan(rows: int, n: int, k: int, n_sm: int | None, chunk: int | None = None, tile: int | None = None,
               cap: int | None = None, sample: int | None = None, z: float | None = None,
               z2: float | None = None) -> Plan | None:
    """The plan `topk` runs on rows x n scores over n_sm multiprocessors (None: the Triton interpreter on the CPU),
    with these knobs (None: the rules above); None: the radix path."""
    if n_sm is not None:
        if cap is None and sample is None and n <= CAP_MAX:
            return short_row_plan(n, k, rows, n_sm, chunk, tile, z, z2)
        return long_row_plan(n, k, rows, n_sm, chunk, tile, cap, sample, z, z2)
    # the interpreter: small chunks and tiles, so that the loops and the gather run
    return long_row_plan(n, k, rows, 4 * rows, chunk or 512, tile or 128, cap, sample, z, z2)


def loop_rule(plan: Plan, bits: int, tile_pairs: bool | None = None, window: bool | None = None) -> tuple[bool, int]:
    """(tiles two at a time, the select's candidate window WIN or 0) for a plan; None = the default, each measured
    faster on the H100 where it applies. Tiles two at a time on fp32 rows past a sampled bound (not on 16-bit rows,
    where the paired loop is slower); they need an even number of tiles per chunk. The window when a row has 8
    chunks or more (where the packed gather's address chain runs long), not with fewer."""
    pairs = (bits == 32 and plan.has_bound) if tile_pairs is None else tile_pairs
    pp = next_pow2(plan.p)
    window = pp >= 8 if window is None else window
    win = plan.cap // pp if window and plan.cap >= pp else 0
    return bool(pairs and (plan.chunk // plan.tile) % 2 == 0), win
