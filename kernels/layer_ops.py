"""The elementwise work of a decode step's layer, fused: residual add + RMSNorm, RoPE of q and k, SiLU(gate) x up, and
the write of one token's K/V into the cache at per-row slots read on the device.

Why: at batch 1 these ops are tiny, and eager transformers code runs each as several kernels (RMSNorm alone: cast,
pow, mean, add, rsqrt, mul, cast, mul); each costs a launch's minimum time, and over every layer of a step they add
up to a large share of it. Here each is one kernel, one program per row, computing in fp32 and rounding once.

`rope_write_kv` is RoPE of q and k and the K/V write in one launch (a decode step's three launches before its
attention).

References (same signatures, plain torch): `reference.py` (rms_norm_reference, rope_reference, silu_mul_reference,
write_kv_reference, rope_write_kv_reference).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .device import dependent_launch, wait_for_prior


@triton.jit
def _rms_norm_kernel(X, R, W, OUT, H_OUT, n, eps, stride_x, stride_r, stride_o, stride_h,
                     RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = 0):
    wait_for_prior(PDL)
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK)
    ok = c < n
    x = tl.load(X + row * stride_x + c, mask=ok, other=0.0).to(tl.float32)
    if RESIDUAL:  # h = x + residual, rounded to the stream's dtype as an eager add would
        x = (x + tl.load(R + row * stride_r + c, mask=ok, other=0.0).to(tl.float32))
        x = x.to(H_OUT.dtype.element_ty)
        tl.store(H_OUT + row * stride_h + c, x, mask=ok)
        x = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n + eps)
    y = (x * inv).to(OUT.dtype.element_ty).to(tl.float32)  # normalised, rounded, then scaled: HF's order
    w = tl.load(W + c, mask=ok, other=0.0).to(tl.float32)
    tl.store(OUT + row * stride_o + c, (y * w).to(OUT.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(h) * weight, h) over the last dim, h = x + residual (or x). x, residual: [..., n]."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    rows = x2.shape[0]
    out = torch.empty_like(x2)
    h = torch.empty_like(x2) if residual is not None else x2
    r2 = residual.reshape(-1, n) if residual is not None else x2
    _rms_norm_kernel[(rows,)](x2, r2, weight, out, h, n, eps, x2.stride(0), r2.stride(0), out.stride(0), h.stride(0),
                              RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(n), num_warps=4,
                              **dependent_launch(x.device))
    return out.view(x.shape), h.view(x.shape)


@triton.jit
def _rope_row(X, COS, SIN, b, stride_cb, R: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr):
    """One row X [D] of batch row b rotated (fp32): its first R dims by cos/sin, the rest passed through."""
    c = tl.arange(0, BLOCK)
    half: tl.constexpr = R // 2
    rot = c < R
    x = tl.load(X + c, mask=c < D, other=0.0).to(tl.float32)
    partner = tl.where(c < half, c + half, c - half)  # rotate_half: (-x2, x1)
    xp = tl.load(X + partner, mask=rot, other=0.0).to(tl.float32)
    xp = tl.where(c < half, -xp, xp)
    cos = tl.load(COS + b * stride_cb + c, mask=rot, other=1.0).to(tl.float32)
    sin = tl.load(SIN + b * stride_cb + c, mask=rot, other=0.0).to(tl.float32)
    return tl.where(rot, x * cos + xp * sin, x)  # dims past the rotary ones pass through (partial rotary)


@triton.jit
def _rope_kernel(X, COS, SIN, OUT, H, stride_xb, stride_xh, stride_cb, stride_ob, stride_oh,
                 R: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = 0):
    wait_for_prior(PDL)
    bh = tl.program_id(0)
    b = bh // H
    h = bh % H
    c = tl.arange(0, BLOCK)
    y = _rope_row(X + b * stride_xb + h * stride_xh, COS, SIN, b, stride_cb, R, D, BLOCK)
    tl.store(OUT + b * stride_ob + h * stride_oh + c, y.to(OUT.dtype.element_ty), mask=c < D)


@triton.jit
def _rope_write_kernel(Q, K, V, COS, SIN, QO, KO, KB, VB, SLOT, Hq, Hkv,
                       s_qb, s_qh, s_kb, s_kh, s_vb, s_vh, stride_cb, s_qob, s_qoh, s_kob, s_koh,
                       s_cb, s_ch, s_cn, s_db, s_dh, s_dn,
                       R: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BLOCK: tl.constexpr,
                       PDL: tl.constexpr = 0):
    """Programs [0, B·Hq): a query row rotated; the next B·Hkv: a key row rotated, stored, and written with its value
    row into the cache at the row's slot."""
    wait_for_prior(PDL)
    i = tl.program_id(0)
    nq = tl.num_programs(0) // (Hq + Hkv) * Hq  # B·Hq
    c = tl.arange(0, BLOCK)
    # each branch names its own values: a name bound in both branches of a Triton `if` must keep one type
    if i < nq:
        bq = i // Hq
        hq = i % Hq
        yq = _rope_row(Q + bq * s_qb + hq * s_qh, COS, SIN, bq, stride_cb, R, D, BLOCK)
        tl.store(QO + bq * s_qob + hq * s_qoh + c, yq.to(QO.dtype.element_ty), mask=c < D)
    else:
        bk = (i - nq) // Hkv
        hk = (i - nq) % Hkv
        yk = _rope_row(K + bk * s_kb + hk * s_kh, COS, SIN, bk, stride_cb, R, D, BLOCK).to(KO.dtype.element_ty)
        tl.store(KO + bk * s_kob + hk * s_koh + c, yk, mask=c < D)
        slot = tl.load(SLOT + bk).to(tl.int64)
        tl.store(KB + bk * s_cb + hk * s_ch + slot * s_cn + c, yk, mask=c < D)
        v = tl.load(V + bk * s_vb + hk * s_vh + c, mask=c < DV)
        tl.store(VB + bk * s_db + hk * s_dh + slot * s_dn + c, v, mask=c < DV)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, 1, D] rotated by cos/sin [B, 1, R] (R <= D rotary dims, the rest passes through) -> [B, H, 1, D]."""
    B, H, n, D = x.shape
    if n != 1:
        raise ValueError(f"rope: one position per row, got {n}")
    R = cos.shape[-1]
    cos2, sin2 = cos.reshape(B, R), sin.reshape(B, R)
    out = torch.empty(B, H, 1, D, dtype=x.dtype, device=x.device)
    _rope_kernel[(B * H,)](x, cos2, sin2, out, H, x.stride(0), x.stride(1), cos2.stride(0), out.stride(0),
                           out.stride(1), R=R, D=D, BLOCK=triton.next_power_of_2(D), num_warps=1,
                           **dependent_launch(x.device))
    return out


def rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  keys: torch.Tensor, values: torch.Tensor, slot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step's q [B, Hq, 1, D] and k [B, Hkv, 1, D] rotated (`rope`), and the rotated k with v written into
    the cache keys/values [B, Hkv, L, D] at slot [B] (`write_kv`), in one launch -> (q, k) rotated."""
    B, Hq, n, D = q.shape
    Hkv = k.shape[1]
    if n != 1 or k.shape != (B, Hkv, 1, D) or v.shape[:3] != (B, Hkv, 1) or slot.shape != (B,):
        raise ValueError(f"rope_write_kv: one token per row, q {tuple(q.shape)}, k {tuple(k.shape)}, v "
                         f"{tuple(v.shape)}, slot {tuple(slot.shape)}")
    if any(t.stride(-1) != 1 for t in (q, k, v, keys, values)):
        raise ValueError("rope_write_kv: the last dim must be contiguous")
    R, DV = cos.shape[-1], v.shape[-1]
    cos2, sin2 = cos.reshape(B, R), sin.reshape(B, R)
    qo = torch.empty(B, Hq, 1, D, dtype=q.dtype, device=q.device)
    ko = torch.empty(B, Hkv, 1, D, dtype=k.dtype, device=k.device)
    _rope_write_kernel[(B * (Hq + Hkv),)](
        q, k, v, cos2, sin2, qo, ko, keys, values, slot, Hq, Hkv, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), cos2.stride(0), qo.stride(0), qo.stride(1), ko.stride(0), ko.stride(1),
        keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1), values.stride(2),
        R=R, D=D, DV=DV, BLOCK=triton.next_power_of_2(max(D, DV)), num_warps=1, **dependent_launch(q.device))
    return qo, ko


