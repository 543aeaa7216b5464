"""Sparse decode (and dense flash-decoding) in Triton: one kernel family for every method's selection.

A decode step reads a list of *slots*: the sink, then the sparse part, then the recent window. Each program
takes one chunk of slots for one selection head (a KV head and its whole GQA group, or one query head), maps
slots to key positions (dense or token indices; blocks and CSR bucket lists are expanded to token indices on the
device first by the caller: Triton 3.6's layout pass crashed on an in-kernel block mapping), reads each key and value once for every
query row that shares it, and keeps an online-softmax partial state (max, sum, acc). A second small kernel
merges the partial states of the chunks: flash-decoding's split-K, which spreads a long sequence (or a short
selection over few heads) across all SMs. `qk_logits` runs the same pass without the attention and writes each
slot's q·k: the exact scores of the oracle and of --rerank.

Reference: `kernels/reference.py::sparse_decode_reference` (same arguments, plain torch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .device import dependent_launch, max_shared_mem, num_sms, wait_for_prior
from .reference import check_positions, decode_positions, selection_heads
from .region import window_first

MODE_DENSE, MODE_INDICES = 0, 1
_GATHER_STAGES = 2  # the gathered path's K/V tiles in flight on the cards `gather_tiles` gives its wide tiles
_GATHER_WAVES = 4  # the gathered path's programs per SM (`_plan`), whatever its tiles
_NEG = tl.constexpr(-1.0e30)  # "minus infinity" that keeps exp(x - m) finite for chunks that read nothing


@triton.jit
def _partial_kernel(
    Q, K, V, IDX, LENS, M_out, L_out, ACC_out, S_out,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_ib, stride_ih,
    scale, n_sel_heads, G, group_rows, sink, n_sparse, window, chunk, n_cols, span, softcap, host_len,
    MODE: tl.constexpr, PREC: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    LOGITS: tl.constexpr = False, SOFTCAP: tl.constexpr = False, HOST_LEN: tl.constexpr = False,
    PDL: tl.constexpr = 0,
):
    """One chunk of slots for one selection head: its online-softmax partial state, or with LOGITS the scaled
    q·k of every slot (S_out [B, Hq, n_cols], -inf where a slot names no key) and no values read.
    A layer with a sliding window (span > 0) sees keys [length - span, length) only: dense slots start there.
    SOFTCAP: logits s become softcap * tanh(s / softcap) (Gemma-2)."""
    wait_for_prior(PDL)
    c = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // n_sel_heads
    hs = bh % n_sel_heads
    kv = hs // (G // group_rows)  # the KV head of this selection head
    q_head0 = hs * group_rows  # first query row served by this program
    if HOST_LEN:  # every row's length, by value (LENS unread)
        length = host_len
    else:
        length = tl.load(LENS + b)
    lo = window_first(length, span)  # first key this row's query may see

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
        # each row splits its own keys over the grid's chunks: the partition (and so the rounding) depends on the row
        # alone, never on the batch it decodes in or on the cache's capacity
        chunk = tl.cdiv(tl.cdiv(n_slots, tl.num_programs(0)), BLOCK_N) * BLOCK_N
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
            # a sparse position outside [lo + sink, length - window) reads nothing: a row shorter than the region
            # its graph selects over never attends a key twice
            sp_ok = (pos >= lo + sink) & (pos < length - window)
            ok = in_range & (pos >= lo) & (pos < length) & (is_sink | tl.where(is_win, wp >= lo + sink, sp_ok))
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
                  D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr = 0):
    wait_for_prior(PDL)
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


def gather_tiles(device: torch.device, D: int, element_size: int) -> tuple[int, int]:
    """(keys per tile, stages) of the gathered sparse path: 128 keys with 2 stages in flight where a program could
    hold two stages of those K and V tiles in shared memory (16-bit, d 128: 128 KB; an H100, H200 or A100) and the
    head dim fills its tile (32, 64 or 128), else 64 keys unpipelined (fp32, consumer cards, the interpreter, other
    head dims), 32 past d 128. The shared-memory bound is conservative, the mark of the cards the tiles suit rather
    than the kernel's need: compiled for sm_90 by Triton 3.9 it holds 42 KB at d 128. An H200 sweep of tiles
    32-256, 1-4 stages, 4 or 8 warps and 2-8 programs per SM on SAAP-, lsh- and Adamas-like selections (131072
    tokens, bf16) found 128 keys at 2 stages the fastest on each: 17.4 -> 13.2, 9.2 -> 7.9 and 15.9 -> 15.3 µs
    against 64 unpipelined (benchmarks/BENCHMARKS.md, "The gathered path's tiles"). A head dim of 20 (a tile of 32,
    masked) does not compile at 128 keys and 2 stages: Triton 3.6's layout pass fails (H200); 32, 64, 96 and 128
    compile, and 96 stays on the narrow tiles, unmeasured."""
    if D > 128:
        return 32, 1
    need = _GATHER_STAGES * 2 * 128 * D * element_size + 16384  # two stages of K/V tiles and some room: the bound
    if D in (32, 64, 128) and device.type == "cuda" and max_shared_mem(device) >= need:
        return 128, _GATHER_STAGES
    return 64, 1


def _plan(n_slots: int, heads: int, device: torch.device, block_n: int, waves: int = 2) -> tuple[int, int]:
    """(chunk, n_chunks): enough chunks that about `waves` programs per SM run for one batch row's `heads`
    selection heads, each at least one tile long. Counted for one row, not the batch: a row's split (and so its
    rounding) is the same whatever batch it decodes in (batch rows only add programs)."""
    sms = num_sms(device) if device.type == "cuda" else 4  # interpreter: few chunks keep it fast
    want = max(1, (waves * sms + heads - 1) // heads)
    chunk = max(block_n, triton.cdiv(triton.cdiv(max(n_slots, 1), want), block_n) * block_n)
    return chunk, triton.cdiv(max(n_slots, 1), chunk)


def _dense_tiles(D: int, logits: bool) -> tuple[int, int, int]:
    """(keys per tile, stages, programs per SM) of a dense pass. Attention: 64-key tiles, 3 stages, 2 programs per
    SM. An H200 sweep (bf16, d 128, 32/8 heads; 6 x 6 x 2 launch configurations) found it the fastest or within 1 %
    of it at 32768 and 131072 tokens, batch 1, and at 32768, batch 8: 43.4 -> 38.7, 131.6 -> 127.1 and
    268.2 -> 250.7 µs against the old defaults (benchmarks/BENCHMARKS.md, "Flash-decoding's tiles"). Other head dims
    (they compile, unmeasured) and the q·k pass (`qk_logits`: keys only; the best of 12 configurations timed for it
    was within 2.5 % of this) keep 128-key tiles, 3 stages, 4 programs per SM."""
    if logits or D != 128:
        return (128 if D <= 128 else 32), 3, 4
    return 64, 3, 2


def _dense_chunks(heads: int, device: torch.device, waves: int) -> int:
    """Chunks of a dense step: the grid's first axis, fixed by the device and the heads alone; each row divides its
    own keys among them in the kernel."""
    sms = num_sms(device) if device.type == "cuda" else 4
    return max(1, (waves * sms + heads - 1) // heads)


def sparse_decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                  lengths: int | torch.Tensor, indices: torch.Tensor | None = None, *, sink: int = 0,
                  window: int = 0, span: int = 0, dense: bool = False, extent: int | None = None,
                  softcap: float | None = None, check: bool = False, block_n: int | None = None,
                  num_warps: int = 4, num_stages: int | None = None, waves: int | None = None) -> torch.Tensor:
    """q [B, Hq, 1, D] over the keys `reference.decode_positions` names -> [B, Hq, 1, D]. Same contract as
    `reference.sparse_decode_reference`.

    `lengths`: valid keys, an int or per row [B] on the device (read there: no host sync). `extent`: the cache slots
    a dense step's grid covers (a graph-replayed step's capacity); default the int length, or the whole buffer.
    `check=True` rejects duplicate positions first (a host sync: for tests and debugging). block_n / num_warps /
    num_stages / waves (programs per SM) are tuning knobs; their defaults are `_dense_tiles` for a dense step and
    `gather_tiles` with `_GATHER_WAVES` for a selection.
    """
    return _launch(q, keys, values, scale, lengths, indices, sink, window, span, dense, extent, softcap, check,
                   False, block_n, num_warps, num_stages, waves)


def qk_logits(q: torch.Tensor, keys: torch.Tensor, indices: torch.Tensor | None = None, *,
              block_n: int | None = None, num_warps: int = 4, num_stages: int | None = None,
              waves: int | None = None) -> torch.Tensor:
    """The exact q·k (unscaled, fp32) [B, Hq, m] of the keys [B, Hkv, L, D] at `indices` [B, H, m] (H = Hkv: a
    group's query heads score the same keys; H = Hq: each query head its own; -1 pads give -inf), or of every key
    when indices is None (m = L). The sparse-decode pass with the attention left out: each key is read once for
    the query rows that share it (the oracle's scores and --rerank's). Reference: `reference.qk_logits_reference`."""
    L = keys.shape[2]
    return _launch(q, keys, keys, 1.0, L, indices, 0, 0, 0, indices is None, None, None, False, True, block_n,
                   num_warps, num_stages, waves)


def _launch(q, keys, values, scale, lengths, indices, sink, window, span, dense, extent, softcap, check, logits,
            block_n, num_warps, num_stages, waves):
    """The partial pass over the step's slots, then the merge (attention) or, with `logits`, the q·k per slot."""
    B, Hq, _, D = q.shape
    Hkv = keys.shape[1]
    G = Hq // Hkv
    Hs = selection_heads(q, keys, indices, dense)
    if check:
        check_positions(decode_positions(B, Hs, lengths, indices, sink, window, span, dense, device=q.device))
    group_rows = G if Hs == Hkv else 1
    host_len = isinstance(lengths, int)  # one length for every row, passed by value: no tensor to fill per call
    if host_len:
        lens = torch.full((1,), lengths, dtype=torch.int32, device=q.device) if indices is None and not dense \
            else None  # the sink-and-window step's unread index placeholder needs an integer tensor
        bound = lengths if extent is None else extent
    else:
        lens = lengths.to(device=q.device, dtype=torch.int32).reshape(-1).expand(B)
        bound = keys.shape[2] if extent is None else extent
    if dense:
        mode, idx, n_sparse, sink, window = MODE_DENSE, q, 0, 0, 0  # idx: never read
        n_slots = min(bound, span) if span else bound
    else:
        mode = MODE_INDICES
        idx = indices if indices is not None else lens  # no sparse part (n_sparse 0): never read
        n_sparse = idx.shape[-1] if indices is not None else 0
        n_slots = sink + n_sparse + window
        if indices is not None and idx.shape[0] != B:
            idx = idx.expand(B, -1, -1)
    BLOCK_D = triton.next_power_of_2(D)
    if mode == MODE_DENSE:
        tiles = _dense_tiles(D, logits)
    else:
        tiles = (*gather_tiles(q.device, D, keys.element_size()), _GATHER_WAVES)
    BLOCK_N, num_stages, waves = block_n or tiles[0], num_stages or tiles[1], waves or tiles[2]
    BLOCK_G = max(16, triton.next_power_of_2(group_rows))  # tl.dot needs at least 16 rows
    if mode == MODE_DENSE:  # chunk: computed per row in the kernel
        chunk, n_chunks = 0, _dense_chunks(Hs, q.device, waves)
    else:
        chunk, n_chunks = _plan(n_slots, Hs, q.device, BLOCK_N, waves)
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
        qc, keys, values, idx, q if lens is None else lens, m, l, acc, s_out,
        qc.stride(0), qc.stride(1), keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2), sib, sih,
        scale, Hs, G, group_rows, sink, n_sparse, window, chunk, n_slots, span, float(softcap or 0.0),
        lengths if host_len else 0,
        MODE=mode, PREC="ieee" if q.dtype == torch.float32 else "tf32", D=D, BLOCK_D=BLOCK_D, BLOCK_G=BLOCK_G,
        BLOCK_N=BLOCK_N, LOGITS=logits, SOFTCAP=bool(softcap) and not logits, HOST_LEN=host_len, num_warps=num_warps,
        num_stages=num_stages, **dependent_launch(q.device),
    )
    if logits:
        return s_out
    out = torch.empty(B, Hq, 1, D, dtype=q.dtype, device=q.device)
    _merge_kernel[(B * Hq,)](m, l, acc, out, out.stride(0), out.stride(1), Hq, n_chunks,
                             D=D, BLOCK_D=BLOCK_D, BLOCK_C=triton.next_power_of_2(n_chunks), num_warps=4,
                             **dependent_launch(q.device))
    return out


