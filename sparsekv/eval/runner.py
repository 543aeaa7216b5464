"""Run a task over a grid of methods × budgets × lengths with one loaded model, and shape the result JSON.

Protocol (stated in every result): the prompt (context + question + answer prefix) is prefilled densely, the
method runs on every decode step, and each generated token is indexed as it is appended: the query-aware
protocol of Quest / MagicPIG / Adamas, not kvpress's query-agnostic compression.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from ..decode import generate_batch, prefill
from ..errors import SparseKVError
from ..jsonio import device_label
from ..methods import get_method, method_names
from ..models import LoadedModel
from ..selection import check_budget
from . import metrics, passkey
from .intervals import annotate
from .result import CellResult, decode_fields, decode_means, tokenizer_name

PROTOCOL = ("query-aware decode: dense prefill of context + question + answer prefix; the method selects keys at "
            "every decode step; generated tokens are indexed as they are appended; greedy decoding")


def _passkey_samples(tokenizer, seq_len: int, n: int, seed: int, **_) -> tuple[list, dict]:
    return passkey.make_samples(tokenizer, seq_len, n, seed), {}


def _ruler_samples(tokenizer, seq_len: int, n: int, seed: int, subtasks=None, haystack_file=None) -> tuple[list, dict]:
    from . import ruler  # imported on use: its word lists are only needed for RULER

    return ruler.make_samples(tokenizer, seq_len, n, seed, subtasks=subtasks, haystack_file=haystack_file)


# generation tasks: name -> samples(tokenizer, seq_len, n, seed, **task_options) -> (samples, skipped subtasks)
TASKS: dict[str, Callable] = {"passkey": _passkey_samples, "ruler": _ruler_samples}
METRICS = {"passkey": "accuracy", "ruler": "accuracy"}
OTHER_TASKS = ("ppl", "recall")  # run by eval/ppl.py and eval/recall.py, not by this runner


@dataclass
class RunSpec:
    method: str
    budget: float | None  # None for dense
    method_options: dict = field(default_factory=dict)  # sink, window, pooling, ...


def check_task(task: str, generation_only: bool = False) -> None:
    known = sorted(TASKS) if generation_only else sorted([*TASKS, *OTHER_TASKS])
    if task not in known:
        raise SparseKVError(f"unknown task {task!r}; available: {', '.join(known)}")


def check_specs(specs: list[RunSpec], seq_len: int) -> None:
    """Every cell names a known method and a budget that fits the context (checked before any work starts)."""
    if not specs:
        raise SparseKVError("no methods to evaluate")
    known = method_names()
    for spec in specs:
        if spec.method not in known:
            raise SparseKVError(f"unknown method {spec.method!r}; available: {', '.join(known)}")
        if spec.budget is not None:
            check_budget(spec.budget, seq_len)


def check_seq(lm: LoadedModel, seq_len: int, gen_tokens: int) -> None:
    if seq_len <= 0:
        raise SparseKVError(f"seq must be positive, got {seq_len}")
    if lm.max_context and seq_len + gen_tokens > lm.max_context:
        raise SparseKVError(f"seq {seq_len} (+{gen_tokens} generated) is longer than {lm.name} supports "
                            f"({lm.max_context} tokens)")


def make_samples(lm: LoadedModel, task: str, seq_len: int, n: int, seed: int = 42,
                 task_options: dict | None = None) -> tuple[list, dict]:
    """The prompts of a generation task (n per subtask for RULER) and the subtasks skipped, with the reason."""
    check_task(task, generation_only=True)
    return TASKS[task](lm.tokenizer, seq_len, n, seed, **(task_options or {}))


def run_task(lm: LoadedModel, task: str, spec: RunSpec, seq_len: int, n: int, seed: int = 42,
             dense_layers: tuple[int, ...] = (), samples=None, on_sample: Callable | None = None,
             task_options: dict | None = None) -> dict:
    """One (method, budget, seq_len) cell: n samples of `task`, scored. Returns the result dict (JSON-ready)."""
    return run_grid(lm, task, [spec], seq_len, n, seed, dense_layers, samples, on_sample, task_options)[0]


def run_grid(lm: LoadedModel, task: str, specs: list[RunSpec], seq_len: int, n: int, seed: int = 42,
             dense_layers: tuple[int, ...] = (), samples=None, on_sample: Callable | None = None,
             task_options: dict | None = None,
             on_partial: Callable[[Callable[[], list[dict]]], None] | None = None,
             batch_size: int = 1) -> list[dict]:
    """Several methods/budgets at one length. Sample-major: each prompt is prefilled once (prefill is dense
    whatever the method) and every method decodes from that prefill; `batch_size` prompts decode together
    (`decode.generate_batch`: each row attends what it would alone).

    `on_partial(results_so_far)` is called after each prompt with a function that builds the cells' results over
    the prompts done so far (marked "complete": False): a caller can save them, so a run that is stopped keeps
    what it measured. The returned results are marked "complete": True."""
    check_task(task, generation_only=True)
    check_specs(specs, seq_len)
    if batch_size < 1:
        raise SparseKVError(f"batch size must be positive, got {batch_size}")
    skipped: dict[str, str] = {}
    if samples is None:
        samples, skipped = make_samples(lm, task, seq_len, n, seed, task_options)
    if not samples:
        raise SparseKVError(f"task {task!r} produced no samples" +
                            (f" (skipped: {'; '.join(f'{k}: {v}' for k, v in skipped.items())})" if skipped else ""))
    check_seq(lm, max(len(s.ids) for s in samples), max(s.max_new_tokens for s in samples))
    methods = [get_method(sp.method, budget=sp.budget or 1.0, **sp.method_options) for sp in specs]
    rows: list[list[dict]] = [[] for _ in specs]
    stats: list[list[dict]] = [[] for _ in specs]
    seconds = [0.0] * len(specs)

    def results(complete: bool) -> list[dict]:
        return annotate([{**_result(lm, task, spec, m, seq_len, seed, dense_layers, samples, r, st, sec, skipped),
                          "complete": complete} for spec, m, r, st, sec in zip(specs, methods, rows, stats, seconds)])

    for at in range(0, len(samples), batch_size):
        group = samples[at : at + batch_size]
        t0 = time.perf_counter()
        pfs = [prefill(lm, s.ids, room=s.max_new_tokens) for s in group]
        shared = (time.perf_counter() - t0) / len(specs)  # prefill time, split evenly over the cells
        for i, method in enumerate(methods):
            t1 = time.perf_counter()
            gens = generate_batch(lm, None, method, [s.max_new_tokens for s in group], dense_layers=dense_layers,
                                  prefilled=pfs)
            seconds[i] += time.perf_counter() - t1 + shared
            for s, g in zip(group, gens):
                rows[i].append({"subtask": s.subtask, "depth": s.depth, "answer": s.answer, "prediction": g.text,
                                "score": metrics.score(s.metric, g.text, s.references),
                                "prompt_tokens": g.prompt_tokens})
                stats[i].append(g.stats)
                if on_sample:
                    on_sample()
        if on_partial:
            on_partial(lambda: results(False))

    return results(True)


def _mean(xs: list[float]) -> float:
    return 100.0 * sum(xs) / len(xs)


def _result(lm, task, spec, method, seq_len, seed, dense_layers, samples, rows, totals, seconds, skipped) -> dict:
    per_depth: dict[float, list[float]] = {}
    per_subtask: dict[str, list[float]] = {}
    for r in rows:
        if r["depth"] is not None:
            per_depth.setdefault(round(r["depth"], 4), []).append(r["score"])
        if r["subtask"] is not None:
            per_subtask.setdefault(r["subtask"], []).append(r["score"])
    # RULER's average is the mean of the subtask scores (each subtask weighs the same whatever its n)
    score = (sum(_mean(v) for v in per_subtask.values()) / len(per_subtask)) if per_subtask else \
        _mean([r["score"] for r in rows])
    return CellResult(
        task=task, metric=METRICS[task], score=score, method=spec.method, method_config=method.config(),
        budget=spec.budget, seq_len=seq_len, n=len(rows), decode=decode_means(totals), model=lm.name,
        model_source=lm.source, artifact=spec.method_options.get("artifact"), seed=seed, protocol=PROTOCOL,
        device=device_label(lm.device), seconds=seconds, dense_layers=list(dense_layers),
        task_fields={
            **decode_fields(lm, totals),
            "per_depth": [{"depth": d, "n": len(v), "score": _mean(v)} for d, v in sorted(per_depth.items())],
            "per_subtask": [{"subtask": k, "n": len(v), "score": _mean(v),
                             "metric": next(x.metric for x in samples if x.subtask == k),
                             "template": next(x.template for x in samples if x.subtask == k),
                             # RULER counts a prediction as null after its cleanup (control characters removed)
                             "nulls": sum(1 for r in rows
                                          if r["subtask"] == k and not metrics.postprocess(r["prediction"]))}
                            for k, v in per_subtask.items()],
            "skipped_subtasks": skipped,
            "tokenizer": tokenizer_name(lm),
            # the prompt templates of the cell's subtasks (RULER's differ in their haystacks), each once
            "template": " | ".join(dict.fromkeys(x.template for x in samples)),
            "gen_tokens": sorted({x.max_new_tokens for x in samples}),
            "samples": rows,
        }).to_json()
