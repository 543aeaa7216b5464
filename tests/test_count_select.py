"""The counting select (k smallest small integers) and the fused code-distance top-k against torch references.

Small shapes under TRITON_INTERPRET=1 on the CPU, with chunks small enough that every pass crosses chunk and tile
boundaries; the real shapes (8 x 131072, k 2048; heavy ties) on the GPU when one is present.
"""

import pytest
import torch

from sparsekv.kernels import count_select
from sparsekv.kernels.codes import code_distance, code_topk, code_topk_supported
from sparsekv.kernels.count_select import MAX_BITS, smallest_k, value_bits
from sparsekv.kernels.reference import RowBounds, head_top_reference

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def smallest_reference(values: torch.Tensor, k: int, offset: int = 0, ties: str = "low") -> torch.Tensor:
    """The k smallest per row, ties to the lower index (or the higher), in ascending index order (int64 keys make
    ties unique)."""
    n = values.shape[-1]
    key = values.long().cpu() * n + (torch.arange(n) if ties == "low" else n - 1 - torch.arange(n))
    return torch.sort(torch.topk(-key, k, dim=-1).indices, dim=-1).values + offset


def _gen(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype,ties", [(torch.int16, "low"), (torch.int32, "low"), (torch.int16, "high")])
@pytest.mark.parametrize("rows,n,k,vmax", [
    (3, 1000, 37, 2047),  # wide values: the window holds 62 of them
    (2, 777, 777, 300),  # k = n
    (4, 513, 1, 63),  # every value fits the window
    (2, 300, 100, 5),  # six distinct values: ties everywhere
    (1, 4096, 500, (1 << MAX_BITS) - 1),  # the widest values
    (2, 129, 64, 0),  # a constant row
])
def test_smallest_k_matches_reference(dtype, rows, n, k, vmax, ties):
    g = _gen(rows * n + k)
    if vmax > 100:  # bell-shaped, like code distances: the k-th smallest sits in a sparse tail
        v = (torch.randn(rows, n, generator=g) * vmax / 8 + vmax / 2).clamp(0, vmax).int()
    else:
        v = torch.randint(0, vmax + 1, (rows, n), generator=g, dtype=torch.int32)
    out = smallest_k(v.to(dtype).to(DEV), k, vmax, offset=5, ties=ties)
    assert out.dtype == torch.int64 and out.shape == (rows, k)
    assert torch.equal(out.cpu(), smallest_reference(v, k, 5, ties))


def test_first_runs_in_the_callers_launch_once():
    """smallest_k(first=): the caller's launch gets the select's first step (BaseStep) once and runs it for every
    row; the same indices as without it. A row of one chunk (the one-launch row kernel) hands it None; so does
    k 0."""
    from sparsekv.kernels import count_select

    v = torch.randint(0, 300, (3, 700), generator=_gen(4), dtype=torch.int32).to(DEV)
    seen = []

    def first(base):
        seen.append(base)
        if base is not None:  # what codes.code_topk's forcing launch does beside its own programs
            count_select._base_kernel[(base.rows,)](*base.args, **base.consts, num_warps=base.num_warps)

    want = smallest_reference(v, 50, 0, "high")
    assert torch.equal(smallest_k(v, 50, 300, ties="high", first=first, _chunk=128).cpu(), want)
    assert len(seen) == 1 and seen[0].rows == 3
    assert torch.equal(smallest_k(v[:, :100].contiguous(), 20, 300, first=first, _chunk=128).cpu(),
                       smallest_reference(v[:, :100], 20))
    smallest_k(v, 0, 300, first=first)
    assert seen[1:] == [None, None]


def test_smallest_k_repeats_and_shapes():
    """Scratch is left clean (same answer every call); leading dims; k = 0; chunk sizes from 1 program to many."""
    v = torch.randint(0, 40, (2, 3, 1000), generator=_gen(2), dtype=torch.int32).to(DEV)
    want = smallest_reference(v.view(6, -1), 200).view(2, 3, 200)
    for chunk in (None, 64, 1024):  # 1024 >= n: one chunk per row, the one-launch row kernel
        for _ in range(2):
            assert torch.equal(smallest_k(v, 200, 63, _chunk=chunk).cpu(), want)
    assert smallest_k(v, 0, 63).shape == (2, 3, 0)
    w = (v * 37) % 2048  # same shape and scratch, other value range: each call clears the row histogram first
    for _ in range(2):
        assert torch.equal(smallest_k(w, 150, 2047).cpu(), smallest_reference(w.view(6, -1), 150).view(2, 3, 150))
        assert torch.equal(smallest_k(v, 200, 63).cpu(), want)


def test_smallest_k_clamps_out_of_range_values():
    v = torch.tensor([[70, -3, 5, 64, 63, 0, 1000]], dtype=torch.int32)
    # the range is [0, 63]: -3 counts as 0 (ties with the 0 after it, lower index first), 70/64/1000 as 63
    assert smallest_k(v.to(DEV), 3, 63).cpu().tolist() == [[1, 2, 5]]
    assert smallest_k(v.to(DEV), 5, 63).cpu().tolist() == [[0, 1, 2, 3, 5]]
    # ties to the higher index: of the four 63s (0, 3, 4, 6) the last two
    assert smallest_k(v.to(DEV), 2, 63, ties="high").cpu().tolist() == [[1, 5]]
    assert smallest_k(v.to(DEV), 5, 63, ties="high").cpu().tolist() == [[1, 2, 4, 5, 6]]


def test_smallest_k_window_misses():
    """The window histogram sits around the k-th smallest of a strided sample; when the row's k-th smallest falls
    outside it (a row whose sampled positions mislead, or a forced miss), emit finds the threshold from the row
    itself: slower, still exact."""
    n = 8192  # 1024 values sampled, every 8th
    v = torch.randint(0, 50, (1, n), generator=_gen(9), dtype=torch.int32)
    v[:, ::2] = 2000  # every sampled value is large: the estimate sits far above the k-th smallest (a miss) ...
    for k in (300, 5000):  # ... unless k reaches into the large ones (5000: a hit on a two-valued row)
        for ties in ("low", "high"):
            out = smallest_k(v.to(DEV), k, 2047, ties=ties, _chunk=1024, _tile=512)
            assert torch.equal(out.cpu(), smallest_reference(v, k, ties=ties))
    w = (torch.randn(3, 1000, generator=_gen(10)) * 60 + 300).clamp(0, 1023).int()
    for chunk in (64, 1024):  # many chunks; one chunk per row (the row kernel: no window, the same answer)
        for k, ties in ((1, "low"), (77, "low"), (1000, "low"), (77, "high")):
            out = smallest_k(w.to(DEV), k, 1023, ties=ties, _chunk=chunk, _force_miss=True)
            assert torch.equal(out.cpu(), smallest_reference(w, k, ties=ties)), (chunk, k, ties)


@pytest.mark.parametrize("win", [16, 64])
@pytest.mark.parametrize("ties", ["low", "high"])
def test_smallest_k_window_widths_and_tied_chunks(win, ties):
    """Either window width (sample_plan picks it from how closely the sample ranks the k-th smallest) gives the
    same indices; rows whose ties at the threshold fill many chunks, so that some chunks take all their ties, some
    none and one (or two) the boundary, as well as rows spread over hundreds of values and rows with negative and
    too-large values (the clamp)."""
    g = _gen(11 + win)
    few = torch.randint(0, 4, (2, 640), generator=g, dtype=torch.int32)  # ~160 ties per value over 10 chunks
    bell = (torch.randn(1, 640, generator=g) * 40 + 200).clamp(0, 511).int()
    wild = torch.randint(-50, 600, (1, 640), generator=g, dtype=torch.int32)  # clamped into [0, 511]
    for v, vmax, ks, dtypes in ((few, 3, (150, 400, 639), (torch.int16,)), (bell, 511, (5, 300), (torch.int16,)),
                                (wild, 511, (10, 300), (torch.int16, torch.int32))):
        for k in ks:
            for dtype in dtypes:
                out = smallest_k(v.to(dtype).to(DEV), k, vmax, ties=ties, _chunk=64, _win=win)
                assert torch.equal(out.cpu(), smallest_reference(v.clamp(0, vmax), k, ties=ties)), (k, dtype)
    with pytest.raises(ValueError, match="window bins must be 16 or 64"):
        smallest_k(few.to(DEV), 5, 3, _chunk=64, _win=32)


def test_smallest_k_small_k_samples_more():
    """k / n small: the plan samples more values (8192 of 12000 here), and the indices stay exact."""
    from sparsekv.kernels.count_select import sample_plan

    assert sample_plan(12000, 60, 9)[:2] == (8192, 1)
    v = (torch.randn(1, 12000, generator=_gen(12)) * 30 + 150).clamp(0, 511).int()
    for ties in ("low", "high"):
        out = smallest_k(v.to(torch.int16).to(DEV), 60, 511, ties=ties, _chunk=1024)
        assert torch.equal(out.cpu(), smallest_reference(v, 60, ties=ties))


def test_sample_plan_window_width():
    """A narrow window when the estimate is exact (every value sampled) or when 1024 samples put 16 on both sides of
    it and the values are below 2^10; a wide one otherwise, and more samples when k / n is small (S, stride, ks,
    below, win)."""
    from sparsekv.kernels.count_select import sample_plan

    assert sample_plan(1000, 3, 11) == (1024, 1, 3, 7, 16)  # every value sampled: exact
    assert sample_plan(131071, 2047, 9) == (1024, 127, 16, 7, 16)  # 16 of 1024 samples at or below the estimate
    assert sample_plan(131071, 2047, 11)[4] == 64  # values up to 2047: the wide window
    assert sample_plan(131071, 1500, 9) == (1024, 127, 12, 31, 64)  # a tail: the wide window
    assert sample_plan(131071, 800, 9) == (8192, 15, 50, 31, 64)  # further out: more samples
    assert sample_plan(131071, 131071 - 1500, 9)[4] == 64  # few above the estimate
    assert sample_plan(1 << 20, 64, 9)[:3] == (16384, 64, 1)  # at most 16384 samples
    assert sample_plan(16384, 256, 10)[4] == 16
    plan = sample_plan(16384, 200, 10)
    assert (plan[0], plan[4]) == (1024, 64)
    assert sample_plan(16384, 8, 9)[:3] == (16384, 1, 8)  # every value sampled


def test_smallest_k_padded_rows_read_whole_and_count_only_the_row():
    """Rows padded to count_select.ALIGN values (code_topk's distances) are loaded whole, past n: the padding's
    values (zeros here, smaller than any real one) are never counted nor chosen, on every path (window, the
    chunk emit, a forced miss, the one-launch row kernel). `readable` pads only rows whose stride and storage hold
    the padding."""
    from sparsekv.kernels.count_select import ALIGN, padded_rows, readable

    n = 300
    v = (torch.randn(3, n, generator=_gen(13)) * 30 + 150).clamp(1, 511).int()
    buf = padded_rows((3, n), torch.int16, torch.device(DEV))
    assert buf.stride(0) == 320 and readable(buf) == 320
    buf.as_strided((3, 320), (320, 1)).zero_()
    buf.copy_(v)
    for k, ties, chunk, miss in ((40, "low", 64, False), (40, "high", 64, True), (299, "low", 128, False),
                                 (7, "high", 512, False)):
        out = smallest_k(buf, k, 511, ties=ties, _chunk=chunk, _force_miss=miss)
        assert torch.equal(out.cpu(), smallest_reference(v, k, ties=ties)), (k, ties, chunk, miss)
    assert readable(v.to(torch.int16)) == n  # contiguous rows of 300: no room past the last one
    whole = torch.zeros(3, ALIGN * 5, dtype=torch.int16)
    assert readable(whole[:, :n]) == 320 and readable(whole[:, 20:]) == n  # the last row's padding: past the end
    assert readable(whole[:, :n].t().contiguous().t()) == n  # rows not contiguous


def test_smallest_k_rejects_bad_input():
    v = torch.zeros(2, 10, dtype=torch.int32)
    with pytest.raises(ValueError, match="int16 or int32"):
        smallest_k(v.float(), 3, 10)
    with pytest.raises(ValueError, match="between 0 and the row length"):
        smallest_k(v, 11, 10)
    with pytest.raises(ValueError, match="below 2\\^14"):
        smallest_k(v, 3, 1 << MAX_BITS)
    with pytest.raises(ValueError, match="smallest_k: the input needs at least one dimension"):
        smallest_k(torch.tensor(3, dtype=torch.int32), 1, 10)
    with pytest.raises(ValueError, match="ties must be 'low' or 'high'"):
        smallest_k(v, 3, 10, ties="newest")
    assert value_bits(0) == 1 and value_bits(2047) == 11


def _codes(B, Hq, Hkv, L, D, bits, seed):
    W = -(-D // {1: 16, 2: 8, 3: 5}[bits])
    g = _gen(seed)
    qw = torch.randint(-32768, 32767, (B, Hq, W), generator=g, dtype=torch.int32).to(torch.int16)
    kw = torch.randint(-32768, 32767, (B, Hkv, L, W), generator=g, dtype=torch.int32).to(torch.int16)
    if bits == 3:  # 5 codes per word: bit 15 unused
        qw, kw = qw & 0x7FFF, kw & 0x7FFF
    return qw.to(DEV), kw.to(DEV)


@pytest.mark.parametrize("B,Hq,Hkv,D,bits,metric,pool,L,k,block_l,chunk", [
    (1, 8, 2, 64, 2, "l1", "sum", 700, 50, 32, 64),  # the Adamas path: 2-bit L1 lanes, pooled over the group
    (2, 4, 2, 64, 2, "l1", None, 300, 77, 16, None),  # one selection row per query head
    (1, 4, 1, 128, 1, "l1", "sum", 500, 100, 64, 128),  # LSH: 1-bit Hamming
    (1, 4, 2, 32, 3, "l2", "min", 333, 33, 16, 64),  # the generic (bits, metric) path, min pooling
    (1, 2, 2, 64, 2, "l1", "sum", 200, 200, 16, 256),  # k = every key; one chunk per row (the row kernel)
])
@pytest.mark.parametrize("ties", ["low", "high"])
def test_code_topk_matches_distances(B, Hq, Hkv, D, bits, metric, pool, L, k, block_l, chunk, ties):
    """code_topk == the k smallest of code_distance (ties to the lower or higher index), on a sliced cache with an
    offset."""
    qw, kw = _codes(B, Hq, Hkv, L + 10, D, bits, B * Hq * L + k)
    off = 3
    got = code_topk(qw, kw[:, :, off:], L, D, k, bits, metric, pool=pool, offset=off, ties=ties, block_l=block_l,
                    _chunk=chunk)
    dist = code_distance(qw, kw[:, :, off:], L, D, bits, metric, pool=pool)
    assert got.shape == (B, dist.shape[1], k)
    assert torch.equal(got.cpu(), smallest_reference(dist, k, off, ties))


def test_code_topk_hands_the_select_padded_rows(monkeypatch):
    """The distance rows code_topk selects from are allocated padded (count_select.padded_rows), so the select loads
    them whole (`readable`: past their 333 values)."""
    seen = []
    real = count_select.smallest_k
    monkeypatch.setattr(count_select, "smallest_k",
                        lambda values, *a, **kw: seen.append(count_select.readable(values.view(-1, values.shape[-1])))
                        or real(values, *a, **kw))
    qw, kw = _codes(1, 4, 2, 333, 64, 2, 5)
    code_topk(qw, kw, 333, 64, 20, 2, "l1", pool="sum")
    assert seen == [count_select.ALIGN * 6]


@pytest.mark.parametrize("bits,pool,span,sink,window", [
    (2, "sum", 0, 2, 8),  # a full-attention layer: sink and window carved out of each row's own length
    (1, None, 150, 1, 4),  # a sliding-window layer: each row starts at its length - span
])
def test_code_topk_row_bounds(bits, pool, span, sink, window):
    """A graph step's per-row region applied inside the distance kernel (RowBounds, read from device lengths) chooses
    what the bool mask of the same region does, rows of different lengths in one batch: keys outside come last."""
    B, Hq, Hkv, D, n, lo = 3, 4, 2, 64, 400, 2
    qw, kw = _codes(B, Hq, Hkv, n + lo, D, bits, 11 + span)
    bounds = RowBounds(torch.tensor([402, 260, 40], dtype=torch.int32, device=DEV), span, sink, window, lo)
    keep = bounds.mask(n)
    start = max(0, 40 - span) if span else 0
    assert keep.shape == (B, 1, n) and keep[2, 0].sum() == (40 - window) - max(lo, start + sink)
    for k, ties in ((90, "high"), (1, "low"), (90, "low"), (n, "low")):
        got = code_topk(qw, kw[:, :, lo:], n, D, k, bits, pool=pool, offset=lo, bounds=bounds, ties=ties, block_l=64,
                        _chunk=128)
        want = code_topk(qw, kw[:, :, lo:], n, D, k, bits, pool=pool, offset=lo, keep=keep, ties=ties, block_l=64,
                         _chunk=128)
        assert torch.equal(got.cpu(), want.cpu()), (k, ties)
    dist = code_distance(qw, kw[:, :, lo:], n, D, bits, pool=pool).masked_fill(~keep, 1 << 14)
    assert torch.equal(got.cpu()[..., :50], smallest_reference(dist.cpu(), n, lo)[..., :50])
    with pytest.raises(ValueError, match="bounds.lengths"):
        code_topk(qw, kw, n, D, 5, bits, pool=pool, bounds=RowBounds(torch.tensor([1, 2], device=DEV)))


def test_code_topk_ties_and_limits():
    """Duplicated keys (every distance tied in runs) keep the lower index, or the higher with ties="high";
    oversized value ranges are refused."""
    qw, kw = _codes(1, 4, 1, 40, 64, 2, 7)
    kw = kw.repeat_interleave(8, dim=2)  # 320 keys, each value 8 times in a row
    dist = code_distance(qw, kw, 320, 64, pool="sum")
    for k in (1, 5, 100):
        for ties in ("low", "high"):
            assert torch.equal(code_topk(qw, kw, 320, 64, k, pool="sum", ties=ties, block_l=16, _chunk=64).cpu(),
                               smallest_reference(dist, k, ties=ties))
    assert code_topk_supported(128, 2, "l1", 4) and not code_topk_supported(256, 3, "l2", 8)
    q3, k3 = _codes(1, 4, 1, 40, 128, 3, 8)
    with pytest.raises(ValueError, match="below 2\\^14"):  # 3-bit L2 over 128 dims x 4 heads reaches 25088
        code_topk(q3, k3, 40, 128, 5, bits=3, metric="l2", pool="sum")
    with pytest.raises(ValueError, match="between 0 and the 320 keys"):
        code_topk(qw, kw, 320, 64, 321, pool="sum")


def head_top_want(qw, kw, n, D, bits, k, m, ties, lo=0, keep=None):
    """The reference of code_topk(head_top=m): each query head's m nearest keys (head_top_reference on the per-head
    distances) ranked above the rest, the rest by the group's summed distance."""
    Hkv = kw.shape[1]
    per = code_distance(qw, kw[:, :, lo:], n, D, bits).cpu()
    pooled = code_distance(qw, kw[:, :, lo:], n, D, bits, pool="sum").cpu()
    forced = head_top_reference(-per.float(), Hkv, m, None if keep is None else keep.cpu(), ties)
    values = torch.where(forced, 0, pooled + 1)
    if keep is not None:
        values = values.masked_fill(~keep.cpu(), 1 << 14)
    return smallest_reference(values, k, lo, ties), forced


@pytest.mark.parametrize("B,Hq,Hkv,D,bits,L,k,m,block_l", [
    (1, 4, 1, 128, 1, 500, 60, 3, 64),  # Spotlight/LSH: 1-bit Hamming over a group of 4
    (2, 6, 2, 64, 1, 300, 40, 4, 32),  # groups of 3, two rows
    (1, 4, 2, 64, 1, 200, 5, 4, 16),  # more forced keys than k: the newest / oldest of them
    (1, 2, 1, 64, 1, 40, 40, 8, 16),  # k = every key
    (1, 8, 2, 128, 2, 400, 50, 4, 64),  # Adamas: 2-bit L1 codes, 16 words a key
    (2, 4, 2, 64, 2, 300, 30, 2, 32),  # 2-bit, 8 words a key
])
@pytest.mark.parametrize("ties", ["low", "high"])
def test_code_topk_head_top(B, Hq, Hkv, D, bits, L, k, m, block_l, ties):
    """head_top: each query head's m nearest keys (found from every block's m best, then merged) come first, the
    rest by the pooled distance: the same keys as the reference, across blocks and chunks."""
    qw, kw = _codes(B, Hq, Hkv, L + 3, D, bits, L + m)
    got = code_topk(qw, kw[:, :, 3:], L, D, k, bits, pool="sum", offset=3, ties=ties, head_top=m, block_l=block_l,
                    _chunk=128)
    want, forced = head_top_want(qw, kw[:, :, 3:], L, D, bits, k, m, ties)
    assert torch.equal(got.cpu(), want + 3)
    assert int(forced.sum()) > m  # the heads of a group force different keys
    if k >= forced.sum(-1).max():  # every forced key is chosen
        chosen = torch.zeros_like(forced).scatter_(-1, got.cpu() - 3, True)
        assert bool((chosen | ~forced).all())


def test_code_topk_head_top_in_row_bounds():
    """Per-row regions (RowBounds, rows of different lengths): a head forces only keys its row may choose, and a row
    with fewer allowed keys than m forces fewer."""
    B, Hq, Hkv, D, n, lo, m = 3, 4, 2, 64, 400, 2, 4
    qw, kw = _codes(B, Hq, Hkv, n + lo, D, 1, 5)
    bounds = RowBounds(torch.tensor([402, 260, 8], dtype=torch.int32, device=DEV), 0, 2, 3, lo)
    keep = bounds.mask(n)  # row 2 may choose positions 2, 3 and 4 only
    for k, ties in ((90, "high"), (3, "low"), (90, "low")):
        got = code_topk(qw, kw[:, :, lo:], n, D, k, 1, pool="sum", offset=lo, bounds=bounds, ties=ties, head_top=m,
                        block_l=64, _chunk=128)
        want, forced = head_top_want(qw, kw, n, D, 1, k, m, ties, lo=lo, keep=keep)
        assert torch.equal(got.cpu()[:2], want[:2]), (k, ties)  # row 2 has 3 keys to choose: the rest is filler
        assert torch.equal(got.cpu()[2, :, :3], torch.tensor([[2, 3, 4], [2, 3, 4]]))
        assert int(forced[2].sum()) == 6  # its 3 allowed keys, for each KV head
    with pytest.raises(ValueError, match="head_top"):
        code_topk(qw, kw, n, D, 5, 1, pool=None, head_top=2)
    with pytest.raises(ValueError, match="head_top"):
        code_topk(qw, kw, n, D, 5, 1, pool="sum", keep=keep, head_top=2)
    # 2-bit L2 or 3-bit codes: code_topk refuses, the callers rank code_scores instead
    q2, k2 = _codes(1, 4, 2, 50, 64, 2, 6)
    assert code_topk_supported(64, 2, "l1", 2, head_top=2) and code_topk_supported(64, 1, "l1", 2, head_top=2)
    assert not code_topk_supported(64, 2, "l2", 2, head_top=2) and not code_topk_supported(64, 3, "l1", 2, head_top=2)
    with pytest.raises(ValueError, match="head_top needs 1-bit or 2-bit L1 codes"):
        code_topk(q2, k2, 50, 64, 5, 2, "l2", pool="sum", head_top=2)


@pytest.mark.skipif(not CUDA, reason="needs a GPU")
def test_gpu_long_rows_with_ties():
    """The bench's shape: 8 rows of 131072 distances (a few hundred distinct values), k 2048; short rows; and
    code_topk on random codes at 131072, pooled over groups of 4."""
    g = _gen(3)
    v = (torch.randn(8, 131072, generator=g) * 60 + 600).clamp(0, 1535).int()
    for k in (1, 2048, 8192, 131072):
        assert torch.equal(smallest_k(v.to(torch.int16).cuda(), k, 1535).cpu(), smallest_reference(v, k))
        assert torch.equal(smallest_k(v.to(torch.int16).cuda(), k, 1535, ties="high").cpu(),
                           smallest_reference(v, k, ties="high"))
    for rows, n in ((8, 16384), (32, 8191)):  # short rows: the one-launch row kernel
        v = torch.randint(0, 300, (rows, n), generator=g, dtype=torch.int32)
        for k in (1, 127, n):
            assert torch.equal(smallest_k(v.cuda(), k, 1535).cpu(), smallest_reference(v, k))
    qw, kw = _codes(1, 32, 8, 131072, 128, 2, 4)
    dist = code_distance(qw, kw, 131072, 128, pool="sum")
    for _ in range(3):
        assert torch.equal(code_topk(qw, kw, 131072, 128, 2048, pool="sum").cpu(), smallest_reference(dist, 2048))
    dist = code_distance(qw, kw, 131072, 128)  # one row per query head: 32 rows of 64 chunks
    assert torch.equal(code_topk(qw, kw, 131072, 128, 2048).cpu(), smallest_reference(dist, 2048))
    assert torch.equal(code_topk(qw, kw, 131072, 128, 2047, ties="high").cpu(),
                       smallest_reference(dist, 2047, ties="high"))
    qw, kw = _codes(1, 32, 8, 131072, 128, 1, 5)  # each query head's nearest keys first (1-bit codes, as Spotlight)
    for m, ties, block_l in ((4, "high", None), (1, "low", None), (3, "high", 32)):  # 32: 4096 blocks, two tiles
        want, _ = head_top_want(qw, kw, 131072, 128, 1, 2048, m, ties)
        got = code_topk(qw, kw, 131072, 128, 2048, 1, pool="sum", ties=ties, head_top=m, block_l=block_l)
        assert torch.equal(got.cpu(), want)


def test_plan_caps_chunks(monkeypatch):
    """On CUDA, long rows get about two programs per SM but never chunks over 2048 values (32 rows of 131071 values:
    64 chunks each, not 8 of 16384), and short rows one chunk (the row kernel) unless a graph is being captured."""
    import sparsekv.kernels.count_select as CS

    monkeypatch.setattr(CS, "num_sms", lambda device: 132)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    cuda = torch.device("cuda")
    assert CS.plan(131071, 32, cuda) == dict(chunk=2048, p=64, tile=2048)
    assert CS.plan(131071, 8, cuda)["chunk"] == 2048
    assert CS.plan(32767, 8, cuda)["chunk"] == 1024  # 33 programs per row
    assert CS.plan(8191, 8, cuda)["p"] == 1  # the one-launch row kernel
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert CS.plan(8191, 8, cuda) == dict(chunk=256, p=32, tile=256)


@pytest.mark.skipif(not CUDA, reason="needs a GPU")
def test_gpu_graph_capture_short_rows():
    """Captured in a CUDA graph, short rows take the three parallel passes (eagerly: the row kernel); replays of
    the graph give the same exact answer, with the scratch left clean between them."""
    v = torch.randint(0, 500, (8, 8191), generator=_gen(5), dtype=torch.int32)
    want = smallest_reference(v, 127)
    x = v.to(torch.int16).cuda()
    assert torch.equal(smallest_k(x, 127, 1535).cpu(), want)  # eager: row kernel (and compiles)
    out = torch.empty(8, 127, dtype=torch.int64, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        smallest_k(x, 127, 1535, out=out, _chunk=256)  # the chunks capture picks (2 per SM): compile them first
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        smallest_k(x, 127, 1535, out=out)
    for _ in range(3):
        out.zero_()
        g.replay()
        assert torch.equal(out.cpu(), want)


@pytest.mark.parametrize("m", [0, 3])
@pytest.mark.parametrize("ties", ["low", "high"])
def test_code_topk_ternary_queries(ties, m):
    """Ternary query words (signs, then care words) through the fused top-k, with and without head_top: the keys of
    the reference's distances, which count the cared-for bits only."""
    from sparsekv.kernels.reference import code_distance_reference

    B, Hq, Hkv, D, L, k = 2, 6, 2, 128, 400, 40
    qw, kw = _codes(B, Hq, Hkv, L + 3, D, 1, 11)
    tq = torch.cat([qw, _codes(B, Hq, Hkv, 1, D, 1, 12)[0]], -1)  # random care words: about half the bits
    got = code_topk(tq, kw[:, :, 3:], L, D, k, 1, pool="sum", offset=3, ties=ties, head_top=m, block_l=64,
                    _chunk=128)
    if m:
        want, _ = head_top_want(tq, kw[:, :, 3:], L, D, 1, k, m, ties)
    else:
        want = smallest_reference(code_distance_reference(tq.cpu(), kw[:, :, 3:3 + L].cpu(), D, 1, pool="sum"), k,
                                  0, ties)
    assert torch.equal(got.cpu(), want + 3)
    binary = code_topk(qw, kw[:, :, 3:], L, D, k, 1, pool="sum", offset=3, ties=ties, head_top=m, block_l=64,
                       _chunk=128)
    assert not torch.equal(got, binary)  # the care words change the choice
