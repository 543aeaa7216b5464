"""The spotlight method: codes appended as keys arrive equal the hash of every key at once, its choice is the top-k
by matching bits, the kernel path equals the torch path, a budget covering the context is dense attention."""

import pytest
import torch

from sparsekv.decode import generate
from sparsekv.errors import SparseKVError
from sparsekv.kernels.reference import mlp_hash_reference
from sparsekv.methods import get_method
from sparsekv.methods.spotlight import untrained_hashes

from test_quest_lsh import DEV, PREFILL_THEN_DECODE, _gen, build

pytestmark = pytest.mark.usefixtures("one_thread")


def hashes(layers=1, kv=2, d=20, hidden=32, nbits=48, seed=0):
    return untrained_hashes(layers, kv, d, hidden=hidden, nbits=nbits, seed=seed)


def matching_bits(q, keys, h, pooling, margin=0.0):
    """Matching bits of sign(MLP(q)) and sign(MLP(k)) by hand, pooled: [B, Hsel, L]; with `margin` minus the
    differing bits of the query's cared-for ones (|y| > margin · rms(y)), the method's default ranking."""
    B, Hkv, L, D = keys.shape
    w = (h["w1"][0], h["b1"][0], h["w2"][0])
    kb = mlp_hash_reference(keys, *w) > 0
    y = mlp_hash_reference(q, *w)  # [B, Hq, 1, nbits]
    G = q.shape[1] // Hkv
    bit_same = (y > 0).view(B, Hkv, G, 1, -1) == kb.unsqueeze(2)  # [B, Hkv, G, L, nbits]
    if margin:
        care = (y.abs() > margin * y.pow(2).mean(-1, keepdim=True).sqrt()).view(B, Hkv, G, 1, -1)
        same = -(~bit_same & care).sum(-1)
    else:
        same = bit_same.sum(-1)
    return (same.sum(2) if pooling == "group" else same.reshape(B, Hkv * G, L)).float()


def test_appended_codes_equal_the_hash_of_every_key():
    keys = torch.randn(2, 2, 77, 20, generator=_gen(1))
    h = hashes()
    m = get_method("spotlight", budget=32, hashes=h)
    st = build(m, keys, PREFILL_THEN_DECODE)
    from sparsekv.kernels.reference import mlp_hash_pack_reference

    assert torch.equal(st.codes[:, :, :77], mlp_hash_pack_reference(keys, h["w1"][0], h["b1"][0], h["w2"][0]))


