"""Quest (page min/max bounds) and linear LSH (SimHash): incremental state == state from scratch, the bound bounds,
hand-built selections, the dense part is never re-read, budget >= context is dense, the kernel paths (Quest page
scores, the 1-bit Hamming path of the Adamas kernels) match the torch paths (TRITON_INTERPRET=1 on the CPU, or the
GPU), and both run through the real runtime and the bench."""

import functools

import pytest
import torch

import sparsekv.decode as decode
from sparsekv import ops
from sparsekv.decode import generate
from sparsekv.errors import SparseKVError
from sparsekv.methods import CacheShape, MethodOptions, get_method
from sparsekv.kernels.reference import quantize_pack_reference
from sparsekv.step import make_step

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the kernel path: the GPU, else the interpreter


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def build(method, keys, chunks, q_heads=None, max_len=None):
    """A layer state fed like the cache does: K/V written first, then `append` per chunk (prefill pieces, then
    single decode tokens). chunks: the end positions of successive appends."""
    B, H, L, D = keys.shape
    st = method.new_state(0, CacheShape(B, H, q_heads or H, D, max_len or L + 8, keys.dtype, keys.device))
    st.keys = torch.zeros(B, H, max_len or L + 8, D, dtype=keys.dtype, device=keys.device)
    st.values = st.keys.clone()
    start = 0
    for end in chunks:
        st.keys[:, :, start:end] = keys[:, :, start:end]
        st.length = end
        method.append(st, keys[:, :, start:end], keys[:, :, start:end], None, start)
        start = end
    return st


PREFILL_THEN_DECODE = [20, 37, 50, *range(51, 78)]  # odd chunks straddling pages, then one token per step


# -- Quest -----------------------------------------------------------------------------------------------------------

