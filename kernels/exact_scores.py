"""The oracle's ranking from exact q·k logits, in two passes over them: each query head's softmax normaliser, then the
log of the probabilities summed over each GQA group, written once per KV head.

Why: the oracle ranks a group's keys by the sum of its query heads' softmax probabilities. Eager torch did that in
about eight passes over [B, Hq, n] fp32 (scale, mask, max, exp, sum, divide, sum over the group), ~16 MB each at
131072 keys x 32 heads; two fused passes read the logits twice and write the pooled scores once. The log keeps the
ranking and keeps far-off keys apart: in fp32 most of a peaked softmax underflows to exactly 0, and a row of tied
zeros sends the top-k down its slow, tie-heavy path. Two launches and nothing between them: the second pass's
programs combine the chunks' statistics into each head's normaliser themselves, and a replayed step's region comes
from the device lengths (RowBounds) inside both, with no mask tensor built (each small torch op a graph replays
costs a launch, every layer).

Reference: `reference.py::pooled_log_probs_reference` (same signature).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .device import dependent_launch, wait_for_prior
from .reference import RowBounds
from .region import in_sparse_region

_NEG = tl.constexpr(-1.0e30)  # "minus infinity" that keeps exp(x - m) finite for a chunk that keeps nothing


@triton.jit
def _kept(length, j, ok, span, sink, window, lo, BOUNDS: tl.constexpr):
    """Which of keys j (< n: ok) lie in the row's own region, from its device length (RowBounds); every one without
    bounds. The same for every query head of the row: computed once a tile."""
    if BOUNDS:
        ok = ok & in_sparse_region(length, lo + j, span, sink, window)
    return ok


@triton.jit
def _logit(S, b, row, j, ok, keep, stride_sb, stride_sh, scale, softcap, SOFTCAP: tl.constexpr):
    s = tl.load(S + b * stride_sb + row * stride_sh + j, mask=ok, other=0.0) * scale
    if SOFTCAP:  # tanh from one exp, stable for any |s|
        x = s / softcap
        e = tl.exp(-2.0 * tl.abs(x))
        th = (1.0 - e) / (1.0 + e)
        s = softcap * tl.where(x < 0, -th, th)
    return tl.where(keep, s, float("-inf"))


@triton.jit
def _stats_kernel(S, LENS, M, L, n, Hq, chunk, stride_sb, stride_sh, scale, softcap, span, sink, window, lo,
                  SOFTCAP: tl.constexpr, BOUNDS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = 0):
    """Per (row, query head, chunk): the max of the chunk's logits and the sum of exp(logit - max)."""
    wait_for_prior(PDL)
    c = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // Hq
    h = bh % Hq
    length = tl.load(LENS + b).to(tl.int32) if BOUNDS else 0
    m = tl.full([BLOCK], _NEG, tl.float32)
    acc = tl.zeros([BLOCK], tl.float32)
    for j0 in range(c * chunk, tl.minimum(c * chunk + chunk, n), BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        ok = j < n
        keep = _kept(length, j, ok, span, sink, window, lo, BOUNDS)
        s = _logit(S, b, h, j, ok, keep, stride_sb, stride_sh, scale, softcap, SOFTCAP)
        m_new = tl.maximum(m, s)
        acc = acc * tl.exp(m - m_new) + tl.exp(s - m_new)
        m = m_new
    m_all = tl.max(m, 0)
    total = tl.sum(acc * tl.exp(m - m_all), 0)
    n_chunks = tl.num_programs(0)
    tl.store(M + bh * n_chunks + c, m_all)
    tl.store(L + bh * n_chunks + c, total)


@triton.jit
def _lse(M, L, row, n_chunks, BLOCK_C: tl.constexpr):
    """A query head's log normaliser from its chunks' (max, sum); 0 for a head that keeps no key (not NaN)."""
    c = tl.arange(0, BLOCK_C)
    m = tl.load(M + row * n_chunks + c, mask=c < n_chunks, other=_NEG)
    s = tl.load(L + row * n_chunks + c, mask=c < n_chunks, other=0.0)
    m_all = tl.max(m, 0)
    lse = m_all + tl.log(tl.sum(s * tl.exp(m - m_all), 0))
    return tl.where((lse == lse) & (tl.abs(lse) < float("inf")), lse, 0.0)


@triton.jit
def _pool_kernel(S, LENS, M, L, OUT, n, H_out, n_chunks, stride_sb, stride_sh, stride_ob, stride_oh, scale, softcap,
                 span, sink, window, lo, G: tl.constexpr, SOFTCAP: tl.constexpr, BOUNDS: tl.constexpr,
                 BLOCK: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr = 0):
    """out[b, kv, j] = log of the sum over the group's query heads g of exp(logit - lse_g): the log of the group's
    summed probability, by logsumexp (no underflow). Each program combines its heads' chunk statistics into lse_g
    itself (a few values each), so no launch sits between the two passes."""
    wait_for_prior(PDL)
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H_out
    kv = bh % H_out
    j = pid * BLOCK + tl.arange(0, BLOCK)
    ok = j < n
    keep = _kept(tl.load(LENS + b).to(tl.int32) if BOUNDS else 0, j, ok, span, sink, window, lo, BOUNDS)
    m = tl.full([BLOCK], _NEG, tl.float32)
    total = tl.zeros([BLOCK], tl.float32)
    for g in tl.static_range(G):
        row = kv * G + g
        s = _logit(S, b, row, j, ok, keep, stride_sb, stride_sh, scale, softcap, SOFTCAP)
        s = s - _lse(M, L, b * (H_out * G) + row, n_chunks, BLOCK_C)
        m_new = tl.maximum(m, s)
        total = total * tl.exp(m - m_new) + tl.exp(s - m_new)
        m = m_new
    out = tl.where(m > _NEG, m + tl.log(total), float("-inf"))  # a key no head keeps: -inf
    tl.store(OUT + b * stride_ob + kv * stride_oh + j, out, mask=ok)


def pooled_log_probs(logits: torch.Tensor, group: int, scale: float, softcap: float | None = None,
                     bounds: RowBounds | None = None) -> torch.Tensor:
    """logits [B, Hq, n] (q·k, unscaled fp32) -> [B, Hq // group, n] fp32: the log of softmax(logits x scale,
    softcapped, over the keys of each row's region `bounds` (RowBounds: key i is position bounds.lo + i; every key
    when None)) per query head, summed over each run of `group` heads (-inf where no head keeps the key)."""
    B, Hq, n = logits.shape
    if Hq % group:
        raise ValueError(f"{Hq} query heads are not a multiple of the group {group}")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    H_out = Hq // group
    out = torch.empty(B, H_out, n, dtype=torch.float32, device=logits.device)
    if n == 0 or B == 0:
        return out
    if bounds is not None:
        bounds.check(B, logits.device)
    lens, region = (bounds.lengths, (bounds.span, bounds.sink, bounds.window, bounds.lo)) if bounds is not None \
        else (logits, (0, 0, 0, 0))  # unread placeholders without bounds
    BLOCK = 1024
    chunk = max(BLOCK, triton.cdiv(triton.cdiv(n, 32), BLOCK) * BLOCK)  # ~32 programs per head: short chains
    n_chunks = triton.cdiv(n, chunk)
    m = torch.empty(B * Hq * n_chunks, dtype=torch.float32, device=logits.device)
    s = torch.empty_like(m)
    common = dict(SOFTCAP=bool(softcap), BOUNDS=bounds is not None, BLOCK=BLOCK, num_warps=4,
                  **dependent_launch(logits.device))
    _stats_kernel[(n_chunks, B * Hq)](logits, lens, m, s, n, Hq, chunk, logits.stride(0), logits.stride(1), scale,
                                      float(softcap or 0.0), *region, **common)
    _pool_kernel[(triton.cdiv(n, BLOCK), B * H_out)](logits, lens, m, s, out, n, H_out, n_chunks, logits.stride(0),
                                                     logits.stride(1), out.stride(0), out.stride(1), scale,
                                                     float(softcap or 0.0), *region, G=group,
                                                     BLOCK_C=triton.next_power_of_2(n_chunks), **common)
    return out
