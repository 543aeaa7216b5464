"""`sparsekv bench` on the CPU with tiny shapes: rows for every method, exact byte and selectivity arithmetic, the
CLI's JSON, and one clear line (exit 2) for bad input."""

import json
import subprocess
import sys

import pytest
import torch

from sparsekv.bench import SHAPES, from_name, run_bench, run_e2e
from sparsekv.errors import SparseKVError
from sparsekv.methods import CacheShape, MethodOptions, get_method

L, B, SINK, WINDOW, BUDGET = 2048, 2, 16, 64, 256
shape = SHAPES["smollm2-135m"]
D, HKV, F32 = shape.head_dim, shape.kv_heads, 4


@pytest.fixture(scope="module")
def result():
    return run_bench("smollm2-135m", L, "dense,oracle,streaming", BUDGET, batch=B, dtype="fp32", device="cpu",
                     options=MethodOptions(sink=SINK, window=WINDOW))


def _row(result, method):
    return next(r for r in result["rows"] if r["method"] == method)


def test_rows_for_every_method(result):
    assert [r["method"] for r in result["rows"]] == ["sdpa", "flashdecode", "oracle", "streaming"]
    for r in result["rows"]:
        assert r["us"] > 0 and r["us_eager"] > 0 and r["GBps"] > 0 and r["speedup"] > 0
    assert min(abs(r["speedup"] - 1) for r in result["rows"] if r["kind"] == "dense") < 1e-9  # the best dense is 1x
    assert result["timer"] == "cpu-perf_counter" and result["config"]["cpu_fallback"]
    assert result["copy_bandwidth"]["GBps"] > 0 and result["kernels"]["sparse_decode"] == "torch-reference"
    assert _row(result, "flashdecode")["kernel"] == "torch-reference"
    assert _row(result, "sdpa")["kernel"].startswith("torch-sdpa:")
    json.dumps(result)  # JSON-ready as it is


def test_dense_bytes_are_the_whole_cache(result):
    for m in ("sdpa", "flashdecode"):
        r = _row(result, m)
        assert r["bytes_read"] == 2 * B * HKV * L * D * F32
        assert r["selectivity"] == 1.0
    floor = result["floor"][0]
    assert floor["dense_bytes"] == 2 * B * HKV * L * D * F32
    assert floor["dense_floor_us"] == pytest.approx(floor["dense_bytes"] / (result["copy_bandwidth"]["GBps"] * 1e3))


def test_streaming_reads_sink_and_window_only(result):
    r = _row(result, "streaming")
    assert r["bytes_read"] == 2 * B * HKV * (SINK + WINDOW) * D * F32
    assert (r["sink"], r["window"], r["selected"]) == (SINK, WINDOW, 0)
    assert r["selectivity"] == pytest.approx((SINK + WINDOW) / L)


def test_oracle_bytes_count_scoring_and_topk(result):
    r = _row(result, "oracle")
    mid = L - SINK - WINDOW
    assert (r["sink"], r["window"], r["selected"]) == (SINK, WINDOW, BUDGET - SINK - WINDOW)
    assert r["selectivity"] == pytest.approx(BUDGET / L)
    assert r["bytes"]["kv"] == 2 * B * HKV * BUDGET * D * F32
    assert r["bytes"]["select"] == B * HKV * mid * D * F32  # exact scoring reads every middle key once
    assert r["bytes"]["scores"] == 2 * F32 * B * HKV * mid
    assert r["bytes_read"] == r["bytes"]["kv"] + r["bytes"]["select"] + r["bytes"]["scores"]
    assert r["us_attend"] > 0


def test_topk_rows(result):
    (t,) = result["topk"]  # no GPU: torch.topk alone
    assert (t["rows"], t["n"], t["k"], t["op"]) == (B * shape.q_heads, L, BUDGET - SINK - WINDOW, "torch.topk")
    assert t["us"] > 0


def test_dense_only_says_why_no_topk():
    r = run_bench("smollm2-135m", 512, "sdpa", [256], dtype="fp32", device="cpu")
    assert r["topk"] == [] and any("top-k not timed" in n for n in r["notes"])


def test_sweep_list_and_cpu_cap():
    r = run_bench("smollm2-135m", 1024, ["streaming"], [64, 128], dtype="fp32", device="cpu", sweep=[512, 1024],
                  topk=False)
    assert [(x["seq"], x["budget"]) for x in r["rows"]] == [(512, 64), (512, 128), (1024, 64), (1024, 128)]
    assert all(x["speedup"] is None for x in r["rows"])  # no dense baseline asked for
    capped = run_bench("smollm2-135m", 10**6, ["sdpa"], [], dtype="fp32", device="cpu", topk=False)
    assert capped["config"]["seq"] == [16384] and any("CPU cap" in n for n in capped["notes"])


