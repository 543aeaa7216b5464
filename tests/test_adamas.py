"""Adamas: codes and selection on a hand-built example, dense equivalence, ±inf thresholds, and the calibrate ->
artifact -> eval pipeline on tiny-random (fit quality, fingerprint refusal, ablations)."""

import json
import math
import subprocess
import sys

import pytest
import torch

from sparsekv.activations import dump_activations, load_activations
from sparsekv.artifacts import ArtifactError
from sparsekv.calibrate import _Block, _Objective, calibrate_adamas, codes, save_calibration
from sparsekv.decode import generate
from sparsekv.errors import SparseKVError
from sparsekv.eval.runner import RunSpec, run_task
from sparsekv.kernels.reference import code_distance_reference, code_pack_reference, hadamard_matrix
from sparsekv.methods import CacheShape, get_method
from sparsekv.methods.adamas import FIXED_THRESHOLDS
from sparsekv.models import tiny_random

TEXT = ("Adamas applies the Hadamard transform, bucketization and 2-bit compression to queries and keys, then ranks "
        "the keys by the Manhattan distance between codes. ")


# -- the hand-built example ------------------------------------------------------------------------------------------
# D = 8, thresholds (-1, 0, 1): the values -2, -0.5, 0.5, 2 in the Hadamard domain have codes 0, 1, 2, 3.
# Two query heads share one KV head. qA's codes are [3,3,3,3,0,0,0,0], qB's are all 3. Keys 0..6 (key 7 is the
# recent window) have the codes below; their L1 distances to qA / qB and the group's sum are:
#   key  codes               dA  dB  sum
#   0    3 3 3 3  0 0 0 0     0  12   12
#   1    0 0 0 0  0 0 0 0    12  24   36
#   2    3 3 3 2  3 3 3 3    13   1   14
#   3    1 1 3 3  0 0 0 0     4  16   20
#   4    3 3 2 2  0 0 0 0     2  14   16
#   5    2 2 2 0  2 2 2 2    14  10   24
#   6    2 2 2 3  0 0 0 0     3  15   18
# Budget 4 = window 1 + 3 chosen: group pooling picks {0, 2, 4}; per head, qA picks {0, 4, 6} and qB {0, 2, 5}.
LEVEL = torch.tensor([-2.0, -0.5, 0.5, 2.0])
Q_CODES = [[3, 3, 3, 3, 0, 0, 0, 0], [3] * 8]
K_CODES = [[3, 3, 3, 3, 0, 0, 0, 0], [0] * 8, [3, 3, 3, 2, 3, 3, 3, 3], [1, 1, 3, 3, 0, 0, 0, 0],
           [3, 3, 2, 2, 0, 0, 0, 0], [2, 2, 2, 0, 2, 2, 2, 2], [2, 2, 2, 3, 0, 0, 0, 0], [0] * 8]
DIST = [[0, 12, 13, 4, 2, 14, 3, 12], [12, 24, 1, 16, 14, 10, 15, 24]]

# CPU tensors through the Triton path need the interpreter (on only when there is no GPU); on a GPU machine the
# kernels are covered on CUDA by test_adamas_kernels.py
interpreter_only = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors need TRITON_INTERPRET")


def hand_built(hadamard=True, rotate=True, budget=4, **options):
    """The example through `append` and `select`; returns (method, state, selection)."""
    H = hadamard_matrix(8)
    q = LEVEL[torch.tensor(Q_CODES)]
    k = LEVEL[torch.tensor(K_CODES)]
    if rotate:  # x = y Hᵀ has Hadamard transform x H = y (H is orthonormal)
        q, k = q @ H.T, k @ H.T
    m = get_method("adamas", budget=budget, thresholds=(-1, 0, 1), hadamard=hadamard, **options)
    st = m.new_state(0, CacheShape(1, 1, 2, 8, 16, torch.float32, torch.device("cpu")))
    st.keys = torch.zeros(1, 1, 16, 8)
    st.keys[0, 0, :8] = k
    m.append(st, k.view(1, 1, 8, 8), k.view(1, 1, 8, 8), None, 0)
    st.length = 8
    return m, st, m.select(st, q.view(1, 2, 1, 8), None)


