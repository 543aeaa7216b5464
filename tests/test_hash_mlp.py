"""Spotlight's MLP hash kernel (kernels/hash_mlp.py) against its torch reference: under TRITON_INTERPRET=1 on the CPU
(fp32/fp16: the interpreter cannot do bf16), in bf16 when a GPU is present; and the bit layout pinned against the
1-bit Hamming scores of kernels/codes.py (code_scores with bits=1, metric "l1")."""

import pytest
import torch

from sparsekv import ops
from sparsekv.kernels.hash_mlp import mlp_hash_pack, mlp_hash_pack_into
from sparsekv.kernels.reference import (PendingHash, mlp_hash_pack_into_reference, mlp_hash_pack_reference,
                                        mlp_hash_reference, quantize_pack_reference)

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _weights(Hkv, D, M=128, nbits=128, dtype=torch.float32, seed=0):
    """Random weights at the scale of a trained hash: pre-activations and outputs of order 1."""
    g = _gen(seed)
    w1 = torch.randn(Hkv, D, M, generator=g) / D ** 0.5
    b1 = torch.randn(Hkv, M, generator=g) * 0.5
    w2 = torch.randn(Hkv, M, nbits, generator=g) / M ** 0.5
    return [t.to(DEV, dtype) for t in (w1, b1, w2)]


def _bits(words: torch.Tensor) -> torch.Tensor:
    """Every bit of int16 words [..., W] -> uint8 [..., 16·W], bit j at position j % 16 of word j // 16 (spelled out
    here, independently of the packer under test)."""
    w = words.to(torch.int32) & 0xFFFF
    shifts = torch.arange(16, dtype=torch.int32, device=words.device)
    return ((w.unsqueeze(-1) >> shifts) & 1).flatten(-2).to(torch.uint8)


