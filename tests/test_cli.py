"""Every bad input gives one clear line on stderr and a non-zero exit; a good eval writes its JSON."""

import json
import subprocess
import sys

import pytest


def sparsekv(*args):
    return subprocess.run([sys.executable, "-m", "sparsekv.cli", *args], capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("args,message", [
    (["eval", "--model", "tiny-random", "--method", "bogus"], "unknown method 'bogus'"),
    (["eval", "--model", "tiny-random", "--task", "bogus"], "unknown task 'bogus'"),
    (["eval", "--model", "tiny-random", "--method", "oracle", "--budget", "0", "--seq", "300"], "budget must be positive"),
    (["eval", "--model", "tiny-random", "--method", "oracle", "--budget", "400", "--seq", "300"],
     "larger than the context"),
    (["eval", "--model", "tiny-random", "--seq", "5000", "--n", "1"], "longer than tiny-random"),
    (["eval", "--model", "no-such-model"], "unknown model 'no-such-model'"),
    (["generate", "--model", "tiny-random", "--prompt-file", "/nonexistent/p.txt"],
     "--prompt-file /nonexistent/p.txt: file not found"),
    (["dump", "--model", "tiny-random", "--text-file", "/nonexistent/t.txt", "--out", "/tmp/sparsekv-x-out"],
     "not found"),
    (["artifacts", "verify", "/nonexistent/artifact"], "manifest"),
    (["eval", "--model", "tiny-random", "--prefill", "100"], "--prefill is for --task ppl, not passkey"),
    (["eval", "--model", "tiny-random", "--task", "ppl", "--seq", "300"], "exactly one of --text-file or --dataset"),
    (["eval", "--model", "tiny-random", "--task", "recall"], "--task recall needs --acts"),
    (["eval", "--model", "tiny-random", "--task", "ruler", "--subtasks", "niah_bogus", "--seq", "2000"],
     "niah_bogus"),
    (["eval", "--model", "tiny-random", "--task", "ruler", "--haystack-file", "/nonexistent/h.txt"],
     "--haystack-file /nonexistent/h.txt: file not found"),
    (["eval", "--model", "tiny-random", "--batch", "0"], "--batch must be positive"),
    (["eval", "--model", "tiny-random", "--task", "ppl", "--batch", "2"], "--batch applies to passkey"),
    (["eval", "--model", "tiny-random", "--batch-size", "0"], "--batch must be positive"),  # the old spelling
    (["eval", "--model", "tiny-random", "--method", "dense", "--sink", "4"], "--sink apply to none of the methods"),
])
def test_bad_input_is_one_clear_line(args, message):
    r = sparsekv(*args)
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert lines and message in lines[-1], r.stderr
    assert "Traceback" not in r.stderr


def test_eval_writes_json(tmp_path):
    out = tmp_path / "r.json"
    r = sparsekv("eval", "--model", "tiny-random", "--method", "oracle,dense", "--budget", "16", "--seq", "300",
                 "--n", "2", "--json", str(out))
    assert r.returncode == 0, r.stderr
    rows = json.loads(out.read_text())
    assert [x["method"] for x in rows] == ["oracle", "dense"]
    assert rows[0]["budget"] == 16 and rows[0]["selectivity"] < 0.1 and rows[1]["selectivity"] == 1.0
    assert "oracle" in r.stdout and "dense" in r.stdout
    # not a terminal (a batch job's log): the progress bar also leaves plain lines, at least the last one
    assert "2 method/budget cells: 4/4 in " in r.stdout, r.stdout


def test_generate_runs(tmp_path):
    out = tmp_path / "g.json"
    r = sparsekv("generate", "--model", "tiny-random", "--prompt", "hello there", "--method", "streaming",
                 "--budget", "8", "--max-new-tokens", "5", "--json", str(out))
    assert r.returncode == 0, r.stderr
    g = json.loads(out.read_text())
    assert len(g["tokens"]) == 5 and g["method_config"]["method"] == "streaming"


def test_generate_takes_the_method_options(tmp_path):
    out = tmp_path / "g.json"
    r = sparsekv("generate", "--model", "tiny-random", "--prompt", "hello there", "--method", "adamas",
                 "--budget", "8", "--max-new-tokens", "3", "--distance", "ip", "--rerank", "2", "--pooling", "group",
                 "--json", str(out))
    assert r.returncode == 0, r.stderr
    cfg = json.loads(out.read_text())["method_config"]
    assert (cfg["method"], cfg["distance"], cfg["rerank"], cfg["pooling"], cfg["budget"]) == ("adamas", "ip", 2, "group", 8)
    for args, msg in [(["--method", "oracle", "--rerank", "2"], "apply to none of the methods oracle"),
                      (["--method", "nope"], "unknown method 'nope'"),
                      (["--method", "adamas", "--rerank", "0"], "rerank must be a whole number >= 1")]:
        r = sparsekv("generate", "--model", "tiny-random", "--prompt", "hi", *args)
        assert r.returncode == 2 and msg in r.stderr, r.stderr


def test_method_options_reach_only_the_methods_that_take_them(tmp_path):
    out = tmp_path / "abl.json"
    r = sparsekv("eval", "--model", "tiny-random", "--method", "oracle,adamas", "--budget", "16", "--seq", "300",
                 "--n", "1", "--no-hadamard", "--bits", "1", "--distance", "l2", "--rerank", "3",
                 "--json", str(out))
    assert r.returncode == 0, r.stderr
    oracle, adamas = json.loads(out.read_text())
    assert "bits" not in oracle["method_config"] and "rerank" not in oracle["method_config"]
    assert (adamas["method_config"]["hadamard"], adamas["method_config"]["bits"],
            adamas["method_config"]["distance"], adamas["method_config"]["rerank"]) == (False, 1, "l2", 3)
    r = sparsekv("eval", "--model", "tiny-random", "--method", "oracle", "--budget", "16", "--seq", "300",
                 "--n", "1", "--bits", "1")
    assert r.returncode == 2 and "apply to none of the methods oracle" in r.stderr


def test_eval_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "scores.png"
    r = sparsekv("eval", "--model", "tiny-random", "--method", "dense,oracle,streaming", "--budget", "16,32",
                 "--seq", "300", "--n", "1", "--plot", str(png))
    assert r.returncode == 0, r.stderr
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"


def test_eval_ppl_reports_dense_beside_sparse(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog while the cat sleeps. " * 40)
    out = tmp_path / "ppl.json"
    r = sparsekv("eval", "--model", "tiny-random", "--task", "ppl", "--text-file", str(text), "--seq", "96",
                 "--prefill", "64", "--method", "oracle", "--budget", "16", "--n", "1", "--json", str(out))
    assert r.returncode == 0, r.stderr
    rows = json.loads(out.read_text())
    assert [x["method"] for x in rows] == ["dense", "oracle"]  # dense always runs beside the sparse methods
    assert all(x["metric"] == "perplexity" and x["score"] > 1 for x in rows)
    assert rows[1]["dense_score"] == rows[0]["score"] and rows[1]["tokens_scored"] == 32


def test_eval_recall_on_a_dump(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("Some natural-looking text to record keys and queries from, again and again. " * 60)
    dump = tmp_path / "dump"
    r = sparsekv("dump", "--model", "tiny-random", "--text-file", str(text), "--tokens", "512", "--seq", "256",
                 "--queries", "8", "--out", str(dump))
    assert r.returncode == 0, r.stderr
    out = tmp_path / "recall.json"
    r = sparsekv("eval", "--model", "tiny-random", "--task", "recall", "--acts", str(dump), "--method",
                 "oracle,streaming", "--budget", "32", "--json", str(out))
    assert r.returncode == 0, r.stderr
    rows = json.loads(out.read_text())
    assert [x["method"] for x in rows] == ["oracle", "streaming"]
    assert rows[0]["iou"] == pytest.approx(1.0) and rows[0]["topk_recall"] == pytest.approx(1.0)
    assert rows[1]["score"] < rows[0]["score"] and len(rows[0]["per_layer"]) == 2