def test_hand_built_codes_and_selection():
    m, st, sel = hand_built(pooling="group")
    assert torch.equal(st.codes[0, 0, :8], code_pack_reference(torch.tensor(K_CODES), bits=2))
    q_words = code_pack_reference(torch.tensor(Q_CODES), bits=2).view(1, 2, -1)
    assert code_distance_reference(q_words, st.codes[:, :, :8], 8).tolist() == [DIST]
    assert (sel.sink, sel.window, sel.length) == (0, 1, 8)
    assert sorted(sel.indices[0, 0].tolist()) == [0, 2, 4]
    m, _, per_head = hand_built()  # the default: per query head, as the authors' code
    assert m.pooling == "head" and m.config()["pooling"] == "head"
    assert [sorted(r) for r in per_head.indices[0].tolist()] == [[0, 4, 6], [0, 2, 5]]


def test_hand_built_without_transform_and_transform_matters():
    _, _, raw = hand_built(hadamard=False, rotate=False, pooling="group")  # codes of the raw values: same example
    assert sorted(raw.indices[0, 0].tolist()) == [0, 2, 4]
    _, st, _ = hand_built(hadamard=True, rotate=False)  # the transform must be applied to the keys
    assert not torch.equal(st.codes[0, 0, :8], code_pack_reference(torch.tensor(K_CODES), bits=2))


@pytest.mark.parametrize("opts", [{}, {"pooling": "group"}, {"hadamard": False, "rotate": False}])
@interpreter_only
def test_kernel_path_selects_the_same(monkeypatch, opts):
    """The Triton kernels (interpreted on the CPU) give the reference's codes and choices."""
    _, st_ref, ref = hand_built(**opts)
    monkeypatch.setenv("SPARSEKV_KERNELS", "1")
    _, st_ker, ker = hand_built(**opts)
    assert torch.equal(st_ker.codes, st_ref.codes)
    assert [sorted(r) for r in ker.indices[0].tolist()] == [sorted(r) for r in ref.indices[0].tolist()]


@pytest.mark.parametrize("flag", ["0", "1"])
def test_head_top_keeps_each_heads_nearest(monkeypatch, flag):
    """Budget 5 (4 chosen): the group's sum picks {0, 2, 4, 6}; with head_top 2 each head's two nearest come first,
    qA's {0, 4} and qB's {2, 5}, so key 5 (qB's second, distance 10) displaces key 6 (qA's third). Torch path and
    kernel path (interpreted on the CPU)."""
    if flag == "1" and torch.cuda.is_available():
        pytest.skip("CPU tensors need TRITON_INTERPRET")
    monkeypatch.setenv("SPARSEKV_KERNELS", flag)
    _, _, group = hand_built(budget=5, pooling="group")
    assert sorted(group.indices[0, 0].tolist()) == [0, 2, 4, 6]
    m, _, sel = hand_built(budget=5, pooling="group", head_top=2)
    assert sorted(sel.indices[0, 0].tolist()) == [0, 2, 4, 5]
    assert m.config()["head_top"] == 2 and hand_built(head_top=2)[0].config()["head_top"] == 0  # per head anyway


@interpreter_only
@pytest.mark.parametrize("bits,distance", [(1, "l1"), (3, "l1"), (2, "l2")])
def test_kernel_path_codes_other_bits(monkeypatch, bits, distance):
    g = torch.Generator().manual_seed(bits)
    k = torch.randn(1, 2, 40, 20, generator=g)
    thr = torch.tensor(FIXED_THRESHOLDS[bits]) / 10  # |H k| is about 1 here: make every bucket occur
    states = []
    for flag in ("0", "1"):
        monkeypatch.setenv("SPARSEKV_KERNELS", flag)
        m = get_method("adamas", budget=8, bits=bits, distance=distance, thresholds=thr)
        st = m.new_state(0, CacheShape(1, 2, 4, 20, 48, torch.float32, torch.device("cpu")))
        m.append(st, k[:, :, :30], k[:, :, :30], None, 0)  # prefill, then one decode step's key
        m.append(st, k[:, :, 30:31], k[:, :, 30:31], None, 30)
        states.append(st.codes)
    assert torch.equal(states[0], states[1]) and len(states[0][:, :, :31].unique()) > 2 ** bits