def dense_decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: int | torch.Tensor,
                 scale: float, span: int = 0, softcap: float | None = None, **tuning) -> torch.Tensor:
    """Split-K flash-decoding over the whole valid cache (its last `span` keys with a sliding window): our dense
    baseline. lengths: int or [B]."""
    return sparse_decode(q, keys, values, scale, lengths, span=span, dense=True, softcap=softcap, **tuning)


@triton.jit
def _block_positions_kernel(BLK, OUT, COUNT, LENS, stride_l, length, H, nb, span, sink, window, per_head,
                            stride_bb, stride_bh, stride_ob, stride_oh, S: tl.constexpr, BLOCK: tl.constexpr,
                            ROW_LENGTHS: tl.constexpr, PDL: tl.constexpr = 0):
    wait_for_prior(PDL)
    bh = tl.program_id(0)
    b = bh // H
    h = bh % H
    t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # slots: block t // S, offset t % S
    ok = t < nb * S
    blk = tl.load(BLK + b * stride_bb + h * stride_bh + t // S, mask=ok, other=-1)
    L = tl.full([], 0, tl.int64) + length
    if ROW_LENGTHS:
        L = tl.load(LENS + b * stride_l).to(tl.int64)
    lo = window_first(L, span) + sink
    pos = blk * S + t % S
    keep = (blk >= 0) & (pos >= lo) & (pos < L - window)
    tl.store(OUT + b * stride_ob + h * stride_oh + t, tl.where(keep, pos, -1), mask=ok)
    # the mean count per (row, head): exact whatever the order of the adds while B·H is a power of two (and, added
    # into a running sum, while that fits its type's mantissa: fp64 for a decode loop's)
    part = tl.sum((keep & ok).to(tl.float32), 0) * per_head
    tl.atomic_add(COUNT, part.to(COUNT.dtype.element_ty), sem="relaxed")


def block_positions(blocks: torch.Tensor, block_size: int, lengths: int | torch.Tensor, span: int = 0,
                    sink: int = 0, window: int = 0, count: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks [B, H, nb] as padded token positions [B, H, nb·block_size], clipped to each row's sparse region
    (lengths: an int, or per row [B] on the device), and their mean count per (row, head), in one launch (and the
    count's zeroing), or with `count` (a 0-dim fp32/fp64 tensor on the device: a running sum) added into it in the
    same launch. Same contract as block_positions_reference."""
    B, H, nb = blocks.shape
    out = torch.empty(B, H, nb * block_size, dtype=torch.int64, device=blocks.device)
    if count is None:
        count = torch.zeros((), dtype=torch.float32, device=blocks.device)
    elif count.dim() != 0 or count.device != blocks.device or count.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"count must be a 0-dim fp32/fp64 tensor on {blocks.device}, got {count.dtype} "
                         f"{tuple(count.shape)} on {count.device}")
    if out.numel() == 0:
        return out, count
    rows = isinstance(lengths, torch.Tensor)
    if rows and (lengths.dim() != 1 or lengths.shape[0] not in (1, B) or lengths.device != blocks.device):
        raise ValueError(f"lengths must be an int or an integer tensor [{B}] on {blocks.device}, "
                         f"got {tuple(lengths.shape)} on {lengths.device}")
    BLOCK = min(1024, triton.next_power_of_2(nb * block_size))
    grid = (B * H, triton.cdiv(nb * block_size, BLOCK))
    _block_positions_kernel[grid](
        blocks, out, count, lengths if rows else out, lengths.stride(0) if rows and lengths.shape[0] > 1 else 0,
        0 if rows else lengths, H, nb, span, sink, window, 1.0 / (B * H), blocks.stride(0), blocks.stride(1),
        out.stride(0), out.stride(1), S=block_size, BLOCK=BLOCK, ROW_LENGTHS=rows, num_warps=4,
        **dependent_launch(blocks.device))
    return out, count
