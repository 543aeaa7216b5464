"""Spotlight Attention's MLP hash in Triton (§3.2 eq. 5-6): H(x) = sign(W2 · SiLU(W1 x + b1)), packed 16 bits per
int16 word in the layout of the 1-bit codes (kernels/reference.py::code_pack_reference, bits=1), so that the Hamming
kernels of `codes.py` (code_scores / code_topk with bits=1, metric "l1": xor + popcount) score them.

mlp_hash_pack(_into)  one fused pass per (batch, KV head, block of rows): a program loads its rows of x (a KV head's
                      keys, or the query heads of its GQA group: rows (g, i) flattened, so a decode step's queries
                      read their KV head's weights once per program), then, per chunk of BLOCK_N output bits and of
                      BLOCK_K intermediate units, hid = SiLU(x @ W1[:, chunk] + b1[chunk]) (tl.dot, fp32
                      accumulate, bias and SiLU in fp32) and acc += hid @ W2[chunk, bits] (tl.dot): the
                      intermediate activations never leave registers. The bits 1[acc > 0], reshaped
                      [rows, BLOCK_N / 16, 16], are shifted to their positions and summed into words, stored
                      straight into the code buffer at the given rows or per-row device slots.

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
memory <= 128 KB: BLOCK_M 64 rows with 8 warps
(16 rows, 4 warps below 64 rows: a decode step), BLOCK_K 64 intermediate units for 16-bit weights and 32 for fp32
ones (fp32 tiles take twice the shared memory), BLOCK_N min(128, next_pow2(nbits)); 4 warps at 64 rows spill.

Reference: kernels/reference.py::mlp_hash_pack_reference, mlp_hash_pack_into_reference (mlp_hash_reference: the
pre-sign values).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference import _mlp_hash_shapes

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_PRECISIONS = ("tf32", "tf32x3", "ieee")


@triton.jit
def _mlp_hash_kernel(X, W1, B1, W2, OUT, START, n, G, Hkv, start,
                     stride_xb, stride_xh, stride_xn, stride_xd,
                     stride_1h, stride_1d, stride_1m, stride_bh, stride_bm, stride_2h, stride_2m, stride_2k,
                     stride_ob, stride_oh, stride_on,
                     D: tl.constexpr, M: tl.constexpr, NBITS: tl.constexpr, W: tl.constexpr,
                     PREC1: tl.constexpr, PREC2: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                     N_NC: tl.constexpr, ROW_START: tl.constexpr):
    pid_m = tl.program_id(0)
    bk = tl.program_id(1)
    b = (bk // Hkv).to(tl.int64)
    kv = bk % Hkv
    r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # flattened (g, i): query head kv·G + g, row i
    r_ok = r < G * n
    g = r // n
    i = r % n
    h = (kv * G + g).to(tl.int64)
    if ROW_START:  # each batch row's first slot, read on the device (a graph-replayed decode step)
        start = tl.load(START + b).to(tl.int64)
    dd = tl.arange(0, BLOCK_D)
    d_ok = dd < D
    x = tl.load(X + b * stride_xb + h[:, None] * stride_xh + i[:, None] * stride_xn + dd[None, :] * stride_xd,
                mask=r_ok[:, None] & d_ok[None, :], other=0.0).to(W1.dtype.element_ty)
    w1_base = W1 + kv * stride_1h
    b1_base = B1 + kv * stride_bh
    w2_base = W2 + kv * stride_2h
    o_row = OUT + b * stride_ob + h * stride_oh + (start + i) * stride_on  # [BLOCK_M] pointers
    slot = tl.arange(0, 16)
    for nc in tl.static_range(N_NC):  # chunks of BLOCK_N bits (one for nbits <= 128)
        cols = nc * BLOCK_N + tl.arange(0, BLOCK_N)
        c_ok = cols < NBITS
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for m0 in range(0, M, BLOCK_K):
            mm = m0 + tl.arange(0, BLOCK_K)
            m_ok = mm < M
            w1 = tl.load(w1_base + dd[:, None] * stride_1d + mm[None, :] * stride_1m,
                         mask=d_ok[:, None] & m_ok[None, :], other=0.0)
            bias = tl.load(b1_base + mm * stride_bm, mask=m_ok, other=0.0).to(tl.float32)
            hid = tl.dot(x, w1, input_precision=PREC1) + bias[None, :]  # padded units: SiLU(0) = 0
            hid = hid * tl.sigmoid(hid)
            w2 = tl.load(w2_base + mm[:, None] * stride_2m + cols[None, :] * stride_2k,
                         mask=m_ok[:, None] & c_ok[None, :], other=0.0)  # padded bits: acc 0, bit 0
            acc = tl.dot(hid.to(W2.dtype.element_ty), w2, acc, input_precision=PREC2)
        bits = tl.reshape((acc > 0).to(tl.int32), [BLOCK_M, BLOCK_N // 16, 16])  # column w·16 + j: word w, bit j
        word = tl.sum(bits << slot[None, None, :], axis=2)  # disjoint bits: sum == or
        word = tl.where(word >= 32768, word - 65536, word)  # the int16 with the same bits
        w = nc * (BLOCK_N // 16) + tl.arange(0, BLOCK_N // 16)
        tl.store(o_row[:, None] + w[None, :], word.to(tl.int16), mask=r_ok[:, None] & (w < W)[None, :])


def _check(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor) -> tuple[int, int, int]:
    """(Hkv, M, nbits), after the reference's shape checks and the kernel's dtypes and devices (host metadata)."""
    for name, t in (("x", x), ("w1", w1), ("b1", b1), ("w2", w2)):
        if t.dtype not in _FLOATS:
            raise ValueError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")
    Hkv, M, nbits = _mlp_hash_shapes(x, w1, b1, w2)
    if M < 1:
        raise ValueError(f"w1 {tuple(w1.shape)} has no intermediate units")
    return Hkv, M, nbits


def _prec(dtype: torch.dtype, precision: str) -> str:
    return precision if dtype == torch.float32 else "tf32"  # ignored for 16-bit operands (native tensor cores)


def mlp_hash_pack_into(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor,
                       out_words: torch.Tensor, start: int | torch.Tensor, *, precision: str = "ieee",
                       block_m: int | None = None, block_k: int | None = None, block_n: int | None = None,
                       num_warps: int | None = None) -> None:
    """The hash codes of x [B, H, n, D] written into out_words[:, :, start:start + n] in place.

    out_words: int16 [B, H, Lmax, ceil(nbits / 16)] with contiguous words (the cache state; other slots are not
    touched). start: an int, or a device integer tensor [B] of each batch row's first slot (a decode step: rows
    [start[b], start[b] + n); not range-checked: no host read). w1 [Hkv, D, M], b1 [Hkv, M], w2 [Hkv, M, nbits]:
    fp32 or 16-bit, any strides; H a multiple of Hkv (head h uses KV head h // (H // Hkv)'s weights).
    precision: the dots' input precision when a weight is fp32 ("tf32", "tf32x3" or "ieee"; CUDA only, the
    interpreter computes in fp32). Tuning knobs (powers of two >= 16): block_m rows, block_k intermediate units,
    block_n output bits per chunk; num_warps (default 8 from 64 rows up, else 4). Same bits as
    mlp_hash_pack_into_reference up to pre-sign values within rounding of 0.
    """
    Hkv, M, nbits = _check(x, w1, b1, w2)
    if precision not in _PRECISIONS:
        raise ValueError(f"precision must be one of {_PRECISIONS}, got {precision!r}")
    B, H, n, D = x.shape
    W = triton.cdiv(nbits, 16)
    if (out_words.dtype != torch.int16 or out_words.dim() != 4 or tuple(out_words.shape[:2]) != (B, H)
            or out_words.shape[3] != W or out_words.stride(-1) != 1 or out_words.device != x.device):
        raise ValueError(f"out_words must be int16 [{B}, {H}, Lmax, {W}] on {x.device} with contiguous words, "
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
    rows = G * n  # a program's rows: its KV head's query group x the n positions
    BLOCK_M = block_m or (64 if rows >= 64 else 16)
    BLOCK_K = block_k or max(16, min(32 if w1.dtype == torch.float32 else 64, triton.next_power_of_2(M)))
    BLOCK_N = block_n or max(16, min(128, triton.next_power_of_2(nbits)))
    grid = (triton.cdiv(rows, BLOCK_M), B * Hkv)
    _mlp_hash_kernel[grid](
        x, w1, b1, w2, out_words, start if row_start else out_words, n, G, Hkv, 0 if row_start else start,
        x.stride(0), x.stride(1), x.stride(2), x.stride(3),
        w1.stride(0), w1.stride(1), w1.stride(2), b1.stride(0), b1.stride(1), w2.stride(0), w2.stride(1),
        w2.stride(2), out_words.stride(0), out_words.stride(1), out_words.stride(2),
        D=D, M=M, NBITS=nbits, W=W, PREC1=_prec(w1.dtype, precision), PREC2=_prec(w2.dtype, precision),
        BLOCK_M=BLOCK_M, BLOCK_D=max(16, triton.next_power_of_2(D)), BLOCK_K=BLOCK_K, BLOCK_N=BLOCK_N,
        N_NC=triton.cdiv(nbits, BLOCK_N), ROW_START=row_start, num_warps=num_warps or (8 if BLOCK_M >= 64 else 4),
    )


def mlp_hash_pack(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor,
                  **tuning) -> torch.Tensor:
    """Fused MLP hash + sign + pack: x [B, H, n, D] -> int16 words [B, H, n, ceil(nbits / 16)]
    (see mlp_hash_pack_into for the weights and `tuning`)."""
    _, _, nbits = _check(x, w1, b1, w2)
    B, H, n, _ = x.shape
    out = torch.empty(B, H, n, triton.cdiv(nbits, 16), dtype=torch.int16, device=x.device)
    mlp_hash_pack_into(x, w1, b1, w2, out, 0, **tuning)
    return out
