"""The Triton sparse-decode family against its torch reference: under TRITON_INTERPRET=1 on the CPU (small
shapes, fp32/fp16: the interpreter cannot do bf16) and, when a GPU is present, at real shapes in bf16 too."""

import pytest
import torch

from sparsekv.kernels.reference import block_positions_reference, qk_logits_reference, sparse_decode_reference
from sparsekv.kernels.sparse_decode import block_positions, dense_decode, qk_logits, sparse_decode
from sparsekv.selection import Selection

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def _args(sel, lengths):
    a = sel.decode_args()
    if lengths is not None:  # rows of their own lengths
        a["lengths"] = lengths
    return a


def kernel(q, k, v, sel, scale, lengths=None, **kw):
    """The kernel on a Selection's plain arguments (as ops.sparse_decode passes them)."""
    return sparse_decode(q, k, v, scale, **_args(sel, lengths), **kw)


def reference(q, k, v, sel, scale, lengths=None, **kw):
    return sparse_decode_reference(q, k, v, scale, **_args(sel, lengths), **kw)


def _data(B, Hkv, G, L, D, dtype, seed=0, extra=5):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hkv * G, 1, D, generator=g)
    k = torch.randn(B, Hkv, L + extra, D, generator=g)
    v = torch.randn(B, Hkv, L + extra, D, generator=g)
    return [t.to(DEV, dtype) for t in (q, k, v)]


def _indices(B, H, L, sink, window, n, seed=0, pad=0):
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randperm(L - sink - window, generator=g)[:n] + sink for _ in range(B * H)]
    idx = torch.stack(rows).view(B, H, n)
    if pad:
        idx[..., -pad:] = -1
    return idx.to(DEV)