def test_ip_hand_built_per_head_and_group():
    """Distance "ip" on the hand-built example: centers (-1.5, -0.5, 0.5, 1.5) for thresholds (-1, 0, 1); qA·c over
    keys 0..6 = 24, 0, -2, 16, 20, -4, 18 and qB·c = 0, -24, 22, -8, -4, 4, -6 (the group's sum 24, -24, 20, 8, 16,
    0, 12)."""
    m, _, sel = hand_built(distance="ip")
    assert [sorted(r) for r in sel.indices[0].tolist()] == [[0, 4, 6], [0, 2, 5]]
    _, _, sel = hand_built(distance="ip", pooling="group")
    assert sorted(sel.indices[0, 0].tolist()) == [0, 2, 4]
    assert m.config()["distance"] == "ip"


def _ip_vs_l1(distance):
    """q = (4, 0.2 x 7) has codes (3, 2 x 7). Key X = codes (3, 0 x 7): L1 14, q·c = 6 - 2.1 = 3.9; key Y = (0, 2 x
    7): L1 3, q·c = -6 + 0.7 = -5.3; key 2 is the window. L1 picks Y, "ip" picks X: the key aligned with the
    query's one large component."""
    level = torch.tensor([-1.5, -0.5, 0.5, 1.5])
    k = level[torch.tensor([[3] + [0] * 7, [0] + [2] * 7, [1] * 8])].view(1, 1, 3, 8)
    q = torch.tensor([4.0] + [0.2] * 7).view(1, 1, 1, 8)
    m = get_method("adamas", budget=2, thresholds=(-1, 0, 1), hadamard=False, distance=distance)
    st = m.new_state(0, CacheShape(1, 1, 1, 8, 4, torch.float32, torch.device("cpu")))
    m.append(st, k, k, None, 0)
    st.length = 3
    return m.select(st, q, None).indices.flatten().tolist()


def test_ip_ranks_by_the_query_not_its_codes():
    assert _ip_vs_l1("l1") == [1] and _ip_vs_l1("ip") == [0]


@interpreter_only
@pytest.mark.parametrize("opts", [{"distance": "ip"}, {"distance": "ip", "pooling": "group"}])
def test_ip_kernel_path_selects_the_same(monkeypatch, opts):
    _, _, ref = hand_built(**opts)
    monkeypatch.setenv("SPARSEKV_KERNELS", "1")
    _, _, ker = hand_built(**opts)
    assert [sorted(r) for r in ker.indices[0].tolist()] == [sorted(r) for r in ref.indices[0].tolist()]
    assert _ip_vs_l1("ip") == [0]


def test_ip_runs_in_the_runtime(tiny, prompt_ids):
    a = generate(tiny, prompt_ids, get_method("adamas", budget=16, distance="ip"), 6, stop_on_eos=False)
    assert a.stats["mean_attended"] == 16 and a.stats["mean_selected"] == 15 and a.stats["mean_window"] == 1
    d = generate(tiny, prompt_ids, get_method("adamas", budget=400, distance="ip"), 4, keep_logits=True,
                 stop_on_eos=False)
    e = generate(tiny, prompt_ids, get_method("dense"), 4, keep_logits=True, stop_on_eos=False)
    assert d.tokens == e.tokens and all(torch.equal(x, y) for x, y in zip(d.logits, e.logits))


