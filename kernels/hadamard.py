"""Orthonormal Hadamard transform over the last dim, in Triton: y = x @ H_d (Adamas, eq. 4).

Supported head dims (kernels/reference.py::SUPPORTED_HADAMARD): 2^n, 12·2^n and 20·2^n, i.e. H_{2^n} ⊗ H_m with
Sylvester's H_{2^n} and Paley's H_12 / H_20 (64, 80, 96, 128, 160, 192, 256, ...). Any other d is a ValueError.

Why a matrix product and not the O(d log d) butterfly: at head dims <= 256 one tile of rows times the d x d matrix is
a single tensor-core tl.dot per tile, and H_{2^n} ⊗ H_m needs no special case. The matrix is the *unnormalised* ±1
one (exact in fp16 / bf16, so the products are exact and the sum is accumulated in fp32); the 1/sqrt(d) scale is
applied to the fp32 accumulator. fp32 inputs use an IEEE fp32 dot (exact products, as the reference).

Reference: `kernels/reference.py::hadamard_reference` (same argument, plain torch).
"""

from __future__ import annotations

from typing import Callable

import torch
import triton
import triton.language as tl

from .reference import hadamard_matrix

_SIGNS: dict = {}


def hadamard_signs(d: int, dtype: torch.dtype, device, rows: int | None = None, cols: int | None = None,
                   perm: Callable[[], torch.Tensor] | None = None, key=None) -> torch.Tensor:
    """The ±1 matrix sqrt(d)·H_d in `dtype`, zero-padded to [rows, cols] (cached). With `perm` (called on a cache
    miss only, `key` naming it: a column index per output column, -1 for a zero column) its columns are gathered
    first: the fused quantize kernel's layout."""
    ck = (d, dtype, str(device), rows, cols, key)
    S = _SIGNS.get(ck)
    if S is None:
        H = torch.sign(hadamard_matrix(d, torch.float64))  # entries are exactly ±1/sqrt(d)
        if perm is not None:
            perm = perm()
            H = torch.where(perm >= 0, H[:, perm.clamp(min=0)], 0.0)
        rows, cols = rows or H.shape[0], cols or H.shape[1]
        S = torch.zeros(rows, cols, dtype=dtype, device=device)
        S[: H.shape[0], : H.shape[1]] = H.to(dtype)
        _SIGNS[ck] = S
    return S


@triton.jit
def _hadamard_kernel(X, S, OUT, M, stride_xm, stride_om, scale,
                     D: tl.constexpr, DP: tl.constexpr, PREC: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    r_ok = rows < M
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in tl.static_range(0, DP, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(X + rows[:, None] * stride_xm + kk[None, :], mask=r_ok[:, None] & (kk < D)[None, :], other=0.0)
        s = tl.load(S + kk[:, None] * DP + cols[None, :])  # padded with zeros: no mask
        acc += tl.dot(x, s, input_precision=PREC)
    y = acc * scale
    tl.store(OUT + rows[:, None] * stride_om + cols[None, :], y.to(OUT.dtype.element_ty),
             mask=r_ok[:, None] & (cols < D)[None, :])


def _prec(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # tf32 is ignored for 16-bit inputs (native tensor cores)


def hadamard(x: torch.Tensor, *, block_m: int = 64, num_warps: int = 4) -> torch.Tensor:
    """x @ H_d over the last dim of x [..., d] (fp32 accumulate), in x's dtype. Same contract as
    hadamard_reference; d must be one of SUPPORTED_HADAMARD (else ValueError)."""
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"hadamard: x must be float32, float16 or bfloat16, got {x.dtype}")
    D = x.shape[-1]
    hadamard_matrix(D)  # raises for unsupported d
    DP = max(16, triton.next_power_of_2(D))
    S = hadamard_signs(D, x.dtype, x.device, DP, DP)
    x2 = x.reshape(-1, D)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    out = torch.empty(M, D, dtype=x.dtype, device=x.device)
    if M == 0:
        return out.view(x.shape)
    BLOCK_M = block_m if M >= block_m else 16
    BLOCK_N = min(DP, 128)
    BLOCK_K = min(DP, 64)
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(D, BLOCK_N))
    _hadamard_kernel[grid](x2, S, out, M, x2.stride(0), out.stride(0), D ** -0.5,
                           D=D, DP=DP, PREC=_prec(x.dtype), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                           num_warps=num_warps)
    return out.view(x.shape)