@pytest.mark.parametrize("kwargs,message", [
    (dict(budget=4096), "larger than the context"),
    (dict(methods="dense,bogus"), "unknown method 'bogus'"),
    (dict(shape="llama9"), "unknown shape 'llama9'"),
    (dict(dtype="fp8"), "unknown dtype"),
    (dict(options={"sink": 200, "window": 100}), r"oracle: sink 200 \+ window 100 exceed --budget 256"),
])
def test_bad_config_is_a_sparsekv_error(kwargs, message):
    args = dict(shape="smollm2-135m", seq=L, methods="dense,oracle", budget=BUDGET, dtype="fp32", device="cpu")
    with pytest.raises(SparseKVError, match=message):
        run_bench(**{**args, **kwargs})


def test_a_methods_own_sink_and_window_over_the_budget_name_the_method():
    """SAAP's paper sink and window (1 + 2047) do not fit 64 keys: `bench` and `bench --e2e` refuse before any work,
    naming the method and what to change, as `eval` does; a method's step says whose sink and window they are."""
    message = r"^saap: sink 1 \+ window 2047 exceed --budget 64 \(64 tokens\); lower --sink/--window or raise --budget$"
    with pytest.raises(SparseKVError, match=message):
        run_bench("smollm2-135m", 512, "saap", [64], dtype="fp32", device="cpu", topk=False)
    with pytest.raises(SparseKVError, match=message):
        run_e2e([512], "dense,saap", 64, shape="smollm2-135m", device="cpu")
    lsh = get_method("lsh", budget=64, window=100)
    state = lsh.new_state(0, CacheShape(1, 1, 1, 8, 512, torch.float32, torch.device("cpu")))
    state.length = 512
    with pytest.raises(SparseKVError, match=r"^lsh: sink 0 \+ window 100 exceed the budget \(64 tokens\); "
                                            r"lower --sink/--window or raise --budget$"):
        lsh.split(state)


def test_method_options_go_to_the_methods_that_take_them():
    r = run_bench("smollm2-135m", 512, "dense,adamas,streaming", [64], dtype="fp32", device="cpu", topk=False,
                  options={"distance": "ip"})
    rows = {x["method"]: x for x in r["rows"]}
    assert rows["adamas"]["method_config"]["distance"] == "ip" and "distance" not in rows["streaming"]["method_config"]
    for methods in ("dense,oracle", "sdpa"):
        with pytest.raises(SparseKVError, match="--distance apply to none of the methods"):
            run_bench("smollm2-135m", 512, methods, [64], dtype="fp32", device="cpu", options={"distance": "ip"})
    with pytest.raises(SparseKVError, match="unknown distance 'cos'"):
        run_bench("smollm2-135m", 512, "adamas", [64], dtype="fp32", device="cpu", options={"distance": "cos"})


def test_shape_presets():
    s = from_name("llama3-8b")
    assert (s.q_heads, s.kv_heads, s.head_dim) == (32, 8, 128)
    assert (SHAPES["qwen2.5-7b"].q_heads, SHAPES["qwen2.5-7b"].kv_heads) == (28, 4)


def sparsekv(*args):
    return subprocess.run([sys.executable, "-m", "sparsekv.cli", "bench", *args], capture_output=True, text=True,
                          timeout=120)


def test_cli_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    r = sparsekv("--seq", "2048", "--shape", "smollm2-135m", "--method", "dense,oracle,streaming", "--budget", "256",
                 "--dtype", "fp32", "--json", str(out))
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert [x["method"] for x in res["rows"]] == ["sdpa", "flashdecode", "oracle", "streaming"]
    assert res["config"]["shape"]["name"] == "smollm2-135m" and res["config"]["budgets"] == [256]
    assert "oracle" in r.stdout and "streaming" in r.stdout
    if not torch.cuda.is_available():
        assert "no GPU" in r.stdout.splitlines()[0] and "CPU FALLBACK" in r.stdout


@pytest.mark.parametrize("args,message", [
    (["--budget", "4096"], "larger than the context"),
    (["--shape", "llama9"], "unknown shape 'llama9'"),
    (["--method", "dense,bogus"], "unknown method 'bogus'"),
    (["--methods", "dense,bogus"], "unknown method 'bogus'"),  # the old spelling, kept hidden
    (["--method", "dense,oracle", "--distance", "ip"], "--distance apply to none of the methods"),
    (["--method", "dense,oracle", "--rerank", "4"], "--rerank apply to none of the methods"),
    (["--method", "dense,adamas", "--rerank", "0"], "rerank must be a whole number >= 1"),
    (["--method", "dense,lsh", "--head-top", "-1"], "head_top must be a whole number >= 0"),
    (["--method", "dense,quest", "--head-top", "2"], "--head-top apply to none of the methods"),
    (["--new-tokens", "5"], "--new-tokens is for --e2e"),
    (["--new-tokens", "5", "--prefill-chunk", "512"], "--prefill-chunk and --new-tokens are for --e2e"),
    (["--sweep"], "give --seq or --sweep, not both"),
    (["--sweep", "--e2e"], "--sweep is for one layer's step"),
    (["--method", "dense,adamas", "--distance", "ip", "--head-top", "2", "--pooling", "group"],
     "head_top ranks code distances"),
    (["--method", "dense,adamas", "--head-top", "2"], "adamas choose per query head here: add --pooling group"),
    (["--method", "adamas,lsh", "--head-top", "2", "--pooling", "head"], "add --pooling group"),
])
def test_cli_bad_input_is_one_line(args, message):
    r = sparsekv("--seq", "2048", "--shape", "smollm2-135m", "--dtype", "fp32", *args)
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and message in lines[0], r.stderr