def _random_state(method, seed=0, B=2, Hkv=2, Hq=4, L=40, D=16, device="cpu"):
    """A filled Adamas state of random keys (fixed thresholds) and a query, fp32."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, Hkv, L, D, generator=g).to(device)
    st = method.new_state(0, CacheShape(B, Hkv, Hq, D, L, torch.float32, torch.device(device)))
    st.keys, st.values = k.clone(), k.clone()
    method.append(st, k, k, None, 0)
    st.length = L
    return st, torch.randn(B, Hq, 1, D, generator=g).to(device)


def _sets(sel):
    return [[sorted(r) for r in b] for b in sel.indices.tolist()]


@pytest.mark.parametrize("pooling", ["head", "group"])
@pytest.mark.parametrize("distance", ["l1", "ip"])
def test_rerank_of_every_key_is_the_oracle(pooling, distance):
    """rerank x k >= the keys in range: every key is a candidate, so the exact re-rank makes the oracle's choice."""
    opts = dict(budget=8, sink=2, window=3, pooling=pooling)
    ada = get_method("adamas", thresholds=(-0.5, 0, 0.5), distance=distance, rerank=20, **opts)
    st, q = _random_state(ada)
    oracle = get_method("oracle", **opts).select(st, q, None)
    sel = ada.select(st, q, None)
    assert sel.indices.shape[-1] == 3 and (sel.sink, sel.window) == (2, 3)
    assert _sets(sel) == _sets(oracle)


@pytest.mark.parametrize("pooling", ["head", "group"])
def test_rerank_keeps_k_of_the_wider_choice(pooling):
    """rerank F: the k kept are among the F x k the codes pick, have the highest exact scores there, and differ
    from the codes' own top k on random keys; F = 1 is the plain selection."""
    kw = dict(budget=7, thresholds=(-0.5, 0, 0.5), distance="ip", pooling=pooling)
    plain, wide, rr = (get_method("adamas", **kw), get_method("adamas", **{**kw, "budget": 19}),
                       get_method("adamas", rerank=3, **kw))
    st, q = _random_state(plain, seed=3)
    a, w, r = plain.select(st, q, None), wide.select(st, q, None), rr.select(st, q, None)
    assert _sets(get_method("adamas", rerank=1, **kw).select(st, q, None)) == _sets(a)
    assert r.indices.shape[-1] == 6 and w.indices.shape[-1] == 18
    assert all(set(x) <= set(y) for rb, wb in zip(_sets(r), _sets(w)) for x, y in zip(rb, wb))
    assert _sets(r) != _sets(a)
    B, Hq, Hkv = q.shape[0], q.shape[1], st.keys.shape[1]
    if pooling == "head":  # the kept keys' exact scores are the candidates' top 6
        kv = torch.arange(Hq) // (Hq // Hkv)
        for b in range(B):
            for h in range(Hq):
                s = st.keys[b, kv[h]] @ q[b, h, 0]
                cand = w.indices[b, h]
                assert sorted(r.indices[b, h].tolist()) == sorted(cand[s[cand].topk(6).indices].tolist())
    assert get_method("adamas", rerank=3, **kw).config()["rerank"] == 3


@interpreter_only
def test_rerank_kernel_path_selects_the_same(monkeypatch):
    ada = get_method("adamas", budget=7, thresholds=(-0.5, 0, 0.5), distance="ip", rerank=3)
    st, q = _random_state(ada, seed=3)
    ref = ada.select(st, q, None)
    monkeypatch.setenv("SPARSEKV_KERNELS", "1")
    st, q = _random_state(ada, seed=3)
    assert _sets(ada.select(st, q, None)) == _sets(ref)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("pooling", ["head", "group"])
def test_gpu_rerank_selects_as_the_cpu(pooling):
    """The kernels' path (ip scores, the fused top-k, the re-rank's gather and top-k) on CUDA against the CPU path."""
    kw = dict(budget=64, thresholds=(-0.5, 0, 0.5), distance="ip", rerank=4, pooling=pooling)
    ada = get_method("adamas", **kw)
    sets = [_sets(ada.select(*_random_state(ada, seed=5, B=2, Hkv=2, Hq=8, L=3000, D=128, device=dev), None))
            for dev in ("cpu", "cuda")]
    assert sets[0] == sets[1]


