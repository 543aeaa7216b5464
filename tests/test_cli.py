"""Every bad input gives one clear line on stderr and a non-zero exit; a good eval writes its JSON."""

import json
import shlex
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
    (["artifacts", "verify", "/nonexistent/artifact"], "no artifact at /nonexistent/artifact: no such file or folder"),
    (["eval", "--model", "/nonexistent/model"], "--model /nonexistent/model: no such folder"),
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
    (["eval", "--model", "tiny-random", "--method", "quest,adamas", "--bits", "5"], "adamas: bits must be 1, 2 or 3"),
])
def test_bad_input_is_one_clear_line(args, message):
    r = sparsekv(*args)
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], r.stderr


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """What the checks below read: a text, a dump of tiny-random, a copy with a corrupt layer, a dump and an adamas
    artifact of another model (3 layers, another head dim)."""
    import shutil

    import torch

    from sparsekv.activations import dump_activations
    from sparsekv.artifacts import save_artifact
    from sparsekv.models import load_model, tiny_random, wire

    fx = tmp_path_factory.mktemp("inputs")
    (fx / "t.txt").write_text("Some natural-looking text to record keys and queries from, again and again. " * 60)
    lm = load_model("tiny-random")
    ids = lm.tokenizer.encode((fx / "t.txt").read_text(), add_special_tokens=False)[:512]
    dump_activations(lm, ids, fx / "dump", seq_len=256, queries_per_seq=8)
    shutil.copytree(fx / "dump", fx / "corrupt")
    layer = fx / "corrupt" / "layer_001.safetensors"
    data = bytearray(layer.read_bytes())
    data[-10] ^= 0xFF
    layer.write_bytes(bytes(data))
    dump_activations(wire(tiny_random(layers=3)), ids[:256], fx / "dump3", seq_len=128, queries_per_seq=4)
    other = {"name": "other-model", "num_layers": 3, "q_heads": 6, "kv_heads": 2, "head_dim": 16}
    thresholds = torch.tensor([-1.0, 0.0, 1.0]).repeat(3, 2, 1)
    save_artifact(fx / "art", method="adamas", model_fingerprint=other, config={"bits": 2, "hadamard": True},
                  tensors={"thresholds": {"thresholds": thresholds, "query_thresholds": thresholds.clone()}},
                  version="v1")
    return fx


TINY = ["--model", "tiny-random"]
RECALL = ["eval", *TINY, "--task", "recall", "--method", "oracle", "--budget", "32"]
OTHER = "name other-model != tiny-random(seed=0), num_layers 3 != 2, head_dim 16 != 20"


