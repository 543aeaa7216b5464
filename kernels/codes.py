"""Packed-code kernels in Triton: Adamas' bucket codes (its Algorithm 1, lines 1-3 and 5) and LSH's sign bits.

quantize_pack(_into)  Hadamard transform + bucketize + pack, fused: one program per (batch, head, block of rows)
                      multiplies its rows by the ±1 Hadamard matrix whose columns were permuted beforehand so that
                      output column w·PW2 + i is dimension w·PW + i (PW codes per word, PW2 its next power of two,
                      padded columns zero). The fp32 result, reshaped [rows, words, PW2], is compared with the
                      thresholds and each code shifted to bit `bits·i` and summed: the words come out of registers
                      with no intermediate tensor in memory. Keys are written straight into the cache state; a
                      decode step's key rides in its query's launch (`append`: programs past the query rows).
code_distance         Σ_dims |qc - kc| (or (qc - kc)²) of each query's codes against the first `length` keys' codes.
code_scores           the same, negated (higher = closer) in fp16/fp32 for the shared top-k, optionally pooled over
                      the GQA group, so the selection needs no separate pooling pass.
code_topk             the k nearest keys' indices: the distances as int16, then the counting select
                      (`count_select.py`): integer distances tie massively, which counting handles exactly and fast.

Code layout (kernels/reference.py is the spec): code i of a word's group at bits [bits·i, bits·(i+1)); 16 codes per
int16 for bits=1, 8 for bits=2, 5 for bits=3 (bit 15 unused); code = number of thresholds strictly below the value.

The 2-bit L1 fast path (the paper's configuration). For codes a, b in {0..3}, |a - b| = Σ_t [a > t] xor [b > t]
(thermometer code), and the three thermometer bits of every 2-bit field are (hi | lo), hi, (hi & lo). On CUDA
(`popc=2`, the default) the words are read as int64 lanes (four int16 words, 32 codes; int32 lanes of 16 codes when
the word count is only even, int16 words when odd). Of each int32 half, two planes: a = [>0] at even bits | [>1] at
odd bits and b = [>2] at even bits; the two halves' b share one word (even / odd bits). The distance of the 32 codes
is then the number of bits set in x1 = a0 ^ a0', x2 = a1 ^ a1', x3 = b ^ b' together, which a carry-save adder turns
into two POPCs: ones = x1 ^ x2 ^ x3 and twos = majority = ((x1 ^ x3) & (x2 ^ x3)) ^ x3, counted as ones + 2·twos. Xor
being linear, the key's a0 ^ a1 ^ b, a0 ^ b, a1 ^ b and b are made once per key tile for the whole query group, and
each query head costs 5 xors, an and, 2 POPCs, a shift and an add per 32 codes. `popc=1` counts each int32 lane's
two planes with a POPC each. The interpreter (no PTX) and `popc=0` keep the SWAR path: a lane's 16 distances are
three xors and one add (each 2-bit field holds a sum <= 3, no carry), then a SWAR horizontal sum (2 -> 4 -> 8 bits,
bytes summed over the row, then 8 -> 32 bits once per key), ~12 integer ops per 16 codes and query head. Either way
the query heads of a group loop over the key tile loaded once (GQA: each KV head's words are read once). Other
(bits, metric) unpack the key tile once into codes [keys, words, PW2] and take |d| or d² code by code (the ablations:
correct, not tuned), except 1-bit codes: their L1 (= L2) distance is the Hamming distance, a POPC of each lane's xor
on CUDA (a SWAR popcount into per-byte counts in the interpreter; the SimHash codes of the `lsh` method, 128 bits).
1-bit codes also take ternary queries: q_words of 2W words, the sign words then the care words (hash_mlp.py,
`margin`); each xor is ANDed with the care lanes before its count, so a bit the query does not care for counts for no
key (the GQA group's heads each with their own).

H100 (CUDA-graph replay; 131072 keys x 8 KV heads x 16 words, D 128: 33.5 MB read, ~11 µs at 3 TB/s; 4 query
heads per KV head). The SWAR path is compute-bound (~470 integer ops per key against Hopper's 64 INT32
lanes/SM/clock): 42.2 µs per query head (int16 out), 40.4 pooled. POPC runs beside the integer
pipe: one per int32 plane 27.0 / 24.0, the int64 pairs 19.4 / 16.9 (32768 keys: 11.9 -> 6.1, 11.2 -> 5.4). 1-bit
(LSH, 8 words): 19.5 -> 10.9 per query head, 18.5 -> 8.5 pooled. Per-query-head int32 output would add 16.8 MB of
writes, which is why code_scores(pool=...) writes one row per KV head instead.

References: kernels/reference.py::code_bucketize_reference, code_pack_reference, code_distance_reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import count_select
from .hadamard import _prec, hadamard_signs
from .reference import PendingCodes, RowBounds, _per_word, check_pending, hadamard_matrix
from .device import dependent_launch, wait_for_prior
from .region import in_sparse_region

_POOLS = {None: 0, "sum": 1, "min": 2}


# --------------------------------------------------------------------------------------------------------------
# quantize + pack


@triton.jit
def _quantize_pack_kernel(X, S, TH, OUT, n, H, rep, start, START, scale,
                          stride_xb, stride_xh, stride_xn, stride_ob, stride_oh, stride_on, stride_th,
                          KX, KTH, KOUT, KSLOT, BH, HK, krep, stride_kxb, stride_kxh, stride_kob, stride_koh,
                          stride_kon, stride_kth,
                          D: tl.constexpr, W: tl.constexpr, BITS: tl.constexpr, PW: tl.constexpr,
                          PW2: tl.constexpr, T: tl.constexpr, TRANSFORM: tl.constexpr, PREC: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_WC: tl.constexpr,
                          N_WC: tl.constexpr, ROW_START: tl.constexpr = False, WITH_KEYS: tl.constexpr = False,
                          PDL: tl.constexpr = 0):
    wait_for_prior(PDL)
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    r_ok = rows < n
    x_base = X + b * stride_xb + h * stride_xh
    if ROW_START:  # each batch row's first position, read on the device (a graph-replayed decode step)
        start = tl.load(START + b).to(tl.int64)
    o_base = OUT + b * stride_ob + h * stride_oh + start * stride_on
    th_base = TH + (h // rep) * stride_th
    if WITH_KEYS:  # the programs past the BH query rows code a decode step's key each (one row) into its cache slot
        if bh >= BH:
            kb = (bh - BH) // HK
            kh = (bh - BH) % HK
            x_base = KX + kb * stride_kxb + kh * stride_kxh
            o_base = KOUT + kb * stride_kob + kh * stride_koh + tl.load(KSLOT + kb).to(tl.int64) * stride_kon
            th_base = KTH + (kh // krep) * stride_kth
    slot = tl.arange(0, PW2)
    if TRANSFORM:
        dd = tl.arange(0, BLOCK_D)
        x = tl.load(x_base + rows[:, None] * stride_xn + dd[None, :], mask=r_ok[:, None] & (dd < D)[None, :],
                    other=0.0)
    for wc in tl.static_range(N_WC):
        w = wc * BLOCK_WC + tl.arange(0, BLOCK_WC)
        dim = w[:, None] * PW + slot[None, :]  # [BLOCK_WC, PW2]
        valid = (slot < PW)[None, :] & (dim < D)  # padding codes stay 0
        if TRANSFORM:
            cols = wc * (BLOCK_WC * PW2) + tl.arange(0, BLOCK_WC * PW2)
            s = tl.load(S + dd[:, None] * (N_WC * BLOCK_WC * PW2) + cols[None, :])  # zero-padded: no mask
            y = tl.dot(x, s, input_precision=PREC) * scale  # fp32 [BLOCK_M, BLOCK_WC * PW2]
            y = tl.reshape(y, [BLOCK_M, BLOCK_WC, PW2])
        else:
            y = tl.load(x_base + rows[:, None, None] * stride_xn + dim[None, :, :],
                        mask=r_ok[:, None, None] & valid[None, :, :], other=0.0).to(tl.float32)
        code = tl.zeros([BLOCK_M, BLOCK_WC, PW2], tl.int32)
        for t in tl.static_range(T):
            code += (y > tl.load(th_base + t)).to(tl.int32)  # eq. 5: B(x) = Σ_i 1[x > B_i]
        code = tl.where(valid[None, :, :], code, 0)
        word = tl.sum(code << (slot * BITS)[None, None, :], axis=2)  # disjoint bit fields: sum == or
        word = tl.where(word >= 32768, word - 65536, word)  # the int16 with the same bits
        tl.store(o_base + rows[:, None] * stride_on + w[None, :], word.to(tl.int16),
                 mask=r_ok[:, None] & (w < W)[None, :])


def _layout(D: int, bits: int) -> tuple[int, int, int, int, int]:
    """(PW, PW2, W, BLOCK_WC, N_WC): codes per word, its power of two, words per row, words per chunk, chunks."""
    PW = _per_word(bits)
    PW2 = triton.next_power_of_2(PW)
    W = triton.cdiv(D, PW)
    BLOCK_WC = max(16 // PW2, min(triton.next_power_of_2(W), 128 // PW2))  # a chunk is 16..128 dot columns
    return PW, PW2, W, BLOCK_WC, triton.cdiv(W, BLOCK_WC)


def _permuted_signs(D: int, bits: int, dtype: torch.dtype, device) -> torch.Tensor:
    """±1 Hadamard matrix [BLOCK_D, N_WC·BLOCK_WC·PW2]: column w·PW2 + i is dim w·PW + i (zero where padding).
    The permutation is built only on a cache miss: every appended key asks for the matrix, and building it costs
    ~90 µs."""
    PW, PW2, W, BLOCK_WC, N_WC = _layout(D, bits)
    cols = N_WC * BLOCK_WC * PW2

    def perm() -> torch.Tensor:
        c = torch.arange(cols)
        w, i = c // PW2, c % PW2
        dim = w * PW + i
        return torch.where((i < PW) & (dim < D), dim, -1)

    return hadamard_signs(D, dtype, device, rows=max(16, triton.next_power_of_2(D)), cols=cols, perm=perm,
                          key=("codes", bits))


def _thresholds(thresholds: torch.Tensor, H: int, bits: int, device) -> tuple[torch.Tensor, int, int]:
    """(fp32 contiguous thresholds, row stride, rep): head h reads row h // rep (rep = H // rows), or the one row."""
    T = (1 << bits) - 1
    th = thresholds
    if th.shape[-1] != T or th.dim() not in (1, 2):
        raise ValueError(f"bits={bits} needs thresholds [{T}] or [heads, {T}], got {tuple(th.shape)}")
    if th.dtype != torch.float32 or th.device != device or not th.is_contiguous():
        th = th.to(device=device, dtype=torch.float32).contiguous()  # store them like this to skip the copy
    if th.dim() == 1:
        return th, 0, 1
    if H % th.shape[0]:
        raise ValueError(f"{th.shape[0]} threshold rows do not divide {H} heads")
    return th, th.stride(0), H // th.shape[0]