def test_defaults_and_bad_options():
    cfg = get_method("adamas", budget=64).config()
    assert cfg["thresholds"] == [-10.0, 0.0, 10.0] and (cfg["sink"], cfg["window"]) == (0, 1)
    assert (cfg["hadamard"], cfg["bits"], cfg["distance"], cfg["rerank"], cfg["head_top"]) == (True, 2, "l1", 1, 0)
    for bits in (1, 3):  # more bits refine the 2-bit codes: their thresholds contain the 2-bit ones
        assert set(FIXED_THRESHOLDS[bits]) <= set(FIXED_THRESHOLDS[3])
    for opts, msg in [({"bits": 4}, "bits must be 1, 2 or 3"), ({"distance": "cos"}, "unknown distance"),
                      ({"thresholds": (1, 0, 2)}, "non-decreasing"), ({"thresholds": (0, 1)}, "must have 3"),
                      ({"thresholds": (0, math.nan, 1)}, "NaN"), ({"rerank": 0}, "rerank must be"),
                      ({"rerank": 1.5}, "rerank must be"), ({"rerank": True}, "rerank must be"),
                      ({"head_top": -1}, "head_top must be"),
                      ({"head_top": 2, "distance": "ip"}, "head_top ranks code distances")]:
        with pytest.raises(SparseKVError, match=msg):
            get_method("adamas", budget=8, **opts)
    with pytest.raises(SparseKVError, match="head dim 10"):
        get_method("adamas", budget=8).new_state(0, CacheShape(1, 1, 1, 10, 8, torch.float32, torch.device("cpu")))
    get_method("adamas", budget=8, hadamard=False).new_state(
        0, CacheShape(1, 1, 1, 10, 8, torch.float32, torch.device("cpu")))  # no transform: any dim


# -- runtime ---------------------------------------------------------------------------------------------------------

def test_sparse_budget_selects_and_differs_from_streaming(tiny, prompt_ids):
    a = generate(tiny, prompt_ids, get_method("adamas", budget=16), 6, stop_on_eos=False)
    s = generate(tiny, prompt_ids, get_method("streaming", budget=16), 6, stop_on_eos=False)
    assert a.stats["mean_attended"] == 16 and a.stats["mean_selected"] == 15 and a.stats["mean_window"] == 1
    assert a.tokens != s.tokens  # choosing by codes is not the recent window


@pytest.mark.parametrize("thr,code", [((-math.inf,) * 3, 3), ((math.inf,) * 3, 0), ((-math.inf, 0, math.inf), None)])
def test_infinite_thresholds(tiny, prompt_ids, thr, code):
    runs = [generate(tiny, prompt_ids, get_method("adamas", budget=16, thresholds=thr), 5, stop_on_eos=False)
            for _ in range(2)]
    assert runs[0].tokens == runs[1].tokens
    m = get_method("adamas", budget=16, thresholds=thr, pooling="group")  # one choice per KV head
    st = m.new_state(0, CacheShape(1, 2, 6, 20, 64, torch.float32, torch.device("cpu")))
    k = torch.randn(1, 2, 50, 20, generator=torch.Generator().manual_seed(0))
    m.append(st, k, k, None, 0)
    st.length = 50
    sel = m.select(st, torch.randn(1, 6, 1, 20), None)
    idx = sel.indices
    assert idx.shape == (1, 2, 15) and idx.min() >= 0 and idx.max() < 49
    assert all(len(set(r)) == 15 for r in idx[0].tolist())
    if code is not None:  # every value lands in the same bucket
        assert torch.equal(st.codes[:, :, :50], code_pack_reference(torch.full((1, 2, 50, 20), code), bits=2))
    else:  # codes 1 + [x > 0]: the same distances, so the same choice, as 1-bit codes at 0
        one = get_method("adamas", budget=16, bits=1, pooling="group")
        st1 = one.new_state(0, CacheShape(1, 2, 6, 20, 64, torch.float32, torch.device("cpu")))
        one.append(st1, k, k, None, 0)
        st1.length = 50
        q = torch.randn(1, 6, 1, 20, generator=torch.Generator().manual_seed(1))
        assert torch.equal(m.select(st, q, None).indices, one.select(st1, q, None).indices)


