"""Packed-code kernels (kernels/codes.py: fused quantize + pack, code distances) and the Hadamard transform against
their torch references and hand-computed examples: under TRITON_INTERPRET=1 on the CPU (fp32/fp16), and in bf16 when
a GPU is present."""

import itertools

import pytest
import torch

from sparsekv.kernels.codes import code_distance, code_ip_scores, code_scores, quantize_pack, quantize_pack_into
from sparsekv.kernels.hadamard import hadamard
from sparsekv.kernels.reference import (SUPPORTED_HADAMARD, adamas_bucket_centers, adamas_ip_scores_reference,
                                        code_bucketize_reference, code_distance_reference, code_pack_reference,
                                        code_unpack_reference, hadamard_matrix, hadamard_reference)

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
DIMS = [1, 2, 4, 12, 20, 24, 40, 64, 80, 96, 128, 160, 192, 256]
PER_WORD = {1: 16, 2: 8, 3: 5}


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _thresholds(bits, heads=None, seed=0, scale=0.7):
    g = _gen(seed)
    shape = (1 << bits) - 1 if heads is None else (heads, (1 << bits) - 1)
    return (torch.randn(shape, generator=g) * scale).sort(-1).values


def _random_words(shape_lead, d, bits, seed=0):
    """Valid packed words (random codes, padding codes 0)."""
    codes = torch.randint(0, 1 << bits, (*shape_lead, d), generator=_gen(seed), dtype=torch.uint8)
    return code_pack_reference(codes, bits)


# --------------------------------------------------------------------------------------------------------------
# Hadamard


@pytest.mark.parametrize("d", DIMS)
def test_hadamard_orthonormal_and_inverse(d):
    H = hadamard_matrix(d, torch.float64)
    assert H.shape == (d, d)
    torch.testing.assert_close(H @ H.T, torch.eye(d, dtype=torch.float64), atol=1e-12, rtol=0)
    assert torch.allclose(H.abs(), torch.full_like(H, d ** -0.5))  # a Hadamard matrix: entries ±1/sqrt(d)
    x = torch.randn(3, 5, d, generator=_gen(d))  # the reference does fp32 maths: fp32 tolerances
    y = hadamard_reference(x)
    H = H.float()
    torch.testing.assert_close(y, x @ H)
    torch.testing.assert_close(y @ H.T, x)  # the inverse is Hᵀ for every construction
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))  # eq. 3: dot products are kept
    if d & (d - 1) == 0:  # Sylvester's H is symmetric: H(Hx) = x
        torch.testing.assert_close(hadamard_reference(y), x)


def test_hadamard_kronecker_structure():
    """80 = 4·20 and 96 = 8·12 are H_{2^n} ⊗ H_m, not some other orthogonal matrix."""
    for d, p, m in [(80, 4, 20), (96, 8, 12), (24, 2, 12)]:
        H = hadamard_matrix(d, torch.float64) * d ** 0.5
        torch.testing.assert_close(H, torch.kron(hadamard_matrix(p, torch.float64) * p ** 0.5,
                                                 hadamard_matrix(m, torch.float64) * m ** 0.5))


@pytest.mark.parametrize("d", [0, 3, 36, 70, 100, 112, 144])
def test_hadamard_unsupported_dims_fail_clearly(d):
    with pytest.raises(ValueError, match=rf"head dim {d}\b.*supported"):
        hadamard_matrix(d)
    if d:
        with pytest.raises(ValueError, match=str(d)):
            hadamard(torch.zeros(2, d))
    assert "12·2^n" in SUPPORTED_HADAMARD and "20·2^n" in SUPPORTED_HADAMARD