@pytest.mark.parametrize("args,message", [
    # lengths against the model's context, before it loads and before any prompt is built
    (["eval", *TINY, "--seq", "10000000", "--n", "1"], "--seq 10000000 is longer than tiny-random(seed=0) supports "
                                                       "(4096 tokens)"),
    (["dump", *TINY, "--seq", "10000000", "--text-file", "{fx}/t.txt", "--out", "{tmp}/d"], "--seq 10000000 is longer"),
    (["dump", *TINY, "--seq", "1", "--text-file", "{fx}/t.txt", "--out", "{tmp}/d"], "--seq must be at least 16"),
    (["generate", *TINY, "--prompt", "hi", "--max-new-tokens", "10000000"],
     "--max-new-tokens 10000000 + 1 prompt token exceed tiny-random(seed=0)'s context (4096 tokens)"),
    # dense layers against the layer count (recall: the dump's)
    (["eval", *TINY, "--dense-layers", "7", "--seq", "300", "--n", "1"], "--dense-layers 7: the model has 2 layers"),
    (["generate", *TINY, "--prompt", "hi", "--dense-layers", "7"], "--dense-layers 7: the model has 2 layers"),
    ([*RECALL, "--acts", "{fx}/dump", "--dense-layers", "7"], "--dense-layers 7: the dump has 2 layers (0..1)"),
    ([*RECALL, "--acts", "{fx}/dump", "--dense-layers", "0,1"], "every layer of the dump is dense"),
    ([*RECALL, "--acts", "{fx}/dump", "--seq", "300"], "--seq is for --task passkey, ruler and ppl"),
    ([*RECALL, "--acts", "{fx}/dump", "--n", "5"], "--n is for --task passkey, ruler and ppl"),
    # sink + window over the budget (a fraction: at each --seq)
    (["eval", *TINY, "--method", "streaming", "--sink", "64", "--budget", "32", "--seq", "300", "--n", "1"],
     "streaming: sink 64 + window 0 exceed --budget 32 (32 tokens)"),
    (["eval", *TINY, "--method", "oracle", "--sink", "30", "--window", "30", "--budget", "0.1", "--seq", "300"],
     "oracle: sink 30 + window 30 exceed --budget 0.1 (30 tokens of 300)"),
    (["generate", *TINY, "--prompt", "hi", "--method", "oracle", "--sink", "30", "--window", "30", "--budget", "32"],
     "oracle: sink 30 + window 30 exceed --budget 32"),
    # an artifact or a dump of another model, from its manifest
    (["eval", *TINY, "--method", "adamas", "--artifact", "{fx}/art/other-model/adamas/v1", "--seq", "300"], OTHER),
    (["generate", *TINY, "--prompt", "hi", "--method", "adamas", "--artifact", "{fx}/art/other-model/adamas/v1"],
     OTHER),
    ([*RECALL, "--acts", "{fx}/dump3"], "--acts {fx}/dump3 was made from another model than --model tiny-random "
                                        "(recorded != given): num_layers 3 != 2"),
    (["calibrate", "--acts", "{fx}/dump3", *TINY, "--out", "{tmp}/a"], "num_layers 3 != 2"),
    # a corrupt dump layer, before the work
    ([*RECALL, "--acts", "{fx}/corrupt"], "layer_001.safetensors sha256 mismatch"),
    (["calibrate", "--acts", "{fx}/corrupt", "--out", "{tmp}/a"], "layer_001.safetensors sha256 mismatch"),
    # calibrate's device (the fit runs on the CPU) and options
    (["calibrate", "--acts", "{fx}/dump", "--out", "{tmp}/a", "--device", "tpu"], "--device 'tpu': use auto"),
    (["calibrate", "--acts", "{fx}/dump", "--out", "{tmp}/a", "--device", "cuda"], "--device cuda: "),
    (["calibrate", "--acts", "{fx}/dump", "--out", "{tmp}/a", "--max-queries", "0"], "--max-queries must be 2 or more"),
    # the learned stages: their dump whole and their options, before any training
    (["train-hash", "--acts", "{fx}/corrupt", "--out", "{tmp}/a"], "layer_001.safetensors sha256 mismatch"),
    (["train-hash", "--acts", "{fx}/dump", "--out", "{tmp}/a", "--bits", "20"], "--bits must be a positive multiple"),
    (["train-hash", "--acts", "{fx}/dump", "--out", "{tmp}/a", "--pruning", "1.5"], "--pruning must be in (0, 1)"),
    (["train-hash", "--acts", "{fx}/corrupt", "--out", "{tmp}/a", "--query-margin", "-1"],
     "--query-margin must be a number >= 0"),
    (["train-hash", "--acts", "{fx}/dump", "--out", "{tmp}/a", "--iters", "3", "--resume"], "--resume: no checkpoint"),
    (["train-hash", "--acts", "{fx}/corrupt", "--out", "{tmp}/a", "--bits", "20"],
     "--bits must be a positive multiple"),
    (["train-hash", "--acts", "{fx}/dump", "--out", "{tmp}/a", "--pooling", "kv"], "--pooling must be group or head"),
    (["train-hash", "--acts", "{fx}/dump", "--out", "{tmp}/a", "--holdout", "1"], "--holdout must be in [0, 1)"),
    (["train-hash", "--acts", "{fx}/dump", "--out", "{tmp}/a", "--holdout", "0"], "--holdout 0 holds no sequence out"),
    (["index", "--acts", "{fx}/dump3", *TINY, "--out", "{tmp}/a"], "num_layers 3 != 2"),
    (["index", "--acts", "{fx}/corrupt", "--out", "{tmp}/a", "--clusters", "0"], "--clusters must be >= 1"),
    (["index", "--acts", "{fx}/corrupt", "--out", "{tmp}/a", "--gap", "0"], "--gap must be >= 1, got 0"),
    (["index", "--acts", "{tmp}/nope", "--out", "{tmp}/a"], "--acts {tmp}/nope: no such folder"),
    (["eval", *TINY, "--task", "recall", "--acts", "{fx}/dump", "--method", "oracle", "--max-queries", "0"],
     "--max-queries must be positive, got 0"),
    (["index", "--acts", "{fx}/corrupt", "--out", "{tmp}/a", "--min-range", "-1"], "--min-range must be >= 0, got -1"),
    (["index", "--acts", "{fx}/dump", "--out", "{tmp}/a", "--clusters", "8", "--probes", "9"],
     "--probes 9 is more than the 8 buckets"),
    (["index", "--acts", "{fx}/dump", "--out", "{tmp}/a", "--holdout", "0"], "--holdout 0 holds no sequence out"),
    (["index", "--acts", "{fx}/dump", "--out", "{tmp}/a", "--holdout", "0.9"],
     "--holdout 0.9 holds out all 2 sequences"),
    (["train-hash", "--acts", "{fx}/dump", "--out", "{tmp}/a", "--holdout", "0.9"], "none is left to fit on"),
    (["index", "--acts", "{fx}/dump", "--out", "{tmp}/a", "--iters", "3", "--resume"], "--resume: no checkpoint"),
    (["index", "--acts", "{fx}/dump", "--out", "{tmp}/a", "--space", "rope"], "--space must be pre or post"),
    # what needs the dump's manifest only: before its files are hashed (the corrupt copy would fail there)
    (["index", "--acts", "{fx}/corrupt", "--out", "{tmp}/a", "--layers", "5"], "--layers 5: the dump has layers 0..1"),
    (["index", "--acts", "{fx}/corrupt", "--out", "{tmp}/a", "--gap", "300"], "hold no pair that far apart"),
    (["train-hash", "--acts", "{fx}/corrupt", "--out", "{tmp}/a", "--layers", "2"],
     "--layers 2: the dump has layers 0..1"),
    (["index", "--acts", "{fx}/corrupt", "--out", "{tmp}/a", "--layers", ""], "--layers: give at least one value"),
    (["train-hash", "--acts", "{fx}/corrupt", "--out", "{tmp}/a", "--layers", " "],
     "--layers: give at least one value"),
    (["index", "--acts", "{fx}/dump", "--out", "{tmp}/a", "--method", "ivf"], "index supports: saap"),
    # dump of eval prompts: options of the other kind, a task it cannot dump, a misspelt subtask
    (["dump", *TINY, "--task", "ruler", "--text-file", "{fx}/t.txt", "--out", "{tmp}/d"],
     "--text-file: not with --task"),
    (["dump", *TINY, "--n", "3", "--text-file", "{fx}/t.txt", "--out", "{tmp}/d"], "--n: for --task passkey or ruler"),
    (["dump", *TINY, "--task", "ppl", "--out", "{tmp}/d"], "--task must be passkey or ruler, got 'ppl'"),
    (["dump", *TINY, "--task", "ruler", "--subtasks", "nope", "--out", "{tmp}/d"], "unknown RULER subtask 'nope'"),
    (["dump", *TINY, "--task", "ruler", "--subtasks", "niah", "--seq", "100", "--out", "{tmp}/d"],
     "seq 100 is too short for RULER subtask niah_single_1: it generates 128 tokens alone"),
    (["eval", *TINY, "--task", "ruler", "--subtasks", "vt,niah", "--seq", "300,100"],
     "seq 100 is too short for RULER subtask niah_single_1"),
    (["dump", *TINY, "--task", "passkey", "--subtasks", "niah", "--out", "{tmp}/d"],
     "--subtasks and --haystack-file are for --task ruler"),
    # demo's numbers, before the default model loads and Adamas calibrates
    (["demo", "--n", "0", "--no-adamas"], "--n must be positive, got 0"),
    (["demo", "--budget", "0"], "--budget must be positive, got 0"),
    (["demo", "--seq", "0"], "--seq must be positive, got 0"),
    (["demo", "--seq", "-5", "--budget", "64"], "--seq must be positive, got -5"),
    # budgets and lists as given, whatever the methods
    (["eval", *TINY, "--budget", "1.5", "--seq", "300"], "--budget 1.5 is neither a whole token count"),
    (["eval", *TINY, "--method", "oracle,oracle", "--seq", "300"], "oracle is given twice"),
])
def test_bad_input_is_refused_before_the_model_loads(args, message, inputs, tmp_path):
    """Exit 2, one `error:` line, no traceback, nothing new on disk."""
    def fill(a):
        return a.replace("{fx}", str(inputs)).replace("{tmp}", str(tmp_path))

    before = sorted(inputs.rglob("*")) + sorted(tmp_path.rglob("*"))
    r = sparsekv(*map(fill, args))
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert fill(message) in lines[0], r.stderr
    assert sorted(inputs.rglob("*")) + sorted(tmp_path.rglob("*")) == before