# -- calibrate -------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def dump(tmp_path_factory):
    from sparsekv.models import load_model

    lm = load_model("tiny-random")
    ids = lm.tokenizer.encode(TEXT * 8)[:512]
    path = dump_activations(lm, ids, tmp_path_factory.mktemp("acts") / "d", seq_len=128, queries_per_seq=32,
                            seed=0, source="test text")
    return load_activations(path, lm)


@pytest.fixture(scope="module")
def fitted(dump, tmp_path_factory):
    thr, q_thr, report = calibrate_adamas(dump, budget=16)
    root = tmp_path_factory.mktemp("artifacts")
    path = save_calibration(root, dump, thr, report, per="head", bits=2, hadamard=True, distance="l1", budget=16,
                            query_thresholds=q_thr)
    return thr, q_thr, report, path


def test_objective_distances_equal_the_reference():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(7, 20, generator=g), torch.randn(30, 20, generator=g)
    blk = _Block(q, k, torch.zeros(7, 30, dtype=torch.bool), torch.zeros(7, 4, dtype=torch.long))
    for bits, thr in [(1, [0.1]), (2, [-0.7, 0.0, 0.4]), (3, [-1.5, -1, -0.5, 0, 0.5, 1, 1.5]),
                      (2, [-math.inf, 0.0, math.inf])]:
        thr = torch.tensor(thr)
        qw = code_pack_reference(codes(q, thr), bits).view(1, 7, -1)
        kw = code_pack_reference(codes(k, thr), bits).view(1, 1, 30, -1)
        for metric in ("l1", "l2"):
            want = code_distance_reference(qw, kw, 20, bits, metric)[0]
            assert torch.equal(_Objective(bits, metric).distances(blk, thr), want.long()), (bits, metric)


def test_expected_recall_counts_ties_by_chance():
    # one query, 6 visible keys (+1 hidden), budget 2, truth = keys {0, 3}. 1-bit codes at threshold 0 on a 1-dim
    # vector: q code 1; keys 0, 1, 2 code 1 (distance 0), keys 3, 4, 5 code 0 (distance 1). Three keys tie for two
    # places: key 0 is picked with chance 2/3, key 3 never, so the expected recall is (2/3) / 2.
    q = torch.tensor([[1.0]])
    k = torch.tensor([[1.0], [2.0], [3.0], [-1.0], [-2.0], [-3.0], [5.0]])
    hidden = torch.tensor([[False] * 6 + [True]])
    blk = _Block(q, k, hidden, torch.tensor([[0, 3]]))
    got = _Objective(1, "l1").block_recall(blk, torch.tensor([0.0]))
    assert got.tolist() == pytest.approx([1 / 3])
    blk = _Block(q, k, hidden, torch.tensor([[0, 3]]))
    # at -inf every key codes 1: six keys tie for two places, each truth key is picked with chance 1/3
    assert _Objective(1, "l1").block_recall(blk, torch.tensor([-math.inf])).tolist() == pytest.approx([1 / 3])


def test_fit_improves_recall(fitted, dump):
    thr, _, report, _ = fitted
    assert thr.shape == (dump.num_layers, dump.kv_heads, 3)
    assert (thr[..., 1:] >= thr[..., :-1]).all()
    for layer in report["layers"]:
        for head in layer["heads"]:
            assert head["fit_after"] >= head["fit_before"]
    # on tiny-random the paper's ±10 never fire (|H k| is about 2), so the fit has room: it must use it
    assert report["mean"]["fit_after"] > report["mean"]["fit_before"] + 0.05
    assert report["mean"]["after"] > report["mean"]["before"]
    assert report["queries_heldout"] > 0 and report["budget"] == 16


