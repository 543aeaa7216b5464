"""Tuning knobs of `topk`, for benchmarks and tests: every field None means the plan decides (`plan.py`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TopkConfig:
    """Overrides of the choices `topk` makes per shape. Any value forced here gives exact results; they exist to
    measure alternatives and to reach rare paths (the fused kernel's fallbacks) in the tests."""

    path: str | None = None  # "fused" or "radix"; None: $SPARSEKV_TOPK, else "fused" (`default_path`)
    num_warps: int | None = None  # warps per program, either path
    # the fused path's plan
    chunk: int | None = None  # scores per program (a power of two)
    tile: int | None = None  # scores per streamed tile
    cap: int | None = None  # candidate lanes of the select; a forced cap also turns the second lane count off
    cap2: int | None = None  # second lane count for rows of cap < C <= cap2 candidates; 0: none
    sample: int | None = None  # scores in the row's strided sample
    z: float | None = None  # deviations of the sampled bound's rank J above its expectation
    z2: float | None = None  # the same for the second, lower bound (J2)
    # the fused kernel's loops
    tile_pairs: bool | None = None  # stream tiles two at a time (one packed scan)
    window: bool | None = None  # the select's candidate window (lanes loaded with the counts)
    restream: bool | None = None  # False: a row with too few candidates takes the fallback from the row
    pair: bool | None = None  # two-operand reductions (the GPU's choice; True forces them in the interpreter)
    maxnreg: int | None = None  # register cap per thread
    # the radix path
    block: int | None = None  # scores per program
