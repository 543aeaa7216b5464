"""Run a task over a grid of methods × budgets × lengths with one loaded model, and shape the result JSON.

Protocol (stated in every result): the prompt (context + question + answer prefix) is prefilled densely, the
method runs on every decode step, and each generated token is indexed as it is appended: the query-aware
protocol of Quest / MagicPIG / Adamas, not kvpress's query-agnostic compression.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from .. import __version__
from ..decode import generate, prefill
from ..errors import SparseKVError
from ..methods import get_method, method_names
from ..models import LoadedModel
from ..selection import resolve_budget
from . import passkey

PROTOCOL = ("query-aware decode: dense prefill of context + question + answer prefix; the method selects keys at "
            "every decode step; generated tokens are indexed as they are appended; greedy decoding")

TASKS: dict[str, Callable] = {"passkey": passkey.make_samples}
SCORERS = {"passkey": passkey.score}
METRICS = {"passkey": "accuracy"}


@dataclass
class RunSpec:
    method: str
    budget: float | None  # None for dense
    method_options: dict = field(default_factory=dict)  # sink, window, pooling, ...


def check_task(task: str) -> None:
    if task not in TASKS:
        raise SparseKVError(f"unknown task {task!r}; available: {', '.join(sorted(TASKS))}")


def check_budget(budget: float, seq_len: int) -> None:
    b = resolve_budget(budget, seq_len)
    if b > seq_len:
        raise SparseKVError(f"budget {b} tokens is larger than the context ({seq_len} tokens)")


def check_seq(lm: LoadedModel, seq_len: int, gen_tokens: int) -> None:
    if seq_len <= 0:
        raise SparseKVError(f"seq must be positive, got {seq_len}")
    if lm.max_context and seq_len + gen_tokens > lm.max_context:
        raise SparseKVError(f"seq {seq_len} (+{gen_tokens} generated) is longer than {lm.name} supports "
                            f"({lm.max_context} tokens)")


def run_task(lm: LoadedModel, task: str, spec: RunSpec, seq_len: int, n: int, seed: int = 42,
             dense_layers: tuple[int, ...] = (), samples=None, on_sample: Callable | None = None) -> dict:
    """One (method, budget, seq_len) cell: n samples of `task`, scored. Returns the result dict (JSON-ready)."""
    return run_grid(lm, task, [spec], seq_len, n, seed, dense_layers, samples, on_sample)[0]


def run_grid(lm: LoadedModel, task: str, specs: list[RunSpec], seq_len: int, n: int, seed: int = 42,
             dense_layers: tuple[int, ...] = (), samples=None, on_sample: Callable | None = None) -> list[dict]:
    """Several methods/budgets at one length. Sample-major: each prompt is prefilled once (prefill is dense
    whatever the method) and every method decodes from that prefill."""
    check_task(task)
    known = method_names()
    for spec in specs:
        if spec.method not in known:
            raise SparseKVError(f"unknown method {spec.method!r}; available: {', '.join(known)}")
        if spec.budget is not None:
            check_budget(spec.budget, seq_len)
    samples = samples if samples is not None else TASKS[task](lm.tokenizer, seq_len, n, seed)
    check_seq(lm, max(len(s.ids) for s in samples), max(s.max_new_tokens for s in samples))
    methods = [get_method(sp.method, budget=sp.budget or 1.0, **sp.method_options) for sp in specs]
    scorer = SCORERS[task]
    rows: list[list[dict]] = [[] for _ in specs]
    stats: list[list[dict]] = [[] for _ in specs]
    seconds = [0.0] * len(specs)
    for s in samples:
        t0 = time.perf_counter()
        pf = prefill(lm, s.ids)
        shared = (time.perf_counter() - t0) / len(specs)  # prefill time, split evenly over the cells
        for i, method in enumerate(methods):
            t1 = time.perf_counter()
            g = generate(lm, None, method, s.max_new_tokens, dense_layers=dense_layers, prefilled=pf)
            seconds[i] += time.perf_counter() - t1 + shared
            rows[i].append({"depth": s.depth, "answer": s.answer, "prediction": g.text,
                            "score": scorer(g.text, s.answer), "prompt_tokens": g.prompt_tokens})
            stats[i].append(g.stats)
            if on_sample:
                on_sample()
    return [_result(lm, task, spec, m, seq_len, seed, dense_layers, samples, r, st, sec)
            for spec, m, r, st, sec in zip(specs, methods, rows, stats, seconds)]


def _result(lm, task, spec, method, seq_len, seed, dense_layers, samples, rows, totals, seconds) -> dict:
    steps = sum(t["sparse_steps"] for t in totals)

    def mean_stat(key: str) -> float | None:
        if not steps:
            return None
        return sum(t[key] * t["sparse_steps"] for t in totals) / steps

    per_depth: dict[float, list[float]] = {}
    for r in rows:
        per_depth.setdefault(round(r["depth"], 4), []).append(r["score"])
    sel = mean_stat("selectivity")
    return {
        "task": task,
        "metric": METRICS[task],
        "score": 100.0 * sum(r["score"] for r in rows) / len(rows),
        "method": spec.method,
        "method_config": method.config(),
        "budget": spec.budget,
        "budget_tokens": resolve_budget(spec.budget, seq_len) if spec.budget else None,
        "seq_len": seq_len,
        "n": len(rows),
        "selectivity": 1.0 if sel is None else sel,
        "mean_selected": mean_stat("mean_selected"),
        "mean_sink": mean_stat("mean_sink"),
        "mean_window": mean_stat("mean_window"),
        "dense_layers": sorted(dense_layers),
        "per_depth": [{"depth": d, "n": len(v), "score": 100.0 * sum(v) / len(v)} for d, v in sorted(per_depth.items())],
        "model": lm.name,
        "model_source": lm.source,
        "tokenizer": getattr(lm.tokenizer, "name_or_path", "") or type(lm.tokenizer).__name__,
        "template": samples[0].template,
        "artifact": spec.method_options.get("artifact"),
        "seed": seed,
        "protocol": PROTOCOL,
        "device": str(lm.device),
        "seconds": round(seconds, 2),
        "sparsekv_version": __version__,
        "samples": rows,
    }
