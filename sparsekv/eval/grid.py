"""`evaluate`: a task over a grid of methods x budgets x lengths with one loaded model, in one call; what
`sparsekv eval` runs.

    cfg = EvalConfig("ruler", methods=["dense", "adamas"], budgets=[64, 128], seqs=[4096], n=20, subtasks="niah")
    results = evaluate(load_model("smollm2-135m"), cfg, checkpoint="ruler.json")

One JSON-ready dict per cell (`result.CellResult`). Passkey and RULER with a `checkpoint` file rewrite it with the
cells so far (marked "complete": false) at most every CHECKPOINT_S seconds, so a stopped job keeps what it measured.
Perplexity always runs dense beside the sparse methods and gives every cell its `dense_score`. Recall leaves out, by
default, the queries whose whole context fits the budget.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import SparseKVError
from ..jsonio import write_json
from ..methods import Method, MethodOptions
from ..models import LoadedModel
from ..progress import Ticker
from .runner import TASKS, RunSpec, check_specs, check_task, make_samples, run_grid

CHECKPOINT_S = 60.0
# options that belong to one task: given with another, they are a mistake (e.g. prefill with passkey)
TASK_OPTIONS = {"subtasks": "ruler", "haystack_file": "ruler", "text_file": "ppl", "dataset": "ppl",
                "prefill": "ppl", "acts": "recall", "max_queries": "recall", "min_context": "recall"}


@dataclass
class EvalConfig:
    """A grid to evaluate. `budgets`: token counts or fractions of the context. Task options: RULER's `subtasks`
    (names or groups, comma-separated) and `haystack_file`; perplexity's `text_file` or `dataset` and `prefill`
    (default: half the window); recall's `acts` (a dump folder), `max_queries` and `min_context` (default: the
    largest token budget + 1)."""

    task: str = "passkey"
    methods: list[str] = field(default_factory=lambda: ["dense"])
    budgets: list[float] = field(default_factory=lambda: [64.0])
    seqs: list[int] = field(default_factory=lambda: [1024])
    n: int = 10
    seed: int = 42
    batch: int = 1  # passkey/ruler: prompts decoded together
    dense_layers: tuple[int, ...] = ()
    options: MethodOptions = field(default_factory=MethodOptions)
    subtasks: str = "all"
    haystack_file: Path | None = None
    text_file: Path | None = None
    dataset: str | None = None
    prefill: int | None = None
    acts: Path | None = None
    max_queries: int | None = None
    min_context: int | None = None

    def check(self) -> None:
        """Every problem that needs no model, as one SparseKVError line, before a model loads."""
        from .ppl import prefill_len

        check_task(self.task)
        self.options = MethodOptions.of(self.options)
        if self.n <= 0:
            raise SparseKVError(f"--n must be positive, got {self.n}")
        if self.batch <= 0:
            raise SparseKVError(f"--batch must be positive, got {self.batch}")
        if self.batch > 1 and self.task not in TASKS:
            raise SparseKVError(f"--batch applies to passkey and ruler, not --task {self.task}")
        given = {k: getattr(self, k) for k in TASK_OPTIONS}
        given["subtasks"] = self.subtasks != "all"
        wrong = [k for k, v in given.items() if v not in (None, False) and TASK_OPTIONS[k] != self.task]
        if wrong:
            raise SparseKVError(", ".join(f"--{k.replace('_', '-')} is for --task {TASK_OPTIONS[k]}" for k in wrong)
                                + f", not {self.task}")
        if self.task == "ppl" and (self.text_file is None) == (self.dataset is None):
            raise SparseKVError("--task ppl needs exactly one of --text-file or --dataset")
        if self.text_file is not None and not Path(self.text_file).is_file():
            raise SparseKVError(f"text file not found: {self.text_file}")
        if self.haystack_file is not None and not Path(self.haystack_file).is_file():
            raise SparseKVError(f"haystack file not found: {self.haystack_file}")
        if self.task == "ruler":  # a misspelt subtask or a length too short fails here, not after the model loads
            from .ruler import check_room, resolve_subtasks

            names = resolve_subtasks(self.subtasks)
            for L in self.seqs:
                check_room(L, names)
        if self.max_queries is not None and self.max_queries <= 0:
            raise SparseKVError(f"--max-queries must be positive, got {self.max_queries}")
        if self.task == "recall" and self.acts is None:
            raise SparseKVError("--task recall needs --acts DIR (a `sparsekv dump` folder)")
        if self.task == "recall" and "dense" in self.methods:
            raise SparseKVError("--task recall scores sparse methods: dense reads every key (a recall of 1 by "
                                "definition); give the methods to score (--method), each shown beside the oracle "
                                "at its budget")
        if self.task == "ppl":
            for L in self.seqs:
                prefill_len(L, self.prefill)
        if self.task != "recall":  # recall's length comes from its dump
            self.specs()

    def check_model(self, model: str) -> None:
        """The checks that need the model's config (read without its weights) or the dump, before the model loads:
        lengths against its context, dense layers against its layer count (recall: the dump's), an artifact and a
        dump made from another model, a dump's files (sha256). One SparseKVError line naming the option."""
        from .. import validate

        if self.task != "recall":
            validate.model_checks(model, seqs=self.seqs, layers=self.dense_layers, artifact_path=self.options.artifact)
            return
        shape = validate.model_shape(model)
        acts = validate.dump(self.acts)
        validate.same_model(acts.manifest.get("model"), shape, model, f"--acts {self.acts}")
        check_recall_layers(self.dense_layers, acts.num_layers)
        specs_for(self.methods, self.budgets, [max(acts.seq_lengths)], self.options)
        validate.artifact(self.options.artifact, shape, model)

    def specs(self) -> list[RunSpec]:
        """The grid's cells (perplexity: dense first, as every sparse score is read against it)."""
        return specs_for(self.methods, self.budgets, self.seqs, self.options, always_dense=self.task == "ppl")


def specs_for(methods: list[str], budgets: list[float], seqs: list[int], options: MethodOptions,
              always_dense: bool = False) -> list[RunSpec]:
    """The cells of a grid, validated for every length before minutes are spent on the first one."""
    check_specs([RunSpec(m, None) for m in methods], 1)  # unknown methods first, before option errors
    options.check(methods)
    if always_dense and "dense" not in methods:
        methods = ["dense", *methods]
    specs = [RunSpec(m, b, options.for_method(m)) for m in methods for b in ([None] if m == "dense" else budgets)]
    for L in seqs:
        check_specs(specs, L)
    for L in seqs or [None]:  # an integer budget needs no length; a fraction is checked at each one
        check_sink_window(specs, L)
    for m in dict.fromkeys(sp.method for sp in specs):  # each method's own option checks (bits, page size, ...)
        options.check_build(m, next(sp.budget for sp in specs if sp.method == m))
    return specs


def check_sink_window(specs: list[RunSpec], context: int | None) -> None:
    """Each cell's sink + window (given, else its method's defaults) within its budget, before any work."""
    from .. import validate

    for sp in specs:
        if sp.budget is not None:
            validate.method_sink_window(sp.method, sp.method_options.get("sink"), sp.method_options.get("window"),
                                        sp.budget, context)


def check_recall_layers(dense_layers: tuple[int, ...] | list[int], num_layers: int) -> tuple[int, ...]:
    """Recall's dense layers: layers of the dump, and not all of them (a dense layer is not scored: nothing would
    be left to measure)."""
    from .. import validate

    layers = validate.dense_layers(list(dense_layers), num_layers, what="the dump")
    if num_layers and len(set(layers)) >= num_layers:
        raise SparseKVError(f"--dense-layers {','.join(map(str, layers))}: every layer of the dump is dense; "
                            f"recall has no layer left to score")
    return layers


def method_for(name: str, budget: float, options: MethodOptions | dict | None = None) -> Method:
    """One method at `budget` (dense: every key), checked as a grid's cells are: for a single generation."""
    options = MethodOptions.of(options)
    spec = specs_for([name], [budget], [], options)[0]
    return options.build(name, spec.budget)


def cells_payload(results: list[dict], total_cells: int) -> dict | list[dict]:
    """The JSON of a grid: one object for a one-cell run, else a list (partial saves keep the same shape)."""
    return results[0] if total_cells == 1 and len(results) == 1 else results


def evaluate(lm: LoadedModel, cfg: EvalConfig, progress: Any = None, checkpoint: str | Path | None = None,
             stamp: dict | None = None) -> list[dict]:
    """Run the grid (module docstring). `progress`: a rich Progress or a callable(done, total); `stamp`: fields
    added to every cell of the checkpoint file (the CLI's command line)."""
    cfg.check()
    tick = Ticker(progress, None, cfg.task)
    if cfg.task == "ppl":
        return _ppl(lm, cfg, tick)
    if cfg.task == "recall":
        return _recall(lm, cfg, tick)
    return _generation(lm, cfg, tick, checkpoint, stamp or {})


def _generation(lm: LoadedModel, cfg: EvalConfig, tick: Ticker, checkpoint: str | Path | None,
                stamp: dict) -> list[dict]:
    """Passkey and RULER: per length, make the prompts, then run every cell sample-major."""
    specs = cfg.specs()
    task_options = {"subtasks": cfg.subtasks, "haystack_file": cfg.haystack_file} if cfg.task == "ruler" else {}
    results: list[dict] = []
    skipped: dict[str, str] = {}
    last_save = time.perf_counter()

    def save(partial) -> None:
        nonlocal last_save
        if checkpoint is not None and time.perf_counter() - last_save >= CHECKPOINT_S:
            cells = [{**c, "skipped_subtasks": skipped} for c in partial()]
            write_json(checkpoint, cells_payload([{**c, **stamp} for c in results + cells], len(specs) * len(cfg.seqs)))
            last_save = time.perf_counter()

    # every later length's prompts must fit too: checked on their first prompt before the first cell runs (their
    # whole sets are made when reached, so one length's prompts are held at a time)
    for L in cfg.seqs[1:]:
        tick.update(label=f"{cfg.task} seq={L}: checking the prompts fit")
        make_samples(lm, cfg.task, L, 1, cfg.seed, task_options)
    for L in cfg.seqs:
        tick.update(label=f"{cfg.task} seq={L}: making prompts")
        samples, skipped = make_samples(lm, cfg.task, L, cfg.n, cfg.seed, task_options)
        for name, why in skipped.items():
            tick.note(f"skipped {name}: {why}")
        tick.update(total=(tick.total or 0) + len(samples) * len(specs),
                    label=f"{cfg.task} seq={L}: {len(specs)} method/budget cells")
        cells = run_grid(lm, cfg.task, specs, L, cfg.n, cfg.seed, cfg.dense_layers, samples=samples,
                         on_sample=tick.advance, on_partial=save, batch_size=cfg.batch)
        for c in cells:
            c["skipped_subtasks"] = skipped
        results += cells
    return results


def _ppl(lm: LoadedModel, cfg: EvalConfig, tick: Ticker) -> list[dict]:
    from .ppl import ppl_grid, ppl_tokens, prefill_len, with_dense_score

    specs = cfg.specs()
    tick.update(label="ppl: reading text",
                total=sum(cfg.n * (L - prefill_len(L, cfg.prefill)) * len(specs) for L in cfg.seqs))
    ids = ppl_tokens(lm, text_file=cfg.text_file, dataset=cfg.dataset, want=max(cfg.seqs) * cfg.n)
    source = str(cfg.text_file) if cfg.text_file else f"dataset {cfg.dataset}"
    results = []
    for L in cfg.seqs:
        tick.update(label=f"ppl seq={L}: {len(specs)} method/budget cells, token by token")
        results += ppl_grid(lm, specs, ids, L, prefill_len(L, cfg.prefill), cfg.n, cfg.dense_layers,
                            on_step=tick.advance, text_source=source)
    return with_dense_score(results)


def _recall(lm: LoadedModel, cfg: EvalConfig, tick: Ticker) -> list[dict]:
    from ..activations import load_activations
    from .recall import default_min_context, query_rows, recall_grid

    acts = load_activations(cfg.acts, lm)
    dense = check_recall_layers(cfg.dense_layers, acts.num_layers)
    min_context = default_min_context(cfg.budgets) if cfg.min_context is None else cfg.min_context
    specs = specs_for(cfg.methods, cfg.budgets, [max(acts.seq_lengths)], cfg.options)
    tick.update(label=f"recall on {cfg.acts} ({len(specs)} method/budget cells)",
                total=(acts.num_layers - len(set(dense))) * len(query_rows(acts, cfg.max_queries, min_context)))
    return recall_grid(acts, specs, lm, on_item=tick.advance, max_queries=cfg.max_queries, min_context=min_context,
                       dense_layers=dense)
