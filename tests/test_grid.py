"""`eval.grid.evaluate`: what `sparsekv eval` runs, in one library call (checkpoints, ppl's dense score, recall's
default query floor, input checks before any model work)."""

import json

import pytest
import torch

from sparsekv.activations import dump_activations
from sparsekv.errors import SparseKVError
from sparsekv.eval import grid
from sparsekv.eval.grid import EvalConfig, cells_payload, evaluate, method_for
from sparsekv.eval.recall import default_min_context
from sparsekv.methods import MethodOptions

pytestmark = pytest.mark.usefixtures("one_thread")


def test_long_grid_saves_the_cells_so_far(tiny, tmp_path, monkeypatch):
    """A stopped job keeps what it measured: the grid rewrites its checkpoint while it runs, cells marked
    incomplete and stamped with what the caller gives (the CLI: its command line)."""
    out = tmp_path / "r.json"
    evaluate(tiny, EvalConfig("passkey", ["dense"], [16.0], [300], n=2), checkpoint=out)
    assert not out.exists()  # a short run: nothing saved (at most one save a minute)
    saved = []
    write = grid.write_json
    monkeypatch.setattr(grid, "CHECKPOINT_S", 0.0)
    monkeypatch.setattr(grid, "write_json", lambda path, payload: (saved.append(payload), write(path, payload)))
    results = evaluate(tiny, EvalConfig("passkey", ["dense", "oracle"], [16.0], [300], n=3), checkpoint=out,
                       stamp={"command": "sparsekv eval ..."})
    assert [[c["n"] for c in p] for p in saved] == [[1, 1], [2, 2], [3, 3]]  # after every prompt
    assert all(c["complete"] is False and c["command"] == "sparsekv eval ..." for p in saved for c in p)
    assert all(c["complete"] is True for c in results) and [c["n"] for c in results] == [3, 3]
    on_disk = json.loads(out.read_text())
    assert [c["method"] for c in on_disk] == ["dense", "oracle"] and on_disk[0]["complete"] is False
    assert on_disk[0]["skipped_subtasks"] == {}  # the same fields as the final cells


def test_progress_callback_counts_every_sample(tiny):
    calls = []
    results = evaluate(tiny, EvalConfig("passkey", ["dense", "streaming"], [32], [300], n=2),
                       progress=lambda done, total: calls.append((done, total)))
    assert calls[-1] == (4, 4) and [r["method"] for r in results] == ["dense", "streaming"]
    assert cells_payload(results[:1], 1) == results[0] and cells_payload(results, 2) == results


def test_a_later_length_too_short_fails_before_the_first_cell(tiny, monkeypatch):
    """RULER at --seq 1024,300: 300 cannot hold niah_multikey_1's prompt, which fails before 1024's cells run."""
    ran = []
    monkeypatch.setattr(grid, "run_grid", lambda *a, **k: ran.append(a) or [])
    with pytest.raises(SparseKVError, match="seq 300 is too short for RULER subtask niah_multikey_1"):
        evaluate(tiny, EvalConfig("ruler", ["dense"], [16], [1024, 300], n=2, subtasks="niah_multikey_1"))
    assert ran == []


def test_ppl_runs_dense_beside_sparse_and_scores_against_it(tiny, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog while the cat sleeps. " * 40)
    rows = evaluate(tiny, EvalConfig("ppl", ["oracle"], [16], [96], n=1, text_file=text, prefill=64))
    assert [r["method"] for r in rows] == ["dense", "oracle"]
    assert rows[1]["dense_score"] == rows[0]["score"] == rows[0]["dense_score"] and rows[1]["tokens_scored"] == 32


def test_recall_leaves_out_queries_the_budget_covers(tiny, tmp_path):
    assert default_min_context([0.05, 32, 16]) == 33 and default_min_context([0.1]) == 0
    tokens = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(3)).tolist()
    acts = dump_activations(tiny, tokens, tmp_path / "d", seq_len=128, queries_per_seq=16, seed=0)
    default = evaluate(tiny, EvalConfig("recall", ["oracle"], [32], acts=acts))[0]
    every = evaluate(tiny, EvalConfig("recall", ["oracle"], [32], acts=acts, min_context=0))[0]
    assert 0 < default["n"] < every["n"] and default["queries_dense"] == 0 < every["queries_dense"]


@pytest.mark.parametrize("cfg,message", [
    (EvalConfig("bogus"), "unknown task 'bogus'"),
    (EvalConfig(n=0), "--n must be positive"),
    (EvalConfig("ppl", batch=2), "--batch applies to passkey and ruler"),
    (EvalConfig(prefill=10), "--prefill is for --task ppl, not passkey"),
    (EvalConfig("ppl", seqs=[96]), "exactly one of --text-file or --dataset"),
    (EvalConfig("ppl", seqs=[96], dataset="pg19", prefill=96), "--prefill must be in (0, 96)"),
    (EvalConfig("recall"), "needs --acts"),
    (EvalConfig("recall", ["dense", "oracle"], acts="d"), "dense reads every key (a recall of 1 by definition)"),
    (EvalConfig(methods=["nope"]), "unknown method 'nope'"),
    (EvalConfig(methods=["oracle"], budgets=[400], seqs=[300]), "larger than the context"),
    (EvalConfig(methods=["oracle"], options=MethodOptions(bits=1)), "--bits apply to none of the methods oracle"),
    (EvalConfig(methods=["oracle"], options={"colour": 1}), "unknown method option(s) colour"),
    (EvalConfig(methods=["adamas"], options=MethodOptions(bits=5)), "adamas: bits must be 1, 2 or 3"),
    (EvalConfig("ruler", subtasks="niah,nope"), "unknown RULER subtask 'nope'"),
    (EvalConfig("ruler", seqs=[4096, 128], subtasks="niah"), "seq 128 is too short for RULER subtask niah_single_1: "
                                                              "it generates 128 tokens alone"),
    (EvalConfig(methods=["streaming"], options=MethodOptions(sink=0, window=0)), "attends no key"),
])
def test_bad_config_fails_before_any_work(cfg, message):
    with pytest.raises(SparseKVError, match=message.replace("(", r"\(").replace(")", r"\)")):
        cfg.check()


def test_a_grid_builds_each_method_once_to_check_its_options(monkeypatch):
    """The checks run before the model loads and again when the grid runs; the build that checks a method's own
    options (and may read its artifact) runs once per method and options object."""
    built = []
    real = MethodOptions.build
    monkeypatch.setattr(MethodOptions, "build", lambda self, name, *a, **kw: built.append(name) or real(self, name,
                                                                                                      *a, **kw))
    cfg = EvalConfig(methods=["dense", "adamas", "oracle"], budgets=[8, 16], seqs=[300])
    for _ in range(3):
        cfg.check()
        cfg.specs()
    assert sorted(built) == ["adamas", "dense", "oracle"]


def test_method_for_one_generation():
    m = method_for("adamas", 8, {"distance": "ip", "pooling": "group"})
    assert (m.budget, m.distance, m.config()["pooling"]) == (8, "ip", "group")
    assert method_for("dense", 8).config() == {"method": "dense"}
    with pytest.raises(SparseKVError, match="--rerank apply to none of the methods oracle"):
        method_for("oracle", 8, MethodOptions(rerank=2))
