"""SAAP's decode step in Triton: four launches a layer (two for the bucket logits, the second also carrying out the
step's append in extra programs; bases; gather), none reading back to the host: graph-capturable.

append         one program per (batch row, KV head, block of centroids): the block's best inner product with the
               new key (fp32, ties to the lower bucket), combined across blocks by an atomic max of (score, bucket)
               packed in an int64; the row's last block to finish writes the winner at the key's device position
               and appends the key leaving the dense window (`window` positions earlier, past the sink) to its
               bucket's list: its ordinal is the list's length, which grows by one (that one program owns the
               row's lists). One block per program: a step's centroids are read by the whole GPU, not by B x Hkv
               programs in turn. In a decode step these programs run inside the logits' launch (below): their two
               dependent atomics a row overlap the Q-model's reads instead of preceding them.
bucket_logits  the folded Q-model's logits relu(x w1 + b1) w2 + b2 in two launches, one program per (block of the
               hidden layer, then of buckets; KV head; block of query rows): a KV head's weights are read once for
               its query group over the whole batch, by many programs at once. Without a Q-model, one launch of
               the second kind: the queries' inner products with the centroids. With the centroids' ranking mixed
               in (`centroids_too`), the second launch's programs also take those for their block of buckets.
bucket_bases   one program per (batch row, selection head): each query head's softmax (Q-model), the group's sum,
               the `probes` best buckets by a top-k of 32-bit rank keys (score and bucket in one int32, ties to the
               lower bucket: reference.bucket_rank_keys), and the table of each bucket's first slot (-1 unvisited)
               with the chosen lists end to end. In `bucket_select` it also fills the gather's output with -1 and
               zeroes its counter (no torch launches around the gather). Eight warps: the top-k is the program's
               critical path. With two rankings taken in turn (`centroid_share`), a top-k of each, their ranks
               exchanged through a scratch row, and a top-k of the turns of those candidates.
bucket_gather  one program per chunk of positions of one (batch row, selection head): it reads the bucket and list
               ordinal of each key (8 bytes a key, against the 2·D·2 bytes of its K/V in 16 bits), looks up its
               bucket's first slot and stores the position at base + ordinal (ordinals are negative in newest-first
               lists, whose bases are then the buckets' last slot + 1: sparsekv/saap/lists.py). Slots are unique
               (a bucket's keys have distinct ordinals), so the positions need no atomics and no ordering between
               programs; slots never written keep the -1 the output is filled with. Each program adds how many it
               stored to one counter (an integer atomic: the same total in any order), the step's statistics. A
               graph-replayed step's rows bound their own region from their device lengths inside the kernel
               (RowBounds), as the code distances do.

References: kernels/reference.py::saap_append_reference, bucket_logits_reference, bucket_bases_reference,
bucket_gather_reference, bucket_select_reference (same arguments).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .device import dependent_launch, wait_for_prior
from .reference import PendingAppend, RowBounds, mix_factors
from .region import window_first

CHUNK = 2048  # positions per gather program: 64 programs per head at 131072 keys


LOWEST = tl.constexpr(-(2**63) + 1)  # below every _rank_key


@triton.jit
def _rank_key(score, idx, n):
    """(score, index) as one int64 that orders as the score, ties to the lower index (indices below n): the fp32
    bits made order-preserving as an int32 in the high half, n - 1 - index in the low half."""
    bits = score.to(tl.int32, bitcast=True)
    return ((bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64) << 32) | (n - 1 - idx).to(tl.int64)


# --------------------------------------------------------------------------------------------------------------
# append: the new key's bucket, and the key leaving the window into its list


@triton.jit
def _append_block(K, CENT, BKT, ORD, CNT, POS, BEST, DONE, bh, blk, blocks, C, Hkv, sink, window,
                  s_kb, s_kh, s_ch, s_cc, s_bb, s_bh, s_nb, s_nh,
                  D: tl.constexpr, DP: tl.constexpr, BLOCK_C: tl.constexpr, NEWEST: tl.constexpr):
    """Block `blk` of `blocks` of row bh's (batch row, KV head) append."""
    b = bh // Hkv
    kv = bh % Hkv
    d = tl.arange(0, DP)
    x = tl.load(K + b * s_kb + kv * s_kh + d, mask=d < D, other=0.0).to(tl.float32)
    c = blk * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = c < C
    cent = tl.load(CENT + kv * s_ch + c[:, None] * s_cc + d[None, :], mask=ok[:, None] & (d < D)[None, :],
                   other=0.0).to(tl.float32)
    s = tl.where(ok, tl.sum(cent * x[None, :], axis=1), float("-inf"))
    # this block's best (score, bucket), combined across the row's blocks by an atomic max: the best score's
    # lowest bucket
    tl.atomic_max(BEST + bh, tl.max(tl.where(ok, _rank_key(s, c, C), LOWEST), 0), sem="relaxed")
    # the row's last block to finish (acq_rel: it sees every block's max) records the bucket and resets the scratch
    if tl.atomic_add(DONE + bh, 1) == blocks - 1:
        best = tl.atomic_xchg(BEST + bh, LOWEST)
        tl.atomic_xchg(DONE + bh, 0)
        arg = (C - 1 - (best & 0xFFFFFFFF)).to(tl.int32)
        row = b.to(tl.int64) * s_bb + kv * s_bh
        p_new = tl.load(POS + b).to(tl.int64)
        tl.store(BKT + row + p_new, arg)
        p = p_new - window
        if p >= sink:
            # the leaving key's bucket was recorded steps ago, unless it is the new key itself (window 0)
            bk = tl.where(window == 0, arg, tl.load(BKT + row + tl.maximum(p, 0)))
            cnt = CNT + b.to(tl.int64) * s_nb + kv * s_nh + bk
            index = tl.load(cnt)
            tl.store(ORD + row + p, -1 - index if NEWEST else index)
            tl.store(cnt, index + 1)