@pytest.mark.parametrize("d", [1, 12, 20, 64, 80, 96, 128, 160, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_hadamard_kernel_matches_reference(d, dtype):
    x = torch.randn(2, 3, 7, d, generator=_gen(d)).to(DEV, dtype)
    out = hadamard(x)
    ref = hadamard_reference(x)
    assert out.shape == x.shape and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def test_hadamard_kernel_many_rows_and_strided_input():
    x = torch.randn(100, 2, 128, generator=_gen(1)).to(DEV)[:, 1]  # rows 256 elements apart
    torch.testing.assert_close(hadamard(x), hadamard_reference(x), atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------------------------------------
# bucketize and pack: the conventions


def test_bucketize_counts_thresholds_strictly_below():
    x = torch.tensor([-2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0, float("inf"), float("-inf")])
    th = torch.tensor([-1.0, 0.0, 1.0])
    assert code_bucketize_reference(x, th).tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 0]
    inf = float("inf")
    assert code_bucketize_reference(x, torch.tensor([-inf, -inf, -inf])).tolist() == [3] * 8 + [0]
    assert code_bucketize_reference(x, torch.tensor([inf, inf, inf])).tolist() == [0] * 9
    assert code_bucketize_reference(x, torch.tensor([0.0]), bits=1).tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 0]


def test_bucketize_per_head_thresholds():
    x = torch.zeros(1, 4, 2, 3)  # [B, H, n, D]
    th = torch.tensor([[-1.0, -0.5, 1.0], [1.0, 2.0, 3.0]])  # 2 rows for 4 heads: heads 0-1 row 0, 2-3 row 1
    codes = code_bucketize_reference(x, th)
    assert codes[0, :, 0, 0].tolist() == [2, 2, 0, 0]
    with pytest.raises(ValueError):
        code_bucketize_reference(torch.zeros(1, 3, 2, 3), th)  # 3 heads, 2 rows


def test_pack_layout_by_hand():
    # bits=2: code i at bit 2i; 0,1,2,3,0,1,2,3 -> 4 + 32 + 192 + 1024 + 8192 + 49152 = 58596 = int16 -6940
    codes = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 2]], dtype=torch.uint8)
    assert code_pack_reference(codes, 2).tolist() == [[58596 - 65536, 2]]  # 9th code alone in word 2
    # bits=3: 5 codes per word at bits 0, 3, 6, 9, 12; bit 15 stays 0
    codes3 = torch.tensor([1, 2, 3, 4, 7, 5], dtype=torch.uint8)
    assert code_pack_reference(codes3, 3).tolist() == [1 + (2 << 3) + (3 << 6) + (4 << 9) + (7 << 12), 5]
    # bits=1: 16 codes per word, code i at bit i
    codes1 = torch.zeros(17, dtype=torch.uint8)
    codes1[[0, 15, 16]] = 1
    assert code_pack_reference(codes1, 1).tolist() == [1 + (1 << 15) - 65536, 1]