def _check_x(x: torch.Tensor, what: str) -> None:
    if x.dim() != 4:
        raise ValueError(f"{what} must be [B, H, n, D], got {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"{what} must be float32, float16 or bfloat16, got {x.dtype}")


def quantize_pack_into(x: torch.Tensor, thresholds: torch.Tensor, out_words: torch.Tensor, start: int | torch.Tensor,
                       bits: int = 2, transform: bool = True, *, block_m: int | None = None,
                       num_warps: int = 4, append: PendingCodes | None = None) -> None:
    """Codes of x [B, H, n, D] (Hadamard first if `transform`) packed into out_words[:, :, start:start + n] in place.
    `start`: an int, or a device tensor [B] of each row's first position (not range-checked: no host read).

    out_words: int16 [B, H, Lmax, W] (the cache state; other slots are not touched). thresholds: fp32 [H, 2^bits - 1]
    ascending per head, [Ht, 2^bits - 1] with H % Ht == 0 (head h uses row h // (H // Ht)), or shared [2^bits - 1];
    ±inf allowed. Same codes as code_pack_reference(code_bucketize_reference(hadamard_reference(x)...)), up to
    values within float rounding of a threshold.
    `append` (x one row, n = 1): a decode step's keys [B, Hkv, 1, D], coded into their buffer at their device slots
    in the same launch (extra programs), as quantize_pack_into(append.k, append.thresholds, append.codes,
    append.slots) would.
    """
    _check_x(x, "x")
    B, H, n, D = x.shape
    PW, PW2, W, BLOCK_WC, N_WC = _layout(D, bits)
    if (out_words.dtype != torch.int16 or out_words.dim() != 4 or tuple(out_words.shape[:2]) != (B, H)
            or out_words.shape[3] != W or out_words.stride(-1) != 1):
        raise ValueError(f"out_words must be int16 [{B}, {H}, Lmax, {W}] with contiguous words, "
                         f"got {out_words.dtype} {tuple(out_words.shape)}")
    row_start = isinstance(start, torch.Tensor)
    if row_start and (start.shape != (B,) or start.device != x.device):
        raise ValueError(f"start must be an int or a tensor [{B}] on {x.device}, got {tuple(start.shape)}")
    if not row_start and (not 0 <= start or start + n > out_words.shape[2]):
        raise ValueError(f"positions [{start}, {start + n}) do not fit out_words of length {out_words.shape[2]}")
    if append is not None:  # checked first: it needs one row of x (n = 0 cannot carry it)
        k = append.k
        _check_x(k, "append.k")
        if n != 1 or row_start or k.shape[0] != B or k.shape[2:] != (1, D) or k.dtype != x.dtype:
            raise ValueError(f"append: keys [{B}, Hkv, 1, {D}] of x's dtype beside one row of x written at an int "
                             f"position, got {tuple(k.shape)} {k.dtype} beside x {tuple(x.shape)}")
        check_pending(append.codes, append.slots, B, k.shape[1], W, x.device)
    if n == 0:
        return
    th, stride_th, rep = _thresholds(thresholds, H, bits, x.device)
    if x.stride(-1) != 1:
        x = x.contiguous()
    keys = (x, th, out_words, th, 0, 1, 1) + (0,) * 6  # unread placeholders without `append`
    HK = 0
    if append is not None:
        HK = k.shape[1]
        kth, stride_kth, krep = _thresholds(append.thresholds, HK, bits, x.device)
        if k.stride(-1) != 1:
            k = k.contiguous()
        c = append.codes
        keys = (k, kth, c, append.slots, B * H, HK, krep, k.stride(0), k.stride(1), c.stride(0), c.stride(1),
                c.stride(2), stride_kth)
    if transform:
        hadamard_matrix(D)  # ValueError for unsupported dims
        S = _permuted_signs(D, bits, x.dtype, x.device)
    else:
        S = th  # unused
    BLOCK_M = block_m or (64 if n >= 64 else 16)
    grid = (triton.cdiv(n, BLOCK_M), B * (H + HK))
    _quantize_pack_kernel[grid](
        x, S, th, out_words, n, H, rep, 0 if row_start else start, start if row_start else th, D ** -0.5,
        x.stride(0), x.stride(1), x.stride(2), out_words.stride(0), out_words.stride(1), out_words.stride(2),
        stride_th, *keys,
        D=D, W=W, BITS=bits, PW=PW, PW2=PW2, T=(1 << bits) - 1, TRANSFORM=transform, PREC=_prec(x.dtype),
        BLOCK_M=BLOCK_M, BLOCK_D=max(16, triton.next_power_of_2(D)), BLOCK_WC=BLOCK_WC, N_WC=N_WC,
        ROW_START=row_start, WITH_KEYS=append is not None, num_warps=num_warps, **dependent_launch(x.device),
    )


def quantize_pack(x: torch.Tensor, thresholds: torch.Tensor, bits: int = 2, transform: bool = True,
                  append: PendingCodes | None = None, **tuning) -> torch.Tensor:
    """Fused (Hadamard if `transform`) + bucketize + pack: x [B, H, n, D] -> int16 words [B, H, n, W]. `append`: a
    decode step's keys coded into their cache buffer in the same launch (quantize_pack_into)."""
    _check_x(x, "x")
    B, H, n, D = x.shape
    out = torch.empty(B, H, n, triton.cdiv(D, _per_word(bits)), dtype=torch.int16, device=x.device)
    quantize_pack_into(x, thresholds, out, 0, bits=bits, transform=transform, append=append, **tuning)
    return out


# --------------------------------------------------------------------------------------------------------------
# code distances


@triton.jit
def _l1_2bit_lanes(k_t0, k_t1, k_t2, q):
    """Per-lane sum of |a - b| over the 16 (or 8) 2-bit fields of key lanes, given as their thermometer bit planes
    [>0] = hi | lo, [>1] = hi, [>2] = hi & lo at even positions (made once per key tile, shared by the query
    heads), and one query lane q [BW]: [BL, BW] int32 with one partial sum (<= 12) per byte."""
    q_lo = q & 0x55555555
    q_hi = (q >> 1) & 0x55555555
    s = ((k_t0 ^ (q_hi | q_lo)[None, :]) + (k_t1 ^ q_hi[None, :])
         + (k_t2 ^ (q_hi & q_lo)[None, :]))  # field sum <= 3
    s = (s & 0x33333333) + ((s >> 2) & 0x33333333)  # 4-bit fields <= 6 (the >> may smear the sign into bits 30-31)
    return (s + (s >> 4)) & 0x0F0F0F0F  # bytes <= 12


@triton.jit
def _popc(v):
    """Population count of int32 lanes, one POPC instruction each (CUDA only: the interpreter runs no PTX)."""
    return tl.inline_asm_elementwise("popc.b32 $0, $1;", "=r,r", [v], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _planes(x):
    """Thermometer planes of the 16 two-bit fields of int32 lanes: ([>0] at even bits | [>1] at odd bits, [>2] at
    even bits). |a - b| of two fields is the number of bits set in (a's planes) xor (b's)."""
    lo = x & 0x55555555
    hi = (x >> 1) & 0x55555555  # the >> may smear the sign into bit 31: masked off
    return (hi | lo) | (hi << 1), hi & lo


@triton.jit
def _pair_words(x):
    """int64 lanes (two int32 lanes of 16 two-bit fields each) -> the four words _l1_2bit_pairs needs: with a0, a1
    the lanes' ([>0] | [>1]) planes and b both lanes' [>2] planes in one word (even / odd bits): a0 ^ a1 ^ b,
    a0 ^ b, a1 ^ b, b. Xor is linear, so the key's words are made once per key tile and the query's once per head."""
    a0, b0 = _planes(x.to(tl.int32))
    a1, b1 = _planes((x >> 32).to(tl.int32))
    b = b0 | (b1 << 1)
    return a0 ^ a1 ^ b, a0 ^ b, a1 ^ b, b


@triton.jit
def _l1_2bit_pairs(k_o, k_13, k_23, k_3, q):
    """Σ over lane pairs of the 32 L1 field distances of each pair, with two POPCs: with x1, x2, x3 the three
    planes xor the query's, a carry-save adder gives ones = x1 ^ x2 ^ x3 and twos = majority(x1, x2, x3) =
    ((x1 ^ x3) & (x2 ^ x3)) ^ x3, and ones + 2·twos bits = the bits set in all three. Key words [BL, BW] from
    _pair_words, query lanes q [BW] (int64) -> [BL]."""
    q_o, q_13, q_23, q_3 = _pair_words(q)
    ones = k_o ^ q_o[None, :]
    twos = ((k_13 ^ q_13[None, :]) & (k_23 ^ q_23[None, :])) ^ (k_3 ^ q_3[None, :])
    return tl.sum(_popc(ones) + (_popc(twos) << 1), axis=1)


@triton.jit
def _popcount_bytes(v):
    """Per-byte popcounts (each <= 8) of int32 lanes: SWAR, the masks drop the bits an arithmetic >> smears in."""
    v = v - ((v >> 1) & 0x55555555)
    v = (v & 0x33333333) + ((v >> 2) & 0x33333333)
    return (v + (v >> 4)) & 0x0F0F0F0F


@triton.jit
def _bytes_to_int(acc):
    """Sum of the four bytes of each int32 (each <= 255, all >= 0)."""
    acc = (acc & 0x00FF00FF) + ((acc >> 8) & 0x00FF00FF)
    return (acc & 0xFFFF) + (acc >> 16)


@triton.jit
def _hamming(k, q, m, LANE_BITS: tl.constexpr, POPC: tl.constexpr, BYTE_SUM: tl.constexpr, CARE: tl.constexpr):
    """Hamming distances [BL] of key lanes k [BL, BW] (int32, 16-bit lanes masked to their bits) to query lanes q
    [BW]: a POPC per lane's xor on CUDA, a SWAR popcount into per-byte counts in the interpreter. CARE: only the
    bits set in the query's care lanes m [BW] count (a ternary query)."""
    q = q.to(tl.int32)
    if LANE_BITS == 16:
        q = q & 0xFFFF
    x = k ^ q[None, :]
    if CARE:
        x = x & m.to(tl.int32)[None, :]  # a 16-bit lane's care word sign-extends: k ^ q has no bit above 16
    if POPC:
        dist = tl.sum(_popc(x), axis=1)
    else:
        part = _popcount_bytes(x)
        if BYTE_SUM:  # bytes summed over the row stay <= 255: reduce them once per key
            dist = _bytes_to_int(tl.sum(part, axis=1))
        else:
            dist = tl.sum(_bytes_to_int(part), axis=1)
    return dist


@triton.jit
def _fields(words, BITS: tl.constexpr, PW: tl.constexpr, PW2: tl.constexpr):
    """16-bit words [..., BW] (>= 0) -> their codes [..., BW, PW2] (slots >= PW read 0)."""
    slot = tl.arange(0, PW2)
    f = (tl.expand_dims(words, -1) >> (slot * BITS)) & ((1 << BITS) - 1)
    return tl.where(slot < PW, f, 0)


@triton.jit
def _dist_generic(kf, q, BITS: tl.constexpr, PW: tl.constexpr, PW2: tl.constexpr, L2: tl.constexpr):
    """Σ over fields of |kc - qc| or (kc - qc)²: key codes kf [BL, BW, PW2], query words q [BW] (16 bits, >= 0)."""
    d = kf - _fields(q, BITS, PW, PW2)[None, :, :]
    if L2:
        d = d * d
    else:
        d = tl.abs(d)
    return tl.sum(tl.sum(d, axis=2), axis=1)


@triton.jit
def _key_prep(k, FAST: tl.constexpr, HAMMING: tl.constexpr, LANE_BITS: tl.constexpr, POPC: tl.constexpr,
              BITS: tl.constexpr, PW: tl.constexpr, PW2: tl.constexpr):
    """A key tile's words k [BL, BW] as loaded, made into what _distance_to reads (four tensors, by path), once for
    every query head that reads them: int64 lane pairs' four words (_pair_words); POPC planes; SWAR thermometer
    planes; Hamming lanes; or the unpacked codes [BL, BW, PW2] of the other (bits, metric)."""
    if LANE_BITS == 64:
        a, b, c, d = _pair_words(k)
    elif FAST or HAMMING:
        k = k.to(tl.int32)
        if LANE_BITS == 16:
            k = k & 0xFFFF  # int16 words sign-extend: keep their 16 bits only
        if FAST and POPC:
            a, b = _planes(k)
            c, d = a, b
        elif FAST:
            lo = k & 0x55555555
            hi = (k >> 1) & 0x55555555
            a, b, c, d = hi | lo, hi, hi & lo, k
        else:
            a, b, c, d = k, k, k, k
    else:
        a = _fields(k.to(tl.int32) & 0xFFFF, BITS, PW, PW2)
        b, c, d = a, a, a
    return a, b, c, d


@triton.jit
def _distance_to(a, b, c, d, q, m, FAST: tl.constexpr, HAMMING: tl.constexpr, LANE_BITS: tl.constexpr,
                 POPC: tl.constexpr, BYTE_SUM: tl.constexpr, BITS: tl.constexpr, PW: tl.constexpr,
                 PW2: tl.constexpr, L2: tl.constexpr, CARE: tl.constexpr = False):
    """Distances [BL] of the keys _key_prep made (a, b, c, d) to one query's words q [BW] as loaded (and, CARE:
    1-bit codes, its care words m [BW])."""
    if LANE_BITS == 64:
        dist = _l1_2bit_pairs(a, b, c, d, q)
    elif FAST:
        q = q.to(tl.int32)
        if LANE_BITS == 16:
            q = q & 0xFFFF
        if POPC:
            q_a, q_b = _planes(q)
            dist = tl.sum(_popc(a ^ q_a[None, :]) + _popc(b ^ q_b[None, :]), axis=1)
        else:
            part = _l1_2bit_lanes(a, b, c, q)
            if BYTE_SUM:  # bytes summed over the row stay <= 255: reduce them once per key
                dist = _bytes_to_int(tl.sum(part, axis=1))
            else:
                dist = tl.sum(_bytes_to_int(part), axis=1)
    elif HAMMING:
        dist = _hamming(a, q, m, LANE_BITS, POPC, BYTE_SUM, CARE)
    else:
        dist = _dist_generic(a, q.to(tl.int32) & 0xFFFF, BITS, PW, PW2, L2)
    return dist


# A block's candidate packs a query head's smallest distance in it with that key's place in the block:
# (distance << 13) | local, local counted from the block's end with ties to the higher index, so the smaller int32 is
# the better key; 0x7FFFFFFF: no valid key.
_LOCAL_BITS = 13


@triton.jit
def _order_keys(dist, at, TIES_HIGH: tl.constexpr):
    """int64 keys ordered as the select orders keys: distance, then the tie rule (the higher index first)."""
    order = (2147483647 - at) if TIES_HIGH else at
    return (dist.to(tl.int64) << 32) | order.to(tl.int64)


@triton.jit
def _index_of(key, TIES_HIGH: tl.constexpr):
    low = (key & 0xFFFFFFFF).to(tl.int32)
    return (2147483647 - low) if TIES_HIGH else low


@triton.jit
def _block_keys(CAND, i, n_blocks, BLOCK_L: tl.constexpr, TIES_HIGH: tl.constexpr):
    """Blocks i's candidates as _order_keys of their keys (2^62: none, or past n_blocks)."""
    v = tl.load(CAND + i, mask=i < n_blocks, other=0x7FFFFFFF)
    tb = v & ((1 << 13) - 1)
    key = _order_keys(v >> 13, i * BLOCK_L + ((BLOCK_L - 1 - tb) if TIES_HIGH else tb), TIES_HIGH)
    return tl.where(v != 0x7FFFFFFF, key, 1 << 62)


# sizes that move with a row's length: not specialised (kernels/topk/fused.py, PLAN_SCALARS)
@triton.jit(do_not_specialize=["n_blocks", "ks", "below", "STRIDE"])
def _force_head_top_kernel(CAND, QW, KW, DIST, n_blocks, length, Hkv,
                           stride_qb, stride_qh, stride_kb, stride_kh, stride_kn, stride_db, stride_dh,
                           LENS, span, sink, window, lo,
                           D, GH, STATE, N, ks, below, stride_d, STRIDE, base_rows,
                           G: tl.constexpr, M: tl.constexpr, NW: tl.constexpr, LANE_BITS: tl.constexpr,
                           POPC: tl.constexpr, BYTE_SUM: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_W: tl.constexpr,
                           BLOCK_C: tl.constexpr, M_P2: tl.constexpr, TIES_HIGH: tl.constexpr,
                           BOUNDS: tl.constexpr, FAST: tl.constexpr = False, BASE: tl.constexpr = False,
                           S: tl.constexpr = 1, SHIFT: tl.constexpr = 0, VMAX: tl.constexpr = 1,
                           NB2: tl.constexpr = 32, FORCE_MISS: tl.constexpr = False, CARE: tl.constexpr = False,
                           PDL: tl.constexpr = 0):
    """Programs [0, B * Hq) force each query head's nearest keys (_force_head_top); the last `base_rows` run the
    counting select's first step for their row (BASE; count_select._window_base, its arguments D .. STRIDE and the
    constexprs from S on): the two are independent, so one launch holds both and the select has one launch fewer.
    The sample the base step reads may or may not see the zeros written beside it: that moves the select's window,
    never what it selects."""
    wait_for_prior(PDL)
    row = tl.program_id(0)
    n_force = tl.num_programs(0) - base_rows
    if row < n_force:
        _force_head_top(CAND, QW, KW, DIST, n_blocks, length, Hkv, stride_qb, stride_qh, stride_kb, stride_kh,
                        stride_kn, stride_db, stride_dh, LENS, span, sink, window, lo, row, G, M, NW, LANE_BITS,
                        POPC, BYTE_SUM, BLOCK_L, BLOCK_W, BLOCK_C, M_P2, TIES_HIGH, BOUNDS, FAST, CARE)
    elif BASE:
        count_select._window_base(D, GH, STATE, N, ks, below, stride_d, STRIDE, row - n_force, S, SHIFT, VMAX, NB2,
                                  FORCE_MISS)


@triton.jit
def _force_head_top(CAND, QW, KW, DIST, n_blocks, length, Hkv,
                    stride_qb, stride_qh, stride_kb, stride_kh, stride_kn, stride_db, stride_dh,
                    LENS, span, sink, window, lo, row,
                    G: tl.constexpr, M: tl.constexpr, NW: tl.constexpr, LANE_BITS: tl.constexpr,
                    POPC: tl.constexpr, BYTE_SUM: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_W: tl.constexpr,
                    BLOCK_C: tl.constexpr, M_P2: tl.constexpr, TIES_HIGH: tl.constexpr, BOUNDS: tl.constexpr,
                    FAST: tl.constexpr, CARE: tl.constexpr):
    """Program `row` (b * Hq + query head) sets the pooled distance of the head's M nearest keys to 0, below
    every other key's (the distance kernel added 1 to those). Those keys lie in the M blocks whose nearest keys are
    the M best of the blocks' (M keys of those blocks beat any key of another), so the program takes these blocks
    from the candidates (M passes, each the smallest above the last), reads their codes again for its query (M x
    BLOCK_L keys) and takes their M best. The heads of a group write the same zeros. Codes: 1-bit (Hamming; CARE:
    ternary queries) or, with FAST, 2-bit (L1)."""
    b = row // (Hkv * G)
    h = row % (Hkv * G)
    kv = h // G
    base = CAND + row * n_blocks
    c = tl.arange(0, BLOCK_C)
    r = tl.arange(0, M_P2 * BLOCK_L)  # the blocks' keys, one block after another (M_P2 >= M: a power of 2)
    blk = tl.full([M_P2 * BLOCK_L], -1, tl.int32)
    last = tl.full([], -1, tl.int64)
    held = _block_keys(base, c, n_blocks, BLOCK_L, TIES_HIGH)  # the first BLOCK_C blocks' keys, in registers
    for j in tl.static_range(M):  # the M best blocks
        best = tl.min(tl.where(held > last, held, 1 << 62), axis=0)
        for start in range(BLOCK_C, n_blocks, BLOCK_C):  # more blocks than one tile holds
            key = _block_keys(base, start + c, n_blocks, BLOCK_L, TIES_HIGH)
            best = tl.minimum(best, tl.min(tl.where(key > last, key, 1 << 62), axis=0))
        blk = tl.where((r // BLOCK_L == j) & (best < (1 << 62)), _index_of(best, TIES_HIGH) // BLOCK_L, blk)
        last = best
    keys = blk * BLOCK_L + r % BLOCK_L
    ok = (blk >= 0) & (keys < length)
    if BOUNDS:  # the row's own region, as in the distance kernel
        ok = ok & in_sparse_region(tl.load(LENS + b).to(tl.int32), lo + keys, span, sink, window)
    w = tl.arange(0, BLOCK_W)
    w_ok = w < NW
    k = tl.load(KW + b * stride_kb + kv * stride_kh + keys[:, None] * stride_kn + w[None, :],
                mask=ok[:, None] & w_ok[None, :], other=0)
    # 1-bit or 2-bit L1 codes only (_forces): the other codes' BITS, PW, PW2, L2 below are never read
    k_a, k_b, k_c, k_d = _key_prep(k, FAST, not FAST, LANE_BITS, POPC, 1, 16, 16)
    q = tl.load(QW + b * stride_qb + h * stride_qh + w, mask=w_ok, other=0)
    m = tl.load(QW + b * stride_qb + h * stride_qh + NW + w, mask=w_ok, other=0) if CARE else q
    dist = _distance_to(k_a, k_b, k_c, k_d, q, m, FAST, not FAST, LANE_BITS, POPC, BYTE_SUM, 1, 16, 16, False, CARE)
    key = tl.where(ok, _order_keys(dist, keys, TIES_HIGH), 1 << 62)
    last = tl.full([], -1, tl.int64)
    for j in tl.static_range(M):  # the M best keys of those blocks
        best = tl.min(tl.where(key > last, key, 1 << 62), axis=0)
        tl.store(DIST + b * stride_db + kv * stride_dh + _index_of(best, TIES_HIGH),
                 tl.zeros([], DIST.dtype.element_ty), mask=best < (1 << 62))
        last = best


@triton.jit
def _code_distance_kernel(QW, KW, OUT, length, Hkv,
                          stride_qb, stride_qh, stride_kb, stride_kh, stride_kn, stride_ob, stride_oh,
                          LENS, span, sink, window, lo,
                          G: tl.constexpr, NW: tl.constexpr, FAST: tl.constexpr, HAMMING: tl.constexpr,
                          LANE_BITS: tl.constexpr, BYTE_SUM: tl.constexpr, BITS: tl.constexpr, PW: tl.constexpr,
                          PW2: tl.constexpr, L2: tl.constexpr, POOL: tl.constexpr, NEGATE: tl.constexpr,
                          BLOCK_L: tl.constexpr, BLOCK_W: tl.constexpr, POPC: tl.constexpr,
                          BOUNDS: tl.constexpr = False, FILL: tl.constexpr = 0, DENSE_ROWS: tl.constexpr = False,
                          CAND=None, HEAD_TOP: tl.constexpr = 0, TIES_HIGH: tl.constexpr = False,
                          GP: tl.constexpr = 1, CARE: tl.constexpr = False, PDL: tl.constexpr = 0):
    wait_for_prior(PDL)
    pid_l = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // Hkv
    kv = bh % Hkv
    keys = pid_l * BLOCK_L + tl.arange(0, BLOCK_L)
    k_ok = keys < length
    if BOUNDS:  # the row's own region, from its device length: keys outside it get FILL (chosen last)
        inside = in_sparse_region(tl.load(LENS + b).to(tl.int32), lo + keys, span, sink, window)
    w = tl.arange(0, BLOCK_W)
    w_ok = w < NW
    if DENSE_ROWS:  # keys' lanes back to back (stride NW): the compiler sees one contiguous tile and loads it in
        stride_kn = NW  # 16-byte vectors; with a run-time stride it read each lane alone (~60 % of copy bandwidth)
    # the key tile, read once for the whole query group; padding words read as 0 (code 0 on both sides: adds 0)
    k = tl.load(KW + b * stride_kb + kv * stride_kh + keys[:, None] * stride_kn + w[None, :],
                mask=k_ok[:, None] & w_ok[None, :], other=0)
    k_a, k_b, k_c, k_d = _key_prep(k, FAST, HAMMING, LANE_BITS, POPC, BITS, PW, PW2)  # once for the group
    q_base = QW + b * stride_qb + (kv * G) * stride_qh
    o_base = OUT + b * stride_ob
    if POOL == 2:
        pooled = tl.full([BLOCK_L], 2147483647, tl.int32)
    else:
        pooled = tl.zeros([BLOCK_L], tl.int32)
    if HEAD_TOP > 0:  # every query head's candidates [BLOCK_L, G], reduced once after the group's loop
        heads = tl.arange(0, GP)
        local = tl.arange(0, BLOCK_L)
        at = (BLOCK_L - 1 - local) if TIES_HIGH else local
        valid = k_ok & inside if BOUNDS else k_ok
        cands = tl.full([BLOCK_L, GP], 0x7FFFFFFF, tl.int32)
    for g in tl.static_range(G):
        q = tl.load(q_base + g * stride_qh + w, mask=w_ok, other=0)
        m = tl.load(q_base + g * stride_qh + NW + w, mask=w_ok, other=0) if CARE else q  # care lanes after the signs
        dist = _distance_to(k_a, k_b, k_c, k_d, q, m, FAST, HAMMING, LANE_BITS, POPC, BYTE_SUM, BITS, PW, PW2, L2,
                            CARE)
        if POOL == 0:
            val = dist
            if NEGATE:
                val = (-dist).to(tl.float32)
            if BOUNDS:
                val = tl.where(inside, val, FILL)
            tl.store(o_base + (kv * G + g) * stride_oh + keys, val.to(OUT.dtype.element_ty), mask=k_ok)
        elif POOL == 1:
            pooled += dist
            if HEAD_TOP > 0:
                cands = tl.where((heads == g)[None, :] & valid[:, None], ((dist << 13) | at)[:, None], cands)
        else:
            pooled = tl.minimum(pooled, dist)
    if HEAD_TOP > 0:  # each query head's nearest key of this block (_force_head_top_kernel)
        tl.store(CAND + (bh * G + heads) * tl.num_programs(0) + pid_l, tl.min(cands, axis=0), mask=heads < G)
    if POOL != 0:
        val = pooled
        if HEAD_TOP > 0:  # 0 is kept for the keys a head forces (_force_head_top_kernel)
            val += 1
        if NEGATE:
            val = (-pooled).to(tl.float32)
        if BOUNDS:
            val = tl.where(inside, val, FILL)
        tl.store(o_base + kv * stride_oh + keys, val.to(OUT.dtype.element_ty), mask=k_ok)


def _as_lanes(words: torch.Tensor, dtype: torch.dtype = torch.int32) -> torch.Tensor | None:
    """The same words read as wider lanes (two int16 words per int32, four per int64), or None when the layout does
    not allow it."""
    per = dtype.itemsize // 2
    if words.shape[-1] % per or words.stride(-1) != 1:
        return None
    try:
        return words.view(dtype)
    except RuntimeError:  # odd storage offset or stride
        return None


def _kv_heads(Hq: int, k_words: torch.Tensor, length: int) -> int:
    """The KV heads of k_words [B, Hkv, Lmax, W], checked against Hq query heads (GQA groups) and `length` keys."""
    Hkv = k_words.shape[1]
    if Hq % Hkv:
        raise ValueError(f"{Hq} query heads are not a multiple of {Hkv} KV heads")
    if not 0 <= length <= k_words.shape[2]:
        raise ValueError(f"length {length} is outside the key buffer's {k_words.shape[2]} slots")
    return Hkv


def _launch_distance(q_words, k_words, length, d, bits, metric, pool, out_dtype, negate, block_l, num_warps,
                     popc=None, bounds=None, fill=0, head_top=0, ties="low", padded=False):
    """Validate, then run the distance kernel: distances (or negated scores) [B, H_out, length] in out_dtype.
    popc (CUDA only; the interpreter always takes 0): 0 SWAR sums, 1 a POPC per int32 lane's plane, 2 (default)
    int64 lane pairs through a carry-save adder (2-bit L1; 1-bit codes count lanes with POPC for 1 and 2).
    bounds: RowBounds; keys outside a row's region get `fill` instead of their distance.
    head_top m > 0 (1-bit or 2-bit L1 codes, pool "sum", distances out): the pooled distances + 1, and every
    block's nearest key per query head; the second value returned then launches the forcing step
    (_force_head_top_kernel: 0 for each query head's m nearest keys of the region, ties as `ties`), given the
    counting select's first step to run in the same launch or None (else it is None). `padded`: the rows are
    allocated as the counting select reads them fastest (`count_select.padded_rows`: 16-byte vectors). Returns
    (distances, that launcher)."""
    if metric not in ("l1", "l2"):
        raise ValueError(f"metric must be 'l1' or 'l2', got {metric!r}")
    if pool not in _POOLS:
        raise ValueError(f"pool must be None, 'sum' or 'min', got {pool!r}")
    pw = _per_word(bits)
    W = triton.cdiv(d, pw)
    if q_words.dtype != torch.int16 or k_words.dtype != torch.int16:
        raise ValueError("q_words and k_words must be int16")
    if q_words.dim() == 4 and q_words.shape[2] == 1:
        q_words = q_words[:, :, 0]
    B, Hq, Wq = q_words.shape
    care = bits == 1 and Wq == 2 * W  # ternary queries: sign words, then care words
    if Wq == 2 * W and not care:
        raise ValueError(f"ternary query words (sign and care words, {Wq}) need 1-bit codes, not bits={bits}")
    if k_words.dim() != 4 or k_words.shape[0] != B or k_words.shape[3] != W or (Wq != W and not care):
        q_shape = f"[B, Hq, {W}]" + (f" (or {2 * W}: ternary)" if bits == 1 else "")
        raise ValueError(f"expected q_words {q_shape} and k_words [B, Hkv, Lmax, {W}] for d={d}, bits={bits}; "
                         f"got {tuple(q_words.shape)} and {tuple(k_words.shape)}")
    Hkv = _kv_heads(Hq, k_words, length)
    G = Hq // Hkv
    H_out = Hkv if pool is not None else Hq
    if padded:
        out = count_select.padded_rows((B, H_out, length), out_dtype, q_words.device)
    else:
        out = torch.empty(B, H_out, length, dtype=out_dtype, device=q_words.device)
    if length == 0 or B == 0:
        return out, None
    if q_words.stride(-1) != 1:
        q_words = q_words.contiguous()
    if k_words.stride(-1) != 1:
        k_words = k_words.contiguous()
    fast = bits == 2 and metric == "l1"
    hamming = bits == 1  # |a - b| = (a - b)² for bits: both metrics are the Hamming distance
    popc = (2 if popc is None else popc) if q_words.is_cuda else 0
    qw, kw = q_words, k_words
    lanes = (torch.int64, torch.int32) if fast and popc == 2 else (torch.int32,)  # the widest view that fits
    for dt in lanes if fast or hamming else ():
        q_l, k_l = _as_lanes(q_words.contiguous(), dt), _as_lanes(k_words, dt)
        if q_l is not None and k_l is not None:
            qw, kw = q_l, k_l
            break
    NW = kw.shape[-1]  # a ternary query's care lanes follow its NW sign lanes
    BLOCK_W = triton.next_power_of_2(NW)
    if fast or hamming:  # [BLOCK_L, BLOCK_W] lanes live in registers across the group loop
        BLOCK_L = block_l or (256 if G <= 4 else 128)
    else:  # the unpacked key tile [BLOCK_L, BLOCK_W, PW2] does: about 8K codes per program
        BLOCK_L = block_l or max(16, 8192 // (BLOCK_W * triton.next_power_of_2(pw)))
    grid = (triton.cdiv(length, BLOCK_L), B * Hkv)
    byte_sum = (fast and NW * 12 <= 255) or (hamming and NW * 8 <= 255)  # per-byte sums fit a byte over a row
    cand = None
    if head_top:
        if pool != "sum" or negate or not _forces(bits, metric) or BLOCK_L > 1 << _LOCAL_BITS:
            raise ValueError("head_top needs 1-bit or 2-bit L1 codes, pool='sum', distances out and blocks of at "
                             "most 8192 keys")
        cand = torch.empty(B, Hq, grid[0], dtype=torch.int32, device=q_words.device)
    if bounds is not None:
        bounds.check(B, q_words.device)
    lens, b_args = (bounds.lengths, (bounds.span, bounds.sink, bounds.window, bounds.lo)) if bounds is not None \
        else (out, (0, 0, 0, 0))  # unread placeholders without bounds
    _code_distance_kernel[grid](
        qw, kw, out, length, Hkv,
        qw.stride(0), qw.stride(1), kw.stride(0), kw.stride(1), kw.stride(2), out.stride(0), out.stride(1),
        lens, *b_args,
        G=G, NW=NW, FAST=fast, HAMMING=hamming, LANE_BITS=qw.element_size() * 8,
        BYTE_SUM=byte_sum, BITS=bits, PW=pw,
        PW2=triton.next_power_of_2(pw), L2=metric == "l2",
        POOL=_POOLS[pool], NEGATE=negate, BLOCK_L=BLOCK_L, BLOCK_W=BLOCK_W, num_warps=num_warps,
        POPC=popc > 0, BOUNDS=bounds is not None, FILL=fill, DENSE_ROWS=kw.stride(2) == NW == BLOCK_W,
        CAND=cand, HEAD_TOP=head_top, TIES_HIGH=bool(head_top) and ties == "high", GP=triton.next_power_of_2(G),
        CARE=care, **dependent_launch(q_words.device),
    )
    if not head_top:
        return out, None

    def force(base: count_select.BaseStep | None) -> None:
        """The forcing launch, with the counting select's first step in it when `base` is given (at the forcing
        step's 8 warps, which the first step also takes by default)."""
        rows, b_step, b_consts = (0, (out,) * 3 + (0,) * 5, {}) if base is None else \
            (base.rows, base.args, dict(base.consts, BASE=True))  # without BASE the placeholders are never read
        _force_head_top_kernel[(B * Hq + rows,)](
            cand, qw, kw, out, grid[0], length, Hkv,
            qw.stride(0), qw.stride(1), kw.stride(0), kw.stride(1), kw.stride(2), out.stride(0), out.stride(1),
            lens, *b_args, *b_step, rows,
            G=G, M=head_top, NW=NW, LANE_BITS=qw.element_size() * 8, POPC=popc > 0, BYTE_SUM=byte_sum,
            BLOCK_L=BLOCK_L, BLOCK_W=BLOCK_W, BLOCK_C=min(triton.next_power_of_2(grid[0]), 2048),
            M_P2=triton.next_power_of_2(head_top), TIES_HIGH=ties == "high", BOUNDS=bounds is not None, FAST=fast,
            CARE=care, **b_consts, **dependent_launch(q_words.device),
            num_warps=8)  # reductions one after another: code_topk at M 4 took 27.3 µs with 8 warps, 29.0 with 4
            # (H200, 8 x 131072 keys, group of 4)

    return out, force


def code_distance(q_words: torch.Tensor, k_words: torch.Tensor, length: int, d: int, bits: int = 2,
                  metric: str = "l1", *, pool: str | None = None, block_l: int | None = None,
                  num_warps: int = 4) -> torch.Tensor:
    """Code distances int32 [B, Hq, length] (smaller = closer): q_words [B, Hq, W] (or [B, Hq, 1, W]) against the
    first `length` rows of k_words [B, Hkv, Lmax, W]; query head h reads KV head h // (Hq // Hkv).

    pool="sum" / "min" reduces over each KV head's query group in the kernel -> [B, Hkv, length].
    Same contract as code_distance_reference. A sliced k_words (e.g. k_words[:, :, sink:]) is fine. bits=1: q_words
    may be ternary, [B, Hq, 2W] (sign words, then care words: only the cared-for bits count).
    """
    return _launch_distance(q_words, k_words, length, d, bits, metric, pool, torch.int32, False, block_l,
                            num_warps)[0]


def code_scores(q_words: torch.Tensor, k_words: torch.Tensor, length: int, d: int, bits: int = 2,
                metric: str = "l1", *, pool: str | None = None, dtype: torch.dtype | None = None,
                block_l: int | None = None, num_warps: int = 4) -> torch.Tensor:
    """Negated code distances as floats (higher = closer), ready for the shared top-k: -code_distance(...).

    dtype defaults to fp16 when every possible value is an exact fp16 integer (|score| <= 2048: L1 up to
    d·(2^bits - 1) summed over the pooled group), else fp32. fp16 halves the bytes written and read by the top-k
    and lets the radix select finish in fewer digit passes; ties keep the top-k's lower-index order.
    """
    if dtype is None:
        dtype = torch.float16 if _max_distance(d, bits, metric, _group(q_words, k_words, pool)) <= 2048 \
            else torch.float32
    return _launch_distance(q_words, k_words, length, d, bits, metric, pool, dtype, True, block_l, num_warps)[0]


def code_topk(q_words: torch.Tensor, k_words: torch.Tensor, length: int, d: int, k: int, bits: int = 2,
              metric: str = "l1", *, pool: str | None = None, offset: int = 0, keep: torch.Tensor | None = None,
              bounds: RowBounds | None = None, ties: str = "low", head_top: int = 0, block_l: int | None = None,
              num_warps: int = 4, _chunk: int | None = None, _tile: int | None = None) -> torch.Tensor:
    """Indices + offset, int64 [B, H_out, k], of the k keys (of the first `length`) nearest each query, pooled as
    in code_distance: the distance kernel writes int16 distances, which the counting select (`count_select.py`: a
    sampled window, one histogram pass and emit, the distances in L2) turns into indices. Exact: ties go to the
    lower index (`ties="high"`: to the higher one), ascending index order; the same keys as
    topk(code_scores(...), k, ties), without the float top-k's tie fallback.
    On the H100 (llama3-8b shape, k 2047, CUDA-graph replay) the select takes about two thirds of the time per query
    head at 131072 keys, and the two together beat code_scores + topk; the decode step they serve: BENCHMARKS.md,
    "Decode step of one layer".
    Rows whose distances can reach 2^14 (e.g. 3-bit L2 pooled over 8 heads) raise ValueError: use code_scores +
    topk (`code_topk_supported` tells). `keep` (bool, broadcastable to [B, H_out, length]) or `bounds`
    (RowBounds: the same as a region per row, applied inside the distance kernel with no mask tensor; its `lo` is
    where k_words was sliced): keys outside are chosen last (given the largest value the select counts).
    `head_top` m (pool "sum", 1-bit or 2-bit L1 codes): each query head's own m nearest keys of the region come
    first (ties as `ties`), the rest by the group's summed distance: a head whose match the group's sum would
    dilute still gets it (the reference: `head_top_reference` on the per-head distances, forced keys ranked above
    the rest). The step that forces them shares its launch with the counting select's first step
    (`smallest_k(first=)`), so head_top adds no launch to a select of several chunks (one layer at 131072 keys, m
    4, H100: 54.5 µs with a launch of its own, 51.6 with it shared; BENCHMARKS.md, "Each query head's nearest
    keys")."""
    if head_top < 0 or (head_top and (pool != "sum" or keep is not None)):
        raise ValueError(f"head_top={head_top} needs pool='sum' and a region as bounds (not keep)")
    vmax = _max_distance(d, bits, metric, _group(q_words, k_words, pool)) + (1 if head_top else 0)
    count_select.value_bits(vmax)  # ValueError before any work
    count_select.tie_flag(ties)
    if not 0 <= k <= length:
        raise ValueError(f"k={k} must be between 0 and the {length} keys")
    fill = (1 << count_select.value_bits(vmax)) - 1
    dist, force = _launch_distance(q_words, k_words, length, d, bits, metric, pool, torch.int16, False, block_l,
                                   num_warps, bounds=bounds, fill=fill, head_top=head_top, ties=ties,
                                   padded=True)
    if keep is not None:
        dist.masked_fill_(~keep, fill)
    return count_select.smallest_k(dist, k, vmax, offset=offset, ties=ties, first=force, _chunk=_chunk, _tile=_tile)


# --------------------------------------------------------------------------------------------------------------
# asymmetric scores: the full query against the keys' bucket centers


@triton.jit
def _code_ip_kernel(Q, KW, C, OUT, length, Hkv,
                    stride_qb, stride_qh, stride_kb, stride_kh, stride_kn, stride_cb, stride_ob, stride_oh,
                    G: tl.constexpr, GP: tl.constexpr, NW: tl.constexpr, BITS: tl.constexpr, PW: tl.constexpr,
                    D: tl.constexpr, BLOCK_L: tl.constexpr, PDL: tl.constexpr = 0):
    wait_for_prior(PDL)
    pid_l = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // Hkv
    kv = bh % Hkv
    keys = pid_l * BLOCK_L + tl.arange(0, BLOCK_L)
    k_ok = keys < length
    g = tl.arange(0, GP)
    g_ok = g < G
    q_ptr = Q + b * stride_qb + (kv * G + g) * stride_qh
    k_ptr = KW + b * stride_kb + kv * stride_kh + keys * stride_kn
    c_ptr = C + kv * stride_cb
    c0 = tl.load(c_ptr)
    c1 = tl.load(c_ptr + 1)
    c2 = tl.load(c_ptr + 2 * (BITS > 1))  # 1-bit codes have two centers
    c3 = tl.load(c_ptr + 3 * (BITS > 1))
    acc = tl.zeros([GP, BLOCK_L], tl.float32)  # keys along the threads: each thread owns its keys' whole group
    for w in tl.static_range(NW):
        word = tl.load(k_ptr + w, mask=k_ok, other=0).to(tl.int32)
        for i in tl.static_range(PW):
            if w * PW + i < D:
                if BITS == 2:  # the field's two bits as predicates, then three selects
                    b0 = (word & (1 << (2 * i))) != 0
                    b1 = (word & (2 << (2 * i))) != 0
                    lev = tl.where(b1, tl.where(b0, c3, c2), tl.where(b0, c1, c0))
                elif BITS == 1:
                    lev = tl.where((word & (1 << i)) != 0, c1, c0)
                else:
                    code = (word >> (BITS * i)) & ((1 << BITS) - 1)
                    lev = tl.zeros([BLOCK_L], tl.float32) + c0
                    for t in tl.static_range(1, 1 << BITS):
                        lev = tl.where(code == t, tl.load(c_ptr + t), lev)
                qv = tl.load(q_ptr + (w * PW + i), mask=g_ok, other=0.0)
                acc += qv[:, None] * lev[None, :]
    tl.store(OUT + b * stride_ob + (kv * G + g[:, None]) * stride_oh + keys[None, :], acc,
             mask=g_ok[:, None] & k_ok[None, :])


def code_ip_scores(q: torch.Tensor, k_words: torch.Tensor, centers: torch.Tensor, length: int, d: int,
                   bits: int = 2, *, pool: str | None = None, block_l: int = 256,
                   num_warps: int = 4) -> torch.Tensor:
    """Asymmetric scores fp32 [B, H_out, length] (higher = closer): q [B, Hq, d] (or [B, Hq, 1, d]), already in the
    codes' space (Hadamard-transformed when they are), against the first `length` keys of k_words [B, Hkv, Lmax, W]
    read as their buckets' centers [Hkv, 2^bits] (reference.adamas_bucket_centers): q · c[code(k)].
    pool="sum" adds each KV head's query group first (the sum of the scores is the score of the summed query).

    One program per (batch, KV head, block of keys), keys along the threads: each thread reads its keys' words one
    at a time (the L1 cache serves the repeated sectors), takes each code's center by two bit tests and three
    selects, and adds it times the query value with one FMA per query head of the group, in fp32 throughout: the
    scores equal the fp32 reference to rounding. On the H100 (131072 keys x 8 KV heads, D 128, CUDA-graph replay)
    it takes about three and a half times the L1 code distance's time, per query head or pooled: ~6 integer/select
    ops per code and an FMA per head, ALU-bound (the decode step: BENCHMARKS.md, "Decode step of one layer"). Tried
    and slower: tensor-core dots of the unpacked codes (the register tiles' layout conversions), fp16 codes by a
    magic-number unpack into those dots, each key's words loaded as one tile and taken apart in registers.
    Reference: kernels/reference.py::adamas_ip_scores_reference.
    """
    pw = _per_word(bits)
    W = triton.cdiv(d, pw)
    if q.dim() == 4 and q.shape[2] == 1:
        q = q[:, :, 0]
    if q.dim() != 3 or q.shape[-1] != d:
        raise ValueError(f"q must be [B, Hq, {d}], got {tuple(q.shape)}")
    B, Hq, _ = q.shape
    if k_words.dtype != torch.int16 or k_words.dim() != 4 or k_words.shape[0] != B or k_words.shape[3] != W:
        raise ValueError(f"k_words must be int16 [{B}, Hkv, Lmax, {W}] for d={d}, bits={bits}; "
                         f"got {k_words.dtype} {tuple(k_words.shape)}")
    Hkv = _kv_heads(Hq, k_words, length)
    if tuple(centers.shape) != (Hkv, 1 << bits):
        raise ValueError(f"centers must be [{Hkv}, {1 << bits}], got {tuple(centers.shape)}")
    if pool not in (None, "sum"):
        raise ValueError(f"pool must be None or 'sum', got {pool!r}")
    qf = q.float()
    if pool == "sum":
        qf = qf.view(B, Hkv, Hq // Hkv, d).sum(2)
    H_out = qf.shape[1]
    out = torch.empty(B, H_out, length, dtype=torch.float32, device=q.device)
    if length == 0 or B == 0:
        return out
    qf = qf.contiguous()
    c = centers.to(device=q.device, dtype=torch.float32).contiguous()
    if k_words.stride(-1) != 1:
        k_words = k_words.contiguous()
    G = H_out // Hkv
    grid = (triton.cdiv(length, block_l), B * Hkv)
    _code_ip_kernel[grid](
        qf, k_words, c, out, length, Hkv,
        qf.stride(0), qf.stride(1), k_words.stride(0), k_words.stride(1), k_words.stride(2), c.stride(0),
        out.stride(0), out.stride(1),
        G=G, GP=triton.next_power_of_2(G), NW=W, BITS=bits, PW=pw, D=d, BLOCK_L=block_l, num_warps=num_warps,
        **dependent_launch(q.device),
    )
    return out


def code_topk_supported(d: int, bits: int, metric: str, group: int, head_top: int = 0) -> bool:
    """Whether code_topk handles rows pooled over `group` query heads (their largest distance, + 1 with head_top,
    fits its counting; head_top on 1-bit codes and 2-bit L1 codes only)."""
    if head_top and not _forces(bits, metric):
        return False
    return (_max_distance(d, bits, metric, group) + (1 if head_top else 0)).bit_length() <= count_select.MAX_BITS


def _forces(bits: int, metric: str) -> bool:
    """Whether the head_top forcing step reads these codes: 1-bit (Hamming) or 2-bit L1."""
    return bits == 1 or (bits == 2 and metric == "l1")


def _group(q_words: torch.Tensor, k_words: torch.Tensor, pool: str | None) -> int:
    """Query heads summed into one row: the GQA group with pool="sum", else 1."""
    return q_words.shape[1] // max(k_words.shape[1], 1) if pool == "sum" else 1


def _max_distance(d: int, bits: int, metric: str, group: int) -> int:
    """The largest distance a row can hold: every code at the far end, summed over `group` query heads."""
    top = (1 << bits) - 1
    return d * (top if metric == "l1" else top * top) * group
