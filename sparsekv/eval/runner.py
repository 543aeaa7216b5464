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
from ..decode import generate
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
    check_task(task)
    if spec.method not in method_names():
        raise SparseKVError(f"unknown method {spec.method!r}; available: {', '.join(method_names())}")
    if spec.budget is not None:
        check_budget(spec.budget, seq_len)
    samples = samples if samples is not None else TASKS[task](lm.tokenizer, seq_len, n, seed)
    check_seq(lm, max(len(s.ids) for s in samples), max(s.max_new_tokens for s in samples))
    method = get_method(spec.method, budget=spec.budget or 1.0, **spec.method_options)
    scorer = SCORERS[task]
    rows, totals, t0 = [], [], time.perf_counter()
    for s in samples:
        g = generate(lm, s.ids, method, s.max_new_tokens, dense_layers=dense_layers)
        rows.append({"depth": s.depth, "answer": s.answer, "prediction": g.text, "score": scorer(g.text, s.answer),
                     "prompt_tokens": g.prompt_tokens})
        totals.append(g.stats)
        if on_sample:
            on_sample()
    steps = sum(t["sparse_steps"] for t in totals)

    def mean_stat(key: str) -> float | None:
        if not steps:
            return None
        return sum(t[key] * t["sparse_steps"] for t in totals) / steps

    per_depth: dict[float, list[float]] = {}
    for r in rows:
        per_depth.setdefault(round(r["depth"], 4), []).append(r["score"])
    score = 100.0 * sum(r["score"] for r in rows) / len(rows)
    sel = mean_stat("selectivity")
    return {
        "task": task,
        "metric": METRICS[task],
        "score": score,
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
        "artifact": None,
        "seed": seed,
        "protocol": PROTOCOL,
        "device": str(lm.device),
        "seconds": round(time.perf_counter() - t0, 2),
        "sparsekv_version": __version__,
        "samples": rows,
    }