@pytest.mark.parametrize("bits", [1, 2, 3])
@pytest.mark.parametrize("d", [1, 7, 37, 64, 80])
def test_pack_unpack_round_trip(bits, d):
    codes = torch.randint(0, 1 << bits, (3, 4, d), generator=_gen(d + bits), dtype=torch.uint8)
    words = code_pack_reference(codes, bits)
    assert words.dtype == torch.int16 and words.shape == (3, 4, -(-d // PER_WORD[bits]))
    assert torch.equal(code_unpack_reference(words, d, bits), codes)
    # padding codes are 0: unpacking the whole last word shows zeros past d
    tail = code_unpack_reference(words, words.shape[-1] * PER_WORD[bits], bits)[..., d:]
    assert not tail.any()


# --------------------------------------------------------------------------------------------------------------
# fused quantize + pack


def _check_codes(words, x, th, bits, transform, tol=1e-4):
    """Kernel words == reference words, except at values within float rounding of a threshold (the kernel's fp32
    sum runs in another order), which must be rare."""
    D = x.shape[-1]
    y = hadamard_reference(x.double()) if transform else x.double()
    ref = code_bucketize_reference(y, th.double(), bits)
    got = code_unpack_reference(words.cpu(), D, bits)
    assert words.dtype == torch.int16 and words.shape == (*x.shape[:-1], -(-D // PER_WORD[bits]))
    bad = got != ref.cpu()
    if bad.any():
        thr = th.double().cpu()
        thr = thr.repeat_interleave(x.shape[1] // thr.shape[0], 0)[:, None, None, :] if thr.dim() == 2 else thr
        near = ((y.cpu().unsqueeze(-1) - thr).abs() < tol).any(-1)
        assert not (bad & ~near).any(), f"{int((bad & ~near).sum())} codes differ away from a threshold"
        assert bad.float().mean() < 1e-3
    # and the padding codes of the last word are 0
    tail = code_unpack_reference(words.cpu(), words.shape[-1] * PER_WORD[bits], bits)[..., D:]
    assert not tail.any()


@pytest.mark.parametrize("bits,transform,dtype,shared", [
    (b, t, dt, s) for b, t, dt, s in itertools.product([1, 2, 3], [True, False], [torch.float32, torch.float16],
                                                       [True, False])])
def test_quantize_pack_matches_reference(bits, transform, dtype, shared):
    B, H, n, D = 2, 4, 37, 80  # 80 = 4·20: Kronecker Hadamard; 80 codes: W = 5 / 10 / 16 words
    x = torch.randn(B, H, n, D, generator=_gen(bits)) * (1.0 if transform else 0.8)
    x = x.to(DEV, dtype)
    th = _thresholds(bits, None if shared else H, seed=bits).to(DEV)
    _check_codes(quantize_pack(x, th, bits, transform), x, th, bits, transform)


@pytest.mark.parametrize("D", [1, 12, 20, 64, 96, 128, 256])
def test_quantize_pack_head_dims(D):
    x = torch.randn(1, 2, 19, D, generator=_gen(D)).to(DEV)
    th = _thresholds(2, 2, seed=D).to(DEV)
    _check_codes(quantize_pack(x, th, 2), x, th, 2, True)


def test_quantize_pack_gqa_thresholds_and_unsupported_dim():
    x = torch.randn(1, 8, 5, 64, generator=_gen(5)).to(DEV)
    th = _thresholds(2, 2, seed=5).to(DEV)  # 2 KV heads' thresholds serve 8 query heads: head h uses row h // 4
    words = quantize_pack(x, th, 2)
    _check_codes(words, x, th, 2, True)
    per_head = quantize_pack(x, th.repeat_interleave(4, 0), 2)
    assert torch.equal(words, per_head)
    assert not torch.equal(words, quantize_pack(x, th.flip(0), 2))  # the row really matters
    with pytest.raises(ValueError, match="70"):
        quantize_pack(torch.zeros(1, 1, 2, 70, device=DEV), torch.zeros(3, device=DEV), 2)
    with pytest.raises(ValueError):
        quantize_pack(x, torch.zeros(3, 3, device=DEV), 2)  # 3 rows do not divide 8 heads
    with pytest.raises(ValueError):
        quantize_pack(x, torch.zeros(4, device=DEV), 2)  # bits=2 needs 3 thresholds


@pytest.mark.parametrize("transform", [True, False])
def test_quantize_pack_infinite_thresholds(transform):
    inf = float("inf")
    x = torch.randn(1, 2, 9, 64, generator=_gen(9)).to(DEV)
    x[0, 0, 0, :4] = torch.tensor([1e30, -1e30, 0.0, 3.0])
    for row, code in [([-inf, -inf, -inf], 3), ([inf, inf, inf], 0), ([-inf, inf, inf], 1), ([-inf, -inf, inf], 2)]:
        th = torch.tensor(row, device=DEV)
        words = quantize_pack(x, th, 2, transform)
        assert (code_unpack_reference(words.cpu(), 64, 2) == code).all(), row
    th = torch.tensor([[-inf, 0.0, inf], [inf, inf, inf]], device=DEV)  # per head: head 1 all 0
    x[0, 0, 0, :4] = 0.5  # huge values cancel in another order in the reference: only the ±inf cases above
    words = quantize_pack(x, th, 2, transform)
    _check_codes(words, x, th, 2, transform)
    assert not words[:, 1].any()
    for bits, code in [(1, 1), (3, 7)]:
        words = quantize_pack(x, torch.full(((1 << bits) - 1,), -inf, device=DEV), bits, transform)
        assert (code_unpack_reference(words.cpu(), 64, bits) == code).all()


def test_quantize_pack_by_hand():
    """No transform: the codes are the bucket numbers of the values themselves."""
    vals = torch.tensor([-2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0, 0.25, 9.0], device=DEV)
    x = vals.view(1, 1, 1, 9)
    words = quantize_pack(x, torch.tensor([-1.0, 0.0, 1.0], device=DEV), 2, transform=False)
    codes = [0, 0, 1, 1, 2, 2, 3, 2, 3]
    word0 = sum(c << (2 * i) for i, c in enumerate(codes[:8]))
    assert words.view(-1).tolist() == [word0 - 65536 if word0 >= 32768 else word0, 3]


@pytest.mark.parametrize("transform,gqa,dtype", [(True, 4, torch.float32), (True, 1, torch.float16),
                                                 (False, 2, torch.float32)])
def test_quantize_pack_codes_a_pending_key_in_the_same_launch(transform, gqa, dtype):
    """quantize_pack(q, ..., append=PendingCodes(k, k thresholds, codes, slots)) = quantize_pack_into(k, ...) at the
    slots, then quantize_pack(q, ...): the kernel and the reference each against its own two calls, every other slot
    untouched; a bad append is refused."""
    from sparsekv.kernels.reference import PendingCodes, quantize_pack_into_reference, quantize_pack_reference

    B, Hkv, Lmax, D, bits = 2, 2, 24, 64, 2
    W = -(-D // PER_WORD[bits])
    q = torch.randn(B, Hkv * gqa, 1, D, generator=_gen(31)).to(DEV, dtype)
    k = torch.randn(B, Hkv, 1, D, generator=_gen(32)).to(DEV, dtype)
    q_th, k_th = _thresholds(bits, Hkv, seed=33).to(DEV), _thresholds(bits, Hkv, seed=34, scale=0.4).to(DEV)
    slots = torch.tensor([17, 5], dtype=torch.int32, device=DEV)
    before = torch.full((B, Hkv, Lmax, W), 321, dtype=torch.int16, device=DEV)
    for pack, into in ((quantize_pack, quantize_pack_into), (quantize_pack_reference, quantize_pack_into_reference)):
        want, got = before.clone(), before.clone()
        into(k, k_th, want, slots, bits, transform)
        words = pack(q, q_th, bits, transform, append=PendingCodes(k, k_th, got, slots))
        assert torch.equal(words, pack(q, q_th, bits, transform)) and torch.equal(got, want), pack.__name__
    with pytest.raises(ValueError, match="append.slots"):
        quantize_pack(q, q_th, bits, transform, append=PendingCodes(k, k_th, before, slots[:1]))
    with pytest.raises(ValueError, match="append: keys"):
        quantize_pack(q.expand(B, -1, 2, D), q_th, bits, transform, append=PendingCodes(k, k_th, before, slots))


@pytest.mark.parametrize("bits", [2, 3])
def test_quantize_pack_into_writes_only_its_slots(bits):
    B, H, Lmax, D = 2, 3, 40, 64
    W = -(-D // PER_WORD[bits])
    state = torch.full((B, H, Lmax, W), 12345, dtype=torch.int16, device=DEV)
    before = state.clone()
    th = _thresholds(bits, H, seed=bits).to(DEV)
    x = torch.randn(B, H, 7, D, generator=_gen(7)).to(DEV)
    quantize_pack_into(x, th, state, 11, bits=bits)
    assert torch.equal(state[:, :, 11:18], quantize_pack(x, th, bits))
    assert torch.equal(state[:, :, :11], before[:, :, :11]) and torch.equal(state[:, :, 18:], before[:, :, 18:])
    # a decode step appends one token; a strided (transposed) input works too
    xt = torch.randn(B, 1, H, D, generator=_gen(8)).to(DEV).transpose(1, 2)
    quantize_pack_into(xt, th, state, 18, bits=bits)
    assert torch.equal(state[:, :, 18:19], quantize_pack(xt.contiguous(), th, bits))
    assert torch.equal(state[:, :, 19:], before[:, :, 19:])
    # a graph-replayed decode step: each row's slot read on the device
    rows = torch.tensor([25, 3], dtype=torch.int32, device=DEV)
    one = torch.randn(B, H, 1, D, generator=_gen(9)).to(DEV)
    quantize_pack_into(one, th, state, rows, bits=bits)
    codes = quantize_pack(one, th, bits)
    assert torch.equal(state[0, :, 25:26], codes[0]) and torch.equal(state[1, :, 3:4], codes[1])
    assert torch.equal(state[0, :, 19:25], before[0, :, 19:25]) and torch.equal(state[1, :, 19:], before[1, :, 19:])
    with pytest.raises(ValueError, match="start must be"):
        quantize_pack_into(one, th, state, rows[:1], bits=bits)
    with pytest.raises(ValueError):
        quantize_pack_into(x, th, state, Lmax - 3, bits=bits)  # would run past the buffer
    with pytest.raises(ValueError):
        quantize_pack_into(x, th, state.int(), 0, bits=bits)


# --------------------------------------------------------------------------------------------------------------
# code distances


def test_code_distance_by_hand():
    q = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])
    keys = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3],  # itself: 0
                         [3, 3, 3, 3, 3, 3, 3, 3],  # l1 3+2+1+0 twice = 12, l2 9+4+1+0 twice = 28
                         [0, 0, 0, 0, 0, 0, 0, 0],  # l1 12, l2 0+1+4+9 twice = 28
                         [1, 0, 3, 2, 1, 0, 3, 2],  # every code off by one: l1 8, l2 8
                         [3, 1, 2, 3, 0, 1, 2, 0]])  # two codes off by 3: l1 6, l2 18
    expect = {"l1": [0, 12, 12, 8, 6], "l2": [0, 28, 28, 8, 18]}
    for reps in (1, 2, 5):  # D = 8 (one int16 word), 16 (one int32 lane: the fast path), 40 (odd word count)
        D = 8 * reps
        qw = code_pack_reference(q.repeat(reps).to(torch.uint8), 2).view(1, 1, -1).to(DEV)
        kw = code_pack_reference(keys.repeat(1, reps).to(torch.uint8), 2).view(1, 1, 5, -1)
        kw = torch.cat([kw, torch.full_like(kw[:, :, :2], -1)], 2).to(DEV)  # 2 junk slots past `length`
        for metric in ("l1", "l2"):
            want = [v * reps for v in expect[metric]]
            assert code_distance(qw, kw, 5, D, 2, metric).view(-1).tolist() == want, (D, metric)
            assert code_distance_reference(qw, kw[:, :, :5], D, 2, metric).view(-1).tolist() == want
            assert code_scores(qw, kw, 5, D, 2, metric).view(-1).tolist() == [-v for v in want]
    # bits=1: Hamming distance
    qw = code_pack_reference(torch.tensor([1, 0, 1, 1, 0], dtype=torch.uint8), 1).view(1, 1, 1).to(DEV)
    kw = code_pack_reference(torch.tensor([[1, 0, 1, 1, 0], [0, 1, 0, 0, 1], [1, 1, 1, 1, 1]], dtype=torch.uint8),
                               1).view(1, 1, 3, 1).to(DEV)
    assert code_distance(qw, kw, 3, 5, 1).view(-1).tolist() == [0, 5, 2]


@pytest.mark.parametrize("G", [1, 4, 8])
@pytest.mark.parametrize("metric", ["l1", "l2"])
@pytest.mark.parametrize("bits", [1, 2, 3])
def test_code_distance_matches_reference(G, metric, bits):
    B, Hkv, Lmax, length = 2, 2, 160, 141
    for D in (64, 20):  # 64: even word count (2-bit: int32 lanes); 20: odd (2-bit: int16 words)
        qw = _random_words((B, Hkv * G), D, bits, seed=G + D).to(DEV)
        kw = _random_words((B, Hkv, Lmax), D, bits, seed=bits + D).to(DEV)
        ref = code_distance_reference(qw, kw[:, :, :length], D, bits, metric)
        out = code_distance(qw, kw, length, D, bits, metric)
        assert out.dtype == torch.int32 and out.shape == (B, Hkv * G, length)
        assert torch.equal(out, ref), (D, bits, metric, G)
    # pooled over the query group in the kernel: min distance, or the negated sum as top-k scores
    ref_min = code_distance_reference(qw, kw[:, :, :length], D, bits, metric, pool="min")
    assert ref_min.shape == (B, Hkv, length)
    assert torch.equal(code_distance(qw, kw, length, D, bits, metric, pool="min"), ref_min)
    ref_sum = code_distance_reference(qw, kw[:, :, :length], D, bits, metric, pool="sum")
    sc = code_scores(qw, kw, length, D, bits, metric, pool="sum")
    assert sc.dtype.is_floating_point and torch.equal(sc.float(), -ref_sum.float())


def test_code_distance_sliced_cache_and_decode_shape():
    """k_words may be a view into the cache (e.g. past the sink), q_words may come straight from quantize_pack."""
    B, Hkv, G, Lmax, D = 1, 2, 4, 130, 128
    kw = _random_words((B, Hkv, Lmax), D, 2, seed=1).to(DEV)
    qw = _random_words((B, Hkv * G, 1), D, 2, seed=2).to(DEV)  # [B, Hq, 1, W]
    for s in (0, 3, 4):
        out = code_distance(qw, kw[:, :, s:], 100, D)
        assert torch.equal(out, code_distance_reference(qw[:, :, 0], kw[:, :, s:s + 100], D))


@pytest.mark.parametrize("D", [128, 320, 336, 512])
def test_code_distance_extremes(D):
    """Largest distances (all codes 0 vs all 3): the fast path's packed partial sums must not overflow."""
    qw = code_pack_reference(torch.full((1, 2, D), 3, dtype=torch.uint8), 2).to(DEV)
    kw = code_pack_reference(torch.tensor([0, 3, 1], dtype=torch.uint8).view(1, 1, 3, 1).expand(1, 1, 3, D), 2)
    out = code_distance(qw, kw.to(DEV), 3, D)
    assert out.view(2, 3).tolist() == [[3 * D, 0, 2 * D]] * 2
    assert code_distance(qw, kw.to(DEV), 3, D, metric="l2").view(2, 3).tolist() == [[9 * D, 0, 4 * D]] * 2
    assert code_scores(qw, kw.to(DEV), 3, D, pool="sum").view(-1).tolist() == [-6 * D, 0, -4 * D]


def test_code_distance_rejects_bad_shapes():
    qw = _random_words((1, 4), 64, 2).to(DEV)
    kw = _random_words((1, 3, 10), 64, 2).to(DEV)
    with pytest.raises(ValueError):
        code_distance(qw, kw, 5, 64)  # 4 query heads, 3 KV heads
    kw = _random_words((1, 2, 10), 64, 2).to(DEV)
    with pytest.raises(ValueError):
        code_distance(qw, kw, 11, 64)  # past the buffer
    with pytest.raises(ValueError):
        code_distance(qw, kw, 5, 72)  # 72 dims need 9 words, not 8
    with pytest.raises(ValueError):
        code_distance(qw, kw, 5, 64, metric="cos")


def test_end_to_end_selection_by_hand():
    """Quantize a query and keys with the kernels and check the closest key is the one built to match."""
    D, L = 64, 50
    g = _gen(11)
    keys = torch.randn(1, 1, L, D, generator=g)
    q = keys[:, :, 17:18] + 0.05 * torch.randn(1, 1, 1, D, generator=g)
    th = torch.tensor([-0.6745, 0.0, 0.6745])  # quartiles of N(0, 1): the Hadamard transform keeps N(0, 1)
    kw = quantize_pack(keys.to(DEV), th.to(DEV))
    qw = quantize_pack(q.to(DEV), th.to(DEV))
    dist = code_distance(qw[:, :, 0], kw, L, D)
    assert int(dist.argmin()) == 17
    assert int(code_scores(qw, kw, L, D).argmax()) == 17


# --------------------------------------------------------------------------------------------------------------
# asymmetric scores (distance "ip")

INF = float("inf")


@pytest.mark.parametrize("thr,centers", [
    ((-10.0, 0.0, 10.0), (-15.0, -5.0, 5.0, 15.0)),  # midpoints; the outer buckets extend by half a neighbour
    ((-1.0, 0.0, 3.0), (-1.5, -0.5, 1.5, 4.5)),
    ((0.5,), (0.0, 1.0)),  # one threshold: no finite bucket, width 1
    ((-INF, 0.0, 3.0), (0.0, -1.5, 1.5, 4.5)),  # bucket 0 is empty (nothing is below -inf): any finite value
    ((1.0, 2.0, INF), (0.5, 1.5, 2.5, 0.0)),
    ((-INF, -INF, INF), (0.0, 0.0, 0.0, 0.0)),
])
def test_bucket_centers(thr, centers):
    assert adamas_bucket_centers(torch.tensor(thr)).tolist() == list(centers)
    two = adamas_bucket_centers(torch.tensor([thr, thr]))  # per-head rows
    assert two.shape == (2, len(thr) + 1) and two[1].tolist() == list(centers)


def test_ip_reference_by_hand():
    """Codes (3, 0, 1, 2) read as centers (-15, -5, 5, 15) -> (15, -15, -5, 5); q = (1, 2, 3, 4): 15 - 30 - 15 + 20."""
    kw = code_pack_reference(torch.tensor([3, 0, 1, 2], dtype=torch.uint8).view(1, 1, 1, 4), 2)
    cen = adamas_bucket_centers(torch.tensor([[-10.0, 0.0, 10.0]]))
    q = torch.tensor([[[1.0, 2.0, 3.0, 4.0]]])
    assert adamas_ip_scores_reference(q, kw, cen, 4).tolist() == [[[-10.0]]]
    assert code_ip_scores(q.to(DEV), kw.to(DEV), cen, 1, 4).tolist() == [[[-10.0]]]


@pytest.mark.parametrize("bits,D,G,pool", [(2, 128, 4, None), (2, 128, 4, "sum"), (2, 64, 1, None), (1, 128, 2, None),
                                           (3, 80, 3, "sum"), (2, 20, 3, None), (2, 8, 2, "sum")])
def test_code_ip_scores_match_reference(bits, D, G, pool):
    """Every code width and GQA group, a cache sliced past a sink, padding words (D not a multiple of the codes per
    word) and a key count that is not a multiple of the block: the kernel equals the fp32 reference to fp32
    rounding."""
    B, Hkv, Lmax, length, s = 2, 2, 300, 261, 3
    kw = _random_words((B, Hkv, Lmax), D, bits, seed=D + bits).to(DEV)[:, :, s:]
    cen = adamas_bucket_centers(_thresholds(bits, Hkv, seed=bits, scale=3.0))
    q = (torch.randn(B, Hkv * G, 1, D, generator=_gen(D)) * 4).to(DEV)
    out = code_ip_scores(q, kw, cen, length, D, bits, pool=pool)
    ref = adamas_ip_scores_reference(q[:, :, 0].cpu(), kw[:, :, :length].cpu(), cen, D, bits, pool=pool)
    assert out.shape == ref.shape == (B, Hkv if pool else Hkv * G, length) and out.dtype == torch.float32
    torch.testing.assert_close(out.cpu(), ref, atol=1e-5 * float(ref.abs().max()), rtol=0)


def test_code_ip_scores_reject_bad_input():
    kw = _random_words((1, 2, 10), 64, 2)
    cen = adamas_bucket_centers(_thresholds(2, 2))
    q = torch.randn(1, 4, 64)
    for args, kwargs, msg in [((q[..., :32], kw, cen, 10, 64), {}, "q must be"),
                              ((q, kw, cen[:1], 10, 64), {}, "centers must be"),
                              ((q[:, :3], kw, cen, 10, 64), {}, "not a multiple"),
                              ((q, kw, cen, 11, 64), {}, "outside the key buffer"),
                              ((q, kw, cen, 10, 64), {"pool": "min"}, "pool must be"),
                              ((q, kw.int(), cen, 10, 64), {}, "int16")]:
        with pytest.raises(ValueError, match=msg):
            code_ip_scores(*args, **kwargs)
    assert code_ip_scores(q, kw, cen, 0, 64).shape == (1, 4, 0)


# --------------------------------------------------------------------------------------------------------------
# GPU only: bf16 (the interpreter cannot do bf16) at a real shape


@pytest.mark.skipif(not CUDA, reason="bf16 needs a GPU (the Triton interpreter cannot do bf16)")
def test_bf16_on_gpu():
    B, Hkv, G, L, D = 1, 8, 4, 4099, 128
    x = torch.randn(B, Hkv, L, D, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(hadamard(x).float(), hadamard_reference(x).float(), atol=2e-2, rtol=2e-2)
    th = _thresholds(2, Hkv).cuda()
    words = quantize_pack(x, th, 2)
    _check_codes(words, x.float(), th, 2, True, tol=1e-3)
    q = torch.randn(B, Hkv * G, 1, D, device="cuda", dtype=torch.bfloat16)
    qw = quantize_pack(q, th, 2)
    ref = code_distance_reference(qw[:, :, 0], words, D)
    assert torch.equal(code_distance(qw, words, L, D), ref)


@pytest.mark.skipif(not CUDA, reason="the POPC paths run only on CUDA (the interpreter runs no PTX)")
@pytest.mark.parametrize("bits", [1, 2])
def test_gpu_distance_lane_paths(bits):
    """Every lane width and counting path of the 1-/2-bit L1 kernel equals the reference on the GPU: SWAR byte sums
    (popc=0, what the interpreter runs), one POPC per int32 lane (1), and for 2-bit codes int64 lane pairs through a
    carry-save adder (2, the default). Word counts divisible by 4 (int64 lanes), by 2 only (int32), odd (int16);
    sliced caches; GQA 1/4/8; every pooling."""
    from sparsekv.kernels.codes import _launch_distance

    B, Lmax, length = 2, 700, 613
    cases = [(128, 4), (128, 1), (96, 8), (80, 4), (72, 4), (64, 4)] if bits == 2 else [(128, 4), (80, 4), (20, 1)]
    for (D, G), s in itertools.product(cases, (0, 1)):
        qw = _random_words((B, 2 * G), D, bits, seed=D + G).cuda()
        kw = _random_words((B, 2, Lmax), D, bits, seed=D + s).cuda()[:, :, s:]  # a view past row s, as the sink
        ref = code_distance_reference(qw, kw[:, :, :length], D, bits)
        for popc in (0, 1, 2):
            out = _launch_distance(qw, kw, length, D, bits, "l1", None, torch.int32, False, None, 4, popc=popc)[0]
            assert torch.equal(out, ref), (D, G, s, popc)
        for pool in ("sum", "min"):  # the default path, pooled in the kernel
            ref = code_distance_reference(qw, kw[:, :, :length], D, bits, pool=pool)
            assert torch.equal(code_distance(qw, kw, length, D, bits, pool=pool), ref), (D, G, s, pool)
    # the largest distances, through the default path
    for D in (128, 256, 336):
        qw = code_pack_reference(torch.full((1, 2, D), 3, dtype=torch.uint8), 2).cuda()
        kw = code_pack_reference(torch.tensor([0, 3, 1], dtype=torch.uint8).view(1, 1, 3, 1).expand(1, 1, 3, D), 2)
        assert code_distance(qw, kw.cuda(), 3, D).view(2, 3).tolist() == [[3 * D, 0, 2 * D]] * 2


@pytest.mark.skipif(not CUDA, reason="bf16 needs a GPU (the Triton interpreter cannot do bf16)")
def test_gpu_ip_scores_real_shape():
    """llama3-8b's shape (8 KV heads x 4, D 128), a bf16 query, 4099 keys written by quantize_pack: the kernel
    equals the reference to fp32 rounding, and our top-k of its scores keeps > 99 % of the reference's top-255 (a
    rounding-level difference may swap a key at the cut)."""
    from sparsekv.kernels.topk import topk

    B, Hkv, G, L, D = 1, 8, 4, 4099, 128
    torch.manual_seed(0)
    x = torch.randn(B, Hkv, L, D, device="cuda", dtype=torch.bfloat16)
    th = _thresholds(2, Hkv).cuda()
    words = quantize_pack(x, th, 2)
    q = (torch.randn(B, Hkv * G, D, device="cuda", dtype=torch.bfloat16).float() @
         hadamard_matrix(D, torch.float32, "cuda"))
    cen = adamas_bucket_centers(th)
    for pool in (None, "sum"):
        out = code_ip_scores(q, words, cen, L, D, pool=pool)
        ref = adamas_ip_scores_reference(q, words, cen, D, pool=pool)
        torch.testing.assert_close(out, ref, atol=1e-5 * float(ref.abs().max()), rtol=0)
        got = topk(out.view(-1, L), 255).tolist()
        want = torch.topk(ref.view(-1, L), 255).indices.tolist()
        same = sum(len(set(a) & set(b)) for a, b in zip(got, want)) / (255 * len(got))
        assert same > 0.99  # rounding-level differences may swap a key at the cut


def _ternary_words(lead, d, seed=0, care=0.67):
    """Ternary query words [..., 2W]: random sign words, then care words with about `care` of the bits set."""
    signs = _random_words(lead, d, 1, seed)
    cared = (torch.rand(*lead, d, generator=_gen(seed + 1)) < care).to(torch.uint8)
    return torch.cat([signs, code_pack_reference(cared, 1)], -1)


def test_ternary_distance_by_hand():
    """A ternary query counts the differing bits it cares for only."""
    qw = torch.cat([code_pack_reference(torch.tensor([1, 0, 1, 1, 0], dtype=torch.uint8), 1),
                    code_pack_reference(torch.tensor([1, 1, 0, 1, 0], dtype=torch.uint8), 1)]).view(1, 1, 2).to(DEV)
    keys = torch.tensor([[1, 0, 1, 1, 0],  # itself: 0
                         [0, 1, 0, 0, 1],  # every bit differs; bits 0, 1 and 3 count: 3
                         [1, 1, 1, 1, 1],  # bits 1 and 4 differ; 4 does not count: 1
                         [1, 0, 0, 1, 1]], dtype=torch.uint8)  # bits 2 and 4 differ, neither counts: 0
    kw = code_pack_reference(keys, 1).view(1, 1, 4, 1).to(DEV)
    assert code_distance(qw, kw, 4, 5, 1).view(-1).tolist() == [0, 3, 1, 0]
    assert code_distance_reference(qw, kw, 5, 1).view(-1).tolist() == [0, 3, 1, 0]
    assert code_scores(qw, kw, 4, 5, 1, pool="sum").view(-1).tolist() == [0, -3, -1, 0]
    with pytest.raises(ValueError, match="ternary"):  # 2-bit codes take no care words
        code_distance(_random_words((1, 1), 16, 2).repeat(1, 1, 2).to(DEV), _random_words((1, 1, 3), 16, 2).to(DEV),
                      3, 16, 2)


@pytest.mark.parametrize("G", [1, 4])
@pytest.mark.parametrize("D", [128, 80, 20])  # 8 words (int32 lanes), 5 (int16 words), 2 (one int32 lane)
def test_ternary_distance_matches_reference(G, D):
    B, Hkv, Lmax, length = 2, 2, 160, 141
    qw = _ternary_words((B, Hkv * G), D, seed=G + D).to(DEV)
    kw = _random_words((B, Hkv, Lmax), D, 1, seed=D).to(DEV)
    ref = code_distance_reference(qw, kw[:, :, :length], D, 1)
    assert torch.equal(code_distance(qw, kw, length, D, 1), ref)
    assert not torch.equal(ref, code_distance_reference(qw[..., : qw.shape[-1] // 2], kw[:, :, :length], D, 1))
    for pool in ("sum", "min"):
        want = code_distance_reference(qw, kw[:, :, :length], D, 1, pool=pool)
        assert torch.equal(code_distance(qw, kw, length, D, 1, pool=pool), want), pool
    sc = code_scores(qw[:, :, None], kw[:, :, 3:], length - 3, D, 1, pool="sum")  # [B, Hq, 1, 2W], a sliced cache
    assert torch.equal(sc.float(), -code_distance_reference(qw, kw[:, :, 3:length], D, 1, pool="sum").float())
    full = torch.cat([qw[..., : qw.shape[-1] // 2], torch.full_like(qw[..., qw.shape[-1] // 2:], -1)], -1)
    assert torch.equal(code_distance(full, kw, length, D, 1), code_distance(qw[..., : qw.shape[-1] // 2], kw, length,
                                                                             D, 1))  # caring for every bit: Hamming


@pytest.mark.skipif(not CUDA, reason="the POPC paths run only on CUDA (the interpreter runs no PTX)")
def test_gpu_ternary_lane_paths():
    """Ternary queries through every counting path on the GPU (SWAR, POPC), int32 lanes and int16 words."""
    from sparsekv.kernels.codes import _launch_distance

    B, Lmax, length = 2, 700, 613
    for D, G in ((128, 4), (80, 4), (20, 1)):
        qw = _ternary_words((B, 2 * G), D, seed=D + G).cuda()
        kw = _random_words((B, 2, Lmax), D, 1, seed=D).cuda()[:, :, 1:]
        ref = code_distance_reference(qw, kw[:, :, :length], D, 1)
        for popc in (0, 1, 2):
            out = _launch_distance(qw, kw, length, D, 1, "l1", None, torch.int32, False, None, 4, popc=popc)[0]
            assert torch.equal(out, ref), (D, G, popc)
        want = code_distance_reference(qw, kw[:, :, :length], D, 1, pool="sum")
        assert torch.equal(code_distance(qw, kw, length, D, 1, pool="sum"), want), (D, G)
