"""Spotlight Attention's MLP hash in Triton (§3.2 eq. 5-6): H(x) = sign(W2 · SiLU(W1 x + b1)), packed 16 bits per
int16 word in the layout of the 1-bit codes (kernels/reference.py::code_pack_reference, bits=1), so that the Hamming
kernels of `codes.py` (code_scores / code_topk with bits=1, metric "l1": xor + popcount) score them.

mlp_hash_pack(_into)  one fused pass per (KV head, block of rows): a program loads its rows of x (a KV head's
                      keys, or the query heads of its GQA group, of every batch row: rows (b, g, i) flattened, so a
                      decode step's queries read their KV head's weights once per program), then, per chunk of
                      BLOCK_N output bits and of BLOCK_K intermediate units, hid = SiLU(x @ W1[:, chunk] +
                      b1[chunk]) (tl.dot, fp32 accumulate, bias and SiLU in fp32) and acc += hid @ W2[chunk, bits]
                      (tl.dot): the intermediate activations never leave registers. The bits 1[acc > 0], reshaped
                      [rows, BLOCK_N / 16, 16], are shifted to their positions and summed into words, stored
                      straight into the code buffer at the given rows or per-row device slots.
                      A decode step has one row block per KV head: too few programs for a GPU, each a long
                      chain of loads and dots. There the chunks of hidden units go to programs of their own
                      (`split`), which leave partial sums in scratch; the last of a row block to arrive (an
                      arrival count, acquire/release) adds them in chunk order and packs.
                      Without b1 and w2 the hash is linear, sign(x @ w1) (LSH's hyperplanes): one dot per
                      program and chunk of bits, the chunks on programs of their own.
                      `append`: a decode step's new keys join the queries' launch as extra rows of each KV
                      head's programs (same weights), stored into the code buffer at each row's device slot.
                      `margin` (ternary queries): a row's bits in one chunk, its root mean square over them, and
                      its care bits |acc| > margin · rms packed into the W words after its signs (not the keys').

Weights (per KV head, row-vector form y = SiLU(x @ w1 + b1) @ w2, i.e. W1 = w1ᵀ, W2 = w2ᵀ of the paper):
w1 [Hkv, D, M], b1 [Hkv, M], w2 [Hkv, M, nbits], any strides. Each dot's operands take its weight's dtype: fp32
weights give fp32 dots (precision "ieee" by default: the codes train-hash scored; "tf32": tensor cores, ~fp16 mantissa),
fp16/bf16 weights give native 16-bit dots (x and the SiLU output rounded to that dtype; accumulation in fp32).
Bits can therefore differ from the fp32 reference only where the pre-sign value is within rounding of 0.

Shapes: any D, M, nbits (blocks are padded to powers of two >= 16 and masked; padding bits are 0, as the
reference's). Graph capture: `_into` allocates nothing and reads nothing on the host; with device slots the grid
depends only on shapes.

Speed: part of spotlight's decode step (benchmarks/BENCHMARKS.md, "Speed of Spotlight and SAAP"). The default
tiles were chosen from sm_90 compiles (ptxas -v) at D = M = nbits = 128 to avoid register spills and keep shared
memory <= 128 KB: BLOCK_M 64 rows with 8 warps (below 64 rows, a decode step: 16 rows, a linear hash up to 64,
4 warps), BLOCK_K 64 intermediate units for 16-bit weights and 32 for fp32 ones (fp32 tiles take twice the shared
memory), BLOCK_N min(128, next_pow2(nbits)) (16 for a linear hash); 4 warps at 64 rows spill.

Reference: kernels/reference.py::mlp_hash_pack_reference, mlp_hash_pack_into_reference (mlp_hash_reference: the
pre-sign values).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .device import dependent_launch, num_sms, wait_for_prior
from .reference import PendingHash, _mlp_hash_shapes, check_margin, check_pending

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_PRECISIONS = ("tf32", "tf32x3", "ieee")


@triton.jit
def _mlp_hash_kernel(X, W1, B1, W2, OUT, START, SCR, CNT, n, G, B, start, margin,
                     stride_xb, stride_xh, stride_xn, stride_xd,
                     stride_1h, stride_1d, stride_1m, stride_bh, stride_bm, stride_2h, stride_2m, stride_2k,
                     stride_ob, stride_oh, stride_on,
                     K, KOUT, KSLOT, stride_kb, stride_kh, stride_kd, stride_cb, stride_ch, stride_cn,
                     D: tl.constexpr, M: tl.constexpr, NBITS: tl.constexpr, W: tl.constexpr,
                     PREC1: tl.constexpr, PREC2: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                     ROW_START: tl.constexpr, LINEAR: tl.constexpr, SPLIT: tl.constexpr,
                     WITH_KEYS: tl.constexpr = False, CARE: tl.constexpr = False, PDL: tl.constexpr = 0):
    wait_for_prior(PDL)
    pid_m = tl.program_id(0)
    kv = tl.program_id(1)
    # rows flattened (b, g, i): batch row b, query head kv·G + g, position i; a KV head's rows of every batch row
    # share its weights, so a decode step of a batch reads them once per program, not once per batch row
    r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_x = B * G * n
    r_ok = r < n_x
    b = (r // (G * n)).to(tl.int64)
    g = (r // n) % G
    i = r % n
    h = (kv * G + g).to(tl.int64)
    if ROW_START:  # each batch row's first slot, read on the device (a graph-replayed decode step)
        start = tl.load(START + b, mask=r_ok, other=0).to(tl.int64)
    dd = tl.arange(0, BLOCK_D)
    d_ok = dd < D
    x = tl.load(X + b[:, None] * stride_xb + h[:, None] * stride_xh + i[:, None] * stride_xn
                + dd[None, :] * stride_xd, mask=r_ok[:, None] & d_ok[None, :], other=0.0).to(W1.dtype.element_ty)
    o_row = OUT + b * stride_ob + h * stride_oh + (start + i) * stride_on  # [BLOCK_M] pointers
    q_ok = r_ok  # the rows of x: with CARE their care words follow their W sign words
    if WITH_KEYS:  # rows n_x + b: a decode step's new key of batch row b, into the code buffer at its device slot
        is_k = (r >= n_x) & (r < n_x + B)
        kb = tl.where(is_k, r - n_x, 0).to(tl.int64)
        slot = tl.load(KSLOT + kb, mask=is_k, other=0).to(tl.int64)
        xk = tl.load(K + kb[:, None] * stride_kb + kv * stride_kh + dd[None, :] * stride_kd,
                     mask=is_k[:, None] & d_ok[None, :], other=0.0).to(W1.dtype.element_ty)
        x = tl.where(is_k[:, None], xk, x)
        o_row = tl.where(is_k, KOUT + kb * stride_cb + kv * stride_ch + slot * stride_cn, o_row)
        r_ok = r_ok | is_k
    w1_base = W1 + kv * stride_1h
    b1_base = B1 + kv * stride_bh
    w2_base = W2 + kv * stride_2h
    if LINEAR:  # y = x @ w1: one dot, w1's columns are the bits; program_id(2) is this program's chunk of bits
        nc = tl.program_id(2)
        cols = nc * BLOCK_N + tl.arange(0, BLOCK_N)
        c_ok = cols < NBITS
        w1 = tl.load(w1_base + dd[:, None] * stride_1d + cols[None, :] * stride_1m,
                     mask=d_ok[:, None] & c_ok[None, :], other=0.0)  # padded bits: acc 0, bit 0
        acc = tl.dot(x, w1, input_precision=PREC1)
        _pack_store(acc, o_row, r_ok, q_ok, margin, nc, BLOCK_M, BLOCK_N, W, NBITS, CARE)
    elif SPLIT:  # program_id(2) is this program's chunk of BLOCK_K hidden units; every bit in one chunk
        cols = tl.arange(0, BLOCK_N)
        mc = tl.program_id(2)
        acc = _mlp_part(x, w1_base, b1_base, w2_base, mc * BLOCK_K, dd, d_ok, cols, cols < NBITS, M,
                        stride_1d, stride_1m, stride_bm, stride_2m, stride_2k, W2.dtype.element_ty, PREC1, PREC2,
                        BLOCK_K)
        # the chunks' partial sums meet in scratch; the last chunk of this row block to finish adds them up in
        # chunk order (the same sum every run: no float atomics) and packs the bits
        MC: tl.constexpr = (M + BLOCK_K - 1) // BLOCK_K
        blk = kv * tl.num_programs(0) + pid_m
        rows_ = tl.arange(0, BLOCK_M)
        tile = (blk * MC * BLOCK_M + rows_[:, None]) * BLOCK_N + cols[None, :]
        tl.store(SCR + tile + mc * (BLOCK_M * BLOCK_N), acc, cache_modifier=".cg")
        tl.debug_barrier()  # every thread's part is written before the count says so
        if tl.atomic_add(CNT + blk, 1, sem="acq_rel") == MC - 1:
            total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for c in tl.static_range(MC):
                total += tl.load(SCR + tile + c * (BLOCK_M * BLOCK_N), cache_modifier=".cg")
            _pack_store(total, o_row, r_ok, q_ok, margin, 0, BLOCK_M, BLOCK_N, W, NBITS, CARE)
            tl.atomic_xchg(CNT + blk, 0, sem="relaxed")  # ready for the next call (a graph replays it)
    else:
        nc = tl.program_id(2)  # this program's chunk of BLOCK_N output bits
        cols = nc * BLOCK_N + tl.arange(0, BLOCK_N)
        c_ok = cols < NBITS
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for m0 in range(0, M, BLOCK_K):
            acc += _mlp_part(x, w1_base, b1_base, w2_base, m0, dd, d_ok, cols, c_ok, M, stride_1d, stride_1m,
                             stride_bm, stride_2m, stride_2k, W2.dtype.element_ty, PREC1, PREC2, BLOCK_K)
        _pack_store(acc, o_row, r_ok, q_ok, margin, nc, BLOCK_M, BLOCK_N, W, NBITS, CARE)


@triton.jit
def _mlp_part(x, w1_base, b1_base, w2_base, m0, dd, d_ok, cols, c_ok, M, stride_1d, stride_1m, stride_bm,
              stride_2m, stride_2k, W2_TY: tl.constexpr, PREC1: tl.constexpr, PREC2: tl.constexpr,
              BLOCK_K: tl.constexpr):
    """SiLU(x @ w1[:, units] + b1[units]) @ w2[units, cols] for the BLOCK_K hidden units from m0: fp32 [rows, cols]."""
    mm = m0 + tl.arange(0, BLOCK_K)
    m_ok = mm < M
    w1 = tl.load(w1_base + dd[:, None] * stride_1d + mm[None, :] * stride_1m, mask=d_ok[:, None] & m_ok[None, :],
                 other=0.0)
    bias = tl.load(b1_base + mm * stride_bm, mask=m_ok, other=0.0).to(tl.float32)
    hid = tl.dot(x, w1, input_precision=PREC1) + bias[None, :]  # padded units: SiLU(0) = 0
    hid = hid * tl.sigmoid(hid)
    w2 = tl.load(w2_base + mm[:, None] * stride_2m + cols[None, :] * stride_2k, mask=m_ok[:, None] & c_ok[None, :],
                 other=0.0)  # padded bits: acc 0, bit 0
    return tl.dot(hid.to(W2_TY), w2, input_precision=PREC2)


@triton.jit
def _pack_store(acc, o_row, r_ok, q_ok, margin, nc, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, W: tl.constexpr,
                NBITS: tl.constexpr, CARE: tl.constexpr):
    """The bits 1[acc > 0] of chunk nc (BLOCK_N bits), packed 16 a word, stored at the rows' pointers o_row; with
    CARE (the chunk is the whole row) the query rows q_ok also store their care bits |acc| > margin · rms(acc) in
    the W words after."""
    w = nc * (BLOCK_N // 16) + tl.arange(0, BLOCK_N // 16)
    tl.store(o_row[:, None] + w[None, :], _pack_bits(acc > 0, BLOCK_M, BLOCK_N), mask=r_ok[:, None] & (w < W)[None, :])
    if CARE:  # padded columns hold 0: they add nothing to the sum and are never cared for
        rms = tl.sqrt(tl.sum(acc * acc, axis=1) / NBITS)
        care = tl.abs(acc) > (margin * rms)[:, None]
        tl.store(o_row[:, None] + W + w[None, :], _pack_bits(care, BLOCK_M, BLOCK_N),
                 mask=q_ok[:, None] & (w < W)[None, :])


@triton.jit
def _pack_bits(flags, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """bool [BLOCK_M, BLOCK_N] -> int16 words [BLOCK_M, BLOCK_N / 16], flag j at bit j % 16 of word j // 16."""
    slot = tl.arange(0, 16)
    bits = tl.reshape(flags.to(tl.int32), [BLOCK_M, BLOCK_N // 16, 16])  # column w·16 + j: word w, bit j
    word = tl.sum(bits << slot[None, None, :], axis=2)  # disjoint bits: sum == or
    return tl.where(word >= 32768, word - 65536, word).to(tl.int16)  # the int16 with the same bits


def _check(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor | None,
           w2: torch.Tensor | None) -> tuple[int, int, int]:
    """(Hkv, M, nbits) (M = 0: a linear hash), after the reference's shape checks and the kernel's dtypes and
    devices (host metadata)."""
    for name, t in (("x", x), ("w1", w1), ("b1", b1), ("w2", w2)):
        if t is None:
            continue
        if t.dtype not in _FLOATS:
            raise ValueError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")
    Hkv, M, nbits = _mlp_hash_shapes(x, w1, b1, w2)
    if M < 1 and w2 is not None:
        raise ValueError(f"w1 {tuple(w1.shape)} has no intermediate units")
    return Hkv, M, nbits


def _prec(dtype: torch.dtype, precision: str) -> str:
    return precision if dtype == torch.float32 else "tf32"  # ignored for 16-bit operands (native tensor cores)


def mlp_hash_pack_into(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor | None, w2: torch.Tensor | None,
                       out_words: torch.Tensor, start: int | torch.Tensor, *, precision: str = "ieee",
                       block_m: int | None = None, block_k: int | None = None, block_n: int | None = None,
                       num_warps: int | None = None, split: bool | None = None,
                       append: PendingHash | None = None, margin: float | None = None) -> None:
    """The hash codes of x [B, H, n, D] written into out_words[:, :, start:start + n] in place.

    out_words: int16 [B, H, Lmax, ceil(nbits / 16)] with contiguous words (the cache state; other slots are not
    touched); with `margin`, [B, H, Lmax, 2 ceil(nbits / 16)]: ternary codes, each row's sign words then its care
    words, 1 where |y| > margin · rms(y) over the row's bits (reference.query_care_reference; the appended keys'
    codes stay binary), a row's bits then taken in one chunk (block_n >= nbits) for its root mean square.
    start: an int, or a device integer tensor [B] of each batch row's first slot (a decode step: rows
    [start[b], start[b] + n); not range-checked: no host read). w1 [Hkv, D, M], b1 [Hkv, M], w2 [Hkv, M, nbits]:
    fp32 or 16-bit, any strides; H a multiple of Hkv (head h uses KV head h // (H // Hkv)'s weights). b1 and w2
    None: the linear hash sign(x @ w1), w1 [Hkv, D, nbits] (LSH's hyperplanes).
    precision: the dots' input precision when a weight is fp32 ("tf32", "tf32x3" or "ieee"; CUDA only, the
    interpreter computes in fp32). Tuning knobs (powers of two >= 16): block_m rows, block_k intermediate units,
    block_n output bits per chunk; num_warps (default 8 from 64 rows up, else 4); split (default: on a GPU when
    the row blocks alone would give fewer programs than it has multiprocessors, e.g. a decode step): the hidden
    units are split over programs in chunks of block_k, whose partial sums the last one to finish adds up and
    packs. Same bits as mlp_hash_pack_into_reference up to pre-sign values within rounding of 0.
    append: a decode step's new keys (PendingHash: k [B, Hkv, 1, D] into its codes at device slots [B]), hashed
    with the same weights in the same launch, as extra rows of each KV head's programs.
    """
    Hkv, M, nbits = _check(x, w1, b1, w2)
    if precision not in _PRECISIONS:
        raise ValueError(f"precision must be one of {_PRECISIONS}, got {precision!r}")
    check_margin(margin)
    B, H, n, D = x.shape
    W = triton.cdiv(nbits, 16)
    WO = 2 * W if margin is not None else W
    if (out_words.dtype != torch.int16 or out_words.dim() != 4 or tuple(out_words.shape[:2]) != (B, H)
            or out_words.shape[3] != WO or out_words.stride(-1) != 1 or out_words.device != x.device):
        raise ValueError(f"out_words must be int16 [{B}, {H}, Lmax, {WO}] on {x.device} with contiguous words, "
                         f"got {out_words.dtype} {tuple(out_words.shape)} on {out_words.device}")
    row_start = isinstance(start, torch.Tensor)
    if row_start and (start.shape != (B,) or start.device != x.device or start.is_floating_point()
                      or start.is_complex()):
        raise ValueError(f"start must be an int or an integer tensor [{B}] on {x.device}, "
                         f"got {start.dtype} {tuple(start.shape)} on {start.device}")
    if not row_start and (not 0 <= start or start + n > out_words.shape[2]):
        raise ValueError(f"positions [{start}, {start + n}) do not fit out_words of length {out_words.shape[2]}")
    if n == 0 or B == 0:
        return
    G = H // Hkv
    rows = B * G * n  # a KV head's rows: every batch row's query group x the n positions
    if append is not None:
        _check_append(append, B, Hkv, D, W, x.device)
        rows += B  # and each batch row's new key
    linear = w2 is None
    # below 64 rows a linear hash takes them in one program (a batch's decode rows of a KV head); an MLP keeps 16
    # a program, so that a batch's rows spread over more programs beside the split of its hidden units
    BLOCK_M = block_m or (64 if rows >= 64 else max(16, triton.next_power_of_2(rows)) if linear else 16)
    BLOCK_K = block_k or max(16, min(32 if w1.dtype == torch.float32 else 64, triton.next_power_of_2(max(M, 1))))
    # a linear hash's chunks of bits are independent dots: 16 bits a program spreads a decode step's few rows
    # over more programs; an MLP's chunks would each recompute the hidden layer, so a few rows split its hidden
    # units over programs instead (`split`)
    BLOCK_N = block_n or max(16, min(16 if linear else 128, triton.next_power_of_2(nbits)))
    if margin is not None:  # the care bits need the row's root mean square over all its bits
        if block_n and block_n < nbits:
            raise ValueError(f"margin needs every bit in one chunk: block_n >= {nbits}, got {block_n}")
        BLOCK_N = max(BLOCK_N, triton.next_power_of_2(nbits))
    m_blocks = triton.cdiv(rows, BLOCK_M)
    can_split = not linear and triton.next_power_of_2(nbits) <= BLOCK_N and M > BLOCK_K
    if split is None:  # too few programs to fill the GPU otherwise (a decode step: one row block per KV head)
        split = can_split and x.is_cuda and m_blocks * Hkv < num_sms(x.device)
    if split and not can_split:
        raise ValueError("split needs an MLP hash whose bits fit one chunk (block_n) and more than block_k units")
    chunks = triton.cdiv(M, BLOCK_K) if split else triton.cdiv(nbits, BLOCK_N)
    scr, cnt = _split_scratch(x.device, m_blocks * Hkv, chunks, BLOCK_M, BLOCK_N) if split else (x, out_words)
    b1_, w2_ = (w1[:, 0], w1) if linear else (b1, w2)  # unread placeholders of a linear hash
    a = append or PendingHash(x, out_words, out_words)  # unread placeholders without keys
    _mlp_hash_kernel[(m_blocks, Hkv, chunks)](
        x, w1, b1_, w2_, out_words, start if row_start else out_words, scr, cnt, n, G, B,
        0 if row_start else start, float(margin or 0.0),
        x.stride(0), x.stride(1), x.stride(2), x.stride(3),
        w1.stride(0), w1.stride(1), w1.stride(2), b1_.stride(0), b1_.stride(1), w2_.stride(0), w2_.stride(1),
        w2_.stride(2), out_words.stride(0), out_words.stride(1), out_words.stride(2),
        a.k, a.codes, a.slots, a.k.stride(0), a.k.stride(1), a.k.stride(3), a.codes.stride(0), a.codes.stride(1),
        a.codes.stride(2),
        D=D, M=M, NBITS=nbits, W=W, PREC1=_prec(w1.dtype, precision), PREC2=_prec(w2_.dtype, precision),
        BLOCK_M=BLOCK_M, BLOCK_D=max(16, triton.next_power_of_2(D)), BLOCK_K=BLOCK_K, BLOCK_N=BLOCK_N,
        ROW_START=row_start, LINEAR=linear, SPLIT=bool(split), WITH_KEYS=append is not None,
        CARE=margin is not None,
        num_warps=num_warps or (8 if BLOCK_M >= 64 else 4), **dependent_launch(x.device),
    )


def _check_append(a: PendingHash, B: int, Hkv: int, D: int, W: int, device: torch.device) -> None:
    if a.k.dim() != 4 or tuple(a.k.shape) != (B, Hkv, 1, D) or a.k.device != device or a.k.dtype not in _FLOATS:
        raise ValueError(f"append.k must be a float tensor [{B}, {Hkv}, 1, {D}] on {device}, got {a.k.dtype} "
                         f"{tuple(a.k.shape)} on {a.k.device}")
    check_pending(a.codes, a.slots, B, Hkv, W, device)


_SCRATCH: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _split_scratch(device: torch.device, blocks: int, chunks: int, block_m: int, block_n: int):
    """(partial sums fp32, arrival counts int32 zeroed) of a split launch, cached per shape: the kernel leaves the
    counts at zero, so a captured graph replays with no memset. Calls that share them must be ordered (one stream
    or one graph), as the decode step's are."""
    key = (device, blocks, chunks, block_m, block_n)
    if key not in _SCRATCH:
        _SCRATCH[key] = (torch.empty(blocks * chunks * block_m * block_n, dtype=torch.float32, device=device),
                         torch.zeros(blocks, dtype=torch.int32, device=device))
    return _SCRATCH[key]


def mlp_hash_pack(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor | None = None,
                  w2: torch.Tensor | None = None, *, margin: float | None = None, **tuning) -> torch.Tensor:
    """Fused MLP hash + sign + pack: x [B, H, n, D] -> int16 words [B, H, n, ceil(nbits / 16)], twice the words
    with `margin` (ternary: signs, then care words); see mlp_hash_pack_into for the weights, `append` and
    `tuning`."""
    _, _, nbits = _check(x, w1, b1, w2)
    B, H, n, _ = x.shape
    W = triton.cdiv(nbits, 16) * (1 if margin is None else 2)
    out = torch.empty(B, H, n, W, dtype=torch.int16, device=x.device)
    mlp_hash_pack_into(x, w1, b1, w2, out, 0, margin=margin, **tuning)
    return out