def test_e2e_rows_and_json(tmp_path):
    """`bench --e2e` decodes a whole model per method from one shared prefill: every row has its timings, the
    speedup against dense of the same run, the floor and the decode path."""
    out, png = tmp_path / "e2e.json", tmp_path / "e2e.png"
    r = sparsekv("--e2e", "--model", "tiny-random", "--seq", "120,200", "--method", "dense,oracle,quest", "--budget",
                 "32", "--new-tokens", "5", "--batch", "1,3", "--prefill-chunk", "64", "--json", str(out), "--plot",
                 str(png))
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    rows = res["rows"]
    assert [(x["seq"], x["batch"], x["method"]) for x in rows] == \
        [(s, b, m) for s in (120, 200) for b in (1, 3) for m in ("dense", "oracle", "quest")]
    for x in rows:
        assert x["ms_per_token"] > 0
        assert x["tokens_per_s"] == pytest.approx(x["batch"] * 1e3 / x["ms_per_token"], rel=1e-3)
        assert x["steps"] == 3 and x["floor_ms"] > 0 and x["decode_path"]
        assert x["speedup_vs_dense"] == pytest.approx(next(
            d["ms_per_token"] for d in rows if (d["seq"], d["batch"], d["method"]) == (x["seq"], x["batch"], "dense"))
            / x["ms_per_token"], rel=1e-3, abs=6e-5)  # the JSON rounds to 4 decimals
    floor = {(x["seq"], x["batch"]): x["floor_ms"] for x in rows}
    assert floor[(200, 3)] > floor[(200, 1)] > floor[(120, 1)]  # every row's K/V counts
    assert rows[1]["budget"] == 32 and rows[1]["selectivity"] < 0.3 and rows[0]["budget"] is None
    assert res["config"]["batch"] == [1, 3] and res["config"]["prefill_chunk"] == 64
    assert res["config"]["weights_bytes"] > 0 and png.stat().st_size > 0
    assert "whole-model decode" in r.stdout


@pytest.mark.parametrize("args,message", [
    (["--batch", "0"], "--batch must be positive"),
    (["--new-tokens", "2"], "--new-tokens must be at least 3"),
    (["--prefill-chunk", "0"], "--prefill-chunk must be positive"),
    (["--budget", "32,64"], "one --budget"),
    (["--method", "dense,bogus"], "unknown method(s) bogus"),
    (["--seq", "5000"], "exceed tiny-random(seed=0)'s context"),
    (["--budget", "1000"], "budget 1000 tokens is larger than the context (100 tokens)"),
])
def test_e2e_bad_input_is_one_line(args, message):
    r = sparsekv("--e2e", "--model", "tiny-random", "--seq", "100", "--method", "dense,oracle", "--budget", "16",
                 "--new-tokens", "3", *args)
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert r.returncode == 2 and lines and message in lines[-1], r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_cli_require_gpu():
    r = sparsekv("--require-gpu")
    assert r.returncode == 2 and r.stderr.strip() == "error: --require-gpu: no CUDA device on this machine"


def test_plot(tmp_path, result):
    pytest.importorskip("matplotlib")
    from sparsekv.bench.plot import plot_result

    assert plot_result(result, tmp_path / "bench.png").stat().st_size > 1000


def test_plot_without_matplotlib_is_a_clear_error(monkeypatch):
    from sparsekv.bench.plot import require_matplotlib

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    with pytest.raises(SparseKVError, match=r"needs matplotlib: pip install 'sparsekv\[plot\]'"):
        require_matplotlib()


def test_rerank_bytes_count_the_gathered_keys():
    """adamas --rerank F reads F x k candidate keys per selection head on top of its codes (the probe counts the
    gather's elements, not the whole K cache)."""
    kw = dict(dtype="fp32", device="cpu", topk=False)
    rows = [run_bench("smollm2-135m", 1024, "adamas", [64], options={"pooling": "head", **o}, **kw)["rows"][0]
            for o in ({"distance": "ip"}, {"distance": "ip", "rerank": 4})]
    k = 64 - 1  # window 1 (the paper's default), no sink
    n, words = 1024 - 1, D // 8  # middle keys; int16 words of 8 two-bit codes
    assert rows[0]["bytes"]["select"] == HKV * n * words * 2 + HKV * 4 * F32  # the codes, and the bucket centers once
    assert rows[1]["method_config"]["rerank"] == 4 and rows[1]["selected"] == k
    assert rows[1]["bytes"]["select"] - rows[0]["bytes"]["select"] == shape.q_heads * 4 * k * D * F32
    assert rows[1]["bytes"]["kv"] == rows[0]["bytes"]["kv"]