def _check(words, x, w1, b1, w2, rel=1e-4, max_flips=0.002):
    """words == the reference's bits, except where the pre-sign value is within rel·std of 0; padding bits 0."""
    y = mlp_hash_reference(x, w1, b1, w2).cpu()
    nbits = y.shape[-1]
    W = -(-nbits // 16)
    assert words.shape == (*x.shape[:3], W) and words.dtype == torch.int16
    got = _bits(words.cpu())
    assert not got[..., nbits:].any(), "padding bits must be 0"
    got = got[..., :nbits]
    want = (y > 0).to(torch.uint8)
    bad = got != want
    near = y.abs() <= rel * y.std()
    assert not (bad & ~near).any(), f"{int((bad & ~near).sum())} bits differ away from 0"
    assert bad.float().mean() <= max_flips
    return y


CASES = [  # (B, Hkv, G, n): keys (G = 1, a prefill chunk), GQA query heads at a decode step, a query prefill
    (2, 2, 1, 37),
    (2, 2, 3, 1),
    (1, 2, 3, 37),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("case", CASES)
def test_kernel_matches_reference(dtype, D, case):
    B, Hkv, G, n = case
    w1, b1, w2 = _weights(Hkv, D, seed=D)
    x = torch.randn(B, Hkv * G, n, D, generator=_gen(n + G)).to(DEV, dtype)
    words = mlp_hash_pack(x, w1, b1, w2)
    _check(words, x, w1, b1, w2)
    ref = mlp_hash_pack_reference(x, w1, b1, w2)
    assert (words != ref).float().mean() <= 0.01  # whole words equal but for rare near-0 bits


@pytest.mark.parametrize("nbits,M,block_k", [(128, 128, 32), (40, 48, 16)])
@pytest.mark.parametrize("case", CASES[1:])
def test_split_kernel_matches_reference(nbits, M, block_k, case):
    """Hidden units split over programs (a decode step's launch): the partial sums, added by the last program to
    arrive, give the reference's bits; repeated calls (the arrival counts reset themselves) give the same words, at
    per-row device slots too."""
    B, Hkv, G, n = case
    w1, b1, w2 = _weights(Hkv, 64, M=M, nbits=nbits, seed=M)
    x = torch.randn(B, Hkv * G, n, 64, generator=_gen(n + M)).to(DEV)
    words = mlp_hash_pack(x, w1, b1, w2, split=True, block_k=block_k)
    _check(words, x, w1, b1, w2)
    assert torch.equal(mlp_hash_pack(x, w1, b1, w2, split=True, block_k=block_k), words)
    out = torch.zeros(B, Hkv * G, n + 5, words.shape[-1], dtype=torch.int16, device=DEV)
    mlp_hash_pack_into(x, w1, b1, w2, out, torch.tensor([3, 1][:B], dtype=torch.int32, device=DEV) if n == 1 else 1,
                       split=True, block_k=block_k)
    rows = out[:, :, 1:1 + n] if n > 1 else torch.stack([out[b, :, s] for b, s in enumerate([3, 1][:B])])[:, :, None]
    assert torch.equal(rows, words)
    with pytest.raises(ValueError, match="split needs"):
        mlp_hash_pack(x, w1, b1, w2, split=True, block_k=256)


@pytest.mark.parametrize("nbits", [128, 40, 7])
@pytest.mark.parametrize("case", CASES)
def test_linear_hash_kernel_matches_reference(nbits, case):
    """Without b1 and w2 the kernel is LSH's linear hash sign(x @ w1), one program per 32 bits: the same bits as the
    reference's projection, written at per-row device slots too."""
    B, Hkv, G, n = case
    w1 = (torch.randn(Hkv, 64, nbits, generator=_gen(nbits)) / 8).to(DEV)
    x = torch.randn(B, Hkv * G, n, 64, generator=_gen(n + G + nbits)).to(DEV)
    words = mlp_hash_pack(x, w1)
    y = _check(words, x, w1, None, None)
    assert torch.equal(y, torch.einsum("bhnd,hdm->bhnm", x.cpu().view(B, Hkv, G * n, 64), w1.cpu()).reshape(y.shape))
    out = torch.zeros(B, Hkv * G, n + 9, words.shape[-1], dtype=torch.int16, device=DEV)
    slots = torch.tensor([4, 9][:B], dtype=torch.int32, device=DEV) if n == 1 else 2
    mlp_hash_pack_into(x, w1, None, None, out, slots)
    want = torch.zeros_like(out)
    mlp_hash_pack_into_reference(x, w1, None, None, want, slots)
    assert (out != want).float().mean() <= 0.01 and want.any()
    with pytest.raises(ValueError, match="b1 and w2 together"):
        mlp_hash_pack(x, w1, w1[:, 0])


@pytest.mark.parametrize("hash_kind,split", [("mlp", True), ("mlp", False), ("linear", False)])
@pytest.mark.parametrize("B,G", [(1, 4), (3, 2), (3, 6)])  # (3, 6): keys in a second row block
def test_step_keys_hashed_with_the_queries(hash_kind, split, B, G):
    """A decode step's new keys (PendingHash) hashed in the queries' launch: the same query words and the same key
    codes at each row's device slot as two separate calls; the codes' other slots untouched. The reference does
    the same."""
    Hkv, D = 2, 64
    w = _weights(Hkv, D, M=48, nbits=40, seed=B + G) if hash_kind == "mlp" else \
        [(torch.randn(Hkv, D, 40, generator=_gen(B)) / 8).to(DEV), None, None]
    q = torch.randn(B, Hkv * G, 1, D, generator=_gen(G)).to(DEV)
    k = torch.randn(B, Hkv, 1, D, generator=_gen(G + 1)).to(DEV)
    slots = torch.tensor([5, 0, 7][:B], dtype=torch.int32, device=DEV)
    codes = torch.randint(-30000, 30000, (B, Hkv, 9, 3), generator=_gen(2), dtype=torch.int16).to(DEV)
    tuning = dict(split=split, block_k=16) if hash_kind == "mlp" else {}
    want_codes = codes.clone()
    mlp_hash_pack_into(k, *w, want_codes, slots, **tuning)
    want_q = mlp_hash_pack(q, *w, **tuning)
    got_codes = codes.clone()
    got_q = mlp_hash_pack(q, *w, append=PendingHash(k, got_codes, slots), **tuning)
    assert torch.equal(got_q, want_q)
    assert torch.equal(got_codes, want_codes) and not torch.equal(got_codes, codes)
    ref_codes = codes.clone()
    ref_q = mlp_hash_pack_reference(q, *w, append=PendingHash(k, ref_codes, slots))
    assert (ref_q != got_q).float().mean() <= 0.01 and (ref_codes != got_codes).float().mean() <= 0.01
    with pytest.raises(ValueError, match="append.slots"):
        mlp_hash_pack(q, *w, append=PendingHash(k, got_codes, slots[:1] if B > 1 else slots.float()))


def test_reference_is_the_linear_codes_of_the_mlp_output():
    """The reference's packing is exactly quantize_pack_reference(y, (0,), bits=1, transform=False): the `lsh`
    method's layout, which code_scores / code_topk score."""
    w1, b1, w2 = _weights(2, 64, M=48, nbits=40, seed=3)
    x = torch.randn(1, 6, 5, 64, generator=_gen(3))
    y = mlp_hash_reference(x, w1.cpu(), b1.cpu(), w2.cpu())
    assert y.shape == (1, 6, 5, 40) and y.dtype == torch.float32
    # the row-vector MLP by hand, head 4 -> KV head 1
    h = torch.nn.functional.silu(x[0, 4].double() @ w1[1].cpu().double() + b1[1].cpu().double())
    torch.testing.assert_close(y[0, 4].double(), h @ w2[1].cpu().double(), rtol=1e-5, atol=1e-5)
    assert torch.equal(mlp_hash_pack_reference(x, w1.cpu(), b1.cpu(), w2.cpu()),
                       quantize_pack_reference(y, torch.zeros(1), bits=1, transform=False))


def test_odd_sizes_16bit_weights_and_strides():
    """D, M, nbits not powers of two (padding bits 0), fp16 weights (16-bit dots), strided x and weights."""
    Hkv, D, M, nbits = 2, 80, 48, 40
    w1, b1, w2 = _weights(Hkv, D, M, nbits, seed=5)
    x = torch.randn(1, Hkv * 2, 9, D, generator=_gen(5)).to(DEV)
    _check(mlp_hash_pack(x, w1, b1, w2), x, w1, b1, w2)
    # 16-bit weights: x and the SiLU output are rounded to fp16 before their dots
    h16 = [t.half() for t in (w1, b1, w2)]
    _check(mlp_hash_pack(x.half(), *h16), x.half(), *h16, rel=2e-2, max_flips=0.02)
    # non-contiguous everything: x [B, n, H, D] transposed, w1 stored [Hkv, M, D], w2 [Hkv, nbits, M]
    xt = x.transpose(1, 2).contiguous().transpose(1, 2)
    w1t = w1.transpose(1, 2).contiguous().transpose(1, 2)
    w2t = w2.transpose(1, 2).contiguous().transpose(1, 2)
    b1s = torch.stack([b1, b1], -1)[..., 0]
    assert not (xt.is_contiguous() or w1t.is_contiguous() or w2t.is_contiguous() or b1s.is_contiguous())
    assert torch.equal(mlp_hash_pack(xt, w1t, b1s, w2t), mlp_hash_pack(x, w1, b1, w2))
    # two chunks of output bits (nbits 256 > BLOCK_N 128), the smallest dims
    w1, b1, w2 = _weights(1, 16, 16, 256, seed=6)
    x = torch.randn(2, 2, 3, 16, generator=_gen(6)).to(DEV)
    _check(mlp_hash_pack(x, w1, b1, w2), x, w1, b1, w2)


def test_into_writes_only_its_slots():
    B, Hkv, G, Lmax, D = 2, 2, 3, 40, 64
    w1, b1, w2 = _weights(Hkv, D, seed=7)
    state = torch.full((B, Hkv, Lmax, 8), 12345, dtype=torch.int16, device=DEV)
    before = state.clone()
    x = torch.randn(B, Hkv, 7, D, generator=_gen(7)).to(DEV)
    mlp_hash_pack_into(x, w1, b1, w2, state, 11)
    assert torch.equal(state[:, :, 11:18], mlp_hash_pack(x, w1, b1, w2))
    assert torch.equal(state[:, :, :11], before[:, :, :11]) and torch.equal(state[:, :, 18:], before[:, :, 18:])
    # a graph-replayed decode step: one key per row, each row's slot read on the device
    slots = torch.tensor([25, 3], dtype=torch.int32, device=DEV)
    one = torch.randn(B, Hkv, 1, D, generator=_gen(8)).to(DEV)
    mlp_hash_pack_into(one, w1, b1, w2, state, slots)
    codes = mlp_hash_pack(one, w1, b1, w2)
    assert torch.equal(state[0, :, 25:26], codes[0]) and torch.equal(state[1, :, 3:4], codes[1])
    assert torch.equal(state[0, :, 18:25], before[0, :, 18:25]) and torch.equal(state[0, :, 26:], before[0, :, 26:])
    assert torch.equal(state[1, :, 18:], before[1, :, 18:])
    # the reference writes the same
    ref_state = before.clone()
    mlp_hash_pack_into_reference(x, w1, b1, w2, ref_state, 11)
    mlp_hash_pack_into_reference(one, w1, b1, w2, ref_state, slots.long())
    _check(ref_state[:, :, 11:18], x, w1, b1, w2)
    assert (ref_state != state).float().mean() <= 0.01
    # GQA query heads into a [B, Hq, slots, W] buffer at device slots
    qstate = torch.zeros(B, Hkv * G, 4, 8, dtype=torch.int16, device=DEV)
    q = torch.randn(B, Hkv * G, 1, D, generator=_gen(9)).to(DEV, torch.float16)
    mlp_hash_pack_into(q, w1, b1, w2, qstate, torch.tensor([2, 0], device=DEV))
    qc = mlp_hash_pack(q, w1, b1, w2)
    _check(qc, q, w1, b1, w2)
    assert torch.equal(qstate[0, :, 2:3], qc[0]) and torch.equal(qstate[1, :, 0:1], qc[1])
    assert not qstate[0, :, [0, 1, 3]].any() and not qstate[1, :, 1:].any()
    with pytest.raises(ValueError, match="start must be"):
        mlp_hash_pack_into(one, w1, b1, w2, state, slots[:1])
    with pytest.raises(ValueError):
        mlp_hash_pack_into(x, w1, b1, w2, state, Lmax - 3)  # would run past the buffer
    with pytest.raises(ValueError):
        mlp_hash_pack_into(x, w1, b1, w2, state.int(), 0)
    with pytest.raises(ValueError):
        mlp_hash_pack_into(x, w1, b1, w2, state[..., :4], 0)  # 128 bits need 8 words
    with pytest.raises(ValueError, match="multiple"):
        mlp_hash_pack(torch.randn(1, 3, 1, D, device=DEV), w1, b1, w2)  # 3 heads over 2 KV heads
    with pytest.raises(ValueError):
        mlp_hash_pack(x, w1, b1[:, :64], w2)


@pytest.mark.parametrize("on", [True, False])
def test_ops_dispatch(on):
    Hkv, D = 2, 64
    w1, b1, w2 = _weights(Hkv, D, seed=11)
    x = torch.randn(1, Hkv * 2, 5, D, generator=_gen(11)).to(DEV)
    with ops.kernels(on):
        words = ops.mlp_hash_pack(x, w1, b1, w2)
        state = torch.zeros(1, Hkv * 2, 9, 8, dtype=torch.int16, device=DEV)
        ops.mlp_hash_pack_into(x, w1, b1, w2, state, 3)
    _check(words, x, w1, b1, w2)
    assert torch.equal(state[:, :, 3:8], words) and not state[:, :, :3].any() and not state[:, :, 8:].any()


def _pack_by_hand(bits: torch.Tensor) -> torch.Tensor:
    """0/1 [..., nbits] -> int16 [..., ceil(nbits / 16)] in plain python: bit j sets 1 << (j % 16) of word j // 16."""
    flat = bits.reshape(-1, bits.shape[-1]).tolist()
    W = -(-bits.shape[-1] // 16)
    rows = []
    for row in flat:
        words = [0] * W
        for j, bit in enumerate(row):
            if bit:
                words[j // 16] |= 1 << (j % 16)
        rows.append([w - 65536 if w >= 32768 else w for w in words])
    return torch.tensor(rows, dtype=torch.int16).view(*bits.shape[:-1], W)


@pytest.mark.parametrize("nbits", [128, 40])
@pytest.mark.parametrize("on", [True, False])
def test_hamming_scores_pin_the_layout(nbits, on):
    """Codes packed bit j -> word j // 16, position j % 16, scored by code_scores(bits=1, metric "l1"): the score is
    -Hamming distance, i.e. (matching bits) - nbits, counted here on the unpacked bits."""
    B, Hkv, G, L = 2, 2, 3, 70
    g = _gen(nbits)
    qb = torch.randint(0, 2, (B, Hkv * G, nbits), generator=g)
    kb = torch.randint(0, 2, (B, Hkv, L, nbits), generator=g)
    kb[0, 0, 0] = qb[0, 0]  # an exact match (0), its complement (-nbits)
    kb[0, 0, 1] = 1 - qb[0, 0]
    qw, kw = _pack_by_hand(qb).to(DEV), _pack_by_hand(kb).to(DEV)
    with ops.kernels(on):
        scores = ops.code_scores(qw, kw, L, nbits, bits=1, metric="l1").float().cpu()
    kq = kb.repeat_interleave(G, dim=1)  # query head h reads KV head h // G
    matches = (qb[:, :, None, :] == kq).sum(-1)  # nbits - popcount(q xor k)
    hamming = nbits - matches
    assert torch.equal(scores, -hamming.float())
    assert scores[0, 0, 0] == 0 and scores[0, 0, 1] == -nbits
    # the hash's own codes are packed the same way: they equal the hand-packed sign bits of the MLP output
    w1, b1, w2 = _weights(Hkv, 64, nbits=nbits, seed=nbits)
    x = torch.randn(B, Hkv, 9, 64, generator=g).to(DEV)
    y = mlp_hash_reference(x, w1, b1, w2).cpu()
    with ops.kernels(on):
        words = ops.mlp_hash_pack(x, w1, b1, w2).cpu()
    far = (y.abs() > 1e-4 * y.std()).all(-1)  # rows with no bit near 0
    assert far.float().mean() > 0.5
    assert torch.equal(words[far], _pack_by_hand((y > 0).long())[far])


# --------------------------------------------------------------------------------------------------------------
# GPU only: bf16 (the interpreter cannot do bf16) at a real shape


@pytest.mark.skipif(not CUDA, reason="bf16 needs a GPU (the Triton interpreter cannot do bf16)")
def test_bf16_on_gpu():
    B, Hkv, G, L, D = 1, 8, 4, 8192 + 37, 128
    w1, b1, w2 = _weights(Hkv, D, seed=1)
    k = torch.randn(B, Hkv, L, D, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(B, Hkv * G, 1, D, device="cuda", dtype=torch.bfloat16)
    # fp32 weights: tf32 dots by default, exact fp32 products with precision "ieee"
    _check(mlp_hash_pack(k, w1, b1, w2), k, w1, b1, w2, rel=1e-2, max_flips=0.01)
    _check(mlp_hash_pack(k, w1, b1, w2, precision="ieee"), k, w1, b1, w2, rel=1e-4)
    _check(mlp_hash_pack(q, w1, b1, w2), q, w1, b1, w2, rel=1e-2, max_flips=0.01)
    # bf16 weights (the model dtype): bf16 dots
    wb = [t.bfloat16() for t in (w1, b1, w2)]
    _check(mlp_hash_pack(k, *wb), k, *wb, rel=5e-2, max_flips=0.03)
    # the decode step's writes at device slots, under CUDA-graph capture
    state = torch.zeros(B, Hkv, L + 8, 8, dtype=torch.int16, device="cuda")
    slots = torch.tensor([L + 3], device="cuda")
    one = k[:, :, :1].clone()
    mlp_hash_pack_into(one, w1, b1, w2, state, slots)  # compile outside the capture
    state.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mlp_hash_pack_into(one, w1, b1, w2, state, slots)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(state[:, :, L + 3 : L + 4], mlp_hash_pack(one, w1, b1, w2))
    assert not state[:, :, : L + 3].any() and not state[:, :, L + 4 :].any()


def _check_care(words, x, w1, b1, w2, margin, rel=1e-4):
    """Ternary words [..., 2W]: the sign words as _check, then the care words == |y| > margin · rms(y), except where
    |y| lies within rel·std of that threshold; padding bits 0."""
    y = mlp_hash_reference(x, w1, b1, w2).cpu()
    nbits, W = y.shape[-1], words.shape[-1] // 2
    _check(words[..., :W], x, w1, b1, w2, rel=rel)
    got = _bits(words[..., W:].cpu())
    assert not got[..., nbits:].any(), "padding care bits must be 0"
    lim = margin * y.pow(2).mean(-1, keepdim=True).sqrt()
    bad = got[..., :nbits] != (y.abs() > lim).to(torch.uint8)
    assert not (bad & ((y.abs() - lim).abs() > rel * y.std())).any(), "care bits differ away from the threshold"
    return got[..., :nbits]


@pytest.mark.parametrize("hash_kind,split,nbits", [("mlp", True, 128), ("mlp", False, 128), ("mlp", False, 40),
                                                   ("linear", False, 128), ("linear", False, 40)])
@pytest.mark.parametrize("case", CASES)
def test_ternary_query_words(hash_kind, split, nbits, case):
    """margin: each row's sign words, then its care words (|y| > margin · rms(y) over the row's bits), for every
    path (split hidden units, chunks of bits, the linear hash's one chunk); the same as the reference; margin 0
    cares for every nonzero bit."""
    B, Hkv, G, n = case
    w = _weights(Hkv, 64, M=48, nbits=nbits, seed=nbits) if hash_kind == "mlp" else \
        [(torch.randn(Hkv, 64, nbits, generator=_gen(nbits)) / 8).to(DEV), None, None]
    x = torch.randn(B, Hkv * G, n, 64, generator=_gen(n + G)).to(DEV)
    tuning = dict(split=split, block_k=16) if hash_kind == "mlp" else {}
    words = mlp_hash_pack(x, *w, margin=0.35, **tuning)
    W = -(-nbits // 16)
    assert words.shape == (B, Hkv * G, n, 2 * W)
    assert torch.equal(words[..., :W], mlp_hash_pack(x, *w, **tuning))  # the signs are the binary codes
    care = _check_care(words, x, *w, 0.35)
    assert 0.5 < care.float().mean() < 0.95  # most bits, not all: |N(0, 1)| > 0.35 for ~73 %
    ref = mlp_hash_pack_reference(x, *w, margin=0.35)
    assert ref.shape == words.shape and (words != ref).float().mean() <= 0.01
    assert bool(_check_care(mlp_hash_pack(x, *w, margin=0.0, **tuning), x, *w, 0.0).all())
    with pytest.raises(ValueError, match="margin"):
        mlp_hash_pack(x, *w, margin=-0.1)
    with pytest.raises(ValueError, match="margin needs every bit"):
        mlp_hash_pack(x, *w, margin=0.35, block_n=16)


@pytest.mark.parametrize("split", [True, False])
def test_ternary_queries_with_step_keys(split):
    """A decode step's keys hashed in a ternary query launch: the keys' codes stay binary (W words at their slots,
    nothing written past them), the queries get their care words."""
    B, Hkv, G, D = 2, 2, 3, 64
    w = _weights(Hkv, D, M=48, nbits=40, seed=5)
    q = torch.randn(B, Hkv * G, 1, D, generator=_gen(8)).to(DEV)
    k = torch.randn(B, Hkv, 1, D, generator=_gen(9)).to(DEV)
    slots = torch.tensor([5, 0], dtype=torch.int32, device=DEV)
    codes = torch.randint(-30000, 30000, (B, Hkv, 9, 3), generator=_gen(2), dtype=torch.int16).to(DEV)
    want_codes = codes.clone()
    mlp_hash_pack_into(k, *w, want_codes, slots, split=split, block_k=16)
    got_codes = codes.clone()
    got_q = mlp_hash_pack(q, *w, append=PendingHash(k, got_codes, slots), margin=0.5, split=split, block_k=16)
    assert torch.equal(got_codes, want_codes)
    assert torch.equal(got_q, mlp_hash_pack(q, *w, margin=0.5, split=split, block_k=16))
    _check_care(got_q, q, *w, 0.5)
