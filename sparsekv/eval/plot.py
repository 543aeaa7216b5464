"""Score against budget, or against the share of the context attended, one line per method, one panel per (task,
context length); dense as a dashed line. `load_results` reads the JSON of one or more `eval` runs, so runs that
differ in a method option (SAAP's --probes, ...) can be drawn together (`sparsekv plot`)."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import SparseKVError
from ..plotting import require_matplotlib, save_figure

X_AXES = ("budget", "selectivity")
# a method option that tells a method's points apart when runs differ in it: shown beside the point
_POINT_OPTIONS = {"probes": "ℓ"}


def load_results(paths: list[Path]) -> list[dict]:
    """The result rows of `eval` JSON files (an object for a one-cell run, else a list of them)."""
    rows: list[dict] = []
    for p in paths:
        try:
            data = json.loads(Path(p).read_text())
        except FileNotFoundError:
            raise SparseKVError(f"{p}: no such file") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SparseKVError(f"{p}: not an eval JSON ({e.__class__.__name__}: {e})") from None
        cells = data if isinstance(data, list) else [data]
        if not cells or not all(isinstance(c, dict) and {"task", "seq_len", "method", "score", "budget"} <= c.keys()
                                for c in cells):
            raise SparseKVError(f"{p}: not an eval JSON (result rows with task, seq_len, method, budget and score)")
        rows += cells
    return rows


def _label(r: dict) -> str:
    """A point's option value where it tells the method's points apart (e.g. SAAP's ℓ)."""
    cfg = r.get("method_config") or {}
    return " ".join(f"{name}{cfg[key]}" for key, name in _POINT_OPTIONS.items() if cfg.get(key) is not None)


def plot_scores(results: list[dict], path: Path, x: str = "budget") -> Path:
    """One panel per (task, context length): each method's score against its budget in keys (x="budget", log
    scale) or against the share of the context it attended, as measured (x="selectivity"; points labelled with the
    option that tells a method's runs apart, e.g. SAAP's ℓ)."""
    if x not in X_AXES:
        raise SparseKVError(f"x must be one of {', '.join(X_AXES)}, got {x!r}")
    plt = require_matplotlib()
    panels = sorted({(r["task"], r["seq_len"]) for r in results}, key=lambda p: (p[0], p[1]))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    for ax, (task, seq) in zip(axes[0], panels):
        rows = [r for r in results if r["task"] == task and r["seq_len"] == seq]
        budgets = sorted({r["budget_tokens"] for r in rows if r.get("budget_tokens")})
        series: dict[str, list[tuple[float, float, str]]] = {}
        dense_drawn = set()
        for r in rows:
            if r["budget"] is None:  # dense: one figure for every budget
                if r["method"] not in dense_drawn:
                    dense_drawn.add(r["method"])
                    ax.axhline(r["score"], color="k", ls="--", lw=1, label=f"{r['method']} ({r['score']:.1f})")
            else:
                at = r["budget_tokens"] if x == "budget" else 100 * r["selectivity"]
                series.setdefault(r["method"], []).append((at, r["score"], _label(r)))
        for method, pts in sorted(series.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=method)
            for at, score, label in pts:
                if label:
                    ax.annotate(label, (at, score), textcoords="offset points", xytext=(4, 4), fontsize=7)
        if x == "budget":
            if budgets:
                ax.set_xscale("log", base=2)
                ax.set_xticks(budgets, [f"{b:g}" for b in budgets])
            ax.set_xlabel("budget (keys per KV head per step, sink + window included)")
        else:
            ax.set_xlabel("selectivity: % of the context attended (measured)")
        metric = rows[0]["metric"]
        ax.set_ylabel(metric + (" (lower is better)" if metric == "perplexity" else ""))
        if metric == "perplexity":
            ax.set_yscale("log")
        n = sorted({r["n"] for r in rows})
        ax.set_title(f"{task} at {seq} tokens, {rows[0]['model']}, n={','.join(map(str, n))}", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    return save_figure(fig, path, plt)
