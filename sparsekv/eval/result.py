"""One cell of an eval grid (method x budget x length), the same schema for every task: `CellResult.to_json` makes
the result JSON that tables, plots and the README read."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .. import __version__
from ..selection import resolve_budget


def decode_means(totals: list[dict]) -> dict:
    """What the sparse decode steps read, from their `DecodeStats.summary()`s, each weighted by its step count:
    selectivity (1.0 with no sparse step) and the mean selected, sink, window and visible keys (None then)."""
    steps = sum(t["sparse_steps"] for t in totals)

    def mean(key: str) -> float | None:
        return sum(t[key] * t["sparse_steps"] for t in totals) / steps if steps else None

    sel = mean("selectivity")
    return {"selectivity": 1.0 if sel is None else sel, "mean_selected": mean("mean_selected"),
            "mean_sink": mean("mean_sink"), "mean_window": mean("mean_window"), "mean_context": mean("mean_context")}


@dataclass
class CellResult:
    task: str
    metric: str
    score: float | None
    method: str
    method_config: dict
    budget: float | None  # as given: a token count or a fraction of the context; None for dense
    seq_len: int
    n: int
    decode: dict  # decode_means(...)
    model: str
    model_source: str
    artifact: str | None
    seed: int | None
    protocol: str
    device: str
    seconds: float
    dense_layers: list[int] = field(default_factory=list)
    measures: dict[str, Any] = field(default_factory=dict)  # the task's other measures, written beside `score`
    task_fields: dict[str, Any] = field(default_factory=dict)  # the task's own keys, written after the shared ones

    @property
    def budget_tokens(self) -> int | None:
        return resolve_budget(self.budget, self.seq_len) if self.budget else None

    def to_json(self) -> dict:
        return {"task": self.task, "metric": self.metric, "score": self.score, **self.measures, "method": self.method,
                "method_config": self.method_config, "budget": self.budget, "budget_tokens": self.budget_tokens,
                "seq_len": self.seq_len, "n": self.n, **self.decode, "dense_layers": sorted(self.dense_layers),
                "model": self.model, "model_source": self.model_source, "artifact": self.artifact, "seed": self.seed,
                "protocol": self.protocol, "device": self.device, "seconds": round(self.seconds, 2),
                "sparsekv_version": __version__, **self.task_fields}


def decode_fields(lm: Any, totals: list[dict]) -> dict:
    """How a cell's decode steps ran: the layers that attend a sliding window ({layer: keys}; mean_context, the
    keys a sparse step's layer could see, is that window or the whole cache), and the decode path (CUDA-graph
    replay, or eager and why)."""
    paths = sorted({t.get("decode_path") for t in totals if t.get("decode_path")})
    return {"sliding_window_layers": {str(i): p.span for i, p in enumerate(lm.patterns) if p.span},
            "decode_path": paths[0] if len(paths) == 1 else (paths or None)}


def tokenizer_name(lm: Any) -> str:
    return getattr(lm.tokenizer, "name_or_path", "") or type(lm.tokenizer).__name__
