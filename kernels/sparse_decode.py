"""Sparse decode (and dense flash-decoding) in Triton: one kernel family for every method's selection.

A decode step reads a list of *slots*: the sink, then the sparse part, then the recent window. Each program
takes one chunk of slots for one selection head (a KV head and its whole GQA group, or one query head), maps
slots to key positions (dense or token indices; blocks and CSR bucket lists are expanded to token indices on the
device first, a few µs of torch ops: Triton 3.6's layout pass crashed on an in-kernel block mapping), reads each key and value once for every
query row that shares it, and keeps an online-softmax partial state (max, sum, acc). A second small kernel
merges the partial states of the chunks: flash-decoding's split-K, which spreads a long sequence (or a short
selection over few heads) across all SMs. `qk_logits` runs the same pass without the attention and writes each
slot's q·k: the exact scores of the oracle and of --rerank.

Reference: `kernels/reference.py::sparse_decode_reference` (same arguments, plain torch).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from sparsekv.selection import Selection

from .device import num_sms
from .reference import check_selection

MODE_DENSE, MODE_INDICES = 0, 1
_NEG = tl.constexpr(-1.0e30)  # "minus infinity" that keeps exp(x - m) finite for chunks that read nothing


@triton.jit
def _partial_kernel(
    Q, K, V, IDX, LENS, M_out, L_out, ACC_out, S_out,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_ib, stride_ih,
    scale, n_sel_heads, G, group_rows, sink, n_sparse, window, chunk, n_cols, span, softcap,
    MODE: tl.constexpr, PREC: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    LOGITS: tl.constexpr = False, SOFTCAP: tl.constexpr = False,
):
    """One chunk of slots for one selection head: its online-softmax partial state, or with LOGITS the scaled
    q·k of every slot (S_out [B, Hq, n_cols], -inf where a slot names no key) and no values read.
    A layer with a sliding window (span > 0) sees keys [length - span, length) only: dense slots start there.
    SOFTCAP: logits s become softcap * tanh(s / softcap) (Gemma-2)."""
    c = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // n_sel_heads
    hs = bh % n_sel_heads
    kv = hs // (G // group_rows)  # the KV head of this selection head
    q_head0 = hs * group_rows  # first query row served by this program
    length = tl.load(LENS + b)
    lo = tl.where(span > 0, tl.maximum(length - span, 0), 0)  # first key this row's query may see

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_ok = g < group_rows
    d_ok = d < D
    q = tl.load(Q + b * stride_qb + (q_head0 + g)[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_G], _NEG, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)

    if MODE == 0:
        n_slots = length - lo
    else:
        n_slots = sink + n_sparse + window
    start = c * chunk
    stop = tl.minimum(start + chunk, n_slots)
    k_base = K + b * stride_kb + kv * stride_kh
    v_base = V + b * stride_vb + kv * stride_vh
    for s0 in range(start, stop, BLOCK_N):
        t = s0 + tl.arange(0, BLOCK_N)
        in_range = t < stop
        if MODE == 0:
            pos = lo + t
            ok = in_range
        else:
            is_sink = t < sink
            is_win = t >= sink + n_sparse
            j = t - sink
            sp = tl.load(IDX + b * stride_ib + hs * stride_ih + j, mask=in_range & ~is_sink & ~is_win, other=-1)
            wp = length - window + (t - sink - n_sparse)
            pos = tl.where(is_sink, lo + t, tl.where(is_win, wp, sp))
            ok = in_range & (pos >= lo) & (pos < length) & (is_sink | ~is_win | (wp >= lo + sink))
        pos = tl.where(ok, pos, 0)
        k = tl.load(k_base + pos[:, None] * stride_kn + d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PREC).to(tl.float32) * scale  # [BLOCK_G, BLOCK_N]
        if SOFTCAP:  # tanh from one exp, stable for any |s|
            x = s / softcap
            e = tl.exp(-2.0 * tl.abs(x))
            th = (1.0 - e) / (1.0 + e)
            s = softcap * tl.where(x < 0, -th, th)
        s = tl.where(ok[None, :], s, float("-inf"))
        if LOGITS:
            s_row = (b * (n_sel_heads * group_rows) + q_head0 + g).to(tl.int64) * n_cols
            tl.store(S_out + s_row[:, None] + t[None, :], s, mask=g_ok[:, None] & in_range[None, :])
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_base + pos[:, None] * stride_vn + d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC).to(tl.float32)
            m_i = m_new

    if not LOGITS:
        n_chunks = tl.num_programs(0)
        row = (b * (n_sel_heads * group_rows) + q_head0 + g) * n_chunks + c
        tl.store(M_out + row, m_i, mask=g_ok)
        tl.store(L_out + row, l_i, mask=g_ok)
        tl.store(ACC_out + row[:, None] * BLOCK_D + d[None, :], acc, mask=g_ok[:, None])


@triton.jit
def _merge_kernel(M_in, L_in, ACC_in, OUT, stride_ob, stride_oh, Hq, n_chunks,
                  D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr):
    r = tl.program_id(0)  # one (batch, query head) row
    b = r // Hq
    h = r % Hq
    cc = tl.arange(0, BLOCK_C)
    d = tl.arange(0, BLOCK_D)
    c_ok = cc < n_chunks
    m = tl.load(M_in + r * n_chunks + cc, mask=c_ok, other=_NEG)
    l = tl.load(L_in + r * n_chunks + cc, mask=c_ok, other=0.0)
    acc = tl.load(ACC_in + (r * n_chunks + cc)[:, None] * BLOCK_D + d[None, :], mask=c_ok[:, None], other=0.0)
    m_all = tl.max(m, 0)
    w = tl.exp(m - m_all)
    den = tl.sum(w * l, 0)
    den = tl.where(den > 0, den, 1.0)  # a row that read no key (empty selection) comes out as zeros
    out = tl.sum(acc * w[:, None], 0) / den
    tl.store(OUT + b * stride_ob + h * stride_oh + d, out.to(OUT.dtype.element_ty), mask=d < D)


def _plan(n_slots: int, programs_per_chunk: int, device: torch.device, block_n: int,
          waves: int = 2) -> tuple[int, int]:
    """(chunk, n_chunks): enough chunks that about `waves` programs run per SM, each at least one tile long."""
    sms = num_sms(device) if device.type == "cuda" else 4  # interpreter: few chunks keep it fast
    want = max(1, (waves * sms + programs_per_chunk - 1) // programs_per_chunk)
    chunk = max(block_n, triton.cdiv(triton.cdiv(max(n_slots, 1), want), block_n) * block_n)
    return chunk, triton.cdiv(max(n_slots, 1), chunk)


def sparse_decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, sel: Selection, scale: float,
                  lengths: torch.Tensor | None = None, softcap: float | None = None, check: bool = False, *,
                  block_n: int | None = None, num_warps: int = 4, num_stages: int | None = None,
                  waves: int = 4) -> torch.Tensor:
    """q [B, Hq, 1, D] over the keys `sel` names -> [B, Hq, 1, D]. Same contract as sparse_decode_reference.

    `lengths` [B] (int) gives per-row valid lengths when batch rows differ; `check=True` rejects duplicate
    positions first (a host sync: for tests and debugging). block_n / num_warps / num_stages / waves (programs
    per SM) are tuning knobs; the defaults were measured on an H100 (results/ has the numbers).
    """
    return _launch(q, keys, values, sel, scale, lengths, check, False, block_n, num_warps, num_stages, waves,
                   softcap)


def qk_logits(q: torch.Tensor, keys: torch.Tensor, indices: torch.Tensor | None = None, *,
              block_n: int | None = None, num_warps: int = 4, num_stages: int | None = None,
              waves: int = 4) -> torch.Tensor:
    """The exact q·k (unscaled, fp32) [B, Hq, m] of the keys [B, Hkv, L, D] at `indices` [B, H, m] (H = Hkv: a
    group's query heads score the same keys; H = Hq: each query head its own; -1 pads give -inf), or of every key
    when indices is None (m = L). The sparse-decode pass with the attention left out: each key is read once for
    the query rows that share it (the oracle's scores and --rerank's). Reference: `reference.qk_logits_reference`."""
    L = keys.shape[2]
    sel = Selection(L, dense=True) if indices is None else Selection(L, indices=indices, padded=True)
    return _launch(q, keys, keys, sel, 1.0, None, False, True, block_n, num_warps, num_stages, waves)


def _launch(q, keys, values, sel, scale, lengths, check, logits, block_n, num_warps, num_stages, waves,
            softcap=None):
    """The partial pass over `sel`'s slots, then the merge (attention) or, with `logits`, the q·k per slot."""
    B, Hq, _, D = q.shape
    Hkv = keys.shape[1]
    G = Hq // Hkv
    if sel.buckets is not None:  # CSR: expand the chosen buckets to token indices, then the index path
        sel = replace(sel, buckets=None, bucket_offsets=None, bucket_tokens=None, indices=csr_to_indices(sel))
    elif sel.blocks is not None:  # blocks: expand to token positions (clipped to the middle region)
        sel = replace(sel, blocks=None, block_size=0, indices=sel.sparse_positions())
    Hs = sel.heads(Hkv)
    if Hs not in (Hkv, Hq):
        raise ValueError(f"selection has {Hs} heads; expected {Hkv} (KV heads) or {Hq} (query heads)")
    if check:
        check_selection(sel, B, Hs, lengths)
    group_rows = G if Hs == Hkv else 1
    ragged = lengths is not None  # rows of their own lengths, given by the caller: grids span the whole buffer
    lengths = lengths if ragged else sel.lengths
    lens = (torch.full((B,), sel.length, dtype=torch.int32, device=q.device) if lengths is None
            else lengths.to(device=q.device, dtype=torch.int32))
    if sel.dense:
        mode, idx, n_sparse, sink, window = MODE_DENSE, lens, 0, 0, 0
        # a graph-replayed step covers its extent; an eager one its host length (the device lengths agree)
        bound = sel.extent if sel.extent is not None else keys.shape[2] if ragged else sel.length
        n_slots = min(bound, sel.span) if sel.span else bound
    else:
        mode = MODE_INDICES
        idx = sel.indices if sel.indices is not None else lens.new_full((B, Hs, 1), -1)
        n_sparse = idx.shape[-1] if sel.indices is not None else 0
        sink, window = sel.sink, sel.window
        n_slots = sink + n_sparse + window
        if idx.shape[0] != B:
            idx = idx.expand(B, -1, -1)
    # H100 sweep (bf16, d 128, 32/8 heads, 131072 tokens; .scratch tuning, numbers in results/): dense is best with
    # 128-key tiles and 3 stages (181.8 µs), the gathered sparse path with 64-key tiles and no pipelining (8.6 µs)
    BLOCK_N = block_n or ((128 if mode == MODE_DENSE else 64) if D <= 128 else 32)
    num_stages = num_stages or (3 if mode == MODE_DENSE else 1)
    BLOCK_D = triton.next_power_of_2(D)
    BLOCK_G = max(16, triton.next_power_of_2(group_rows))  # tl.dot needs at least 16 rows
    chunk, n_chunks = _plan(n_slots, B * Hs, q.device, BLOCK_N, waves)
    rows = 0 if logits else B * Hq * n_chunks
    m = torch.empty(rows, dtype=torch.float32, device=q.device)
    l = torch.empty(rows, dtype=torch.float32, device=q.device)
    acc = torch.empty(rows, BLOCK_D, dtype=torch.float32, device=q.device)
    s_out = torch.empty(B, Hq, n_slots if logits else 0, dtype=torch.float32, device=q.device)
    qc = q.reshape(B, Hq, D)
    if qc.stride(-1) != 1:
        qc = qc.contiguous()
    sib, sih = (idx.stride(0), idx.stride(1)) if idx.dim() == 3 else (0, 0)
    _partial_kernel[(n_chunks, B * Hs)](
        qc, keys, values, idx, lens, m, l, acc, s_out,
        qc.stride(0), qc.stride(1), keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2), sib, sih,
        scale, Hs, G, group_rows, sink, n_sparse, window, chunk, n_slots, sel.span, float(softcap or 0.0),
        MODE=mode, PREC="ieee" if q.dtype == torch.float32 else "tf32", D=D, BLOCK_D=BLOCK_D, BLOCK_G=BLOCK_G,
        BLOCK_N=BLOCK_N, LOGITS=logits, SOFTCAP=bool(softcap) and not logits, num_warps=num_warps,
        num_stages=num_stages,
    )
    if logits:
        return s_out
    out = torch.empty(B, Hq, 1, D, dtype=q.dtype, device=q.device)
    _merge_kernel[(B * Hq,)](m, l, acc, out, out.stride(0), out.stride(1), Hq, n_chunks,
                             D=D, BLOCK_D=BLOCK_D, BLOCK_C=triton.next_power_of_2(n_chunks), num_warps=4)
    return out


