"""Causal attention for chunked prefill: the last n queries of L positions, over the keys in the cache, in Triton.

A long prompt (131072 or 262144 tokens) is prefilled chunk by chunk: each chunk's queries attend every earlier key
and themselves (the last `span` keys on a sliding-window layer). A materialised n x L mask or n x L logits would
cost more memory than the cache itself, so this is flash-attention-2's forward pass with an offset: one program per
(query block, batch x query head) keeps an online softmax (max, sum, fp32 accumulator) over BLOCK_N-key tiles, and
only the tiles on the causal diagonal and at the window's start are masked; tiles outside the band are never read.
Extra memory is the output alone. GQA: query head h reads KV head h // (Hq // Hkv) in place (no repeated K/V).

Reference: `kernels/reference.py::prefill_attention_reference` (same arguments, plain torch).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

LOG2E = math.log2(math.e)
_NEG = tl.constexpr(-1.0e30)  # initial running max: finite, so a tile a row sees nothing of gives exp2(-inf) = 0
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _logits(x, qk_scale, cap2, SOFTCAP: tl.constexpr):
    """Raw q·k -> logits in the log2 domain (so the softmax runs on exp2). Without SOFTCAP qk_scale is
    scale * log2(e); with it qk_scale is 2 * scale / softcap * log2(e), cap2 is softcap * log2(e) and the tanh comes
    from one exp2, stable for any |x|."""
    t = x * qk_scale
    if SOFTCAP:
        e = tl.math.exp2(-tl.abs(t))
        th = (1.0 - e) / (1.0 + e)
        t = cap2 * tl.where(t < 0, -th, th)
    return t


@triton.jit
def _attend(acc, l_i, m_i, q, k_ptrs, v_ptrs, start, stop, pos, last, window, stride_kn, stride_vn, qk_scale, cap2,
            d_ok, MASK: tl.constexpr, SOFTCAP: tl.constexpr, PREC: tl.constexpr, BLOCK_N: tl.constexpr,
            PAD: tl.constexpr):
    """The online softmax over key tiles [start, stop), BLOCK_N at a time. MASK: tiles that some row of the block
    sees only in part (the diagonal, the window's start, the end of the keys): keep key j for the query at `pos`
    iff pos - window < j <= pos, and read no key past `last` (the block's last position, < L). Tiles between need no
    mask. PAD: the head dim is padded to a power of two; its lanes past D (d_ok false) read as 0."""
    offs_n = tl.arange(0, BLOCK_N)
    for s in range(start, stop, BLOCK_N):
        j = s + offs_n
        if MASK:
            keep = (j[None, :] <= pos[:, None]) & (j[None, :] > pos[:, None] - window)
            in_keys = (j <= last)[:, None]
            if PAD:
                in_keys = in_keys & d_ok[None, :]
            k = tl.load(k_ptrs, mask=in_keys, other=0.0)
        elif PAD:
            k = tl.load(k_ptrs, mask=d_ok[None, :], other=0.0)
        else:
            k = tl.load(k_ptrs)
        t = _logits(tl.dot(q, tl.trans(k), input_precision=PREC), qk_scale, cap2, SOFTCAP)
        if MASK:
            t = tl.where(keep, t, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(t, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(t - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASK:
            v = tl.load(v_ptrs, mask=in_keys, other=0.0)
        elif PAD:
            v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
        else:
            v = tl.load(v_ptrs)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PREC)
        m_i = m_new
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
    return acc, l_i, m_i


@triton.jit
def _prefill_kernel(
    Q, K, V, O,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    Hq, G, n, L, window, qk_scale, cap2,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr,
    PREC: tl.constexpr, PAD: tl.constexpr,
):
    """One block of BLOCK_M queries of one (batch, query head). Its keys split in three tile ranges: the window's
    start (masked), the band every row sees whole (unmasked), the causal diagonal (masked)."""
    mb = tl.num_programs(0) - 1 - tl.program_id(0)  # the latest (longest) query blocks start first
    bh = tl.program_id(1)
    b = (bh // Hq).to(tl.int64)
    h = bh % Hq
    kv = (h // G).to(tl.int64)
    off = L - n  # absolute position of query 0
    m0 = mb * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)  # the head dim, padded to a power of two (lanes past D read 0, are not stored)
    d_ok = d < D
    row_ok = offs_m < n
    pos = tl.minimum(off + offs_m, L - 1)  # rows past n (padding) take the last position: never past the keys

    rows = offs_m.to(tl.int64)[:, None]  # a long chunk times a wide row stride can pass 2^31
    q_ptrs = Q + b * stride_qb + h.to(tl.int64) * stride_qh + rows * stride_qm + d[None, :]
    io_ok = row_ok[:, None]  # the rows read and written
    if PAD:  # and their lanes below D (a power-of-two head dim needs no lane mask)
        io_ok = io_ok & d_ok[None, :]
    q = tl.load(q_ptrs, mask=io_ok, other=0.0)

    # key tiles of this block: [first, end) in all, of which [band_lo, band_hi) are seen whole by every row
    p_lo = off + m0
    p_hi = off + tl.minimum(m0 + BLOCK_M, n) - 1
    end = p_hi + 1
    first = tl.maximum(p_lo - window + 1, 0) // BLOCK_N * BLOCK_N
    band_lo = tl.minimum(tl.maximum(first, (tl.maximum(p_hi - window + 1, 0) + BLOCK_N - 1) // BLOCK_N * BLOCK_N), end)
    band_hi = tl.minimum(tl.maximum(band_lo, (p_lo + 1) // BLOCK_N * BLOCK_N), end)

    k_tile = K + b * stride_kb + kv * stride_kh + offs_n[:, None] * stride_kn + d[None, :]
    v_tile = V + b * stride_vb + kv * stride_vh + offs_n[:, None] * stride_vn + d[None, :]
    m_i = tl.full([BLOCK_M], _NEG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    acc, l_i, m_i = _attend(acc, l_i, m_i, q, k_tile + first.to(tl.int64) * stride_kn,
                            v_tile + first.to(tl.int64) * stride_vn, first, band_lo, pos, p_hi, window,
                            stride_kn, stride_vn, qk_scale, cap2, d_ok, True, SOFTCAP, PREC, BLOCK_N, PAD)
    acc, l_i, m_i = _attend(acc, l_i, m_i, q, k_tile + band_lo.to(tl.int64) * stride_kn,
                            v_tile + band_lo.to(tl.int64) * stride_vn, band_lo, band_hi, pos, p_hi, window,
                            stride_kn, stride_vn, qk_scale, cap2, d_ok, False, SOFTCAP, PREC, BLOCK_N, PAD)
    acc, l_i, m_i = _attend(acc, l_i, m_i, q, k_tile + band_hi.to(tl.int64) * stride_kn,
                            v_tile + band_hi.to(tl.int64) * stride_vn, band_hi, end, pos, p_hi, window,
                            stride_kn, stride_vn, qk_scale, cap2, d_ok, True, SOFTCAP, PREC, BLOCK_N, PAD)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_ptrs = O + b * stride_ob + h.to(tl.int64) * stride_oh + rows * stride_om + d[None, :]
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=io_ok)


def prefill_config(D: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for H100-class GPUs, fixed (no autotuning: deterministic, no
    warm-up). Flash-attention-2's tile of 128 queries x 64 keys, 8 warps (two warpgroups of 64 rows each) and 3
    stages while the fp32 accumulator fits in registers (D <= 128); at D 256 it doubles, so 64 queries x 32 keys.
    Each pick compiles for sm_90 without register spills; wider tiles (128 x 128 at D 128, 64 x 64 at D 256, 4 warps
    at D 64) spill. fp32 has no tensor-core path in full precision (its dots are FMAs on registers): small tiles."""
    if dtype == torch.float32:
        return (64, 32, 8, 2) if D <= 64 else (32, 16, 8, 2)
    if D <= 128:
        return 128, 64, 8, 3
    return 64, 32, 8, 3


def prefill_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, span: int = 0,
                      softcap: float | None = None, *, block_m: int | None = None, block_n: int | None = None,
                      num_warps: int | None = None, num_stages: int | None = None) -> torch.Tensor:
    """Causal attention of the last n of L positions -> [B, Hq, n, D] in q's dtype.

    q [B, Hq, n, D]; keys/values [B, Hkv, L, D], L >= n, Hq a multiple of Hkv (views of a larger cache are read in
    place through their strides). Query i sits at p = L - n + i and sees keys j <= p, and j > p - span when
    span > 0. Logits scale * q·k, or softcap * tanh(scale * q·k / softcap) (Gemma-2). Softmax and accumulation in
    fp32. block_m / block_n / num_warps / num_stages override `prefill_config` (powers of two, at least 16).
    """
    B, Hq, n, D = q.shape
    Hkv, L = keys.shape[1], keys.shape[2]
    if keys.shape != (B, Hkv, L, D) or values.shape != keys.shape:
        raise ValueError(f"prefill_attention: keys {tuple(keys.shape)} and values {tuple(values.shape)} must both be "
                         f"[B={B}, Hkv, L, D={D}]")
    if L < n or Hkv == 0 or Hq % Hkv:
        raise ValueError(f"prefill_attention: need L >= n and Hq a multiple of Hkv, got L={L}, n={n}, Hq={Hq}, "
                         f"Hkv={Hkv}")
    if not 1 <= D <= 256:
        raise ValueError(f"prefill_attention: head dim must be between 1 and 256, got {D}")
    if q.dtype not in _DTYPES or keys.dtype != q.dtype or values.dtype != q.dtype:
        raise ValueError(f"prefill_attention: q, keys and values must share one of {_DTYPES}, got {q.dtype}, "
                         f"{keys.dtype}, {values.dtype}")
    if span < 0:
        raise ValueError(f"prefill_attention: span must be >= 0, got {span}")
    out = torch.empty(B, Hq, n, D, dtype=q.dtype, device=q.device)
    if n == 0 or B * Hq == 0:
        return out
    q, keys, values = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, keys, values))
    BLOCK_D = max(16, triton.next_power_of_2(D))  # tl.dot's smallest inner size
    BM, BN, warps, stages = prefill_config(BLOCK_D, q.dtype)
    BM, BN = block_m or BM, block_n or BN
    window = span if span > 0 else L + 1  # unbounded: a window longer than any position
    if softcap:
        qk_scale, cap2 = 2.0 * scale / softcap * LOG2E, softcap * LOG2E
    else:
        qk_scale, cap2 = scale * LOG2E, 0.0
    _prefill_kernel[(triton.cdiv(n, BM), B * Hq)](
        q, keys, values, out,
        q.stride(0), q.stride(1), q.stride(2), keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2), out.stride(0), out.stride(1), out.stride(2),
        Hq, Hq // Hkv, n, L, window, qk_scale, cap2,
        D=D, BLOCK_D=BLOCK_D, PAD=BLOCK_D != D, BLOCK_M=BM, BLOCK_N=BN, SOFTCAP=bool(softcap),
        PREC="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps or warps, num_stages=num_stages or stages,
    )
    return out