def test_eval_writes_json(tmp_path):
    out = tmp_path / "r.json"
    r = sparsekv("eval", "--model", "tiny-random", "--method", "oracle,dense", "--budget", "16", "--seq", "300",
                 "--n", "2", "--json", str(out))
    assert r.returncode == 0, r.stderr
    rows = json.loads(out.read_text())
    assert [x["method"] for x in rows] == ["oracle", "dense"]
    assert {x["command"] for x in rows} == {"sparsekv eval --model tiny-random --method oracle,dense --budget 16 "
                                             f"--seq 300 --n 2 --json {shlex.quote(str(out))}"}
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
    assert g["command"].startswith("sparsekv generate --model tiny-random --prompt 'hello there' --method streaming")


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


def test_eval_recall_at_answer_time(tmp_path):
    """dump --task ruler records eval's prompts with queries where the answer is produced; recall scores there."""
    dump = tmp_path / "dump"
    r = sparsekv("dump", "--model", "tiny-random", "--task", "ruler", "--subtasks", "niah_single_1", "--seq", "1024",
                 "--n", "2", "--queries", "4", "--out", str(dump))
    assert r.returncode == 0, r.stderr
    assert "wrote activations of 2 prompts" in r.stdout
    manifest = json.loads((dump / "manifest.json").read_text())
    assert manifest["data"]["prompts"] == 2 and manifest["data"]["subtasks"] == ["niah_single_1"]
    assert manifest["data"]["queries"] == 8 and manifest["config"]["query_sampling"].startswith("answer positions")
    assert manifest["data"]["seed"] == 42  # the prompts' data seed, eval's default: the same prompts
    out = tmp_path / "recall.json"
    r = sparsekv("eval", "--model", "tiny-random", "--task", "recall", "--acts", str(dump), "--method",
                 "oracle,streaming", "--budget", "64", "--json", str(out))
    assert r.returncode == 0, r.stderr
    rows = json.loads(out.read_text())
    assert [x["n"] for x in rows] == [8, 8] and rows[1]["score"] < rows[0]["score"] and rows[0]["seed"] == 42
    # the needle's value tokens: both prompts hold them, and the oracle reads more of them than the window does
    assert manifest["data"]["evidence_prompts"] == 2 and manifest["data"]["evidence_tokens"] > 0
    assert rows[1]["evidence_recall"] < rows[0]["evidence_recall"] <= 1
    assert "evidence" in r.stdout and f"{rows[1]['evidence_recall']:.3f}" in r.stdout