@pytest.mark.parametrize("pooling", ["group", "head"])
def test_choice_is_the_top_k_by_matching_bits(pooling):
    keys = torch.randn(1, 2, 90, 20, generator=_gen(2))
    q = torch.randn(1, 6, 1, 20, generator=_gen(3))
    h = hashes()
    binary = get_method("spotlight", budget=24, pooling=pooling, hashes=h, query_margin=0)
    st = build(binary, keys, [90], q_heads=6)
    G = 1 if pooling == "head" else 3  # -Hamming = matching - nbits
    assert torch.equal(binary.hash_scores(st, q, 0, 90), matching_bits(q, keys, h, pooling) - 48 * G)
    m = get_method("spotlight", budget=24, pooling=pooling, hashes=h)
    assert m.config()["query_margin"] == 0.35 and binary.config()["query_margin"] == 0.0
    st = build(m, keys, [90], q_heads=6)
    want = matching_bits(q, keys, h, pooling, 0.35)  # minus the differing bits the queries care for
    assert torch.equal(m.hash_scores(st, q, 0, 90), want)
    sel = m.select(st, q, None)
    picked = want.gather(-1, sel.indices).sort(-1).values
    assert torch.equal(picked, want.topk(24, -1).values.sort(-1).values)
    sel.check(1, sel.indices.shape[1])
    # head_top 4: each query head's 4 best keys by its own matching bits (ties: the newer) first, the sum the rest
    assert get_method("spotlight", budget=24, pooling=pooling, hashes=h).config()["head_top"] == 0  # the default
    m = get_method("spotlight", budget=24, pooling=pooling, hashes=h, head_top=4)
    assert m.config()["head_top"] == (4 if pooling == "group" else 0)
    st = build(m, keys, [90], q_heads=6)
    sel = m.select(st, q, None)
    if pooling == "head":
        assert torch.equal(want.gather(-1, sel.indices).sort(-1).values, want.topk(24, -1).values.sort(-1).values)
        return
    own = matching_bits(q, keys, h, "head", 0.35) * 1000 + torch.arange(90)  # [1, 6, 90]
    forced = torch.zeros(1, 2, 90, dtype=torch.bool)
    for head in range(6):
        forced[0, head // 3, own[0, head].topk(4).indices] = True
    chosen = torch.zeros_like(forced).scatter_(-1, sel.indices, True)
    assert bool((chosen | ~forced).all())
    rest = want.masked_fill(forced, float("-inf"))  # the others: the best of the sum
    n_rest = 24 - forced.sum(-1, keepdim=True)
    for kv in range(2):
        others = rest[0, kv].gather(-1, (sel.indices[0, kv][~forced[0, kv, sel.indices[0, kv]]])).sort().values
        assert torch.equal(others, rest[0, kv].topk(int(n_rest[0, kv, 0])).values.sort().values)


@pytest.mark.parametrize("pooling", ["group", "head"])
def test_kernel_path_equals_torch_path(monkeypatch, pooling):
    keys = torch.randn(1, 2, 70, 64, generator=_gen(4)).to(DEV)
    q = torch.randn(1, 6, 1, 64, generator=_gen(5)).to(DEV)
    h = hashes(d=64, hidden=64, nbits=128)
    out = []
    for flag in ("0", "1"):
        monkeypatch.setenv("SPARSEKV_KERNELS", flag)
        m = get_method("spotlight", budget=20, pooling=pooling, hashes=h, sink=2, window=3)
        st = build(m, keys, [50, 61, *range(62, 71)], q_heads=6)
        out.append((st.codes.cpu(), m.hash_scores(st, q, 2, 67).cpu(), m.select(st, q, None)))
    (c0, s0, sel0), (c1, s1, sel1) = out
    # a bit may differ only where the MLP output is within rounding of 0 (kernel: tf32 on a GPU)
    assert (c0 != c1).float().mean() < 0.01 and (s0 - s1).abs().max() <= 2 * (3 if pooling == "group" else 1)
    for sel in (sel0, sel1):
        assert sel.indices.shape[-1] == 15 and sel.sink == 2 and sel.window == 3


def test_full_budget_is_dense_and_sparse_budgets_run(tiny, prompt_ids):
    h = untrained_hashes(tiny.num_layers, tiny.kv_heads, tiny.head_dim, hidden=32, nbits=32)
    a = generate(tiny, prompt_ids, get_method("spotlight", budget=400, hashes=h), 8, keep_logits=True,
                 stop_on_eos=False)
    d = generate(tiny, prompt_ids, get_method("dense"), 8, keep_logits=True, stop_on_eos=False)
    assert a.tokens == d.tokens and all(torch.equal(x, y) for x, y in zip(a.logits, d.logits))
    s = generate(tiny, prompt_ids, get_method("spotlight", budget=40, hashes=h), 6, stop_on_eos=False)
    assert s.stats["mean_attended"] == 40 and s.stats["mean_selected"] == 40 and s.stats["mean_window"] == 0


def test_a_sparse_layer_needs_a_hash(tiny, prompt_ids):
    h = untrained_hashes(1, tiny.kv_heads, tiny.head_dim, hidden=32, nbits=32)  # layer 0 only
    h["layers"] = torch.tensor([1])  # ... trained for layer 1: layer 0 must stay dense
    ok = generate(tiny, prompt_ids, get_method("spotlight", budget=40, hashes=h), 3, stop_on_eos=False,
                  dense_layers=(0,))
    assert len(ok.tokens) == 3
    with pytest.raises(SparseKVError, match="layer 0 has no trained hash"):
        generate(tiny, prompt_ids, get_method("spotlight", budget=40, hashes=h), 3, stop_on_eos=False)
    with pytest.raises(SparseKVError, match="hash 2 KV heads of dim 16"):
        bad = untrained_hashes(2, tiny.kv_heads, 16, hidden=32, nbits=32)
        generate(tiny, prompt_ids, get_method("spotlight", budget=40, hashes=bad), 3, stop_on_eos=False)


def test_query_margin_option():
    """query_margin: Spotlight's default 0.35, lsh's 0 (binary, as the papers); ternary query words carry twice the
    words; bad values and methods that do not hash are refused with one clear line."""
    from sparsekv.methods import MethodOptions

    keys = torch.randn(1, 2, 40, 20, generator=_gen(6))
    q = torch.randn(1, 6, 1, 20, generator=_gen(7))
    for name, kw, default in (("spotlight", {"hashes": hashes()}, 0.35), ("lsh", {"nbits": 48}, 0.0)):
        assert get_method(name, budget=8, **kw).config()["query_margin"] == default
        for margin, words in ((0, 3), (0.5, 6)):
            m = get_method(name, budget=8, query_margin=margin, **kw)
            st = build(m, keys, [40], q_heads=6)
            assert m.query_words(st, q).shape == (1, 6, 1, words)
            assert m.select(st, q, None).indices.shape == (1, 2, 8)
        for bad in (-0.1, float("nan"), "x", True):
            with pytest.raises(SparseKVError, match=f"{name}: query_margin"):
                get_method(name, budget=8, query_margin=bad, **kw)
    assert MethodOptions(query_margin=0.5).for_method("lsh") == {"query_margin": 0.5}
    with pytest.raises(SparseKVError, match="--query-margin apply to none"):
        MethodOptions(query_margin=0.5).check(["adamas", "quest"])
