"""Exact top-k over long score rows, in Triton: `topk(scores, k)` -> the k largest scores' indices per row.

Ties go to the lower index and each row's indices come in ascending index order, as from a stable sort
(`reference.py`). Two paths, both without a sort or a host sync (a call can be captured in a CUDA graph):
- `fused.py`, the default: one launch, one read of the rows. The first program of a row bounds the row's k-th
  largest score from a strided sample; every program keeps its chunk's scores above the bound; the row's last
  program selects the k among them in registers (in-kernel fallbacks keep it exact when the sample misjudges).
- `radix.py`: several launches of digit histograms, any k (the fused select holds at most 16384 candidates:
  it hands over k > 8192 unless the whole row fits them).
`plan.py` sizes a fused launch (chunks, tiles, sample, candidate lanes) in plain Python; `config.py`'s TopkConfig
overrides its choices for benchmarks and tests; `launch.py` holds the argument checks and scratch both paths
(and `kernels/count_select.py`) share. Figures: benchmarks/BENCHMARKS.md; `sparsekv bench` times both paths
against torch.topk.
"""

from __future__ import annotations

import os

import torch

from ..device import num_sms
from .config import TopkConfig
from .fused import fused_topk
from .launch import DTYPE_KEY_BITS, rows_and_out
from .plan import fused_plan
from .radix import radix_topk
from .reference import topk_reference

_DEFAULT = TopkConfig()


def default_path() -> str:
    """The path `topk` takes when not told: $SPARSEKV_TOPK, else "fused" (which hands k > 8192 to the radix path
    itself), on every device and row length."""
    env = os.environ.get("SPARSEKV_TOPK")
    if env:
        return env
    return "fused"


def describe_default() -> str:
    """default_path's rule in words, for result files."""
    if os.environ.get("SPARSEKV_TOPK"):
        return f"{default_path()} path"
    return "fused path (radix for k > 8192)"


def topk(scores: torch.Tensor, k: int, out: torch.Tensor | None = None,
         config: TopkConfig | None = None) -> torch.Tensor:
    """scores [..., N] (fp32/fp16/bf16) -> int64 indices [..., k] of the k largest per row (into `out` if given).

    Exact: ties go to the lower index; each row's k indices come in ascending index order (not by score).
    NaN ranks above +inf and -0.0 ties with +0.0, as in torch.sort / torch.topk. No host sync, so it can be
    captured in a CUDA graph. Works on CUDA and under TRITON_INTERPRET=1 on the CPU. `config`: tuning knobs
    (TopkConfig; None: every choice by the plan). The path is config.path, else $SPARSEKV_TOPK, else "fused";
    rows of any length take the fused kernel (with the sampled bound, or every score a candidate on short rows),
    and k > 8192 the radix path unless the whole row fits the fused select's 16384 lanes (on CUDA).
    """
    if scores.dtype not in DTYPE_KEY_BITS:
        raise ValueError(f"topk: scores must be float32, float16 or bfloat16, got {scores.dtype}")
    config = config or _DEFAULT
    x, out, o = rows_and_out(scores, k, out, "topk")
    rows, n = x.shape
    if rows == 0 or k == 0:
        return out
    plan = None
    path = config.path or default_path()
    if path not in ("radix", "fused"):
        raise ValueError(f"topk: path must be 'radix' or 'fused', got {path!r}")
    if path == "fused":
        n_sm = num_sms(scores.device) if scores.device.type == "cuda" else None
        plan = fused_plan(rows, n, k, n_sm, config.chunk, config.tile, config.cap, config.sample, config.z, config.z2)
    if plan is None:
        radix_topk(x, k, o, config.block, config.num_warps)
    else:
        fused_topk(x, k, o, plan, config)
    return out


__all__ = ["TopkConfig", "default_path", "describe_default", "topk", "topk_reference"]