def test_eval_recall_on_a_dump(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("Some natural-looking text to record keys and queries from, again and again. " * 60)
    dump = tmp_path / "dump"
    r = sparsekv("dump", "--model", "tiny-random", "--text-file", str(text), "--tokens", "520", "--seq", "256",
                 "--queries", "8", "--out", str(dump))
    assert r.returncode == 0, r.stderr
    # the last 8 tokens are too few for a sequence: the line says what was dumped, not what was asked
    assert "wrote activations of 512 tokens (16 queries)" in r.stdout and "the last 8 tokens" in r.stdout
    out = tmp_path / "recall.json"
    r = sparsekv("eval", "--model", "tiny-random", "--task", "recall", "--acts", str(dump), "--method",
                 "oracle,streaming", "--budget", "32", "--json", str(out))
    assert r.returncode == 0, r.stderr
    rows = json.loads(out.read_text())
    assert [x["method"] for x in rows] == ["oracle", "streaming"]
    assert rows[0]["iou"] == pytest.approx(1.0) and rows[0]["topk_recall"] == pytest.approx(1.0)
    assert rows[1]["score"] < rows[0]["score"] and len(rows[0]["per_layer"]) == 2
    # dense layers: the method does not select there, so they are not scored (reported as dense)
    r = sparsekv("eval", "--model", "tiny-random", "--task", "recall", "--acts", str(dump), "--method", "oracle",
                 "--budget", "32", "--dense-layers", "0", "--json", str(out))
    assert r.returncode == 0, r.stderr
    cell = json.loads(out.read_text())
    layers = cell["per_layer"]
    assert cell["dense_layers"] == [0] and [x["dense"] for x in layers] == [True, False]
    assert layers[0]["attention_mass_recall"] is None and layers[1] == {**rows[0]["per_layer"][1], "dense": False}
    assert cell["score"] == pytest.approx(100 * layers[1]["attention_mass_recall"])


def test_learned_stages_write_artifacts_their_methods_run(inputs, tmp_path):
    """train-hash and index on a tiny dump: an artifact each (the checkpoints gone), and recall runs the methods."""
    small = ["--acts", str(inputs / "dump"), "--out", str(tmp_path / "art"), "--iters", "4", "--queries-per-step", "4"]
    r = sparsekv("train-hash", *small, "--bits", "32", "--hidden", "32", "--json", str(tmp_path / "th.json"))
    assert r.returncode == 0 and "kept the weights of iteration" in r.stdout, r.stderr
    assert "query margin" in r.stdout and "(held-out IoU: binary" in r.stdout and "ternary at 0.35" in r.stdout
    r = sparsekv("index", *small, "--clusters", "4", "--hidden", "16", "--json", str(tmp_path / "ix.json"))
    assert r.returncode == 0 and "kept the weights of iteration" in r.stdout, r.stderr
    th, ix = (json.loads((tmp_path / f).read_text()) for f in ("th.json", "ix.json"))
    # both stages evaluate every iteration here (iters / 8 and iters / 16 < 1) and keep their best one: 2 worse ones
    # in a row stop them
    assert 2 < th["train"]["steps"] <= 4 and set(th["iou"]["mean"]) == {"mlp_before", "mlp_after", "linear_before"}
    assert set(th["query_margin"]["held_out_iou"]) == {"0.0", "0.35"} and th["query_margin"]["chosen"] in (0.0, 0.35)
    kept = th["train"]["kept"]
    assert kept["by"] == "iou" and kept["value"] == max(m["iou"] for _, m in th["train"]["heldout_curve"])
    assert ix["clusters"]["used"] == 4 and 2 < ix["train"]["steps"] <= 4 and "imbalance" in ix["buckets"]
    kept = ix["train"]["kept"]
    assert kept["by"] == "kl" and kept["value"] == min(m["kl"] for _, m in ix["train"]["heldout_curve"])
    assert not list((tmp_path / "art").rglob(".train-*"))
    for method, art, extra in (("spotlight", th["artifact"], []), ("saap", ix["artifact"], ["--window", "8"])):
        r = sparsekv(*RECALL[:-4], "--method", method, "--budget", "32", "--artifact", art, "--acts",
                     str(inputs / "dump"), *extra, "--json", str(tmp_path / f"{method}.json"))
        assert r.returncode == 0, r.stderr
        result = json.loads((tmp_path / f"{method}.json").read_text())  # one cell: the object itself
        assert result["method"] == method and result["method_config"]["artifact"] == art
    # one run, each artifact to the method it was written for (lsh takes none)
    r = sparsekv(*RECALL[:-4], "--method", "lsh,spotlight,saap", "--budget", "32", "--artifact",
                 f"{ix['artifact']},{th['artifact']}", "--acts", str(inputs / "dump"), "--window", "8",
                 "--json", str(tmp_path / "all.json"))
    assert r.returncode == 0, r.stderr
    got = {c["method"]: c["method_config"].get("artifact") for c in json.loads((tmp_path / "all.json").read_text())}
    assert got == {"lsh": None, "spotlight": th["artifact"], "saap": ix["artifact"]}
    for arts, msg in ((ix["artifact"], "was written for saap; the methods of the run are lsh, spotlight"),
                      (f"{th['artifact']},{th['artifact']}", "were both written for spotlight")):
        r = sparsekv(*RECALL[:-4], "--method", "lsh,spotlight", "--budget", "32", "--artifact", arts, "--acts",
                     str(inputs / "dump"))
        assert r.returncode == 2 and msg in r.stderr, r.stderr


def test_plot_draws_eval_runs_together_against_selectivity(tmp_path):
    """`sparsekv plot` draws several eval JSONs in one figure (runs that differ in --probes: points of one line);
    a file that is not an eval JSON, or an unknown --x, is one clear line and exit 2."""
    pytest.importorskip("matplotlib")

    def row(method, budget, sel, score, probes=None):
        return {"task": "ruler", "metric": "score", "seq_len": 4096, "model": "m", "n": 104, "method": method,
                "budget": budget, "budget_tokens": None if budget is None else int(budget * 4096),
                "selectivity": sel, "score": score, "method_config": {} if probes is None else {"probes": probes}}

    runs = [[row("dense", None, 1.0, 34.6), row("oracle", 0.03, 0.03, 37.0), row("oracle", 0.06, 0.059, 33.7)],
            row("saap", 0.06, 0.034, 16.6, 16), row("saap", 0.06, 0.047, 21.9, 32)]
    files = []
    for i, r in enumerate(runs):
        files.append(tmp_path / f"r{i}.json")
        files[-1].write_text(json.dumps(r))
    for x in ("selectivity", "budget"):
        png = tmp_path / f"{x}.png"
        r = sparsekv("plot", *map(str, files), "--x", x, "--out", str(png))
        assert r.returncode == 0, r.stderr
        assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rows": []}))
    r = sparsekv("plot", str(bad), "--out", str(tmp_path / "b.png"))
    assert r.returncode == 2 and "not an eval JSON" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = sparsekv("plot", str(files[0]), "--x", "depth", "--out", str(tmp_path / "c.png"))
    assert r.returncode == 2 and "--x must be one of budget, selectivity" in r.stderr


def test_a_fit_report_says_when_nothing_was_held_out():
    """A dump of one sequence holds nothing out: train-hash's and index's tables say their queries come from the
    fitted sequence instead of calling them held out."""
    from sparsekv.cli import _heldout

    assert _heldout({"sequences": 1, "queries": 99, "from_fit_sequences": True}).startswith(
        "99 queries of the fitted sequence")
    assert _heldout({"sequences": 3, "queries": 256, "from_fit_sequences": False}) == "held-out queries (256)"
