"""Launch helpers shared by the selects (the fused and radix top-k, and `kernels/count_select.py`): argument checks,
the dtype facts their keys need, cached scratch buffers, and the scattered stores' offsets."""

from __future__ import annotations

from typing import Callable

import torch
import triton
import triton.language as tl

DTYPE_KEY_BITS = {torch.float32: 32, torch.float16: 16, torch.bfloat16: 16}  # width of a score's order key
DTYPE_NAN_EXP = {torch.float16: 0x7C00, torch.bfloat16: 0x7F80}  # |bits| above this is a NaN

_SCRATCH: dict[tuple, dict[str, torch.Tensor]] = {}


def cached_scratch(key: tuple, build: Callable[[], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Scratch buffers cached per key (device and sizes), built once. Every call leaves them clean, so calls that
    share them need only be ordered (one stream, or one CUDA graph): no memset, no host sync."""
    if key not in _SCRATCH:
        _SCRATCH[key] = build()
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


@triton.jit
def scatter_offsets(pos, mask, other):
    """Offsets of masked scattered stores, marked contiguous in runs of 4. A lie the store tolerates: its mask is
    data-dependent, so its vector width stays 1 and every lane stores at its own offset, but the compiler now gives
    the store the 4-per-thread layout of the loads feeding it. Without the mark it picks one score per thread for
    the store and converts the pointers, values and mask through shared memory on every tile (round trips with
    barriers that made up a third of the streaming loop).
    `other` (the masked lanes' offset; no store uses it) must be a runtime value, such as the running count: with
    a constant 0, LLVM moves the 64-bit sign extension above the select and builds each address by hand (sign, two
    selects and a 64-bit shift per offset, a 64-bit add per store); with a runtime value the select stays 32-bit
    and each address is one IMAD.WIDE."""
    pos = tl.where(mask, pos, other)  # an op the canonicaliser keeps, to carry the marks
    return tl.max_contiguous(tl.multiple_of(pos, 4), 4)