def dense_decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: int | torch.Tensor,
                 scale: float, span: int = 0, softcap: float | None = None, **tuning) -> torch.Tensor:
    """Split-K flash-decoding over the whole valid cache (its last `span` keys with a sliding window): our dense
    baseline. lengths: int or [B]."""
    if isinstance(lengths, int):
        return sparse_decode(q, keys, values, Selection(lengths, dense=True, span=span), scale, softcap=softcap,
                             **tuning)
    return sparse_decode(q, keys, values, Selection(int(keys.shape[2]), dense=True, span=span), scale,
                         lengths=lengths, softcap=softcap, **tuning)


def csr_to_indices(sel: Selection) -> torch.Tensor:
    """CSR bucket lists -> padded token indices [B, H, n] (-1 pads), on the device, without a Python loop."""
    B, H, nl = sel.buckets.shape
    off = sel.bucket_offsets.long()
    valid = sel.buckets >= 0
    bk = sel.buckets.clamp(min=0).long()
    starts = off.gather(-1, bk)
    counts = torch.where(valid, off.gather(-1, bk + 1) - starts, 0)
    # n is data-dependent; a bound keeps shapes static: every token belongs to at most one bucket
    n = sel.bucket_tokens.shape[-1]
    ends = counts.cumsum(-1)  # [B, H, nl]
    slot = torch.arange(n, device=bk.device).view(1, 1, -1)
    which = torch.searchsorted(ends, slot.expand(B, H, -1).contiguous(), right=True)  # bucket of each slot
    ok = which < nl
    which = which.clamp(max=nl - 1)
    before = torch.where(which > 0, ends.gather(-1, (which - 1).clamp(min=0)), 0)
    src = starts.gather(-1, which) + (slot - before)
    tok = sel.bucket_tokens.long().gather(-1, src.clamp(max=n - 1))
    return torch.where(ok, tok, -1)
