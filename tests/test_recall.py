"""Selection quality on a dump: oracle bounds, a hand computation for StreamingLLM, growing per-page state honestly."""

import pytest
import torch

from sparsekv.activations import dump_activations, load_activations
from sparsekv.calibrate import calibrate_adamas, save_calibration
from sparsekv.errors import SparseKVError
from sparsekv.eval.recall import query_rows, recall_grid
from sparsekv.eval.runner import RunSpec
from sparsekv.methods import REGISTRY, LayerState, Method
from sparsekv.selection import Selection

SEQ, QPS, BUDGET = 96, 24, 16


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def dump(tiny, tmp_path_factory):
    tokens = torch.randint(0, 256, (2 * SEQ + 40,), generator=torch.Generator().manual_seed(2)).tolist()
    out = tmp_path_factory.mktemp("recall") / "d"
    return load_activations(dump_activations(tiny, tokens, out, seq_len=SEQ, queries_per_seq=QPS, seed=1,
                                             source="random bytes"))


@pytest.fixture(scope="module")
def grid(dump):
    specs = [RunSpec("oracle", BUDGET), RunSpec("oracle", BUDGET, {"pooling": "head"}), RunSpec("streaming", BUDGET),
             RunSpec("adamas", BUDGET), RunSpec("oracle", SEQ), RunSpec("streaming", SEQ), RunSpec("dense", None)]
    items = []
    return recall_grid(dump, specs, on_item=lambda: items.append(1)), len(items)


