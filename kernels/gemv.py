"""A decode step's linear layers, y = x @ Wᵀ (+ b), for a few rows x (one per sequence of a batch), in Triton.

Why: decoding reads every weight once per token, so each projection should stream its weight at copy bandwidth.
cuBLAS's choices for 1-8 rows read Llama-3-8B's MLP and attention weights at ~2.5-2.8 TB/s on the H100 (the two
4096-row outputs through a split-K pass and its reduction launch); this kernel reads them at ~2.9 (one launch, no
split): 3-7 % of a decode step's time at 32768-131072 tokens, for every method alike (benchmarks/BENCHMARKS.md).

One program per BLOCK_N output rows: it streams W[rows, :] in BLOCK_K tiles (software-pipelined: STAGES tiles in
flight) and multiplies each by the rows of x, padded to 16 columns for tl.dot (fp32 accumulate); x is read from L2.
Each output row's sum runs in the same order whatever the number of rows, so a sequence decodes the same in any
batch. Tiles per shape (`plan`) from an H100 sweep of BLOCK_N 16-64, BLOCK_K 128-512 and 3-5 stages on
Llama-3-8B's projections at 1 and 8 rows (the 4096 x 4096 output projection fits the L2 in such a sweep, unlike in a
model, so its choice is the least certain).

Reference: kernels/reference.py::linear_reference (torch.nn.functional.linear).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .device import dependent_launch, wait_for_prior

MAX_ROWS = 16  # rows of x one launch takes (tl.dot's smallest tile); more rows: a GEMM's job (the caller's)


@triton.jit
def _gemv_kernel(X, W, BIAS, Y, N, K, stride_xb, stride_wn, stride_yb, ROWS: tl.constexpr, HAS_BIAS: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr = 0):
    wait_for_prior(PDL)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    r = tl.arange(0, 16)
    r_ok = r < ROWS
    acc = tl.zeros([BLOCK_N, 16], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        w = tl.load(W + n[:, None].to(tl.int64) * stride_wn + k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                    other=0.0)
        x = tl.load(X + r[None, :] * stride_xb + k[:, None], mask=r_ok[None, :] & k_ok[:, None], other=0.0)
        acc = tl.dot(w, x.to(w.dtype), acc)
    if HAS_BIAS:
        acc += tl.load(BIAS + n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    tl.store(Y + r[None, :] * stride_yb + n[:, None], acc.to(Y.dtype.element_ty), mask=n_ok[:, None] & r_ok[None, :])


def plan(n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, STAGES) for an [n, k] weight (the H100 sweep's best per shape of Llama-3-8B)."""
    if k >= 8192:  # the MLP's down projection (K 14336): long rows, narrow tiles
        return 32, 256, 5
    if n >= 16384:  # the joined gate/up projection, the head
        return 64, 128, 4
    return (64, 128, 5) if n > k else (32, 256, 4)  # joined q/k/v; the attention's output projection


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (at most MAX_ROWS rows) @ weight [N, K]ᵀ + bias [N] -> [..., N] in x's dtype; weight rows
    contiguous (a linear layer's). Same contract as linear_reference."""
    N, K = weight.shape
    if x.shape[-1] != K:
        raise ValueError(f"linear: x [..., {x.shape[-1]}] does not fit weight {tuple(weight.shape)}")
    if weight.stride(-1) != 1:
        raise ValueError("linear: the weight's rows must be contiguous")
    if bias is not None and bias.shape != (N,):
        raise ValueError(f"linear: bias must be [{N}], got {tuple(bias.shape)}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    rows = x2.shape[0]
    if rows > MAX_ROWS:
        raise ValueError(f"linear: at most {MAX_ROWS} rows, got {rows}")
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(rows, N, dtype=x.dtype, device=x.device)
    if rows and N:
        bn, bk, stages = plan(N, K)
        _gemv_kernel[(triton.cdiv(N, bn),)](x2, weight, bias if bias is not None else weight, y, N, K, x2.stride(0),
                                           weight.stride(0), y.stride(0), ROWS=rows, HAS_BIAS=bias is not None,
                                           BLOCK_N=bn, BLOCK_K=bk, STAGES=stages, num_warps=4,
                                           **dependent_launch(x.device, early=True))
    return y.view(*lead, N)
