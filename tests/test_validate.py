"""Input checks that run before any work: each bad value is one SparseKVError naming the option."""

import gzip
import os

import pytest
import torch

from sparsekv import validate
from sparsekv.errors import SparseKVError


@pytest.mark.parametrize("spec,message", [("tpu", "use auto, cpu, cuda or cuda:N"), ("cuda:x", "use auto"),
                                          ("", "use auto")])
def test_device_refusals(spec, message):
    with pytest.raises(SparseKVError, match=message):
        validate.device(spec)


def test_device_choices():
    assert validate.device("cpu") == "cpu"
    assert validate.device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(SparseKVError, match="no CUDA device"):
            validate.device("cuda:0")


@pytest.mark.parametrize("text,message", [("64,,128", "empty entry"), ("64,", "empty entry"), (",64", "empty entry"),
                                          ("nan", "finite"), ("64,inf", "finite"), ("abc", "expected a number"),
                                          ("0", "must be positive"), ("-3", "must be positive")])
def test_number_lists(text, message):
    with pytest.raises(SparseKVError, match=message):
        validate.csv(text, float, "--budget", positive=True)


def test_good_lists():
    assert validate.csv("64, 128", float, "--budget", positive=True) == [64.0, 128.0]
    assert validate.csv("256,300", int, "--seq") == [256, 300]
    assert validate.csv("dense,adamas") == ["dense", "adamas"]
    assert validate.csv("") == []
    with pytest.raises(SparseKVError, match="expected an integer"):
        validate.csv("256.5", int, "--seq")


@pytest.mark.parametrize("value,message", [(float("nan"), "finite"), (0, "positive"), (1.5, "neither a whole"),
                                           (-0.2, "positive")])
def test_budget(value, message):
    with pytest.raises(SparseKVError, match=message):
        validate.budget(value)
    assert validate.budget(0.05) == 0.05 and validate.budget(128) == 128


def test_dense_layers():
    assert validate.dense_layers([0, 1], 2) == (0, 1)
    with pytest.raises(SparseKVError, match=r"--dense-layers 7: the model has 2 layers \(0..1\)"):
        validate.dense_layers([0, 7], 2)


def test_lists_given_twice_or_empty():
    with pytest.raises(SparseKVError, match="--method 'oracle,oracle': oracle is given twice"):
        validate.csv("oracle,oracle", str, "--method", unique=True)
    with pytest.raises(SparseKVError, match="64 is given twice"):
        validate.budgets("64,64.0")
    with pytest.raises(SparseKVError, match="--seq: give at least one value"):
        validate.csv("", int, "--seq", required=True)
    assert validate.csv("oracle,oracle") == ["oracle", "oracle"]  # only when asked
    assert validate.budgets("0.05,128") == [0.05, 128.0]
    with pytest.raises(SparseKVError, match="neither a whole"):
        validate.budgets("64,1.5")


def test_dtype():
    assert validate.dtype("bf16") == "bf16"
    with pytest.raises(SparseKVError, match="--dtype 'fp8': use auto, fp32, fp16 or bf16"):
        validate.dtype("fp8")


def test_lengths_against_the_context():
    shape = {"max_context": 4096, "num_layers": 2}
    assert validate.lengths([300, 4096], shape, "tiny-random") == [300, 4096]
    assert validate.lengths([10**7], None, "someone/some-model") == [10**7]  # not known before loading
    with pytest.raises(SparseKVError, match=r"--seq 4097 is longer than tiny-random\(seed=0\) supports \(4096 tokens\)"):
        validate.lengths([300, 4097], shape, "tiny-random")
    with pytest.raises(SparseKVError, match=r"--seq 4000 \+ 100 new tokens exceed tiny-random\(seed=0\)'s context"):
        validate.lengths([4000], shape, "tiny-random", reserve=100, reserve_what="new tokens")
    with pytest.raises(SparseKVError, match="--seq must be positive, got 0"):
        validate.lengths([0], shape, "tiny-random")


def test_model_checks_read_the_config_only():
    shape = validate.model_checks("tiny-random", seqs=[4096], layers=[0, 1])
    assert shape == {"num_layers": 2, "q_heads": 6, "kv_heads": 2, "head_dim": 20, "max_context": 4096}
    with pytest.raises(SparseKVError, match="--dense-layers 2: the model has 2 layers"):
        validate.model_checks("tiny-random", layers=[2])
    assert validate.model_checks("someone/some-model", seqs=[10**7], layers=[99]) is None  # checked when it loads


