"""Score against budget, one line per method, one panel per (task, context length); dense as a dashed line."""

from __future__ import annotations

from pathlib import Path

from ..plotting import require_matplotlib, save_figure


def plot_scores(results: list[dict], path: Path) -> Path:
    plt = require_matplotlib()
    panels = sorted({(r["task"], r["seq_len"]) for r in results}, key=lambda p: (p[0], p[1]))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    for ax, (task, seq) in zip(axes[0], panels):
        rows = [r for r in results if r["task"] == task and r["seq_len"] == seq]
        budgets = sorted({r["budget_tokens"] for r in rows if r["budget_tokens"]})
        series: dict[str, list[tuple[int, float]]] = {}
        for r in rows:
            if r["budget"] is None:  # dense: one figure for every budget
                ax.axhline(r["score"], color="k", ls="--", lw=1, label=f"{r['method']} ({r['score']:.1f})")
            else:
                series.setdefault(r["method"], []).append((r["budget_tokens"], r["score"]))
        for method, pts in sorted(series.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=method)
        if budgets:
            ax.set_xscale("log", base=2)
            ax.set_xticks(budgets, [f"{b:g}" for b in budgets])
        ax.set_xlabel("budget (keys per KV head per step, sink + window included)")
        metric = rows[0]["metric"]
        ax.set_ylabel(metric + (" (lower is better)" if metric == "perplexity" else ""))
        if metric == "perplexity":
            ax.set_yscale("log")
        n = rows[0]["n"]
        ax.set_title(f"{task} at {seq} tokens, {rows[0]['model']}, n={n}", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    return save_figure(fig, path, plt)
