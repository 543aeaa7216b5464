"""One dispatch point per kernel op of the decode step's layer (kernels/layer_ops.py): the Triton kernel where kernels
run (a CUDA device, or SPARSEKV_KERNELS=1), else its torch reference, with the same signature."""

from __future__ import annotations

import torch

from sparsekv.kernels import reference as ref

from .sparse_attention import use_kernels


def _layer_ops(device: torch.device):
    if use_kernels(device):
        from sparsekv.kernels import layer_ops

        return layer_ops
    return None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual) * weight, x + residual)."""
    k = _layer_ops(x.device)
    return (k.rms_norm if k else ref.rms_norm_reference)(x, weight, eps, residual)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, 1, D] rotated by cos/sin [B, 1, R]."""
    k = _layer_ops(x.device)
    return (k.rope if k else ref.rope_reference)(x, cos, sin)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    k = _layer_ops(gate.device)
    return (k.silu_mul if k else ref.silu_mul_reference)(gate, up)


def write_kv(keys: torch.Tensor, values: torch.Tensor, slot: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Write one token's k/v [B, H, 1, D] into the cache keys/values [B, H, L, D] at device slots [B]."""
    kern = _layer_ops(k.device)
    (kern.write_kv if kern else ref.write_kv_reference)(keys, values, slot, k, v)