def test_a_far_too_long_seq_is_refused_at_once():
    """No prompt is built for a length the model cannot take (it once cost 31 s and 2.4 GB first)."""
    import time

    from sparsekv.eval.grid import EvalConfig

    cfg = EvalConfig("passkey", ["oracle"], [64], [10_000_000], n=1)
    cfg.check()
    t0 = time.perf_counter()
    with pytest.raises(SparseKVError, match="--seq 10000000 is longer than"):
        cfg.check_model("tiny-random")
    assert time.perf_counter() - t0 < 1.0


def test_sink_window():
    validate.sink_window("oracle", 30, 30, 64)
    validate.sink_window("oracle", 30, 30, 0.1)  # a fraction without a context: checked when it has one
    validate.sink_window("oracle", 30, 30, 32, context=32)  # the budget covers the context: every key, no split
    with pytest.raises(SparseKVError, match=r"oracle: sink 30 \+ window 30 exceed --budget 32 \(32 tokens\)"):
        validate.sink_window("oracle", 30, 30, 32)
    with pytest.raises(SparseKVError, match=r"exceed --budget 0.1 \(30 tokens of 300\)"):
        validate.sink_window("oracle", 30, 31, 0.1, context=300)


def test_sink_window_of_a_grid_uses_the_methods_defaults():
    from sparsekv.eval.grid import specs_for
    from sparsekv.methods import MethodOptions

    specs_for(["streaming", "adamas"], [8], [300], MethodOptions())  # sink 4 / window 1 fit
    with pytest.raises(SparseKVError, match="streaming: sink 4 \\+ window 0 exceed --budget 2"):
        specs_for(["streaming"], [2], [300], MethodOptions())
    with pytest.raises(SparseKVError, match="adamas: sink 8 \\+ window 1 exceed --budget 0.02 \\(6 tokens of 300\\)"):
        specs_for(["adamas"], [0.5, 0.02], [1000, 300], MethodOptions(sink=8))


def test_same_model():
    recorded = {"name": "tiny-random(seed=0)", "num_layers": 2, "q_heads": 6, "kv_heads": 2, "head_dim": 20}
    shape = validate.model_shape("tiny-random")
    validate.same_model(recorded, shape, "tiny-random", "--artifact x")
    with pytest.raises(SparseKVError, match=r"--artifact x was made from another model than --model tiny-random "
                                            r"\(recorded != given\): name m != tiny-random\(seed=0\), kv_heads 1 != 2$"):
        validate.same_model({**recorded, "name": "m", "kv_heads": 1}, shape, "tiny-random", "--artifact x")
    with pytest.raises(SparseKVError, match="name tiny-random.seed=0. != someone/some-model$"):
        validate.same_model(recorded, None, "someone/some-model", "--acts d")  # the name is known before loading


def test_dump_files_are_checked_up_front(tmp_path):
    import shutil

    from sparsekv.activations import dump_activations, load_activations
    from sparsekv.models import load_model

    lm = load_model("tiny-random")
    dump_activations(lm, [i % 256 for i in range(300)], tmp_path / "d", seq_len=150, queries_per_seq=4)
    shutil.copytree(tmp_path / "d", tmp_path / "bad")
    assert validate.dump(tmp_path / "d", model="tiny-random").num_layers == 2
    layer = tmp_path / "bad" / "layer_001.safetensors"
    data = bytearray(layer.read_bytes())
    data[-1] ^= 1
    layer.write_bytes(bytes(data))  # same size: only the hash tells
    acts = load_activations(tmp_path / "bad")  # opening checks sizes only ...
    with pytest.raises(SparseKVError, match="corrupted: layer_001.safetensors sha256 mismatch"):
        acts.check_files()  # ... every file is hashed before an offline stage starts
    with pytest.raises(SparseKVError, match="--dense-layers 2: the dump has 2 layers"):
        from sparsekv.eval.grid import check_recall_layers

        check_recall_layers([2], 2)


def test_a_cpu_stage_refuses_a_device_it_would_ignore():
    validate.cpu_stage_device("auto", None)
    validate.cpu_stage_device("cpu", None)
    with pytest.raises(SparseKVError, match="--device 'tpu'"):
        validate.cpu_stage_device("tpu", "tiny-random")
    if torch.cuda.is_available():
        validate.cpu_stage_device("cuda", "tiny-random")
        with pytest.raises(SparseKVError, match="--device cuda: this stage computes on the CPU"):
            validate.cpu_stage_device("cuda", None)