def test_query_scale_is_chosen_on_the_fit_set(fitted, dump):
    """Queries' thresholds are the keys' / the chosen scale, and the choice never fits worse than one shared set."""
    thr, q_thr, report, _ = fitted
    assert report["search"]["query_scales"] == [1.0, 2.0, 4.0, 8.0]
    scale = torch.tensor([[h["query_scale"] for h in layer["heads"]] for layer in report["layers"]])
    assert torch.equal(q_thr, thr / scale.unsqueeze(-1))
    thr1, q_thr1, shared = calibrate_adamas(dump, budget=16, query_scales=(1,))
    assert torch.equal(q_thr1, thr1) and "after_shared" in shared["mean"]
    for layer, layer1 in zip(report["layers"], shared["layers"]):
        for head, head1 in zip(layer["heads"], layer1["heads"]):
            assert head["fit_after"] >= head1["fit_after"]
            assert head["after_shared"] == head1["after"]  # the scale-1 fit is the shared one
    with pytest.raises(SparseKVError, match="query-scales"):
        calibrate_adamas(dump, budget=16, query_scales=(0, 2))


@pytest.mark.parametrize("kernels", [False, pytest.param(True, marks=interpreter_only)])
def test_query_thresholds_code_the_query(dump, tiny, tmp_path, monkeypatch, kernels):
    """Queries' thresholds B / 4 pick what shared thresholds B pick for 4q (the transform is linear); an artifact
    with one set (older ones) uses it for both."""
    from sparsekv.artifacts import save_artifact

    thr = torch.tensor([-0.5, 0.0, 0.5]).expand(dump.num_layers, dump.kv_heads, 3).contiguous()
    paths = [save_calibration(tmp_path / "a", dump, thr, {}, per="head", bits=2, hadamard=True, distance="l1",
                              budget=16, query_thresholds=thr / 4),
             save_artifact(tmp_path / "b", method="adamas", model_fingerprint=dump.manifest["model"],
                           config={"bits": 2, "hadamard": True, "distance": "l1"},
                           tensors={"thresholds": {"thresholds": thr}})]
    if kernels:
        monkeypatch.setenv("SPARSEKV_KERNELS", "1")
    g = torch.Generator().manual_seed(3)
    k, q = torch.randn(1, 2, 60, 20, generator=g), torch.randn(1, 6, 1, 20, generator=g)
    picks = []
    for path, query in zip(paths, (q, 4 * q)):
        m = get_method("adamas", budget=16, artifact=path)
        m.bind(tiny)
        st = m.new_state(1, CacheShape(1, 2, 6, 20, 64, torch.float32, torch.device("cpu")))
        m.append(st, k, k, None, 0)
        st.length = 60
        picks.append(m.select(st, query, None).indices)
    assert torch.equal(st.q_thresholds, st.thresholds)  # one set: the keys'
    assert torch.equal(picks[0], picks[1])
    assert get_method("adamas", budget=16, artifact=paths[0]).config()["thresholds"].endswith("queries' apart)")
    with pytest.raises(SparseKVError, match="query thresholds of shape"):
        save_calibration(tmp_path / "c", dump, thr, {}, per="head", bits=2, hadamard=True, distance="l1",
                         budget=16, query_thresholds=thr[:1])


def test_artifact_then_eval_passkey(fitted, tiny):
    thr, q_thr, _, path = fitted
    res = run_task(tiny, "passkey", RunSpec("adamas", 16, {"artifact": str(path)}), 300, 2)
    assert res["artifact"] == str(path)
    assert res["method_config"]["thresholds"].startswith("artifact") and res["selectivity"] < 0.2
    m = get_method("adamas", budget=16, artifact=path)
    m.bind(tiny)
    assert torch.equal(m.layer_thresholds(1, 2), thr[1])
    assert torch.equal(m.layer_thresholds(1, 2, queries=True), q_thr[1])
    with pytest.raises(SparseKVError, match="bits=2"):
        get_method("adamas", budget=16, artifact=path, bits=3)
    with pytest.raises(SparseKVError, match="not both"):
        get_method("adamas", budget=16, artifact=path, thresholds=(-1, 0, 1))


