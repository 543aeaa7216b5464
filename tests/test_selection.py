"""Budget semantics, selections, and the torch sparse-decode reference against masked dense attention."""

import pytest
import torch
import torch.nn.functional as F

from sparsekv import ops
from sparsekv.errors import SparseKVError
from sparsekv.methods import LayerState, get_method
from sparsekv.selection import Selection, resolve_budget, split_budget


def test_budget_counts_and_fractions():
    assert resolve_budget(64, 1000) == 64
    assert resolve_budget(0.05, 1000) == 50
    with pytest.raises(SparseKVError, match="positive"):
        resolve_budget(0, 1000)
    with pytest.raises(SparseKVError, match="neither"):
        resolve_budget(2.5, 1000)
    s = split_budget(64, 4, 16, 1000)
    assert (s.sink, s.window, s.k, s.dense) == (4, 16, 44, False)
    assert split_budget(64, 4, 16, 64).dense
    with pytest.raises(SparseKVError, match="exceed the budget"):
        split_budget(16, 8, 16, 1000)


def _masked_dense(q, keys, values, allowed, scale):
    """allowed: [B, Hq, L] bool -> attention restricted to those keys (the spec, written independently)."""
    G = q.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(G, 1).float()
    v = values.repeat_interleave(G, 1).float()
    return F.scaled_dot_product_attention(q.float(), k, v, attn_mask=allowed.unsqueeze(2), scale=scale)


def _state(B, Hkv, L, D, extra=5):
    g = torch.Generator().manual_seed(L)
    keys = torch.randn(B, Hkv, L + extra, D, generator=g)
    values = torch.randn(B, Hkv, L + extra, D, generator=g)
    return LayerState(keys=keys, values=values, length=L)


@pytest.mark.parametrize("G", [1, 4])
def test_streaming_attends_exactly_sink_and_window(G):
    B, Hkv, L, D = 2, 2, 97, 16
    st = _state(B, Hkv, L, D)
    q = torch.randn(B, Hkv * G, 1, D)
    sel = get_method("streaming", budget=24, sink=4).select(st, q, None)
    assert (sel.sink, sel.window) == (4, 20)
    assert set(sel.positions(B, Hkv).flatten().tolist()) == set(range(4)) | set(range(L - 20, L))
    allowed = torch.zeros(B, Hkv * G, L, dtype=torch.bool)
    allowed[..., :4] = True
    allowed[..., L - 20 :] = True
    out = ops.sparse_decode(q, st.keys, st.values, sel, D**-0.5)
    ref = _masked_dense(q, st.keys[:, :, :L], st.values[:, :, :L], allowed, D**-0.5)
    torch.testing.assert_close(out.float(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("G,pooling", [(1, "group"), (4, "group"), (4, "head")])
def test_oracle_selects_the_true_top_keys(G, pooling):
    B, Hkv, L, D = 1, 2, 200, 16
    st = _state(B, Hkv, L, D)
    q = torch.randn(B, Hkv * G, 1, D)
    sel = get_method("oracle", budget=40, sink=4, window=8, pooling=pooling).select(st, q, None)
    assert sel.indices.shape[-1] == 28
    idx = sel.indices
    assert idx.min() >= 4 and idx.max() < L - 8  # never overlaps the dense part
    # by hand: softmax over the middle region, summed over each group's heads (or per head), top 28
    keys = st.keys[:, :, 4 : L - 8]
    logits = torch.einsum("bhgd,bhnd->bhgn", q.view(B, Hkv, G, D), keys) * D**-0.5
    p = logits.softmax(-1)
    p = p.sum(2) if pooling == "group" else p.reshape(B, Hkv * G, -1)
    expect = p.topk(28, -1).indices + 4
    assert torch.equal(idx.sort(-1).values, expect.sort(-1).values)
    # attention over the selection equals dense attention restricted to it
    Hs = idx.shape[1]
    allowed = torch.zeros(B, Hs, L, dtype=torch.bool)
    allowed.scatter_(-1, idx, True)
    allowed[..., :4] = True
    allowed[..., L - 8 :] = True
    if Hs == Hkv:
        allowed = allowed.repeat_interleave(G, 1)
    out = ops.sparse_decode(q, st.keys, st.values, sel, D**-0.5)
    ref = _masked_dense(q, st.keys[:, :, :L], st.values[:, :, :L], allowed, D**-0.5)
    torch.testing.assert_close(out.float(), ref, atol=1e-5, rtol=1e-5)


def test_block_and_csr_selections_expand_to_the_same_tokens():
    L = 64
    blocks = Selection(L, sink=2, window=4, blocks=torch.tensor([[[1, 3, -1]]]), block_size=8)
    assert sorted(p for p in blocks.sparse_positions().flatten().tolist() if p >= 0) == \
        list(range(8, 16)) + list(range(24, 32))
    tokens = torch.tensor([[[10, 11, 30, 31, 50]]])
    csr = Selection(L, sink=2, window=4, buckets=torch.tensor([[[2, 0]]]),
                    bucket_offsets=torch.tensor([[[0, 2, 4, 5]]]), bucket_tokens=tokens)
    assert sorted(p for p in csr.sparse_positions().flatten().tolist() if p >= 0) == [10, 11, 50]
    assert csr.attended() == 2 + 4 + 3


def test_selected_counts_need_no_host_sync():
    """A top-k selection's count is a host int; a padded one's is a 0-dim tensor the stats sum without reading."""
    from sparsekv.cache import DecodeStats
    from sparsekv.selection import topk_selection

    sel = topk_selection(torch.randn(1, 2, 40), split_budget(16, 2, 4, 46))
    assert sel.selected_count() == 10 and not sel.padded and sel.n_selected == 10
    padded = Selection(46, sink=2, window=4, indices=torch.tensor([[[5, 6, -1], [7, -1, -1]]]))
    assert isinstance(padded.selected_count(), torch.Tensor) and padded.n_selected == 2  # (2 + 1) / 2 rounds to 2
    stats = DecodeStats()
    stats.add_selection(sel)
    stats.add_selection(padded)
    stats.add_selection(Selection(46, dense=True))
    s = stats.summary()
    assert s["sparse_steps"] == 3 and s["mean_selected"] == pytest.approx((10 + 1.5 + 46) / 3)
    assert s["mean_attended"] == pytest.approx((16 + 7.5 + 46) / 3)
    assert s["selectivity"] == pytest.approx((16 + 7.5 + 46) / (3 * 46))


def test_unknown_method_and_option_are_clear():
    with pytest.raises(SparseKVError, match="unknown method .nope.; available: .*dense"):
        get_method("nope")
    with pytest.raises(SparseKVError, match="no option"):
        get_method("oracle", budget=8, bogus=1)
    with pytest.raises(SparseKVError, match="pooling"):
        get_method("oracle", budget=8, pooling="mean")