@triton.jit
def _silu_mul_kernel(G, U, OUT, n, stride_g, stride_u, BLOCK: tl.constexpr, PDL: tl.constexpr = 0):
    wait_for_prior(PDL)
    r = tl.program_id(1).to(tl.int64)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    g = tl.load(G + r * stride_g + i, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(U + r * stride_u + i, mask=ok, other=0.0).to(tl.float32)
    tl.store(OUT + r * n + i, (g / (1.0 + tl.exp(-g)) * u).to(OUT.dtype.element_ty), mask=ok)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up, elementwise, inputs of one shape -> a contiguous result. Rows may be strided (the halves of
    one joined gate/up product, which a batch > 1 would otherwise copy out first: two launches a layer)."""
    if gate.shape != up.shape:
        raise ValueError(f"silu_mul: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    n = gate.shape[-1]
    g, u = gate.reshape(-1, n), up.reshape(-1, n)  # views where the leading dims merge
    if g.stride(-1) != 1:
        g = g.contiguous()
    if u.stride(-1) != 1:
        u = u.contiguous()
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    rows = g.shape[0]
    if rows * n == 0:
        return out
    BLOCK = 1024
    _silu_mul_kernel[(triton.cdiv(n, BLOCK), rows)](g, u, out, n, g.stride(0), u.stride(0), BLOCK=BLOCK,
                                                    num_warps=4, **dependent_launch(gate.device))
    return out


@triton.jit
def _write_kv_kernel(K, V, KB, VB, SLOT, H, stride_kb, stride_kh, stride_vb, stride_vh,
                     stride_cb, stride_ch, stride_cn, stride_db, stride_dh, stride_dn,
                     D: tl.constexpr, DV: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = 0):
    wait_for_prior(PDL)
    bh = tl.program_id(0)
    b = bh // H
    h = bh % H
    slot = tl.load(SLOT + b).to(tl.int64)
    c = tl.arange(0, BLOCK)
    k = tl.load(K + b * stride_kb + h * stride_kh + c, mask=c < D)
    tl.store(KB + b * stride_cb + h * stride_ch + slot * stride_cn + c, k, mask=c < D)
    v = tl.load(V + b * stride_vb + h * stride_vh + c, mask=c < DV)
    tl.store(VB + b * stride_db + h * stride_dh + slot * stride_dn + c, v, mask=c < DV)


def write_kv(keys: torch.Tensor, values: torch.Tensor, slot: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """keys/values [B, H, L, D] (the cache) at positions slot [B] (on the device) <- k/v [B, H, 1, D], in place."""
    B, H, n, D = k.shape
    if n != 1 or slot.shape != (B,):
        raise ValueError(f"write_kv: one token per row and slot [{B}], got {n} tokens and slot {tuple(slot.shape)}")
    if k.stride(-1) != 1 or v.stride(-1) != 1 or keys.stride(-1) != 1 or values.stride(-1) != 1:
        raise ValueError("write_kv: the last dim must be contiguous")
    DV = v.shape[-1]
    _write_kv_kernel[(B * H,)](k, v, keys, values, slot, H, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                               keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1),
                               values.stride(2), D=D, DV=DV, BLOCK=triton.next_power_of_2(max(D, DV)), num_warps=1,
                               **dependent_launch(k.device))