def _close(out, ref, dtype):
    tol = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    assert out.shape == ref.shape and not out.isnan().any()
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("G", [1, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_indices_match_reference(G, dtype):
    B, Hkv, L, D = 2, 2, 211, 64
    q, k, v = _data(B, Hkv, G, L, D, dtype, seed=G)
    sel = Selection(L, sink=4, window=16, indices=_indices(B, Hkv, L, 4, 16, 41, seed=G, pad=3))
    _close(kernel(q, k, v, sel, D**-0.5), reference(q, k, v, sel, D**-0.5), dtype)


@pytest.mark.parametrize("D", [64, 80, 96, 128, 256])
def test_head_dims(D):
    q, k, v = _data(1, 2, 4, 97, D, torch.float32, seed=D)
    sel = Selection(97, sink=2, window=8, indices=_indices(1, 2, 97, 2, 8, 13, seed=D))
    _close(kernel(q, k, v, sel, D**-0.5), reference(q, k, v, sel, D**-0.5), torch.float32)


def test_per_query_head_selection():
    B, Hkv, G, L, D = 1, 2, 4, 150, 64
    q, k, v = _data(B, Hkv, G, L, D, torch.float32)
    sel = Selection(L, sink=4, window=8, indices=_indices(B, Hkv * G, L, 4, 8, 17))
    _close(kernel(q, k, v, sel, 0.1), reference(q, k, v, sel, 0.1), torch.float32)


def test_blocks_match_reference():
    B, Hkv, G, L, D = 2, 2, 4, 203, 64
    q, k, v = _data(B, Hkv, G, L, D, torch.float32)
    blocks = torch.tensor([[[1, 5, -1], [2, 12, 0]], [[7, -1, -1], [4, 8, 11]]], device=DEV)  # 12: clipped tail
    sel = Selection(L, sink=4, window=16, blocks=blocks, block_size=16)
    _close(kernel(q, k, v, sel, D**-0.5), reference(q, k, v, sel, D**-0.5), torch.float32)


def test_csr_matches_reference():
    B, Hkv, G, L, D = 1, 2, 2, 120, 64
    q, k, v = _data(B, Hkv, G, L, D, torch.float32)
    g = torch.Generator().manual_seed(3)
    tokens = torch.stack([torch.randperm(L - 12, generator=g) + 4 for _ in range(Hkv)]).view(1, Hkv, -1)
    offsets = torch.tensor([0, 10, 25, 25, 60, L - 12]).view(1, 1, -1).expand(1, Hkv, -1)
    sel = Selection(L, sink=4, window=8, buckets=torch.tensor([[[3, 0, -1], [1, 2, 4]]]),
                    bucket_offsets=offsets.contiguous(), bucket_tokens=tokens)
    sel = Selection(L, 4, 8, buckets=sel.buckets.to(DEV), bucket_offsets=sel.bucket_offsets.to(DEV),
                    bucket_tokens=sel.bucket_tokens.to(DEV))
    idx = sel.sparse_positions()
    assert sorted(t for t in idx[0, 0].tolist() if t >= 0) == sorted(tokens[0, 0, 25:60].tolist() + tokens[0, 0, :10].tolist())
    _close(kernel(q, k, v, sel, D**-0.5), reference(q, k, v, sel, D**-0.5), torch.float32)


def test_empty_selections():
    q, k, v = _data(1, 2, 4, 50, 64, torch.float32)
    only_dense = Selection(50, sink=4, window=8)
    _close(kernel(q, k, v, only_dense, 0.1), reference(q, k, v, only_dense, 0.1), torch.float32)
    nothing = Selection(50, indices=torch.full((1, 2, 5), -1, device=DEV))
    out = kernel(q, k, v, nothing, 0.1)
    assert torch.equal(out, torch.zeros_like(out))  # reads no key: zeros, never NaN
    _close(out, reference(q, k, v, nothing, 0.1), torch.float32)


def test_duplicate_indices_are_rejected():
    q, k, v = _data(1, 2, 4, 60, 64, torch.float32)
    idx = torch.tensor([[[10, 11, 10], [20, 21, 22]]], device=DEV)
    with pytest.raises(ValueError, match="duplicate"):
        kernel(q, k, v, Selection(60, indices=idx), 0.1, check=True)


def test_sparse_positions_in_the_dense_part_read_nothing():
    """A sparse position inside the sink or the window, or past the row's end, is not read (a short row of a
    graph-replayed batch may be handed such): the step equals the one without it, on both paths."""
    q, k, v = _data(2, 2, 4, 60, 64, torch.float32)
    lens = torch.tensor([60, 40], device=DEV)
    clash = torch.tensor([[[2, 11, 12], [20, 57, 22]], [[2, 11, 12], [20, 36, 45]]], device=DEV)
    clean = torch.tensor([[[-1, 11, 12], [20, -1, 22]], [[-1, 11, 12], [20, -1, -1]]], device=DEV)
    kernel(q, k, v, Selection(60, sink=4, window=8, indices=clash), 0.1, lengths=lens, check=True)  # no duplicate
    for fn in (kernel, reference):
        got = fn(q, k, v, Selection(60, sink=4, window=8, indices=clash), 0.1, lengths=lens)
        _close(got, fn(q, k, v, Selection(60, sink=4, window=8, indices=clean), 0.1, lengths=lens), torch.float32)


def test_batch_rows_with_different_lengths():
    B, Hkv, G, L, D = 3, 2, 4, 180, 64
    q, k, v = _data(B, Hkv, G, L, D, torch.float32)
    lens = torch.tensor([180, 77, 130], device=DEV)
    idx = _indices(B, Hkv, L, 4, 16, 30)
    idx = torch.where(idx < lens.view(B, 1, 1) - 16, idx, -1)
    sel = Selection(L, sink=4, window=16, indices=idx)
    out = kernel(q, k, v, sel, 0.1, lengths=lens)
    _close(out, reference(q, k, v, sel, 0.1, lengths=lens), torch.float32)
    # each row equals a batch-1 call at its own length
    for b in range(B):
        one = Selection(int(lens[b]), 4, 16, indices=idx[b : b + 1])
        _close(out[b : b + 1], kernel(q[b : b + 1], k[b : b + 1], v[b : b + 1], one, 0.1), torch.float32)


def _spec(q, k, v, allowed, scale, softcap=None):
    """Attention of each query row over the keys `allowed` [B, Hq, L] marks, softcapped: written independently of
    the reference (its GQA by repeat, its mask by -inf)."""
    G = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(G, 1).double(), v.repeat_interleave(G, 1).double()
    s = torch.einsum("bhd,bhld->bhl", q[:, :, 0].double(), kk[:, :, : allowed.shape[-1]]) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    p = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1)
    return torch.einsum("bhl,bhld->bhd", p, vv[:, :, : allowed.shape[-1]]).unsqueeze(2)


@pytest.mark.parametrize("softcap", [None, 0.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sliding_window_and_softcap(softcap, dtype):
    """A layer that sees its last `span` keys: the sink is the window's first keys, dense reads the window only,
    indices outside it are never chosen by methods (not tested here); softcapped logits on every path."""
    B, Hkv, G, L, D, span = 2, 2, 4, 150, 64, 57
    q, k, v = _data(B, Hkv, G, L, D, dtype, seed=11)
    lo = L - span
    g = torch.Generator().manual_seed(5)
    rows = [torch.randperm(span - 3 - 8, generator=g)[:20] + lo + 3 for _ in range(B * Hkv)]
    idx = torch.stack(rows).view(B, Hkv, 20).to(DEV)
    sparse = Selection(L, sink=3, window=8, indices=idx, span=span)
    assert sparse.start == lo
    allowed = torch.zeros(B, Hkv, L, dtype=torch.bool, device=DEV)
    allowed[..., lo : lo + 3] = True
    allowed[..., L - 8 :] = True
    allowed.scatter_(2, idx, True)
    allowed = allowed.repeat_interleave(G, 1)
    scale = D**-0.5
    ref = reference(q, k, v, sparse, scale, softcap=softcap)
    _close(ref, _spec(q, k, v, allowed, scale, softcap).to(dtype), dtype)
    _close(kernel(q, k, v, sparse, scale, softcap=softcap), ref, dtype)
    window_only = torch.zeros_like(allowed)
    window_only[..., lo:] = True
    dense = Selection(L, dense=True, span=span)
    ref = reference(q, k, v, dense, scale, softcap=softcap)
    _close(ref, _spec(q, k, v, window_only, scale, softcap).to(dtype), dtype)
    _close(dense_decode(q, k, v, L, scale, span=span, softcap=softcap), ref, dtype)
    _close(kernel(q, k, v, dense, scale, softcap=softcap), ref, dtype)
    short = Selection(30, dense=True, span=span)  # fewer keys than the window: all of them
    _close(kernel(q, k, v, short, scale, softcap=softcap),
           _spec(q, k, v, torch.ones(B, Hkv * G, 30, dtype=torch.bool, device=DEV), scale, softcap).to(dtype), dtype)


def test_sliding_window_with_ragged_rows():
    """Per-row lengths: each row's window ends at its own length."""
    B, Hkv, G, L, D, span = 3, 2, 2, 120, 64, 40
    q, k, v = _data(B, Hkv, G, L, D, torch.float32, seed=2)
    lens = torch.tensor([120, 33, 75], device=DEV)
    out = dense_decode(q, k, v, lens, 0.2, span=span)
    for b in range(B):
        n = int(lens[b])
        one = dense_decode(q[b : b + 1], k[b : b + 1], v[b : b + 1], n, 0.2, span=span)
        _close(out[b : b + 1], one, torch.float32)
        allowed = torch.zeros(1, Hkv * G, n, dtype=torch.bool, device=DEV)
        allowed[..., max(0, n - span) :] = True
        _close(one, _spec(q[b : b + 1], k[b : b + 1], v[b : b + 1], allowed, 0.2).float(), torch.float32)


@pytest.mark.parametrize("G", [1, 4])
def test_dense_decode_matches_reference(G):
    q, k, v = _data(2, 2, G, 333, 64, torch.float32, seed=G)
    full = Selection(333, dense=True)
    _close(dense_decode(q, k, v, 333, 0.125), reference(q, k, v, full, 0.125), torch.float32)
    lens = torch.tensor([333, 100], device=DEV)
    _close(dense_decode(q, k, v, lens, 0.125),
           reference(q, k, v, Selection(338, dense=True), 0.125, lengths=lens), torch.float32)


def test_dense_attention_decode_runs_the_kernel(monkeypatch):
    """An unmasked decode step (one query) with kernels on goes to dense_decode, not SDPA, and agrees with SDPA."""
    import sparsekv.kernels.sparse_decode as kmod
    from sparsekv.sparse_attention import dense_attention

    q, k, v = _data(1, 3, 3, 70, 64, torch.float32)
    k, v = k[:, :, :70], v[:, :, :70]  # a slice of a longer buffer, as the cache hands it over
    monkeypatch.setenv("SPARSEKV_KERNELS", "0")
    ref = dense_attention(q, k, v, 0.125)
    calls = []
    monkeypatch.setattr(kmod, "dense_decode", lambda *a, **kw: calls.append(1) or kmod.sparse_decode(
        a[0], a[1], a[2], a[4], a[3], dense=True))
    monkeypatch.setenv("SPARSEKV_KERNELS", "1")
    _close(dense_attention(q, k, v, 0.125), ref, torch.float32)
    assert calls == [1]
    mask = torch.ones(1, 1, 1, 70, dtype=torch.bool, device=DEV)  # a mask (padding) keeps SDPA
    _close(dense_attention(q, k, v, 0.125, mask=mask), ref, torch.float32)
    assert calls == [1]


def _close_logits(out, ref, dtype):
    """Same -inf slots (the pads), close elsewhere."""
    assert out.shape == ref.shape and out.dtype == torch.float32
    assert torch.equal(out.isneginf(), ref.isneginf()) and not out.isnan().any()
    fin = ref.isfinite()
    tol = {torch.float32: 2e-5, torch.float16: 1e-4, torch.bfloat16: 1e-4}[dtype]  # fp32 sums of exact products
    torch.testing.assert_close(out[fin], ref[fin], atol=tol * ref[fin].abs().max().item(), rtol=tol)


@pytest.mark.parametrize("G", [1, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_qk_logits_match_reference(G, dtype):
    """q·k of the keys each selection head names (per KV head or per query head, -1 pads) and of every key of a
    strided slice of the cache, as the oracle hands it over; D 80 exercises the masked head dims."""
    B, Hkv, L, D = 2, 2, 211, 80
    q, k, _ = _data(B, Hkv, G, L, D, dtype, seed=G)
    for H in {Hkv, Hkv * G}:
        idx = _indices(B, H, L, 0, 0, 37, seed=G + H, pad=3)
        _close_logits(qk_logits(q, k, idx), qk_logits_reference(q, k, idx), dtype)
    part = k[:, :, 5:150]
    _close_logits(qk_logits(q, part), qk_logits_reference(q, part), dtype)
    for fn in (qk_logits, qk_logits_reference):  # 3 selection heads: neither the KV nor the query heads
        with pytest.raises(ValueError, match=r"has 3 heads; expected 2 \(KV heads\) or"):
            fn(q, k, _indices(B, 3, L, 0, 0, 5))


@pytest.mark.parametrize("pooling", ["head", "group"])
def test_exact_scores_kernel_path(monkeypatch, pooling):
    """selection.exact_scores (the oracle's and --rerank's ranking) on the kernel path against the torch path."""
    from sparsekv.selection import exact_scores

    q, k, _ = _data(1, 2, 4, 90, 64, torch.float32, seed=7)
    idx = _indices(1, 8 if pooling == "head" else 2, 90, 0, 0, 20, seed=7)
    out = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("SPARSEKV_KERNELS", flag)
        out[flag] = (exact_scores(q, k[:, :, :90], pooling), exact_scores(q, k, pooling, idx))
    for a, b in zip(out["1"], out["0"]):
        assert a.shape == b.shape and a.shape[1] == (8 if pooling == "head" else 2)
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_real_shapes(dtype):
    B, Hkv, G, L, D = 1, 8, 4, 131072, 128
    q, k, v = _data(B, Hkv, G, L, D, dtype, extra=0)
    sel = Selection(L, sink=128, window=512, indices=_indices(B, Hkv, L, 128, 512, 2048))
    _close(kernel(q, k, v, sel, D**-0.5), reference(q, k, v, sel, D**-0.5), dtype)
    _close(dense_decode(q, k, v, L, D**-0.5), reference(q, k, v, Selection(L, dense=True), D**-0.5),
           dtype)


@pytest.mark.skipif(not CUDA, reason="needs a GPU")
def test_gpu_qk_logits_real_shapes():
    """bf16 at the llama3-8b shape: every key of 32768, and 8192 candidates per query head (--rerank 4 x 2048)."""
    B, Hkv, G, L, D = 1, 8, 4, 32768, 128
    q, k, _ = _data(B, Hkv, G, L, D, torch.bfloat16, extra=0)
    _close_logits(qk_logits(q, k), qk_logits_reference(q, k), torch.bfloat16)
    idx = _indices(B, Hkv * G, L, 0, 0, 8192)
    _close_logits(qk_logits(q, k, idx), qk_logits_reference(q, k, idx), torch.bfloat16)


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_pooled_log_probs_matches_reference(group, softcap):
    """The oracle's two-pass softmax + group sum (in logs) against its reference and against the plain sum of
    probabilities, over every key and over each row's own region (a replayed step's RowBounds, read from the device
    lengths in the kernels), and on rows whose region is empty."""
    from sparsekv.kernels.exact_scores import pooled_log_probs
    from sparsekv.kernels.reference import RowBounds, pooled_log_probs_reference

    B, Hq, n = 2, 8, 2500
    logits = torch.randn(B, Hq, n, generator=torch.Generator().manual_seed(group)).to(DEV) * 6
    lengths = torch.tensor([2507, 1900], device=DEV)  # the second row's region ends short of the buffer
    regions = (None, RowBounds(lengths, sink=3, window=40, lo=7), RowBounds(lengths, span=1500, sink=2, lo=7))
    for bounds in regions:
        got = pooled_log_probs(logits, group, 0.3, softcap, bounds)
        ref = pooled_log_probs_reference(logits, group, 0.3, softcap, bounds)
        assert got.shape == (B, Hq // group, n)
        finite = torch.isfinite(ref)
        keep = torch.ones(B, 1, n, dtype=torch.bool, device=DEV) if bounds is None else bounds.mask(n)
        assert torch.equal(finite, torch.isfinite(got)) and torch.equal(finite, keep.expand_as(finite))
        assert bounds is None or not keep.all()
        torch.testing.assert_close(got[finite], ref[finite], atol=1e-4, rtol=1e-4)
        s = logits * 0.3
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        probs = torch.softmax(s.masked_fill(~keep, float("-inf")), -1)
        summed = probs.view(B, Hq // group, group, n).sum(2)
        torch.testing.assert_close(got.exp(), summed, atol=1e-6, rtol=1e-4)
    nothing = RowBounds(torch.tensor([20, 25], device=DEV), sink=10, window=15)  # sink and window cover each row
    assert torch.isneginf(pooled_log_probs(logits, group, 0.3, softcap, nothing)).all()


def test_a_row_rounds_as_it_would_alone():
    """A row's split-K partition depends on the row alone, not on the batch it decodes in nor on the cache's capacity:
    its output is bit for bit its batch-1 output (so a batch's greedy tokens are its rows' own), dense and sparse."""
    B, Hkv, G, L, D = 3, 2, 4, 700, 64
    q, k, v = _data(B, Hkv, G, L, D, torch.float32, seed=4)
    lens = torch.tensor([700, 333, 520], device=DEV)
    idx = _indices(B, Hkv, 330, 4, 16, 150, seed=4)
    batch_dense = dense_decode(q, k, v, lens, 0.1)
    batch_sparse = sparse_decode(q, k, v, 0.1, lens, idx, sink=4, window=16)
    for b in range(B):
        n, rows = int(lens[b]), slice(b, b + 1)
        cap = n + 37 * (b + 1)  # another capacity than the batch's
        alone = dense_decode(q[rows], k[rows, :, :cap], v[rows, :, :cap], lens[rows], 0.1)
        assert torch.equal(alone, batch_dense[rows])
        alone = sparse_decode(q[rows], k[rows, :, :cap], v[rows, :, :cap], 0.1, lens[rows], idx[rows], sink=4,
                              window=16)
        assert torch.equal(alone, batch_sparse[rows])


@pytest.mark.parametrize("span,sink,window", [(0, 0, 0), (0, 2, 7), (40, 1, 3)])
def test_block_positions_match_reference(span, sink, window):
    """Blocks (Quest's pages, -1 pads) as the positions a step reads, clipped to each row's region: one host length,
    and per-row device lengths (a row shorter than some of its blocks)."""
    g = torch.Generator().manual_seed(span + window)
    blocks = torch.randint(-1, 12, (3, 2, 5), generator=g).to(DEV)
    for lengths in (90, torch.tensor([90, 33, 7], device=DEV)):
        got, count = block_positions(blocks, 8, lengths, span, sink, window)
        want, want_count = block_positions_reference(blocks, 8, lengths, span, sink, window)
        assert got.shape == (3, 2, 40) and torch.equal(got, want) and (got == -1).any() and (got >= 0).any()
        torch.testing.assert_close(count, want_count)  # 6 (row, head) pairs: fp32 sums of sixths
        for dtype in (torch.float32, torch.float64):  # a running sum (a decode loop's), counted into in place
            total = torch.full((), 1000.5, dtype=dtype, device=DEV)
            got, into = block_positions(blocks, 8, lengths, span, sink, window, count=total)
            assert into is total and torch.equal(got, want)
            torch.testing.assert_close(total, torch.tensor(1000.5, dtype=dtype, device=DEV) + want_count.to(dtype))
            want_total = torch.full((), 1000.5, dtype=dtype, device=DEV)
            assert block_positions_reference(blocks, 8, lengths, span, sink, window, count=want_total)[1] is want_total
            torch.testing.assert_close(want_total, total)
    with pytest.raises(ValueError, match="count must be a 0-dim"):
        block_positions(blocks, 8, 90, count=torch.zeros(2, device=DEV))


@pytest.mark.parametrize("smem,element_size,D,want", [
    (232448, 2, 128, (128, 2)),  # H100 / H200, bf16
    (166912, 2, 128, (128, 2)),  # A100
    (101376, 2, 128, (64, 1)),  # consumer Ada / Ampere (the bound: two stages of 128-key K/V tiles)
    (232448, 4, 128, (64, 1)),  # fp32 tiles are twice the bytes
    (101376, 2, 64, (128, 2)),  # head dim 64 (SmolLM2): half the bytes
    (232448, 2, 256, (32, 1)),  # head dim 256
    (232448, 2, 20, (64, 1)),  # a head dim that does not fill its tile: 128 keys at 2 stages fail to compile
    (232448, 2, 96, (64, 1)),
    (232448, 2, 32, (128, 2)),
])
def test_gathered_tiles_follow_the_shared_memory(smem, element_size, D, want, monkeypatch):
    """The gathered path's wide, pipelined tiles only where a program's shared memory could hold two stages of their
    K and V tiles, and the head dim fills its tile; the interpreter keeps the narrow ones."""
    from sparsekv.kernels import sparse_decode as sd

    monkeypatch.setattr(sd, "max_shared_mem", lambda device: smem)
    assert sd.gather_tiles(torch.device("cuda"), D, element_size) == want
    assert sd.gather_tiles(torch.device("cpu"), D, element_size)[1] == 1