def test_output_paths(tmp_path):
    assert validate.output_file(tmp_path / "new" / "deeper" / "r.json") == tmp_path / "new" / "deeper" / "r.json"
    with pytest.raises(SparseKVError, match="is a folder"):
        validate.output_file(tmp_path)
    (tmp_path / "f").write_text("x")
    with pytest.raises(SparseKVError, match="is not a folder"):
        validate.output_file(tmp_path / "f" / "r.json")
    with pytest.raises(SparseKVError, match="exists and is not a folder"):
        validate.output_folder(tmp_path / "f")
    assert list(tmp_path.iterdir()) == [tmp_path / "f"]  # the checks leave nothing behind


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_output_is_refused(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(SparseKVError, match="cannot write"):
            validate.output_file(ro / "r.json")
    finally:
        ro.chmod(0o700)


def test_output_on_a_read_only_filesystem_is_refused(tmp_path, monkeypatch):
    """What a read-only mount does (root included): creating the probe file fails."""
    def refuse(*a, **kw):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(validate.tempfile, "mkstemp", refuse)
    with pytest.raises(SparseKVError, match="--json .*r.json: cannot write in .*Read-only file system"):
        validate.output_file(tmp_path / "r.json")


def test_text_files(tmp_path):
    good = tmp_path / "t.txt"
    good.write_text("plain text, ünïcode too\n" * 1000)
    assert validate.text_file(good, "--text-file") == good
    gz = tmp_path / "t.txt.gz"
    gz.write_bytes(gzip.compress(good.read_bytes()))
    assert validate.text_file(gz, "--text-file") == gz
    cut = tmp_path / "cut.txt"
    cut.write_bytes(("é" * 5000).encode()[: validate.TEXT_SNIFF + 1])  # a character split at the sample's end
    assert validate.text_file(cut, "--text-file") == cut
    binary = tmp_path / "b.bin"
    binary.write_bytes(bytes(range(256)) * 10)
    with pytest.raises(SparseKVError, match="not a text file"):
        validate.text_file(binary, "--text-file")
    latin = tmp_path / "l.txt"
    latin.write_bytes(b"caf\xe9 " * 100)
    with pytest.raises(SparseKVError, match="not UTF-8 text"):
        validate.text_file(latin, "--text-file")
    empty = tmp_path / "e.txt"
    empty.write_bytes(b"")
    with pytest.raises(SparseKVError, match="e.txt: the file is empty"):
        validate.text_file(empty, "--text-file")
    with pytest.raises(SparseKVError, match="file not found"):
        validate.text_file(tmp_path / "missing.txt", "--text-file")
    with pytest.raises(SparseKVError, match="not a file"):
        validate.text_file(tmp_path, "--text-file")


def test_model_specs_checked_without_loading(tmp_path):
    from sparsekv.models import peek_config

    assert peek_config("tiny-random").num_hidden_layers == 2
    (tmp_path / "empty").mkdir()
    (tmp_path / "fake.gguf").write_text("not a gguf")
    (tmp_path / "notes.txt").write_text("hello")
    for spec, message in [(tmp_path / "empty", "no config.json"), (tmp_path / "fake.gguf", "not a GGUF file"),
                          (tmp_path / "missing.gguf", "model file not found"),
                          (tmp_path / "notes.txt", "a file must be a .gguf"), ("bogus", "unknown model 'bogus'")]:
        with pytest.raises(SparseKVError, match=message):
            peek_config(str(spec))
    assert peek_config("someone/some-model") is None  # a hub id: checked when it loads


def _cli(*args, cwd=None):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "sparsekv.cli", *args], capture_output=True, text=True, timeout=300,
                          cwd=cwd)