def test_artifact_needs_bind_and_refuses_another_model(fitted, prompt_ids):
    *_, path = fitted
    m = get_method("adamas", budget=16, artifact=path)
    with pytest.raises(SparseKVError, match="bind"):
        m.new_state(0, CacheShape(1, 2, 6, 20, 64, torch.float32, torch.device("cpu")))
    with pytest.raises(ArtifactError, match=r"fitted on another model .*weights_sha256"):
        generate(tiny_random(seed=1), prompt_ids, m, 3)


@pytest.mark.parametrize("opts", [{"hadamard": False}, {"bits": 1}, {"bits": 3}, {"distance": "l2"},
                                  {"per": "layer"}, {"per": "global"}])
def test_ablations_calibrate_and_run(dump, tiny, prompt_ids, tmp_path, opts):
    cal = {"per": "head", "bits": 2, "hadamard": True, "distance": "l1", **opts}
    thr, q_thr, report = calibrate_adamas(dump, budget=16, sweeps=1, **cal)
    assert thr.shape == (dump.num_layers, dump.kv_heads, 2 ** cal["bits"] - 1)
    assert report["mean"]["fit_after"] >= report["mean"]["fit_before"]
    if cal["per"] != "head":  # one set shared by every head of a layer (or of the model)
        assert torch.equal(thr[0, 0], thr[0, 1]) and (cal["per"] == "layer" or torch.equal(thr[0, 0], thr[1, 0]))
    path = save_calibration(tmp_path, dump, thr, report, budget=16, query_thresholds=q_thr, **cal)
    m = get_method("adamas", budget=16, artifact=path)
    assert {k: m.config()[k] for k in ("bits", "hadamard", "distance")} == \
        {k: cal[k] for k in ("bits", "hadamard", "distance")}
    g = generate(tiny, prompt_ids, m, 4, stop_on_eos=False)
    assert len(g.tokens) == 4 and g.stats["mean_attended"] == 16


def test_calibrate_bad_input(dump):
    with pytest.raises(SparseKVError, match="--per"):
        calibrate_adamas(dump, per="kv")
    with pytest.raises(SparseKVError, match="queries past position 500"):
        calibrate_adamas(dump, budget=500)
    with pytest.raises(SparseKVError, match="calibrate with l1 .* run adamas with --distance ip"):
        calibrate_adamas(dump, distance="ip")


# -- CLI -------------------------------------------------------------------------------------------------------------

def sparsekv(*args):
    return subprocess.run([sys.executable, "-m", "sparsekv.cli", *args], capture_output=True, text=True, timeout=300)


def test_cli_calibrate_then_eval(dump, tmp_path):
    r = sparsekv("calibrate", "--acts", str(dump.path), "--out", str(tmp_path / "art"), "--budget", "16",
                 "--json", str(tmp_path / "c.json"))
    assert r.returncode == 0, r.stderr
    out = json.loads((tmp_path / "c.json").read_text())
    assert out["artifact"] in r.stdout.replace("\n", "") and "mean" in r.stdout
    assert out["mean"]["fit_after"] >= out["mean"]["fit_before"]
    r = sparsekv("eval", "--model", "tiny-random", "--method", "adamas", "--artifact", out["artifact"], "--budget",
                 "16", "--seq", "300", "--n", "1", "--json", str(tmp_path / "e.json"))
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "e.json").read_text())["artifact"] == out["artifact"]
    r = sparsekv("calibrate", "--acts", str(dump.path), "--method", "spotlight")
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == "error: calibrate supports: adamas"
