"""Quest page-score kernel against its torch reference and a hand-computed example: under TRITON_INTERPRET=1 on the
CPU (fp32/fp16), and in bf16 when a GPU is present."""

import pytest
import torch

from sparsekv.kernels.quest import append_one, page_blocks, page_scores
from sparsekv.kernels.reference import (PageRegion, RowBounds, quest_append_reference, quest_blocks_reference,
                                        quest_region_scores_reference, quest_scores_reference)

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])


def _bounds(B, Hkv, P, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(2, B, Hkv, P, D, generator=g) * 2
    return torch.cat([torch.maximum(a, b), torch.minimum(a, b)], -1).to(DEV, dtype)


def test_page_scores_by_hand():
    # one page, D 2: M = (3, 3), m = (-1, 0). q = (1, -2): max(3, -1) + max(-6, 0) = 3; q = (-1, 1): 1 + 3 = 4
    bounds = torch.tensor([3.0, 3.0, -1.0, 0.0], device=DEV).view(1, 1, 1, 4)
    q = torch.tensor([[1.0, -2.0], [-1.0, 1.0]], device=DEV).view(1, 2, 2)
    assert page_scores(q, bounds, 1, None).view(-1).tolist() == [3.0, 4.0]
    assert page_scores(q, bounds, 1).view(-1).tolist() == [4.0]
    assert quest_scores_reference(q, bounds, 1).view(-1).tolist() == [4.0]


@pytest.mark.parametrize("G", [1, 4, 3])
@pytest.mark.parametrize("D", [64, 20, 128])
@pytest.mark.parametrize("dtype", DTYPES)
def test_page_scores_match_reference(G, D, dtype):
    B, Hkv, P, n = 2, 2, 70, 61
    bounds = _bounds(B, Hkv, P, D, dtype, seed=G + D)
    q = torch.randn(B, Hkv * G, 1, D, generator=torch.Generator().manual_seed(D)).to(DEV, dtype)
    tol = dict(atol=1e-4, rtol=1e-5)  # fp32 maths on both sides: only the summation order differs
    for pool in (None, "max"):
        out = page_scores(q, bounds, n, pool)
        assert out.dtype == torch.float32 and out.shape == (B, Hkv if pool else Hkv * G, n)
        torch.testing.assert_close(out, quest_scores_reference(q, bounds, n, pool), **tol)
    for first in (1, 5):  # a slice of the cache state, as select passes it
        torch.testing.assert_close(page_scores(q, bounds[:, :, first:], 40),
                                   quest_scores_reference(q, bounds[:, :, first:], 40), **tol)


def test_page_scores_bound_the_keys():
    """Bounds built from real keys bound every q·k of their page."""
    B, Hkv, G, S, P, D = 1, 2, 4, 16, 33, 128
    g = torch.Generator().manual_seed(3)
    keys = torch.randn(B, Hkv, P, S, D, generator=g)
    bounds = torch.cat([keys.amax(3), keys.amin(3)], -1).to(DEV)
    q = torch.randn(B, Hkv * G, D, generator=g)
    logits = torch.einsum("bhgd,bhpsd->bhgps", q.view(B, Hkv, G, D), keys).amax(-1)  # [B, Hkv, G, P]
    u = page_scores(q.to(DEV), bounds, P, None).cpu().view(B, Hkv, G, P)
    assert (u >= logits - 1e-3).all()
    assert (page_scores(q.to(DEV), bounds, P).cpu() >= logits.amax(2) - 1e-3).all()


def test_page_scores_rejects_bad_shapes():
    bounds = _bounds(1, 2, 10, 16, torch.float32)
    with pytest.raises(ValueError):
        page_scores(torch.randn(1, 3, 16, device=DEV), bounds, 5)  # 3 query heads, 2 KV heads
    with pytest.raises(ValueError):
        page_scores(torch.randn(1, 4, 8, device=DEV), bounds, 5)  # D 8 against rows of 2·16
    with pytest.raises(ValueError):
        page_scores(torch.randn(1, 4, 16, device=DEV), bounds, 11)  # past the buffer
    with pytest.raises(ValueError):
        page_scores(torch.randn(1, 4, 16, device=DEV), bounds, 5, pool="sum")
    assert page_scores(torch.randn(1, 4, 16, device=DEV), bounds, 0).shape == (1, 2, 0)


@pytest.mark.parametrize("span,sink,window,skip_last", [(0, 0, 0, True), (0, 3, 20, False), (100, 1, 0, True)])
def test_region_scores_and_blocks_match_reference(span, sink, window, skip_last):
    """A graph step's rows (their own device lengths, one shorter than the pages scored): pages a row may not choose
    score -inf, in the kernel as in the reference's mask; the blocks turn -inf picks into -1 and end with each row's
    newest page; a single host length serves every row."""
    B, Hkv, G, D, S, p_lo, n = 3, 2, 2, 32, 4, 2, 40
    bounds = _bounds(B, Hkv, p_lo + n, D, torch.float32, seed=span + sink)
    q = torch.randn(B, Hkv * G, 1, D, generator=torch.Generator().manual_seed(5)).to(DEV)
    for lengths in (torch.tensor([168, 95, 13], device=DEV), torch.tensor([150], device=DEV)):
        region = PageRegion(RowBounds(lengths, span, sink, window), S, p_lo, skip_last)
        mask = region.mask(n)
        assert mask.shape == (lengths.shape[0], 1, n)
        for pool in (None, "max"):
            got = page_scores(q, bounds[:, :, p_lo:], n, pool, region=region)
            want = quest_region_scores_reference(q, bounds[:, :, p_lo:], n, pool, region)
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
            assert torch.equal(torch.isinf(got), ~mask.expand_as(got))
            pick = torch.topk(got, 6, dim=-1).indices  # the row of 13 keys has fewer choosable pages: -inf picks
            blocks = page_blocks(got, pick, region)
            assert torch.equal(blocks, quest_blocks_reference(got, pick, region))
            assert blocks.shape[-1] == 6 + skip_last
        if lengths.shape[0] == B:
            assert (page_blocks(got, pick, region)[2] == -1).any()  # short row: padding
    with pytest.raises(ValueError, match="region lengths"):
        page_scores(q, bounds, n, region=PageRegion(RowBounds(torch.tensor([1, 2], device=DEV)), S))


@pytest.mark.parametrize("dtype", DTYPES)
def test_append_one_matches_reference(dtype):
    """A decode step's key into its page: a fresh page is replaced, a partly filled one takes max/min; at one host
    position and at per-row device slots."""
    B, Hkv, D, S = 3, 2, 24, 4
    g = torch.Generator().manual_seed(7)
    bounds = _bounds(B, Hkv, 6, D, dtype, seed=1)
    for pos in (9, 12, torch.tensor([3, 8, 13], dtype=torch.int32, device=DEV)):
        k = torch.randn(B, Hkv, 1, D, generator=g).to(DEV, dtype)
        got, want = bounds.clone(), bounds.clone()
        append_one(got, k, pos, S)
        quest_append_reference(want, k, pos, S)
        assert torch.equal(got, want) and not torch.equal(got, bounds)
    with pytest.raises(ValueError, match="expected k"):
        append_one(bounds, torch.zeros(B, Hkv, 2, D, device=DEV, dtype=dtype), 0, S)