def page_bounds_from_scratch(keys, S):
    B, H, L, D = keys.shape
    P = -(-L // S)
    pad = P * S - L
    hi = torch.nn.functional.pad(keys, (0, 0, 0, pad), value=float("-inf")).view(B, H, P, S, D).amax(3)
    lo = torch.nn.functional.pad(keys, (0, 0, 0, pad), value=float("inf")).view(B, H, P, S, D).amin(3)
    return hi, lo


@pytest.mark.parametrize("dtype,S", [(torch.float32, 16), (torch.float16, 16), (torch.float32, 5), (torch.float32, 1)])
def test_quest_incremental_bounds_equal_scratch(dtype, S):
    keys = torch.randn(2, 3, 77, 12, generator=_gen(0)).to(dtype)
    m = get_method("quest", budget=32, page_size=S)
    st = build(m, keys, PREFILL_THEN_DECODE)
    hi, lo = page_bounds_from_scratch(keys, S)
    P = hi.shape[2]  # the last page is partial for S = 16 and 5 (77 = 4·16 + 13 = 15·5 + 2)
    assert torch.equal(st.page_max[:, :, :P], hi) and torch.equal(st.page_min[:, :, :P], lo)
    assert st.bounds.dtype == dtype and st.bounds.shape[2] == -(-(77 + 8) // (16 * S)) * 16  # a multiple of 16 pages


@pytest.mark.parametrize("G", [1, 3])
def test_quest_bound_upper_bounds_every_key(G):
    S, L, D, Hkv = 8, 100, 16, 2
    keys = torch.randn(1, Hkv, L, D, generator=_gen(1)) * 3
    q = torch.randn(1, Hkv * G, 1, D, generator=_gen(2))
    P = -(-L // S)
    for pooling in ("head", "group"):
        m = get_method("quest", budget=32, page_size=S, pooling=pooling)
        st = build(m, keys, [60, *range(61, L + 1)])
        u = m.page_scores(st, q, 0, P)  # [1, Hsel, P]
        logits = torch.einsum("bhgd,bhnd->bhgn", q.view(1, Hkv, G, D), keys).reshape(1, Hkv * G, L)
        page_max = torch.nn.functional.pad(logits, (0, P * S - L), value=float("-inf")).view(1, -1, P, S).amax(-1)
        if pooling == "group":
            page_max = page_max.view(1, Hkv, G, P).amax(2)
        assert (u >= page_max - 1e-4).all()
        assert (u - page_max).abs().max() > 1  # a bound, not the exact maximum
    # a page of one key: the bound is q·k itself
    m = get_method("quest", budget=32, page_size=S, pooling="head")
    st = build(m, keys[:, :, :97], [97])
    last = m.page_scores(st, q, 12, 13)[0, :, 0]
    torch.testing.assert_close(last, torch.einsum("hgd,hd->hg", q[0, :, 0].view(Hkv, G, D), keys[0, :, 96]).flatten())


# Hand-built: page size 4, D 2, one KV head, query heads qA = (1, 1), qB = (1, -1). Length 21: pages 0..4 are full,
# page 5 holds the current token (position 20) and is always attended. Budget 12 = 3 pages, the last one included
# (the authors' page budget): 2 pages chosen.
#   page  keys                       max    min     U_A  U_B  group max  true max A, B
#   0     (0,0) x4                   (0,0)  (0,0)    0    0    0          0, 0
#   1     (3,0) (0,3) (0,0) (0,0)    (3,3)  (0,0)    6    3    6          3, 3
#   2     (2,2) x4                   (2,2)  (2,2)    4    0    4          4, 0
#   3     (1,-4) x4                  (1,-4) (1,-4)  -3    5    5         -3, 5
#   4     (-1,-1) x4                                -2    0    0         -2, 0
# Group: pages {1, 3}. Per head: A {1, 2} (the bound prefers page 1 over page 2, whose best key is better: Quest
# ranks by the bound), B {3, 1}.
HAND_KEYS = [[0, 0]] * 4 + [[3, 0], [0, 3], [0, 0], [0, 0]] + [[2, 2]] * 4 + [[1, -4]] * 4 + [[-1, -1]] * 4 + [[5, 5]]
HAND_Q = [[1.0, 1.0], [1.0, -1.0]]


def quest_hand(**options):
    m = get_method("quest", budget=12, page_size=4, **options)
    keys = torch.tensor(HAND_KEYS, dtype=torch.float32).view(1, 1, 21, 2)
    st = build(m, keys, [13, *range(14, 22)], q_heads=2)
    return m, st, m.select(st, torch.tensor(HAND_Q).view(1, 2, 1, 2), None)


def test_quest_hand_built_selection():
    m, st, sel = quest_hand()
    assert m.page_scores(st, torch.tensor(HAND_Q).view(1, 2, 1, 2), 0, 5).tolist() == [[[0, 6, 4, 5, 0]]]
    assert (sel.sink, sel.window, sel.block_size, sel.length) == (0, 0, 4, 21)
    assert sorted(sel.blocks[0, 0].tolist()) == [1, 3, 5]  # page 5: the newest key's
    read = sel.positions(1, 1)[0, 0]
    assert sorted(read[read >= 0].tolist()) == [4, 5, 6, 7, 12, 13, 14, 15, 20]
    assert sel.attended() == 9 and sel.n_selected == 9
    _, _, per_head = quest_hand(pooling="head")
    assert [sorted(r) for r in per_head.blocks[0].tolist()] == [[1, 2, 5], [1, 3, 5]]


def test_quest_hand_built_on_the_kernel_device():
    """On a GPU the bounds stay in the cache's half dtype (bf16) and the scores come out in fp32."""
    dtype = torch.bfloat16 if DEV.type == "cuda" else torch.float16
    m = get_method("quest", budget=12, page_size=4)
    keys = torch.tensor(HAND_KEYS, dtype=dtype, device=DEV).view(1, 1, 21, 2)
    st = build(m, keys, [13, *range(14, 22)], q_heads=2)
    q = torch.tensor(HAND_Q, dtype=dtype, device=DEV).view(1, 2, 1, 2)
    assert st.bounds.dtype == dtype
    assert m.page_scores(st, q, 0, 5).dtype == torch.float32
    assert sorted(m.select(st, q, None).blocks[0, 0].tolist()) == [1, 3, 5]


def test_quest_window_is_the_last_page_and_budget_is_honest():
    """The newest key's page is always read, as one of the budget's B // S pages (the authors' page budget); a
    budget below one page reads the newest budget keys."""
    S, D = 16, 8
    keys = torch.randn(1, 2, 200, D, generator=_gen(3))
    q = torch.randn(1, 4, 1, D, generator=_gen(4))
    for budget in (8, 40, 64, 100):
        m = get_method("quest", budget=budget, page_size=S)
        st = build(m, keys, [120])
        for L in range(121, 201):
            st.keys[:, :, L - 1] = keys[:, :, L - 1]
            st.length = L
            m.append(st, keys[:, :, L - 1 : L], keys[:, :, L - 1 : L], None, L - 1)
            sel = m.select(st, q, None)
            fill = L - (L - 1) // S * S
            assert sel.sink == 0 and sel.attended() <= budget
            if budget < S:
                assert sel.window == budget and not sel.has_sparse
            else:
                assert sel.window == 0 and sel.blocks.shape[-1] == budget // S
                assert (sel.blocks[..., -1] == (L - 1) // S).all()
                assert sel.n_selected == (budget // S - 1) * S + fill  # whole pages and the newest one's keys
            sel.check(1, 2)
            pos = sel.positions(1, 2)
            assert (pos >= 0).sum(-1).eq(sel.attended()).all()


@pytest.mark.parametrize("sink,window,budget,S", [(3, 5, 16, 4), (4, 0, 37, 16), (0, 7, 30, 6), (2, 2, 4, 8)])
def test_quest_explicit_sink_window_clip_pages(sink, window, budget, S):
    keys = torch.randn(1, 2, 90, 8, generator=_gen(5))
    q = torch.randn(1, 2, 1, 8, generator=_gen(6))
    m = get_method("quest", budget=budget, page_size=S, sink=sink, window=window)
    st = build(m, keys, [60, *range(61, 91)])
    for L in (61, 75, 90):
        st.length = L
        sel = m.select(st, q, None)
        assert (sel.sink, sel.window) == (sink, window)
        sparse = sel.sparse_positions() if sel.has_sparse else torch.empty(0)
        got = sparse[sparse >= 0]
        assert ((got >= sink) & (got < L - window)).all()  # never inside the dense part
        sel.check(1, 2)
        assert sel.attended() <= budget
        if sel.has_sparse:
            assert sel.blocks.shape[-1] == (budget - sink - window) // S


def test_quest_options_and_errors():
    cfg = get_method("quest", budget=64).config()
    assert (cfg["page_size"], cfg["sink"], cfg["window"], cfg["pooling"]) == (16, 0, "last page", "group")
    assert get_method("quest", budget=64, page_size=32, window=8).config()["window"] == 8
    with pytest.raises(SparseKVError, match="page_size"):
        get_method("quest", budget=64, page_size=0)
    with pytest.raises(SparseKVError, match="no option"):
        get_method("quest", budget=64, nbits=3)
    m = get_method("quest", budget=16, sink=10, window=10)
    st = build(m, torch.randn(1, 1, 40, 4, generator=_gen(7)), [40])
    with pytest.raises(SparseKVError, match=r"^quest: sink 10 \+ window 10 exceed the budget \(16 tokens\); "
                                            r"lower --sink/--window or raise --budget$"):
        m.select(st, torch.randn(1, 1, 1, 4), None)


# -- LSH -------------------------------------------------------------------------------------------------------------

def hamming_scores(q, keys, R, G, pooling):
    """-Hamming distance of sign(x R), written independently of the packed codes."""
    B, Hkv, L, D = keys.shape
    kb = torch.einsum("bhnd,hdm->bhnm", keys.float(), R) > 0
    qb = torch.einsum("bhgd,hdm->bhgm", q.float().view(B, Hkv, G, D), R) > 0
    dist = (qb.unsqueeze(3) != kb.unsqueeze(2)).sum(-1)  # [B, Hkv, G, L]
    return (-dist.sum(2) if pooling == "group" else -dist.reshape(B, Hkv * G, L)).float()


@pytest.mark.parametrize("nbits", [128, 40, 7])
def test_lsh_incremental_codes_equal_scratch(nbits):
    keys = torch.randn(2, 2, 77, 20, generator=_gen(8))
    m = get_method("lsh", budget=32, nbits=nbits)
    st = build(m, keys, PREFILL_THEN_DECODE)
    assert st.codes.shape[-1] == -(-nbits // 16)
    scratch = quantize_pack_reference(torch.einsum("bhnd,hdm->bhnm", keys, st.proj), torch.zeros(1), bits=1,
                                      transform=False)  # sign bits, packed as 1-bit codes
    assert torch.equal(st.codes[:, :, :77], scratch)


@pytest.mark.parametrize("name", ["lsh", "spotlight", "adamas"])
def test_step_keys_coded_by_the_select(name):
    """A decode step's key (a device slot) is left pending by `append` and hashed (adamas: coded) by the step's
    `select`: alone while the budget covers the context (a dense select), with the queries once it chooses;
    afterwards the codes equal every key coded at once."""
    from sparsekv import ops
    from sparsekv.methods.spotlight import untrained_hashes

    keys = torch.randn(1, 2, 40, 16, generator=_gen(21))
    q = torch.randn(1, 4, 1, 16, generator=_gen(22))
    m = get_method(name, budget=30, **({"hashes": untrained_hashes(1, 2, 16, hidden=32)} if name == "spotlight"
                                       else {}))
    st = build(m, keys, [20], q_heads=4)
    dense = []
    for p in range(20, 40):  # the context outgrows the budget at 31 keys
        st.keys[:, :, p] = keys[:, :, p]
        st.length = p + 1
        m.append(st, keys[:, :, p:p + 1], keys[:, :, p:p + 1], None, torch.tensor([p]))
        assert st.pending is not None
        dense.append(m.select(st, q, None).dense)
        assert st.pending is None
    assert dense[0] and not dense[-1]
    at_once = ops.quantize_pack(keys, st.thresholds, bits=m.bits) if name == "adamas" else \
        ops.mlp_hash_pack(keys, *m.weights(st))
    assert torch.equal(st.codes[:, :, :40], at_once)


@pytest.mark.parametrize("pooling", ["group", "head"])
def test_lsh_scores_are_negated_hamming(pooling):
    keys = torch.randn(1, 2, 60, 20, generator=_gen(9))
    q = torch.randn(1, 6, 1, 20, generator=_gen(10))
    m = get_method("lsh", budget=16, pooling=pooling)
    st = build(m, keys, [60], q_heads=6)
    assert torch.equal(m.hash_scores(st, q, 0, 60), hamming_scores(q, keys, st.proj, 3, pooling))
    assert torch.equal(m.hash_scores(st, q, 5, 50), hamming_scores(q, keys, st.proj, 3, pooling)[..., 5:50])


def test_lsh_finds_a_planted_key_and_keeps_out_of_the_dense_part():
    keys = torch.randn(1, 1, 300, 32, generator=_gen(11))
    q = torch.randn(1, 1, 1, 32, generator=_gen(12))
    keys[0, 0, 123] = 2.5 * q[0, 0, 0]  # same direction: Hamming distance 0 under any hyperplanes
    m = get_method("lsh", budget=24, sink=4, window=8)
    st = build(m, keys, [250, *range(251, 301)])
    sel = m.select(st, q, None)
    assert 123 in sel.indices[0, 0].tolist()
    assert (sel.sink, sel.window, sel.n_selected) == (4, 8, 12)
    got = sel.indices[0, 0]
    assert ((got >= 4) & (got < 300 - 8)).all()
    sel.check(1, 1)


def test_lsh_hyperplanes():
    m = get_method("lsh", budget=16)
    R = m.hyperplanes(3, 2, 64)  # 128 bits over d 64: two independent rotations side by side
    assert R.shape == (2, 64, 128)
    for h in range(2):
        for blk in (R[h, :, :64], R[h, :, 64:]):
            torch.testing.assert_close(blk.T @ blk, torch.eye(64), atol=1e-5, rtol=0)
            assert torch.linalg.det(blk.double()) > 0  # in SO(d) (Spotlight A.5)
    assert not torch.allclose(R[0, :, :64], R[0, :, 64:]) and not torch.allclose(R[0], R[1])
    assert torch.equal(R, get_method("lsh", budget=16).hyperplanes(3, 2, 64))  # deterministic
    assert not torch.equal(R, m.hyperplanes(4, 2, 64))  # per layer
    assert not torch.equal(R, get_method("lsh", budget=16, seed=1).hyperplanes(3, 2, 64))  # per seed
    g = get_method("lsh", budget=16, projection="gaussian", nbits=40).hyperplanes(0, 2, 128)
    assert g.shape == (2, 128, 40) and 0.8 < float(g.std()) < 1.2
    cfg = get_method("lsh", budget=64).config()
    assert (cfg["nbits"], cfg["seed"], cfg["projection"], cfg["sink"], cfg["window"], cfg["head_top"]) == \
        (128, 0, "rotation", 0, 0, 0)
    assert get_method("lsh", budget=64, head_top=3).config()["head_top"] == 3
    assert get_method("lsh", budget=64, head_top=3, pooling="head").config()["head_top"] == 0  # per head anyway
    for opts, msg in [({"nbits": 0}, "nbits"), ({"projection": "qr"}, "unknown projection"),
                      ({"page_size": 16}, "no option"), ({"head_top": -1}, "head_top must be a whole number"),
                      ({"head_top": True}, "head_top must be")]:
        with pytest.raises(SparseKVError, match=msg):
            get_method("lsh", budget=16, **opts)


def test_lsh_hyperplanes_are_drawn_once_per_process():
    """Every cache of every generation builds its layers' states: the rotations' QR runs once per (seed, layer,
    shape), and each caller gets its own copy (changing one leaves the next equal to the first)."""
    from sparsekv.methods.lsh import _hyperplanes

    m = get_method("lsh", budget=16, seed=7)
    first = m.hyperplanes(5, 2, 64)
    hits = _hyperplanes.cache_info().hits
    again = get_method("lsh", budget=16, seed=7).hyperplanes(5, 2, 64)
    assert _hyperplanes.cache_info().hits == hits + 1 and torch.equal(first, again)
    first.zero_()
    assert torch.equal(again, m.hyperplanes(5, 2, 64)) and again.abs().sum() > 0


@pytest.mark.parametrize("nbits,pooling,head_top", [(128, "group", 0), (40, "head", 0), (128, "head", 0),
                                                     (128, "group", 2), (40, "group", 5)])
def test_lsh_kernel_path_equals_torch_path(monkeypatch, nbits, pooling, head_top):
    """quantize_pack_into / code_scores (bits=1, no transform) interpreted on the CPU: same codes, scores, choice;
    with head_top, the fused code_topk and the torch path (head_top_reference) force the same keys."""
    keys = torch.randn(1, 2, 70, 20, generator=_gen(13)).to(DEV)
    q = torch.randn(1, 6, 1, 20, generator=_gen(14)).to(DEV)
    out = []
    for flag in ("0", "1"):
        monkeypatch.setenv("SPARSEKV_KERNELS", flag)
        m = get_method("lsh", budget=20, nbits=nbits, pooling=pooling, sink=2, window=3, head_top=head_top)
        st = build(m, keys, [50, 61, *range(62, 71)], q_heads=6)
        out.append((st.codes.cpu(), m.hash_scores(st, q, 2, 67).float().cpu(), m.select(st, q, None)))
    (c0, s0, sel0), (c1, s1, sel1) = out
    assert torch.equal(c0, c1) and torch.equal(s0, s1)
    assert torch.equal(sel0.indices.cpu(), sel1.indices.cpu())  # ties go to the newer key on both paths
    picked = s0.gather(-1, sel0.indices.cpu() - 2).sort(-1).values
    best = s0.topk(sel0.indices.shape[-1], -1).values.sort(-1).values
    if head_top == 0:
        assert torch.equal(picked, best)
        return
    # each query head's own nearest keys (ties: the newer) are in, which the sum alone would not have chosen
    heads = ops.code_scores(m.query_words(st, q), st.codes[:, :, 2:], 65, nbits, bits=1, metric="l1").float().cpu()
    order = heads * 1000 + torch.arange(65)  # -Hamming, then the newer key
    for h in range(6):
        top = set((order[0, h].topk(head_top).indices + 2).tolist())
        assert top <= set(sel0.indices[0, h // 3].tolist()), h
    assert not torch.equal(picked, best)


@pytest.mark.parametrize("name", ["lsh", "adamas"])
@pytest.mark.parametrize("flag", ["0", "1"])
def test_code_distance_ties_go_to_the_newer_key(monkeypatch, name, flag):
    """Keys with equal codes tie at every distance: the selection takes the newest of the sparse region, on the
    kernel path (counting select) and the torch path (code_scores + topk) alike."""
    monkeypatch.setenv("SPARSEKV_KERNELS", flag)
    keys = torch.randn(1, 2, 1, 16, generator=_gen(21)).expand(1, 2, 80, 16).contiguous().to(DEV)
    q = torch.randn(1, 4, 1, 16, generator=_gen(22)).to(DEV)
    m = get_method(name, budget=20, sink=2, window=3)
    st = build(m, keys, [60, *range(61, 81)], q_heads=4)
    sel = m.select(st, q, None)
    want = torch.arange(80 - 3 - 15, 80 - 3)  # 15 sparse keys, the last ones before the window
    assert sel.indices.shape[-1] == 15
    assert torch.equal(sel.indices.cpu(), want.expand_as(sel.indices.cpu()))


@pytest.mark.parametrize("nbits", [16, 40, 128, 512, 1024])
def test_hamming_fast_path_extremes(nbits):
    """The 1-bit path of code_distance (xor + popcount): all bits differ, none, every other, half; odd word counts."""
    from sparsekv.kernels.codes import code_distance, code_scores
    from sparsekv.kernels.reference import code_distance_reference, code_pack_reference

    ones, zeros = torch.ones(nbits, dtype=torch.uint8), torch.zeros(nbits, dtype=torch.uint8)
    alt = torch.arange(nbits) % 2
    half = (torch.arange(nbits) < nbits // 2).to(torch.uint8)
    keys = torch.stack([ones, zeros, alt.to(torch.uint8), half]).view(1, 1, 4, nbits)
    kw = code_pack_reference(keys, 1).to(DEV)
    qw = code_pack_reference(torch.stack([ones, zeros]).view(1, 2, nbits), 1).to(DEV)
    want = [[0, nbits, nbits // 2, nbits - nbits // 2], [nbits, 0, nbits // 2, nbits // 2]]
    assert code_distance(qw, kw, 4, nbits, bits=1).view(2, 4).tolist() == want
    assert code_distance_reference(qw.cpu(), kw.cpu(), nbits, bits=1).view(2, 4).tolist() == want
    assert code_distance(qw, kw, 4, nbits, bits=1, metric="l2").view(2, 4).tolist() == want
    assert code_scores(qw, kw, 4, nbits, bits=1, pool="sum").view(-1).tolist() == [-nbits] * 3 + [-nbits]
    rnd = code_pack_reference(torch.randint(0, 2, (1, 3, 50, nbits), generator=_gen(nbits), dtype=torch.uint8), 1)
    qr = code_pack_reference(torch.randint(0, 2, (1, 6, nbits), generator=_gen(1), dtype=torch.uint8), 1)
    assert torch.equal(code_distance(qr.to(DEV), rnd.to(DEV), 47, nbits, bits=1).cpu(),
                       code_distance_reference(qr, rnd[:, :, :47], nbits, bits=1))


@pytest.mark.parametrize("pooling", ["group", "head"])
def test_quest_kernel_path_equals_torch_path(monkeypatch, pooling):
    keys = torch.randn(1, 2, 90, 20, generator=_gen(16)).to(DEV)
    q = torch.randn(1, 6, 1, 20, generator=_gen(17)).to(DEV)
    out = []
    for flag in ("0", "1"):
        monkeypatch.setenv("SPARSEKV_KERNELS", flag)
        m = get_method("quest", budget=40, page_size=8, pooling=pooling)
        st = build(m, keys, [50, 61, *range(62, 91)], q_heads=6)
        out.append((st.bounds.cpu(), m.page_scores(st, q, 0, 11).cpu(), m.select(st, q, None)))
    (b0, s0, sel0), (b1, s1, sel1) = out
    assert torch.equal(b0, b1)
    torch.testing.assert_close(s0, s1, atol=1e-4, rtol=1e-5)
    assert [sorted(r) for r in sel0.blocks[0].tolist()] == [sorted(r) for r in sel1.blocks[0].tolist()]


# -- both: dense at full budget, runtime, bench ------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["quest", "lsh"])
def test_budget_covering_the_context_is_dense(name):
    m = get_method(name, budget=64)
    st = build(m, torch.randn(1, 1, 64, 8, generator=_gen(15)), [64])
    assert m.select(st, torch.randn(1, 1, 1, 8), None).dense
    st.length = 40
    assert get_method(name, budget=0.999).select(st, torch.randn(1, 1, 1, 8), None).dense  # 0.999 x 40 -> 40 tokens
    assert not get_method(name, budget=0.5).select(st, torch.randn(1, 1, 1, 8), None).dense


@pytest.mark.parametrize("name", ["adamas", "quest", "lsh"])
def test_runtime_full_budget_equals_dense(tiny, prompt_ids, name):
    a = generate(tiny, prompt_ids, get_method(name, budget=400), 8, keep_logits=True, stop_on_eos=False)
    d = generate(tiny, prompt_ids, get_method("dense"), 8, keep_logits=True, stop_on_eos=False)
    assert a.tokens == d.tokens
    assert all(torch.equal(x, y) for x, y in zip(a.logits, d.logits))
    assert a.stats["selectivity"] == 1.0


def test_runtime_sparse_budgets(tiny, prompt_ids):
    q = generate(tiny, prompt_ids, get_method("quest", budget=40), 6, stop_on_eos=False)
    assert q.stats["sparse_steps"] > 0 and q.stats["mean_attended"] <= 40 and q.stats["mean_sink"] == 0
    # 40 // 16 = 2 pages: one chosen, and the newest key's, partly filled (prompt 200 + 1..5 tokens: 9..13 keys)
    assert q.stats["mean_window"] == 0 and q.stats["mean_selected"] == pytest.approx(16 + 11)
    s = generate(tiny, prompt_ids, get_method("lsh", budget=40), 6, stop_on_eos=False)
    assert s.stats["mean_attended"] == 40 and s.stats["mean_selected"] == 40 and s.stats["mean_window"] == 0


def test_bench_rows():
    from sparsekv.bench import run_bench

    L, B, budget = 1024, 1, 128
    res = run_bench("smollm2-135m", L, "quest,lsh", budget, batch=B, dtype="fp32", device="cpu", topk=False)
    rows = {r["method"]: r for r in res["rows"]}
    quest, lsh = rows["quest"], rows["lsh"]
    assert quest["sink"] == 0 and quest["window"] == 0 and quest["selected"] == budget  # L is page-aligned
    assert lsh["selected"] == budget and lsh["selectivity"] == pytest.approx(budget / L)
    assert quest["method_config"]["page_size"] == 16 and lsh["method_config"]["nbits"] == 128
    D, Hkv = 64, 3
    assert quest["bytes"]["select"] == B * Hkv * (L // 16) * 2 * D * 4  # max and min of each page
    # 128 bits = 8 int16 words per key and the hyperplanes the query is hashed with (fp32)
    assert lsh["bytes"]["select"] == B * Hkv * L * 8 * 2 + Hkv * D * 128 * 4


def test_lsh_hyperplanes_are_a_run_option():
    """`--projection` (a method option of every command that runs methods) reaches lsh; a bad one is refused."""
    m = MethodOptions(projection="gaussian").build("lsh", budget=32)
    assert m.projection == "gaussian" and m.config()["projection"] == "gaussian"
    assert not torch.equal(m.hyperplanes(0, 2, 16), MethodOptions().build("lsh", budget=32).hyperplanes(0, 2, 16))
    with pytest.raises(SparseKVError, match="unknown projection"):
        MethodOptions(projection="cubic").build("lsh", budget=32)


@pytest.mark.parametrize("name,opts,flag", [("quest", {"page_size": 0}, "(--page-size)"),
                                            ("lsh", {"head_top": -1}, "(--head-top)"),
                                            ("lsh", {"query_margin": -1.0}, "(--query-margin)"),
                                            ("lsh", {"projection": "qr"}, "(--projection)"),
                                            ("adamas", {"bits": 4}, "(--bits)"), ("adamas", {"rerank": 0}, "(--rerank)")])
def test_a_method_option_error_names_the_flag(name, opts, flag):
    """Library callers read the keyword, CLI users the flag: a method's option error ends with the flag."""
    with pytest.raises(SparseKVError) as e:
        get_method(name, budget=64, **opts)
    assert str(e.value).endswith(flag), str(e.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the tiny model's CPU tensors need TRITON_INTERPRET")
def test_quest_statistics_are_counted_in_the_block_expansion(tiny, prompt_ids, monkeypatch):
    """A graph-shaped step ("static": padded blocks, device lengths) counts Quest's selected keys on the device, in
    the launch that expands its pages (`Selection.add_count`): the statistics equal the torch references'. (The
    count's launch on a GPU: test_sparse_decode_kernel's block-position test.)"""
    monkeypatch.setattr(decode, "make_step", functools.partial(make_step, mode="static"))
    runs = []
    for kernels in (False, True):
        with ops.kernels(kernels):
            runs.append(generate(tiny, prompt_ids, get_method("quest", budget=64, page_size=8), 5, stop_on_eos=False))
    assert runs[0].tokens == runs[1].tokens
    assert runs[0].stats == runs[1].stats and 0 < runs[0].stats["selectivity"] < 1
    assert runs[0].stats["mean_selected"] > 0
