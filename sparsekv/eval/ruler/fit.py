"""Find the largest haystack that fits: RULER binary-searches the haystack size so that prompt tokens +
tokens_to_generate <= max_seq_length (niah.py generate_samples, and the same loop in every task script).

Token counts grow almost linearly with the haystack size, so we step with the secant slope (Newton-like) and fall
back to bisection: a few evaluations instead of ~15 from a start near the answer (the previous sample's). The driver
runs it on predicted lengths (summed piece counts), and on exact ones only as a fallback.
"""

from __future__ import annotations

import math
from typing import Callable


def largest_fitting(count: Callable[[int], int], budget: int, start: int, lo: int, hi: int | None = None,
                    slope: float = 1.0, max_evals: int = 60) -> tuple[int | None, float]:
    """-> (largest size in [lo, hi] with count(size) <= budget, or None when even `lo` is too long; slope seen).

    `count` may be slightly non-monotone (sentence cuts, random digits): the answer is a size that fits, with the
    next size up known not to fit, as in RULER's search.
    """
    hi = hi if hi is not None else 1 << 40
    seen: dict[int, int] = {}
    ok: int | None = None  # largest size known to fit
    bad: int | None = None  # smallest size known not to fit, above ok
    s = min(max(start, lo), hi)
    slope = max(slope, 1e-6)
    prev: tuple[int, int] | None = None
    for it in range(max_evals):
        t = seen[s] if s in seen else seen.setdefault(s, count(s))
        if prev is not None and s != prev[0] and (t - prev[1]) / (s - prev[0]) > 0:
            slope = (t - prev[1]) / (s - prev[0])  # secant: tokens per haystack unit, measured here
        prev = (s, t)
        if t <= budget:
            ok = s
            if bad is not None and bad <= ok:
                bad = None
        else:
            bad = s if bad is None or s < bad else bad
        if bad == lo:
            return None, slope
        if ok is not None and (ok == hi or bad == ok + 1):
            return ok, slope
        low = ok + 1 if ok is not None else lo  # next probe strictly inside the unknown range
        high = bad - 1 if bad is not None else hi
        if it >= 6 and ok is not None and bad is not None:
            nxt = (low + high) // 2  # the slope keeps missing: bisect
        else:
            nxt = s + math.floor((budget - t) / slope)  # where the line through (s, t) crosses the budget
            nxt = s + 1 if t <= budget and nxt <= s else nxt
        s = min(max(nxt, low), high)
    # the cap is a safety net only; return what is known to fit
    return ok, slope
