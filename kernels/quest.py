"""Quest page scores in Triton (Tang et al., ICML 2024, Algorithm 1, "when perform self-attention").

page_scores  U[p] = Σ_i max(q_i·m_i, q_i·M_i) of every page p against its key-wise max M and min m, stored side by
             side as one [max | min] row of 2D values per page. One program per (batch row, KV head, block of pages)
             reads its pages' rows once (bounds are 2·D values per page, so at page size 16 this is 1/8 of the
             keys) and loops over the query heads of the GQA group, which either each write their row or are
             reduced by max in registers (pooling "group": one row per KV head, no second pass).

Why a kernel: cuBLAS takes the [G, 2D] x [2D, pages] product of a decode step (G = 4 query rows per KV head) as a
tall-skinny GEMM and ran it at ~80 µs for 8 KV heads x 8192 pages (llama3-8b, 131072 tokens, H100, bf16), ~7x the
33.5 MB read's bandwidth floor; reading the tile once and doing the O(G·D) work per page in registers is
bandwidth-bound. fp32 maths whatever the storage dtype.

Reference: kernels/reference.py::quest_scores_reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _page_scores_kernel(Q, BND, OUT, n_pages, Hkv,
                        stride_qb, stride_qh, stride_bb, stride_bh, stride_bp, stride_ob, stride_oh,
                        D: tl.constexpr, G: tl.constexpr, POOL_MAX: tl.constexpr,
                        BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_p = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // Hkv
    kv = bh % Hkv
    pages = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    p_ok = pages < n_pages
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    row = BND + b * stride_bb + kv * stride_bh + pages[:, None] * stride_bp + d[None, :]
    m_ok = p_ok[:, None] & d_ok[None, :]
    hi = tl.load(row, mask=m_ok, other=0.0).to(tl.float32)  # M: padding dims read 0 and add 0
    lo = tl.load(row + D, mask=m_ok, other=0.0).to(tl.float32)  # m
    best = tl.full([BLOCK_P], float("-inf"), tl.float32)
    for g in tl.static_range(G):
        q = tl.load(Q + b * stride_qb + (kv * G + g) * stride_qh + d, mask=d_ok, other=0.0).to(tl.float32)
        u = tl.sum(tl.maximum(q[None, :] * hi, q[None, :] * lo), axis=1)
        if POOL_MAX:
            best = tl.maximum(best, u)
        else:
            tl.store(OUT + b * stride_ob + (kv * G + g) * stride_oh + pages, u, mask=p_ok)
    if POOL_MAX:
        tl.store(OUT + b * stride_ob + kv * stride_oh + pages, best, mask=p_ok)


def page_scores(q: torch.Tensor, bounds: torch.Tensor, n_pages: int, pool: str | None = "max", *,
                block_p: int | None = None, num_warps: int = 4) -> torch.Tensor:
    """Upper bounds fp32 [B, Hkv, n_pages] (pool "max" over each KV head's query group) or [B, Hq, n_pages] (None).

    q: [B, Hq, D] or [B, Hq, 1, D]; bounds: [B, Hkv, >= n_pages, 2D] with each page's max then min (a slice of the
    cache state is fine, e.g. bounds[:, :, first_page:]); query head h reads KV head h // (Hq // Hkv).
    Same contract as quest_scores_reference.
    """
    if q.dim() == 4:
        if q.shape[2] != 1:
            raise ValueError(f"q must be [B, Hq, D] or [B, Hq, 1, D], got {tuple(q.shape)}")
        q = q[:, :, 0]
    if pool not in (None, "max"):
        raise ValueError(f"pool must be None or 'max', got {pool!r}")
    B, Hq, D = q.shape
    if bounds.dim() != 4 or bounds.shape[0] != B or bounds.shape[3] != 2 * D:
        raise ValueError(f"expected bounds [{B}, Hkv, pages, {2 * D}] for q {tuple(q.shape)}, "
                         f"got {tuple(bounds.shape)}")
    Hkv = bounds.shape[1]
    if Hq % Hkv:
        raise ValueError(f"{Hq} query heads are not a multiple of {Hkv} KV heads")
    if not 0 <= n_pages <= bounds.shape[2]:
        raise ValueError(f"n_pages {n_pages} is outside the bounds buffer's {bounds.shape[2]} pages")
    G = Hq // Hkv
    out = torch.empty(B, Hkv if pool else Hq, n_pages, dtype=torch.float32, device=q.device)
    if n_pages == 0 or B == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    if bounds.stride(-1) != 1:
        bounds = bounds.contiguous()
    BLOCK_D = triton.next_power_of_2(D)
    BLOCK_P = block_p or max(16, 4096 // BLOCK_D)  # two [BLOCK_P, BLOCK_D] fp32 tiles in registers
    grid = (triton.cdiv(n_pages, BLOCK_P), B * Hkv)
    _page_scores_kernel[grid](
        q, bounds, out, n_pages, Hkv,
        q.stride(0), q.stride(1), bounds.stride(0), bounds.stride(1), bounds.stride(2), out.stride(0), out.stride(1),
        D=D, G=G, POOL_MAX=pool == "max", BLOCK_P=BLOCK_P, BLOCK_D=BLOCK_D, num_warps=num_warps,
    )
    return out