@triton.jit
def _append_kernel(K, CENT, BKT, ORD, CNT, POS, BEST, DONE, C, Hkv, sink, window,
                   s_kb, s_kh, s_ch, s_cc, s_bb, s_bh, s_nb, s_nh,
                   D: tl.constexpr, DP: tl.constexpr, BLOCK_C: tl.constexpr, NEWEST: tl.constexpr,
                   PDL: tl.constexpr = 0):
    wait_for_prior(PDL)
    _append_block(K, CENT, BKT, ORD, CNT, POS, BEST, DONE, tl.program_id(0), tl.program_id(1), tl.num_programs(1),
                  C, Hkv, sink, window, s_kb, s_kh, s_ch, s_cc, s_bb, s_bh, s_nb, s_nh,
                  D=D, DP=DP, BLOCK_C=BLOCK_C, NEWEST=NEWEST)


_SCRATCH: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _append_scratch(device: torch.device, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (batch row, KV head): the running best (int64, reset to its minimum) and how many blocks are done (0).
    Each call leaves them reset; calls that share them must be ordered (one stream or one graph)."""
    key = (device, rows)
    if key not in _SCRATCH:
        _SCRATCH[key] = (torch.full((rows,), LOWEST.value, dtype=torch.int64, device=device),
                         torch.zeros(rows, dtype=torch.int32, device=device))
    return _SCRATCH[key]


def _append_launch(a: PendingAppend, centroids: torch.Tensor, block_c: int | None = None) -> tuple[list, dict, int, int]:
    """The append's kernel arguments (positional, constexpr), its rows (batch row x KV head) and blocks per row."""
    B, Hkv, n, D = a.k.shape
    C = centroids.shape[1]
    if n != 1 or centroids.shape != (Hkv, C, D) or a.pos.shape != (B,):
        raise ValueError(f"saap_append takes one key per row [B, Hkv, 1, D], centroids [Hkv, C, D] and pos [B]; got "
                         f"{tuple(a.k.shape)}, {tuple(centroids.shape)}, {tuple(a.pos.shape)}")
    if a.buckets.stride(-1) != 1 or a.ordinals.stride() != a.buckets.stride() or a.counts.stride(-1) != 1:
        raise ValueError("buckets and ordinals must share a layout with contiguous positions")
    cent = centroids if centroids.stride(-1) == 1 else centroids.contiguous()
    k = a.k if a.k.stride(-1) == 1 else a.k.contiguous()
    DP = max(16, triton.next_power_of_2(D))
    block_c = block_c or max(16, min(triton.next_power_of_2(C), 8192 // DP))
    best, done = _append_scratch(k.device, B * Hkv)
    args = [k, cent, a.buckets, a.ordinals, a.counts, a.pos, best, done, C, Hkv, a.sink, a.window,
            k.stride(0), k.stride(1), cent.stride(0), cent.stride(1), a.buckets.stride(0), a.buckets.stride(1),
            a.counts.stride(0), a.counts.stride(1)]
    return args, dict(D=D, DP=DP, BLOCK_C=block_c, NEWEST=a.newest_first), B * Hkv, triton.cdiv(C, block_c)


def saap_append(buckets: torch.Tensor, ordinals: torch.Tensor, counts: torch.Tensor, centroids: torch.Tensor,
                k: torch.Tensor, pos: torch.Tensor, sink: int, window: int, newest_first: bool = False,
                block_c: int | None = None) -> None:
    """Contract of `reference.saap_append_reference` (in place): keys k [B, Hkv, 1, D] at device positions pos [B].
    `block_c`: centroids per program (default: 8192 codes' worth)."""
    args, const, rows, blocks = _append_launch(
        PendingAppend(buckets, ordinals, counts, k, pos, sink, window, newest_first), centroids, block_c)
    _append_kernel[(rows, blocks)](*args, **const, num_warps=4, **dependent_launch(k.device))


# --------------------------------------------------------------------------------------------------------------
# the queries' bucket logits


@triton.jit
def _rows(s_xb, s_xh, kv, G, n_rows, RB: tl.constexpr):
    """This program's query rows (batch row, query head of KV head kv's group): their offsets in a [B, Hq, ...] tensor
    of strides (s_xb, s_xh), and which rows exist."""
    r = tl.program_id(2) * RB + tl.arange(0, RB)
    return (r // G) * s_xb + (kv * G + r % G) * s_xh, r < n_rows


@triton.jit
def _hidden_kernel(X, W1, B1, H, n_rows, G, M, s_xb, s_xh, s_hb, s_hh,
                   D: tl.constexpr, DP: tl.constexpr, RB: tl.constexpr, BLOCK_M: tl.constexpr, PREC: tl.constexpr,
                   PDL: tl.constexpr = 0):
    wait_for_prior(PDL)
    kv = tl.program_id(1)
    x_off, r_ok = _rows(s_xb, s_xh, kv, G, n_rows, RB)
    h_off, _ = _rows(s_hb, s_hh, kv, G, n_rows, RB)
    d = tl.arange(0, DP)
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < M
    x = tl.load(X + x_off[:, None] + d[None, :], mask=r_ok[:, None] & (d < D)[None, :], other=0.0)
    w1 = tl.load(W1 + kv * D * M + d[:, None] * M + m[None, :], mask=(d < D)[:, None] & m_ok[None, :], other=0.0)
    h = tl.dot(x.to(w1.dtype), w1, input_precision=PREC)
    h = tl.maximum(h + tl.load(B1 + kv * M + m, mask=m_ok, other=0.0).to(tl.float32)[None, :], 0.0)
    tl.store(H + h_off[:, None] + m[None, :], h.to(H.dtype.element_ty), mask=r_ok[:, None] & m_ok[None, :])


@triton.jit
def _product(A, W, a_off, r_ok, kv, c, c_ok, K, s_wh, s_wk, s_wc,
             RB: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr):
    """fp32 [RB, BLOCK_C]: rows A[a_off, :K] times the block of columns c of KV head kv's W [K, C] (strides given)."""
    acc = tl.zeros([RB, BLOCK_C], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < K
        w = tl.load(W + kv * s_wh + kk[:, None] * s_wk + c[None, :] * s_wc, mask=k_ok[:, None] & c_ok[None, :],
                    other=0.0)
        a = tl.load(A + a_off[:, None] + kk[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.dot(a.to(w.dtype), w, input_precision=PREC)
    return acc


@triton.jit
def _logits_kernel(A, W, BIAS, OUT, n_rows, G, C, K, s_ab, s_ah, s_wh, s_wk, s_wc, s_ob, s_oh,
                   X2, CENT2, OUT2, D2, s_xb, s_xh,
                   AK, ACENT, ABKT, AORD, ACNT, APOS, ABEST, ADONE, AC, AHkv, a_sink, a_window,
                   as_kb, as_kh, as_ch, as_cc, as_bb, as_bh, as_nb, as_nh, a_rows, a_blocks,
                   RB: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                   PREC: tl.constexpr, CENTROIDS_TOO: tl.constexpr, APPEND: tl.constexpr, AD: tl.constexpr,
                   ADP: tl.constexpr, ABLOCK_C: tl.constexpr, ANEWEST: tl.constexpr, PDL: tl.constexpr = 0):
    wait_for_prior(PDL)
    c_blocks = tl.cdiv(C, BLOCK_C)
    if APPEND and tl.program_id(0) >= c_blocks:  # the programs past the logits' own carry out the append
        lin = ((tl.program_id(0) - c_blocks) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(2) \
            + tl.program_id(2)
        if lin < a_rows * a_blocks:
            _append_block(AK, ACENT, ABKT, AORD, ACNT, APOS, ABEST, ADONE, lin // a_blocks, lin % a_blocks, a_blocks,
                          AC, AHkv, a_sink, a_window, as_kb, as_kh, as_ch, as_cc, as_bb, as_bh, as_nb, as_nh,
                          D=AD, DP=ADP, BLOCK_C=ABLOCK_C, NEWEST=ANEWEST)
    else:
        kv = tl.program_id(1)
        a_off, r_ok = _rows(s_ab, s_ah, kv, G, n_rows, RB)
        o_off, _ = _rows(s_ob, s_oh, kv, G, n_rows, RB)
        c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
        c_ok = c < C
        acc = _product(A, W, a_off, r_ok, kv, c, c_ok, K, s_wh, s_wk, s_wc,
                       RB=RB, BLOCK_C=BLOCK_C, BLOCK_K=BLOCK_K, PREC=PREC)
        if HAS_BIAS:
            acc += tl.load(BIAS + kv * C + c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(OUT + o_off[:, None] + c[None, :], acc, mask=r_ok[:, None] & c_ok[None, :])
        if CENTROIDS_TOO:  # the same block of buckets scored by the queries' inner products with the centroids
            x_off, _ = _rows(s_xb, s_xh, kv, G, n_rows, RB)
            acc = _product(X2, CENT2, x_off, r_ok, kv, c, c_ok, D2, C * D2, 1, D2,
                           RB=RB, BLOCK_C=BLOCK_C, BLOCK_K=BLOCK_K, PREC=PREC)
            tl.store(OUT2 + o_off[:, None] + c[None, :], acc, mask=r_ok[:, None] & c_ok[None, :])


def bucket_logits(x: torch.Tensor, centroids: torch.Tensor, model: tuple | None = None,
                  append: PendingAppend | None = None, centroids_too: bool = False, block_c: int = 64,
                  block_m: int = 64, block_k: int = 128, num_warps: int = 4,
                  num_stages: int = 4) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Contract of `reference.bucket_logits_reference`: fp32 [B, Hq, C] of queries x [B, Hq, 1, D]. Two launches
    with a Q-model (its hidden layer [B, Hq, M] in the weights' dtype, then the logits), one without; `append`
    runs as extra programs of the logits' launch (its ~2 dependent atomics a row overlap the logits' reads);
    `centroids_too`: the logits' programs also score their block of buckets by the centroids. Tiles: `block_m`
    hidden units a program of the hidden layer; `block_c` buckets a program of the logits, which step through the
    hidden units `block_k` at a time with `num_stages` loads in flight. The defaults of the logits' launch
    (64 buckets a program, 128 hidden units a step, 4 stages in flight) were the fastest of every combination
    timed on an H200 at the paper's sizes with the weights cold in L2, as in a whole model's step (their effect on
    the whole step: benchmarks/BENCHMARKS.md, "SAAP's select tuned")."""
    B, Hq, n, D = x.shape
    Hkv, C, _ = centroids.shape
    if n != 1 or centroids.shape[2] != D or Hq % Hkv:
        raise ValueError(f"bucket_logits takes queries [B, Hq, 1, D] and centroids [Hkv, C, D]; got {tuple(x.shape)} "
                         f"and {tuple(centroids.shape)}")
    G, n_rows = Hq // Hkv, B * (Hq // Hkv)
    x = x[:, :, 0]
    if x.stride(-1) != 1:
        x = x.contiguous()
    RB = max(16, min(64, triton.next_power_of_2(n_rows)))  # tl.dot's smallest tile is 16 rows
    DP = max(16, triton.next_power_of_2(D))
    out = torch.empty(B, Hq, C, dtype=torch.float32, device=x.device)
    rows = triton.cdiv(n_rows, RB)
    cent = centroids.contiguous()
    if model is None:
        if centroids_too:
            raise ValueError("bucket_logits: centroids_too pairs a Q-model's logits with the centroids'")
        a, w, bias, K, w_strides = x, cent, cent, D, (C * D, 1, D)  # K = dims, the centroids read transposed
        prec = _prec(cent.dtype)
    else:
        w1, b1, w2, b2 = (t.contiguous() for t in model)
        M = w1.shape[-1]
        if w1.shape != (Hkv, D, M) or w2.shape != (Hkv, M, C) or b1.shape != (Hkv, M) or b2.shape != (Hkv, C):
            raise ValueError("bucket_logits: the Q-model's weights do not match the centroids' heads and buckets")
        prec = _prec(w1.dtype)
        h = torch.empty(B, Hq, M, dtype=w1.dtype, device=x.device)
        _hidden_kernel[(triton.cdiv(M, block_m), Hkv, rows)](
            x, w1, b1, h, n_rows, G, M, x.stride(0), x.stride(1), h.stride(0), h.stride(1),
            D=D, DP=DP, RB=RB, BLOCK_M=block_m, PREC=prec, num_warps=num_warps, **dependent_launch(x.device))
        a, w, bias, K, w_strides = h, w2, b2, M, (M * C, C, 1)
    extra = 0
    if append is not None:
        app_args, app_const, app_rows, app_blocks = _append_launch(append, centroids)
        app_args += [app_rows, app_blocks]
        extra = triton.cdiv(app_rows * app_blocks, Hkv * rows)  # grid columns past the logits' own
        app_const = {"A" + name: v for name, v in app_const.items()}
    else:  # unread placeholders
        app_args = [out] * 8 + [0] * 14
        app_const = dict(AD=16, ADP=16, ABLOCK_C=16, ANEWEST=False)
    out2 = torch.empty_like(out) if centroids_too else out  # unread placeholder without
    _logits_kernel[(triton.cdiv(C, block_c) + extra, Hkv, rows)](
        a, w, bias, out, n_rows, G, C, K, a.stride(0), a.stride(1), *w_strides, out.stride(0), out.stride(1),
        x, cent, out2, D, x.stride(0), x.stride(1),
        *app_args, RB=RB, BLOCK_C=block_c, BLOCK_K=min(block_k, max(16, triton.next_power_of_2(K))),
        HAS_BIAS=model is not None, PREC=prec, CENTROIDS_TOO=centroids_too, APPEND=append is not None, **app_const,
        num_warps=num_warps, num_stages=num_stages, **dependent_launch(x.device))
    return (out, out2) if centroids_too else out


def _prec(dtype: torch.dtype) -> str:
    """tl.dot's precision: full fp32 products for fp32 weights (no TF32 rounding); 16-bit inputs are exact."""
    return "ieee" if dtype == torch.float32 else "tf32"


# --------------------------------------------------------------------------------------------------------------
# the visited buckets' first slots


@triton.jit
def _rank_key32(score, idx, LOG_C: tl.constexpr):
    """`reference.bucket_rank_keys` (idx below 2**LOG_C): the fp32 bits made order-preserving as an int32, the lowest
    LOG_C bits replaced by the bucket's rank from the top."""
    bits = score.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return ((key >> LOG_C) << LOG_C) | ((1 << LOG_C) - 1 - idx)


@triton.jit
def _group_sum(S, b, hs, s_sb, s_sh, C, G, GP: tl.constexpr, CP: tl.constexpr, SOFTMAX: tl.constexpr):
    """fp32 [CP]: selection head hs's bucket scores (`reference.group_scores`), -inf past C."""
    g = tl.arange(0, GP)
    c = tl.arange(0, CP)
    ok = (g < G)[:, None] & (c < C)[None, :]
    s = tl.load(S + b * s_sb + (hs * G + g)[:, None] * s_sh + c[None, :], mask=ok, other=float("-inf"))
    if SOFTMAX:  # each query head's distribution over the buckets
        top = tl.max(s, 1)
        e = tl.where(ok, tl.exp(s - tl.where(top == float("-inf"), 0.0, top)[:, None]), 0.0)  # padding rows: 0
        s = e / tl.maximum(tl.sum(e, 1), 1e-30)[:, None]
    return tl.where(c < C, tl.sum(tl.where(ok, s, 0.0), 0), float("-inf"))


@triton.jit
def _best_buckets(score, LOG_C: tl.constexpr, CP: tl.constexpr, KP: tl.constexpr):
    """The KP best buckets of scores [CP], best first, as `reference.bucket_rank_keys` orders them."""
    best = tl.topk(_rank_key32(score, tl.arange(0, CP), LOG_C), KP)  # keys are distinct
    return (1 << LOG_C) - 1 - (best & ((1 << LOG_C) - 1))


@triton.jit
def _turn_keys(rq, rc, bucket, fq, fc, C, LOG_C: tl.constexpr, KP: tl.constexpr):
    """int64 keys that order buckets as `reference.mixed_order` places them: (turn, the first ranking's
    rank, bucket), a rank of KP or more standing for every rank past the KP best (padding buckets last)."""
    turn = tl.minimum(rq.to(tl.float32) * fq, rc.to(tl.float32) * fc)  # >= 0: its bits order as it does
    key = (turn.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (tl.minimum(rq, KP).to(tl.int64) << (LOG_C + 1)) \
        | bucket.to(tl.int64)
    return tl.where(bucket < C, key, 0x7FFFFFFFFFFFFFFF)


@triton.jit
def _mixed_best(score, score2, scratch, fq, fc, C, LOG_C: tl.constexpr, CP: tl.constexpr, KP: tl.constexpr):
    """The first KP buckets of `reference.mixed_order`, in its order. The mix's k-th place comes no later than
    the k-th of either ranking, so its first KP are among each ranking's KP best: each list's ranks are spread over
    the buckets through `scratch` (2 x CP int32, a rank past KP elsewhere) for the other list to read, and the
    best KP of the two lists' turn keys (a bucket in both counted once) are the mix's first KP. An unknown rank (past
    KP) never decides one of those places: its bucket comes earlier by its other rank, or after them."""
    c = tl.arange(0, CP)
    r = tl.arange(0, KP)
    far = 1 << 24  # a rank no list gives: its turn is past every known one
    tl.store(scratch + c, tl.full([CP], far, tl.int32))
    tl.store(scratch + CP + c, tl.full([CP], far, tl.int32))
    tl.debug_barrier()
    bq = _best_buckets(score, LOG_C, CP, KP)
    bc = _best_buckets(score2, LOG_C, CP, KP)
    tl.store(scratch + bq, r)
    tl.store(scratch + CP + bc, r)
    tl.debug_barrier()
    rc_of_q = tl.load(scratch + CP + bq)
    rq_of_c = tl.load(scratch + bc)
    kq = _turn_keys(r, rc_of_q, bq, fq, fc, C, LOG_C, KP)
    kc = _turn_keys(rq_of_c, r, bc, fq, fc, C, LOG_C, KP)
    kc = tl.where(rq_of_c < KP, 0x7FFFFFFFFFFFFFFF, kc)  # in the first list too: its key is there
    key = tl.reshape(tl.join(kq, kc), [2 * KP])  # any order: the top-k sorts
    return (~tl.topk(~key, KP) & (CP - 1)).to(tl.int32)  # the KP smallest keys, smallest first


@triton.jit
def _bases_kernel(S, S2, SCRATCH, CNT, BASES, OUT, COUNT, C, G, Hs, sel_per_kv, probes, cap, fq, fc,
                  s_sb, s_sh, s_nb, s_nh, s_bb, s_bh, s_ob, s_oh,
                  GP: tl.constexpr, CP: tl.constexpr, LOG_C: tl.constexpr, KP: tl.constexpr, SOFTMAX: tl.constexpr,
                  MIX: tl.constexpr, NEWEST: tl.constexpr, FILL: tl.constexpr, FILL_BLOCK: tl.constexpr,
                  PDL: tl.constexpr = 0):
    wait_for_prior(PDL)
    bh = tl.program_id(0)
    b = bh // Hs
    hs = bh % Hs
    if FILL:  # the gather's output row: -1 where no key will land; its counter zeroed
        o = OUT + b.to(tl.int64) * s_ob + hs * s_oh
        for f0 in range(0, cap, FILL_BLOCK):
            f = f0 + tl.arange(0, FILL_BLOCK)
            tl.store(o + f, tl.full([FILL_BLOCK], -1, tl.int64), mask=f < cap)
        if bh == 0:
            tl.store(COUNT, 0)
    c = tl.arange(0, CP)
    score = _group_sum(S, b, hs, s_sb, s_sh, C, G, GP=GP, CP=CP, SOFTMAX=SOFTMAX)
    if MIX:  # two rankings taken in turn (SAAP's centroid_share)
        score2 = _group_sum(S2, b, hs, s_sb, s_sh, C, G, GP=GP, CP=CP, SOFTMAX=SOFTMAX)
        bucket = _mixed_best(score, score2, SCRATCH + bh.to(tl.int64) * 2 * CP, fq, fc, C,
                             LOG_C=LOG_C, CP=CP, KP=KP)
    else:
        bucket = _best_buckets(score, LOG_C=LOG_C, CP=CP, KP=KP)
    r = tl.arange(0, KP)  # the rank
    chosen = r < probes
    cnt = tl.load(CNT + b * s_nb + (hs // sel_per_kv) * s_nh + bucket, mask=chosen, other=0)
    ends = tl.cumsum(cnt, 0)
    out = BASES + b * s_bb + hs * s_bh
    tl.store(out + c, tl.full([CP], -1, tl.int32), mask=c < C)  # every bucket unvisited ...
    tl.store(out + C, -1)  # ... and the "no key" sentinel
    tl.debug_barrier()  # ... before the chosen ones' first slots overwrite theirs
    tl.store(out + bucket, (ends if NEWEST else ends - cnt).to(tl.int32), mask=chosen)


def bucket_bases(scores: torch.Tensor, counts: torch.Tensor, probes: int, group: int = 1, softmax: bool = False,
                 newest_first: bool = False, centroid_scores: torch.Tensor | None = None, centroid_share: float = 0.0,
                 out: torch.Tensor | None = None, count: torch.Tensor | None = None,
                 num_warps: int = 8) -> torch.Tensor:
    """Contract of `reference.bucket_bases_reference`: int32 [B, Hq / group, C + 1]. Given the gather's output
    `out` [B, Hq / group, cap] (int64) and its counter `count` (int32 [1]), the same launch fills the one with -1
    and zeroes the other (`bucket_select`)."""
    B, Hq, C = scores.shape
    Hkv = counts.shape[1]
    Hs = Hq // group
    mix = bool(centroid_share)
    if Hq % group or Hs % Hkv or counts.shape != (B, Hkv, C + 1) or not 1 <= probes <= C or \
            (mix and (centroid_scores is None or centroid_scores.shape != scores.shape or not 0 < centroid_share < 1
                      or C > 1 << 15)):  # the turn keys' low 32 bits hold a rank and a bucket of 16 and 15 bits
        raise ValueError(f"bucket_bases: scores {tuple(scores.shape)}, group {group}, counts {tuple(counts.shape)}, "
                         f"probes {probes} and the centroid share {centroid_share} do not fit together")
    s = scores.float().contiguous()
    s2 = centroid_scores.float().contiguous() if mix else s  # an unread placeholder without the mix
    if counts.stride(-1) != 1:
        counts = counts.contiguous()
    bases = torch.empty(B, Hs, C + 1, dtype=torch.int32, device=scores.device)
    fill = out is not None
    if fill and (out.shape[:2] != (B, Hs) or out.stride(-1) != 1 or count is None):
        raise ValueError("bucket_bases: out must be [B, Hs, cap] with contiguous slots, given with its counter")
    log_c = max(1, (C - 1).bit_length())
    CP = 1 << log_c
    o, cnt_out = (out, count) if fill else (bases, bases)  # unread placeholders without a fill
    scratch = torch.empty(B * Hs * 2 * CP if mix else 1, dtype=torch.int32, device=scores.device)
    fq, fc = (float(f) for f in mix_factors(centroid_share)) if mix else (1.0, 1.0)
    _bases_kernel[(B * Hs,)](
        s, s2, scratch, counts, bases, o, cnt_out, C, group, Hs, Hs // Hkv, probes, o.shape[-1] if fill else 0,
        fq, fc, s.stride(0), s.stride(1), counts.stride(0), counts.stride(1), bases.stride(0), bases.stride(1),
        o.stride(0), o.stride(1),
        GP=triton.next_power_of_2(group), CP=CP, LOG_C=log_c,
        KP=min(CP, max(2, triton.next_power_of_2(probes))), SOFTMAX=softmax, MIX=mix, NEWEST=newest_first,
        FILL=fill, FILL_BLOCK=1024, num_warps=num_warps, **dependent_launch(scores.device))
    return bases


# --------------------------------------------------------------------------------------------------------------
# the visited lists' positions


@triton.jit
def _bucket_gather_kernel(BKT, ORD, BASE, OUT, COUNT, LENS,
                          s_kb, s_kh, s_bb, s_bh, s_ob, s_oh,
                          n_sel_heads, sel_per_kv, lo, hi, cap, chunk, span, sink, window,
                          ROWS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = 0):
    wait_for_prior(PDL)
    c = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // n_sel_heads
    hs = bh % n_sel_heads
    kv = hs // sel_per_kv
    r_lo = lo
    r_hi = hi
    if ROWS:  # this row's own region (a graph-replayed step scans the region of the longest row)
        L = tl.load(LENS + b).to(tl.int32)
        r_lo = tl.maximum(r_lo, window_first(L, span) + sink)
        r_hi = tl.minimum(r_hi, L - window)
    start = lo + c * chunk
    stop = tl.minimum(start + chunk, hi)
    k_off = b.to(tl.int64) * s_kb + kv * s_kh
    stored = tl.zeros([BLOCK], tl.int32)
    for s0 in range(start, stop, BLOCK):
        p = s0 + tl.arange(0, BLOCK)
        ok = (p < stop) & (p >= r_lo) & (p < r_hi)
        bk = tl.load(BKT + k_off + p, mask=ok, other=0)
        base = tl.load(BASE + b * s_bb + hs * s_bh + bk, mask=ok, other=-1)
        ok = ok & (base >= 0)
        # the ordinals of visited buckets' keys only: ~1/3 of their sectors at ~5 % selectivity
        slot = base + tl.load(ORD + k_off + p, mask=ok, other=0)
        ok = ok & (slot < cap)
        tl.store(OUT + b.to(tl.int64) * s_ob + hs * s_oh + slot, p.to(tl.int64), mask=ok)
        stored += ok.to(tl.int32)
    tl.atomic_add(COUNT, tl.sum(stored, 0), sem="relaxed")  # integers: the same total in any order


def bucket_gather(buckets: torch.Tensor, ordinals: torch.Tensor, bases: torch.Tensor, cap: int, lo: int, hi: int,
                  bounds: RowBounds | None = None, out: torch.Tensor | None = None,
                  count: torch.Tensor | None = None, block: int = 1024, chunk: int = CHUNK,
                  num_warps: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Contract of `reference.bucket_gather_reference`: (int64 [B, Hs, cap], -1 where no key lands; how many keys
    landed, summed over rows and heads, 0-dim int32), the count summed by the programs as they store. `out` and
    `count` given: already -1 and 0 (`bucket_bases` fills them in its launch)."""
    B, Hkv, _ = buckets.shape
    Hs = bases.shape[1]
    if out is None:
        out = torch.full((B, Hs, cap), -1, dtype=torch.int64, device=buckets.device)
        count = torch.zeros(1, dtype=torch.int32, device=buckets.device)
    if hi > lo and cap > 0:
        if buckets.stride(-1) != 1 or ordinals.stride() != buckets.stride():
            raise ValueError("buckets and ordinals must share a layout with contiguous positions")
        bases = bases.to(torch.int32).contiguous()
        if bounds is not None:
            bounds.check(B, buckets.device)
        lens, b_args = (bounds.lengths, (bounds.span, bounds.sink, bounds.window)) if bounds is not None \
            else (bases, (0, 0, 0))  # unread placeholders without bounds
        _bucket_gather_kernel[(triton.cdiv(hi - lo, chunk), B * Hs)](
            buckets, ordinals, bases, out, count, lens,
            buckets.stride(0), buckets.stride(1), bases.stride(0), bases.stride(1), out.stride(0), out.stride(1),
            Hs, Hs // Hkv, lo, hi, cap, chunk, *b_args, ROWS=bounds is not None, BLOCK=min(block, chunk),
            num_warps=num_warps, **dependent_launch(bases.device))
    return out, count.view(())


def bucket_select(scores: torch.Tensor, counts: torch.Tensor, buckets: torch.Tensor, ordinals: torch.Tensor,
                  probes: int, group: int, softmax: bool, newest_first: bool, cap: int, lo: int, hi: int,
                  bounds: RowBounds | None = None, centroid_scores: torch.Tensor | None = None,
                  centroid_share: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Contract of `reference.bucket_select_reference`: `bucket_bases` (which also fills the output and zeroes
    the counter) then `bucket_gather`, two launches."""
    B, Hq, _ = scores.shape
    out = torch.empty(B, Hq // group, cap, dtype=torch.int64, device=scores.device)
    count = torch.empty(1, dtype=torch.int32, device=scores.device)
    bases = bucket_bases(scores, counts, probes, group, softmax, newest_first, centroid_scores, centroid_share,
                         out=out, count=count)
    return bucket_gather(buckets, ordinals, bases, cap, lo, hi, bounds, out=out, count=count)