@pytest.mark.parametrize("args,message", [
    (["eval", "--model", "tiny-random", "--bogus"], "No such option: --bogus"),
    (["eval", "--model", "tiny-random", "--n", "abc"], "Invalid value for '--n'"),
    (["eval", "--model", "tiny-random", "--budget", "64,,128"], "empty entry"),
    (["eval", "--model", "tiny-random", "--seq", "256,,300"], "empty entry"),
    (["eval", "--model", "tiny-random", "--budget", "nan"], "finite"),
    (["generate", "--model", "tiny-random", "--prompt", "hi", "--budget", "nan"], "finite"),
    (["generate", "--model", "tiny-random", "--prompt", "hi", "--budget", "1.5"], "neither a whole"),
    (["eval", "--model", "tiny-random", "--device", "tpu"], "--device 'tpu': use auto, cpu, cuda or cuda:N"),
    (["dump", "--model", "tiny-random", "--device", "tpu", "--out", "{tmp}/d", "--text-file", "{tmp}/t.txt"],
     "--device 'tpu'"),
    (["eval", "--model", "tiny-random", "--json", "{tmp}"], "is a folder"),
    (["eval", "--model", "tiny-random", "--plot", "{tmp}/f/p.png"], "is not a folder"),
    (["eval", "--model", "tiny-random", "--plot", "{tmp}/p.txt"], "the name must end in one of .png"),
    (["bench", "--seq", "256", "--plot", "{tmp}/p"], "the name must end in one of .png"),
    (["plot", "{tmp}/t.txt", "-o", "{tmp}/p.txt"], "the name must end in one of .png"),
    (["eval", "--model", "tiny-random", "--json", "{tmp}/r.png", "--plot", "{tmp}/r.png"],
     "--json and --plot name the same file"),
    (["bench", "--seq", "256", "--json", "{tmp}/r.png", "--plot", "{tmp}/./r.png"], "--json and --plot name the same"),
    (["bench", "--seq", "256,256"], "--seq '256,256': 256 is given twice"),
    (["bench", "--seq", "256", "--e2e", "--batch", "1,1"], "--batch '1,1': 1 is given twice"),
    (["bench", "--seq", "256", "--method", "quest,quest"], "--method 'quest,quest': quest is given twice"),
    (["dump", "--model", "tiny-random", "--out", "{tmp}/f"], "exists and is not a folder"),
    (["eval", "--model", "{tmp}/empty"], "no config.json"),
    (["eval", "--model", "{tmp}/f"], "a file must be a .gguf"),
    (["generate", "--model", "tiny-random", "--prompt-file", "{tmp}/b.bin"], "not a text file"),
    (["eval", "--model", "tiny-random", "--task", "ppl", "--text-file", "{tmp}/b.bin"], "not a text file"),
])
def test_bad_input_is_one_line_before_any_work(args, message, tmp_path):
    """Exit 2, exactly one `error:` line, no traceback, nothing new on disk."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "f").write_text("a file")
    (tmp_path / "b.bin").write_bytes(bytes(range(256)))
    (tmp_path / "t.txt").write_text("some text " * 50)
    before = sorted(tmp_path.rglob("*"))
    r = _cli(*[a.replace("{tmp}", str(tmp_path)) for a in args])
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], r.stderr
    assert sorted(tmp_path.rglob("*")) == before


def test_debug_shows_the_traceback(tmp_path):
    r = _cli("--debug", "eval", "--model", "tiny-random", "--json", str(tmp_path), "--n", "1")
    assert r.returncode == 2 and "is a folder" in r.stderr  # bad input stays one line with --debug too


def _main_raising(error, monkeypatch, capsys) -> tuple[int, list[str]]:
    """cli.main on a command (`plot`) whose work raises `error`: (exit code, the non-blank stderr lines)."""
    from sparsekv import cli

    def work(*a, **k):
        raise error

    monkeypatch.setattr(cli, "_stop_on_sigterm", lambda: None)
    monkeypatch.setattr("sparsekv.eval.plot.load_results", work)
    monkeypatch.setattr("sys.argv", ["sparsekv", "plot", "r.json", "-o", "p.png"])
    with pytest.raises(SystemExit) as stop:
        cli.main()
    return stop.value.code, [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]


def test_an_interrupted_command_says_so(monkeypatch, capsys):
    """Ctrl-C (and SIGTERM, turned into it) inside a command: exit 130 and an `error: interrupted` line, whatever
    Typer does with the KeyboardInterrupt."""
    code, lines = _main_raising(KeyboardInterrupt(), monkeypatch, capsys)
    assert code == 130 and lines == ["error: interrupted"]


@pytest.mark.parametrize("error", [MemoryError(), RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. "
                                                               "DefaultCPUAllocator: can't allocate memory")])
def test_out_of_memory_is_one_line_naming_the_sizes(error, monkeypatch, capsys):
    """A size too large for the machine (`bench --batch 100000`, `dump --tokens 99999999999`) ends in one line that
    names the options to lower, exit 2, not the allocator's message."""
    code, lines = _main_raising(error, monkeypatch, capsys)
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: out of memory: lower"), lines