def exact_probs(dump, layer):
    """[Hq, S, T-of-its-sequence] softmax of each dumped query over keys [0, p] of its sequence (loops: a spec)."""
    d = dump.layer(layer)
    G = dump.q_heads // dump.kv_heads
    out = []
    for j in range(dump.queries):
        s, p = int(d["q_seq"][j]), int(d["q_pos"][j])
        off = dump.seq_offsets[s]
        rows = []
        for h in range(dump.q_heads):
            k = d["k_post"][h // G, off : off + p + 1].double()
            q = d["q_post"][h, j].double()
            rows.append(torch.softmax(k @ q / dump.head_dim**0.5, 0))
        out.append((p, rows))
    return out


def test_oracle_against_itself(grid, dump):
    res, items = grid
    assert items == dump.num_layers * dump.queries
    for r in res[:2]:
        assert r["topk_recall"] == pytest.approx(1.0) and r["iou"] == pytest.approx(1.0)
        assert r["attention_mass_recall"] == pytest.approx(r["oracle_mass_recall"])
        assert r["iou_reference"]["method"] == "oracle" and r["iou_reference"]["budget"] == BUDGET
    group, head = res[0], res[1]
    assert head["topk_recall_head"] == pytest.approx(1.0)  # per-head choice: each head's own top-k
    assert group["topk_recall_head"] < 1.0  # one choice per group cannot be every head's top-k ...
    assert group["attention_mass_recall"] <= head["attention_mass_recall"] + 1e-9  # ... nor keep as much mass


def test_streaming_mass_is_the_hand_computation(grid, dump):
    res, _ = grid
    r = res[2]
    want = []
    for layer in range(dump.num_layers):
        vals = []
        for p, rows in exact_probs(dump, layer):
            n = p + 1
            if n <= BUDGET:  # the whole context fits: dense
                vals += [1.0] * len(rows)
                continue
            keep = torch.zeros(n, dtype=torch.bool)
            keep[:4] = True  # 4 sink tokens (the paper's), the window takes the rest of the budget
            keep[n - (BUDGET - 4):] = True
            vals += [float(pr[keep].sum()) for pr in rows]
        want.append(sum(vals) / len(vals))
        assert r["per_layer"][layer]["attention_mass_recall"] == pytest.approx(want[-1], abs=1e-5)
    assert r["attention_mass_recall"] == pytest.approx(sum(want) / len(want), abs=1e-6)
    assert r["score"] == pytest.approx(100 * r["attention_mass_recall"])
    dense_share = sum(int(p + 1 <= BUDGET) for p in dump.layer(0)["q_pos"].tolist()) / dump.queries
    assert r["queries_dense"] == pytest.approx(dense_share) and 0 < dense_share < 1
    # stats average every step, dense ones (no sink, no window, every key counted selected) included, as the
    # runtime's DecodeStats do
    qpos = dump.layer(0)["q_pos"].tolist()
    assert r["mean_sink"] == pytest.approx(4 * (1 - dense_share))
    assert r["mean_selected"] == pytest.approx(sum(p + 1 for p in qpos if p + 1 <= BUDGET) / len(qpos))


def test_budget_covering_the_context_and_dense_give_one(grid):
    res, _ = grid
    for r in res[4:]:
        for key in ("attention_mass_recall", "topk_recall", "topk_recall_head"):
            assert r[key] == pytest.approx(1.0), (r["method"], key)
        assert r["selectivity"] == pytest.approx(1.0) and r["queries_dense"] == 1.0
    assert res[4]["iou"] == pytest.approx(1.0)
    assert res[6]["iou"] is None and res[6]["iou_reference"] is None  # dense has no budget to compare at


def test_result_shape_and_bounds(grid, dump):
    res, _ = grid
    for r in res:
        assert (r["task"], r["metric"], r["seq_len"], r["n"]) == ("recall", "attention_mass_recall", SEQ,
                                                                  dump.queries)
        assert len(r["per_layer"]) == dump.num_layers and [x["layer"] for x in r["per_layer"]] == [0, 1]
        assert r["model"] == dump.manifest["model"]["name"] and r["text_source"] == "random bytes"
        assert r["dump"] == str(dump.path) and r["seed"] == 1 and "grown over keys [0, p]" in r["protocol"]
        for key in ("attention_mass_recall", "topk_recall", "topk_recall_head"):
            assert 0.0 <= r[key] <= 1.0 + 1e-9
        if r["oracle_mass_recall"] is not None:  # nothing beats the oracle with the same sink/window and k
            assert r["attention_mass_recall"] <= r["oracle_mass_recall"] + 1e-9
            assert 0 < r["iou"] <= 1 + 1e-9
    adamas = res[3]
    assert adamas["method_config"]["method"] == "adamas" and adamas["budget_tokens"] == BUDGET
    assert adamas["iou_reference"]["window"] == 1 and adamas["iou_reference"]["sink"] == 0
    assert adamas["mean_sink"] == 0 and 0 < adamas["mean_window"] <= 1  # the paper's: no sink, the newest token
    assert res[2]["attention_mass_recall"] < res[0]["attention_mass_recall"]


def test_adamas_artifact_binds_without_a_model(dump, tiny, tmp_path):
    thr, q_thr, report = calibrate_adamas(dump, budget=BUDGET, sweeps=1, max_queries=16)
    path = save_calibration(tmp_path, dump, thr, report, per="head", bits=2, hadamard=True, distance="l1",
                            budget=BUDGET, query_thresholds=q_thr)
    spec = RunSpec("adamas", BUDGET, {"artifact": str(path)})
    a = recall_grid(dump, [spec], max_queries=10)[0]
    b = recall_grid(dump, [spec], lm=tiny, max_queries=10)[0]
    assert a["n"] == 10 and a["artifact"] == str(path)
    assert a["attention_mass_recall"] == pytest.approx(b["attention_mass_recall"])


def test_errors(dump, tiny):
    with pytest.raises(SparseKVError, match="larger than the context"):
        recall_grid(dump, [RunSpec("oracle", SEQ + 1)])
    with pytest.raises(SparseKVError, match="unknown method"):
        recall_grid(dump, [RunSpec("nope", 8)])
    with pytest.raises(SparseKVError, match="no queries with a context of 1000"):
        recall_grid(dump, [RunSpec("oracle", 8)], min_context=1000)
    rows = query_rows(dump, max_queries=7, min_context=BUDGET + 1)
    pos = dump.positions()["q_pos"]
    assert len(rows) == 7 and bool((pos[rows] >= BUDGET).all())
    other = type(tiny)(tiny.model, tiny.tokenizer, "another-model", tiny.source)
    with pytest.raises(Exception, match="dumped from another model"):
        recall_grid(dump, [RunSpec("oracle", 8)], lm=other)


class PageProbe(Method):
    """A Quest-like per-page summary (max of each page's key norms), checked at every select: the page holding the
    newest key must summarise exactly the keys [page start, length), never a later one."""

    name = "page-probe"
    PAGE = 8
    checked = 0

    def new_state(self, layer, shape):
        st = LayerState()
        st.page_max = torch.full((shape.max_len // self.PAGE + 1,), -1.0)
        return st

    def append(self, state, k, v, k_pre_rope, pos):
        norms = k[0].norm(dim=-1).amax(0)  # [n]
        for i, x in enumerate(norms.tolist()):
            p = (pos + i) // self.PAGE
            state.page_max[p] = max(float(state.page_max[p]), x)

    def select(self, state, q, q_pre_rope):
        n = state.length
        last = (n - 1) // self.PAGE
        want = state.keys[0, :, last * self.PAGE : n].norm(dim=-1).amax()
        assert float(state.page_max[last]) == pytest.approx(float(want), rel=1e-6)
        assert float(state.keys[0, :, n:].abs().sum()) == 0  # nothing past the length is visible
        PageProbe.checked += 1
        return Selection(n, sink=0, window=min(n, 4))


def test_per_page_state_is_grown_not_truncated(dump, monkeypatch):
    monkeypatch.setitem(REGISTRY, PageProbe.name, PageProbe)
    r = recall_grid(dump, [RunSpec("page-probe", 4)], max_queries=20)[0]
    assert r["n"] == 20 and PageProbe.checked == 20 * dump.num_layers
