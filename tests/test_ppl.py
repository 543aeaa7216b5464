"""Perplexity under sparse decoding: the decode path end to end against a plain forward, budget limits, errors."""

import gzip
import math

import pytest
import torch

from sparsekv.decode import prefill, score_continuation
from sparsekv.errors import SparseKVError
from sparsekv.eval.ppl import ppl_grid, ppl_tokens
from sparsekv.eval.runner import RunSpec
from sparsekv.methods import get_method

SEQ, PREFILL, N = 96, 48, 2


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 256, (N * SEQ + 17,), generator=torch.Generator().manual_seed(5)).tolist()


def plain_ppl(lm, ids, seq, pre, n):
    """Teacher forcing in one full-sequence forward per window: stock eager attention, no cache."""
    lm.model.set_attn_implementation("eager")
    try:
        total = 0.0
        for w in range(n):
            x = torch.tensor([ids[w * seq : (w + 1) * seq]])
            with torch.no_grad():
                logits = lm.model(input_ids=x, use_cache=False).logits[0].double()
            lp = torch.log_softmax(logits, -1)
            total -= float(lp[pre - 1 : seq - 1].gather(1, x[0, pre:].view(-1, 1)).sum())
    finally:
        lm.model.set_attn_implementation("sparsekv")
    return math.exp(total / (n * (seq - pre)))


@pytest.fixture(scope="module")
def grid(tiny, ids):
    specs = [RunSpec("dense", None), RunSpec("oracle", SEQ), RunSpec("streaming", SEQ), RunSpec("adamas", SEQ),
             RunSpec("oracle", 8), RunSpec("streaming", 8)]
    steps = []
    res = ppl_grid(tiny, specs, ids, SEQ, PREFILL, n=N, on_step=lambda: steps.append(1), text_source="random")
    return res, len(steps), specs


def test_dense_equals_plain_forward(tiny, ids, grid):
    res, _, _ = grid
    assert res[0]["score"] == pytest.approx(plain_ppl(tiny, ids, SEQ, PREFILL, N), rel=1e-5)
    assert res[0]["selectivity"] == 1.0 and res[0]["mean_selected"] is None  # dense keeps no sparse steps


def test_budget_covering_the_context_equals_dense(grid):
    res, _, _ = grid
    for r in res[1:4]:
        assert r["score"] == pytest.approx(res[0]["score"], rel=1e-6), r["method"]
        assert r["selectivity"] == pytest.approx(1.0)
        for a, b in zip(r["per_window"], res[0]["per_window"]):
            assert a["ppl"] == pytest.approx(b["ppl"], rel=1e-6)


def test_small_budget_is_sparse_and_recorded(tiny, grid):
    res, steps, specs = grid
    assert steps == N * len(specs) * (SEQ - PREFILL)
    for r in res[4:]:
        assert r["score"] != pytest.approx(res[0]["score"], rel=1e-4)
        assert r["selectivity"] < 0.2 and r["budget_tokens"] == 8
        assert r["mean_sink"] + r["mean_window"] + r["mean_selected"] == pytest.approx(8)
    assert res[5]["mean_sink"] == 4 and res[5]["mean_window"] == 4 and res[5]["mean_selected"] == 0
    r = res[4]
    assert (r["task"], r["metric"], r["seq_len"], r["n"], r["prefill"], r["tokens_scored"]) == \
        ("ppl", "perplexity", SEQ, N, PREFILL, N * (SEQ - PREFILL))
    assert [w["window"] for w in r["per_window"]] == [0, 1]
    # overall ppl is the token-weighted geometric mean of the windows' (equal sizes here)
    assert r["score"] == pytest.approx(math.sqrt(r["per_window"][0]["ppl"] * r["per_window"][1]["ppl"]))
    assert r["text_source"] == "random" and r["model"] == tiny.name and "teacher-forced" in r["protocol"]
    assert r["method_config"]["budget"] == 8 and r["dense_layers"] == [] and r["seconds"] >= 0


def test_score_continuation_matches_logits_and_dense_layers(tiny, ids):
    pf = prefill(tiny, ids[:40])
    nll, n, st = score_continuation(tiny, get_method("dense"), pf, ids[40:41])
    assert n == 1 and st["sparse_steps"] == 0
    assert nll == pytest.approx(-float(torch.log_softmax(pf.logits[0].double(), -1)[ids[40]]))
    _, n, st = score_continuation(tiny, get_method("oracle", budget=8), pf, ids[40:46], dense_layers=(0,))
    assert n == 6 and st["sparse_steps"] == 5  # 5 fed tokens x 1 sparse layer


@pytest.mark.parametrize("kwargs, message", [
    (dict(seq_len=SEQ, prefill=PREFILL, n=3), "needs 288 tokens; the text has 209"),
    (dict(seq_len=SEQ, prefill=SEQ, n=1), "prefill must be between 1 and seq - 1"),
    (dict(seq_len=SEQ, prefill=0, n=1), "prefill must be between"),
    (dict(seq_len=SEQ, prefill=PREFILL, n=0), "n \\(windows\\) must be positive"),
    (dict(seq_len=10**6, prefill=PREFILL, n=1), "needs 1000000 tokens"),
])
def test_bad_arguments_are_one_line(tiny, ids, kwargs, message):
    with pytest.raises(SparseKVError, match=message):
        ppl_grid(tiny, [RunSpec("dense", None)], ids, **kwargs)


def test_budget_and_method_checks(tiny, ids):
    with pytest.raises(SparseKVError, match="budget 97 tokens is larger than the context \\(96 tokens\\)"):
        ppl_grid(tiny, [RunSpec("oracle", SEQ + 1)], ids, SEQ, PREFILL)
    with pytest.raises(SparseKVError, match="unknown method 'nope'"):
        ppl_grid(tiny, [RunSpec("nope", 8)], ids, SEQ, PREFILL)
    long = list(range(256)) * 40
    with pytest.raises(SparseKVError, match="longer than"):
        ppl_grid(tiny, [RunSpec("dense", None)], long, tiny.max_context + 8, PREFILL)


def test_ppl_tokens_from_gz_file_and_dataset(tiny, tmp_path, monkeypatch):
    path = tmp_path / "book.txt.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write("The quick brown fox. " * 50)
    toks = ppl_tokens(tiny, text_file=path, want=300)
    assert len(toks) == 300 and toks[:4] == list(tiny.tokenizer.encode("The ", add_special_tokens=False))
    with pytest.raises(SparseKVError, match="has only"):
        ppl_tokens(tiny, text_file=path, want=10**5)

    datasets = pytest.importorskip("datasets")
    asked = []

    def fake_load(hub_id, config, split, streaming):
        asked.append((hub_id, config, split))
        return iter([{"short_book_title": "t", "text": "abc " * 100}])

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    assert len(ppl_tokens(tiny, dataset="pg19", want=50)) == 50
    assert asked == [("emozilla/pg19", None, "test")]

    def offline(*a, **k):
        raise ConnectionError("Couldn't reach 'emozilla/pg19' on the Hub\nmore lines")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(SparseKVError, match=r"^cannot read dataset 'pg19' \(emozilla/pg19, split test\): "
                                            r"Couldn't reach") as e:
        ppl_tokens(tiny, dataset="pg19", want=50)
    assert "\n" not in str(e.value)
