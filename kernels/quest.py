"""Quest page scores in Triton (Tang et al., ICML 2024, Algorithm 1, "when perform self-attention").

page_scores  U[p] = Σ_i max(q_i·m_i, q_i·M_i) of every page p against its key-wise max M and min m, stored side by
             side as one [max | min] row of 2D values per page. Per channel the larger product is q_i·M_i where
             q_i > 0 and q_i·m_i where not, so U[p] = M·max(q, 0) + m·min(q, 0): two products of a tile of pages
             with the GQA group's queries as columns, on the MMA units (exact products of the stored values, fp32
             sums). Programs, a few per SM, loop over tiles of pages of one (batch row, KV head), several tiles in
             flight, and read each page's row once (bounds are 2·D values per page, so at page size 16 this is 1/8
             of the keys); the group's heads either each write their row or are reduced by max in registers
             (pooling "group": one row per KV head, no second pass).

Why a kernel: cuBLAS takes the [G, 2D] x [2D, pages] product of a decode step (G = 4 query rows per KV head) as a
tall-skinny GEMM and ran it at ~80 µs for 8 KV heads x 8192 pages (llama3-8b, 131072 tokens, H100, bf16), ~7x the
33.5 MB read's bandwidth floor. Here it takes 10.8 µs on an H200 (3.1 TB/s), where the same kernel with the
products and maxima written out per head took 14.4 (benchmarks/BENCHMARKS.md, "Quest's page scores").

page_blocks  the top-k's picks as the pages a step attends, with each row's newest page, in one launch.
append_one   a decode step's new key folded into its page's bounds, in one launch.

A graph-replayed step's rows have their own lengths on the device (PageRegion): page_scores gives the pages a row
may not choose -inf, and page_blocks reads each row's newest page, so a step builds no mask tensors.

References: kernels/reference.py::quest_region_scores_reference, quest_blocks_reference, quest_append_reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .device import dependent_launch, max_shared_mem, num_sms, wait_for_prior
from .reference import PageRegion
from .region import window_first


@triton.jit
def _choosable(L, page, first, window, S, SKIP_LAST: tl.constexpr):
    """Which absolute pages overlap a row's region [first, L - window) (first: its window's first key + sink) and are
    not its newest page with SKIP_LAST (PageRegion)."""
    ok = ((page + 1) * S > first) & (page * S < L - window)
    if SKIP_LAST:
        ok = ok & (page != (L - 1) // S)
    return ok


@triton.jit
def _page_scores_kernel(Q, BND, OUT, n_pages, Hkv,
                        stride_qb, stride_qh, stride_bb, stride_bh, stride_bp, stride_ob, stride_oh,
                        LENS, stride_l, span, sink, window, S, p_lo,
                        D: tl.constexpr, G: tl.constexpr, POOL_MAX: tl.constexpr,
                        BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr, REGION: tl.constexpr,
                        SKIP_LAST: tl.constexpr, STAGES: tl.constexpr, BLOCK_G: tl.constexpr,
                        F32: tl.constexpr, PDL: tl.constexpr = 0):
    """The pages of one (batch row, KV head) split over the grid's first axis: each program reads every
    num_programs(0)-th tile of BLOCK_P pages, STAGES tiles in flight."""
    wait_for_prior(PDL)
    b = tl.program_id(1) // Hkv
    kv = tl.program_id(1) % Hkv
    if REGION:  # pages this row may not choose score -inf; its length read on the device
        L = tl.load(LENS + b * stride_l).to(tl.int32)
        first = window_first(L, span) + sink
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    base = BND + b * stride_bb + kv * stride_bh
    # U = Σ_i max(q_i m_i, q_i M_i) = M · max(q, 0) + m · min(q, 0): two products with the group's queries as the
    # columns of [BLOCK_D, BLOCK_G] operands, so every head of the group scores a tile in one pass of the MMA units
    g = tl.arange(0, BLOCK_G)
    g_ok = g < G
    qt = tl.load(Q + b * stride_qb + (kv * G + g)[None, :] * stride_qh + d[:, None],
                 mask=d_ok[:, None] & g_ok[None, :], other=0.0)
    # fp32 bounds, or a query of another dtype than the bounds: fp32 operands; else the bounds' (q exact in them)
    op_dtype = tl.float32 if F32 else BND.dtype.element_ty
    q_pos = tl.maximum(qt.to(tl.float32), 0.0).to(op_dtype)
    q_neg = tl.minimum(qt.to(tl.float32), 0.0).to(op_dtype)
    for tile in tl.range(tl.program_id(0), tl.cdiv(n_pages, BLOCK_P), tl.num_programs(0), num_stages=STAGES):
        pages = tile * BLOCK_P + tl.arange(0, BLOCK_P)
        p_ok = pages < n_pages
        row = base + pages[:, None] * stride_bp + d[None, :]
        m_ok = p_ok[:, None] & d_ok[None, :]
        hi = tl.load(row, mask=m_ok, other=0.0)  # M: padding dims read 0 and add 0
        lo = tl.load(row + D, mask=m_ok, other=0.0)  # m
        if F32:
            hi = hi.to(tl.float32)
            lo = lo.to(tl.float32)
        u = tl.dot(hi, q_pos, input_precision="ieee") + tl.dot(lo, q_neg, input_precision="ieee")  # [P, G] fp32
        if REGION:
            inside = _choosable(L, p_lo + pages, first, window, S, SKIP_LAST)
            u = tl.where(inside[:, None], u, float("-inf"))
        if POOL_MAX:
            best = tl.max(tl.where(g_ok[None, :], u, float("-inf")), axis=1)
            tl.store(OUT + b * stride_ob + kv * stride_oh + pages, best, mask=p_ok)
        else:
            tl.store(OUT + b * stride_ob + (kv * G + g)[None, :] * stride_oh + pages[:, None], u,
                     mask=p_ok[:, None] & g_ok[None, :])


def page_scores(q: torch.Tensor, bounds: torch.Tensor, n_pages: int, pool: str | None = "max", *,
                region: PageRegion | None = None, block_p: int | None = None, num_warps: int = 4,
                num_stages: int | None = None, waves: int = 2) -> torch.Tensor:
    """Upper bounds fp32 [B, Hkv, n_pages] (pool "max" over each KV head's query group) or [B, Hq, n_pages] (None).

    q: [B, Hq, D] or [B, Hq, 1, D]; bounds: [B, Hkv, >= n_pages, 2D] with each page's max then min (a slice of the
    cache state is fine, e.g. bounds[:, :, first_page:]); query head h reads KV head h // (Hq // Hkv).
    region: pages outside it score -inf (read from device lengths: no mask tensor). Same contract as
    quest_region_scores_reference. Tuning: tiles of `block_p` pages, `num_stages` of them in flight, `waves`
    programs per SM looping over them.
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
    BLOCK_D = max(16, triton.next_power_of_2(D))  # tl.dot's least inner size; padding dims read 0
    BLOCK_P = block_p or max(16, 8192 // BLOCK_D)
    stages = num_stages or _stages(q.device, BLOCK_P * BLOCK_D * 2 * bounds.element_size(),
                                   bounds.element_size())
    tiles = triton.cdiv(n_pages, BLOCK_P)
    sms = num_sms(q.device) if q.device.type == "cuda" else 4  # the interpreter: a few programs loop over many tiles
    per_row = max(1, min(tiles, waves * sms // (B * Hkv)))
    _page_scores_kernel[(per_row, B * Hkv)](
        q, bounds, out, n_pages, Hkv,
        q.stride(0), q.stride(1), bounds.stride(0), bounds.stride(1), bounds.stride(2), out.stride(0), out.stride(1),
        *_region_args(region, B, q.device),
        D=D, G=G, POOL_MAX=pool == "max", BLOCK_P=BLOCK_P, BLOCK_D=BLOCK_D, REGION=region is not None,
        SKIP_LAST=region is not None and region.skip_last, STAGES=stages, BLOCK_G=max(16, triton.next_power_of_2(G)),
        F32=bounds.dtype == torch.float32 or q.dtype != bounds.dtype, num_warps=num_warps, **dependent_launch(q.device),
    )
    return out


def _stages(device: torch.device, tile_bytes: int, element_size: int) -> int:
    """Page tiles in flight: 3 for 16-bit bounds (what was measured) where shared memory holds three stages of a
    tile's max and min rows with room to spare (64 pages at d 128: 96 KB, on an H100, H200 or A100), else 1."""
    if device.type != "cuda" or element_size != 2:
        return 1
    return 3 if max_shared_mem(device) >= 3 * tile_bytes + 32768 else 1


def _region_args(region: PageRegion | None, batch: int, device: torch.device) -> tuple:
    """(LENS, stride, span, sink, window, page size, p_lo) of a PageRegion; placeholders without one. A single
    length (a host-length step) serves every row (stride 0)."""
    if region is None:
        return (torch.empty(1, dtype=torch.int32, device=device), 0, 0, 0, 0, 1, 0)
    r = region.rows
    L = r.lengths
    if L.dim() != 1 or L.shape[0] not in (1, batch) or L.device != device or L.is_floating_point():
        raise ValueError(f"region lengths must be an integer tensor [{batch}] or [1] on {device}, got {L.dtype} "
                         f"{tuple(L.shape)} on {L.device}")
    return (L, L.stride(0) if L.shape[0] > 1 else 0, r.span, r.sink, r.window, region.page_size, region.p_lo)


@triton.jit
def _blocks_kernel(SC, PICK, OUT, LENS, stride_l, H, k, p_lo, S, stride_sb, stride_sh, stride_pb, stride_ph,
                   stride_ob, stride_oh, SKIP_LAST: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = 0):
    wait_for_prior(PDL)
    bh = tl.program_id(0)
    b = bh // H
    h = bh % H
    j = tl.arange(0, BLOCK_K)
    ok = j < k
    pick = tl.load(PICK + b * stride_pb + h * stride_ph + j, mask=ok, other=0)
    score = tl.load(SC + b * stride_sb + h * stride_sh + pick, mask=ok, other=float("-inf"))
    o = OUT + b * stride_ob + h * stride_oh
    tl.store(o + j, tl.where(score > float("-inf"), pick + p_lo, -1), mask=ok)
    if SKIP_LAST:
        L = tl.load(LENS + b * stride_l).to(tl.int64)
        tl.store(o + k, (L - 1) // S)


def page_blocks(scores: torch.Tensor, pick: torch.Tensor, region: PageRegion) -> torch.Tensor:
    """The pages a step attends, int64 [B, H, k (+ 1 with region.skip_last)], in one launch: the top-k's picks
    (indices into scores [B, H, n]) as absolute pages, -1 for a -inf pick, then each row's newest page. Same
    contract as quest_blocks_reference."""
    B, H, k = pick.shape
    if scores.shape[:2] != (B, H) or pick.dtype != torch.int64:
        raise ValueError(f"pick must be int64 [B, H, k] over scores {tuple(scores.shape)}, got {pick.dtype} "
                         f"{tuple(pick.shape)}")
    out = torch.empty(B, H, k + int(region.skip_last), dtype=torch.int64, device=scores.device)
    if B * H == 0:
        return out
    L, stride_l, *_ = _region_args(region, B, scores.device)
    _blocks_kernel[(B * H,)](
        scores, pick, out, L, stride_l, H, k, region.p_lo, region.page_size, scores.stride(0), scores.stride(1),
        pick.stride(0), pick.stride(1), out.stride(0), out.stride(1), SKIP_LAST=region.skip_last,
        BLOCK_K=max(16, triton.next_power_of_2(k)), num_warps=4, **dependent_launch(scores.device))
    return out


@triton.jit
def _append_kernel(K, BND, SLOT, slot, Hkv, stride_kb, stride_kh, stride_bb, stride_bh, stride_bp, S,
                   D: tl.constexpr, BLOCK_D: tl.constexpr, ROW_SLOT: tl.constexpr, PDL: tl.constexpr = 0):
    wait_for_prior(PDL)
    bh = tl.program_id(0)
    b = bh // Hkv
    kv = bh % Hkv
    if ROW_SLOT:  # each batch row's write slot, read on the device (a graph-replayed decode step)
        slot = tl.load(SLOT + b).to(tl.int64)
    page = slot // S
    fresh = slot % S == 0  # the first key of its page replaces the page's bounds
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    k = tl.load(K + b * stride_kb + kv * stride_kh + d, mask=d_ok).to(BND.dtype.element_ty)
    row = BND + b * stride_bb + kv * stride_bh + page * stride_bp + d
    hi = tl.load(row, mask=d_ok)
    lo = tl.load(row + D, mask=d_ok)
    tl.store(row, tl.where(fresh, k, tl.maximum(hi, k)), mask=d_ok)
    tl.store(row + D, tl.where(fresh, k, tl.minimum(lo, k)), mask=d_ok)


def append_one(bounds: torch.Tensor, k: torch.Tensor, pos: int | torch.Tensor, page_size: int) -> None:
    """One new key per row, k [B, Hkv, 1, D] at position pos (an int, or device write slots [B]: no host read),
    folded into its page's [max | min] row of bounds [B, Hkv, pages, 2D] in place, one program per (row, KV head).
    Same contract as quest_append_reference."""
    B, Hkv, n, D = k.shape
    if n != 1 or bounds.shape[:2] != (B, Hkv) or bounds.shape[3] != 2 * D or bounds.stride(3) != 1:
        raise ValueError(f"expected k [B, Hkv, 1, D] and bounds [B, Hkv, pages, 2D] with contiguous rows, got "
                         f"{tuple(k.shape)} and {tuple(bounds.shape)}")
    row_slot = isinstance(pos, torch.Tensor)
    if B * Hkv == 0:
        return
    _append_kernel[(B * Hkv,)](
        k, bounds, pos if row_slot else bounds, 0 if row_slot else pos, Hkv, k.stride(0), k.stride(1),
        bounds.stride(0), bounds.stride(1), bounds.stride(2), page_size, D=D,
        BLOCK_D=triton.next_power_of_2(D), ROW_SLOT=row_slot, num_warps=1, **dependent_launch(k.device))
