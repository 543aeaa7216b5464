"""µs per decode step against context length, one line per method (and budget), with the dense memory floor; and
the whole-model counterpart (`--e2e`): ms per token against context length."""

from __future__ import annotations

from pathlib import Path

from ..plotting import require_matplotlib, save_figure


def plot_result(result: dict, path: Path) -> Path:
    plt = require_matplotlib()
    series: dict[str, list[tuple[int, float]]] = {}
    for r in result["rows"]:
        label = r["method"] if r["budget"] is None else f"{r['method']} @ {r['budget']:g}"
        series.setdefault(label, []).append((r["seq"], r["us"]))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, pts in series.items():
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    floor = sorted((f["seq"], f["dense_floor_us"]) for f in result["floor"])
    bw = result["copy_bandwidth"]["GBps"]
    ax.plot([f[0] for f in floor], [f[1] for f in floor], "k--", label=f"dense floor (K+V at {bw:.0f} GB/s copy)")
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(lambda x, _: f"{x / 1024:g}K" if x >= 1024 else f"{x:g}")
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("µs per decode step, one layer")
    c, dev = result["config"], result["device"]
    cpu = " - CPU fallback, not GPU numbers" if c["cpu_fallback"] else ""
    ax.set_title(f"{c['shape']['name']}, batch {c['batch']}, {c['dtype']} on {dev['name']} "
                 f"({result['timer'].split(' ')[0]}){cpu}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path, plt)


def plot_e2e(result: dict, path: Path) -> Path:
    plt = require_matplotlib()
    series: dict[str, list[tuple[int, float]]] = {}
    floor: dict[int, float] = {}
    batches = sorted({r["batch"] for r in result["rows"]})
    for r in result["rows"]:
        label = r["method"] if r["budget"] is None else f"{r['method']} @ {r['budget']:g}"
        if len(batches) > 1:
            label += f", batch {r['batch']}"
        series.setdefault(label, []).append((r["seq"], r["ms_per_token"]))
        if r["batch"] == batches[0]:
            floor[r["seq"]] = r["floor_ms"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, pts in series.items():
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    seqs = sorted(floor)
    ax.plot(seqs, [floor[s] for s in seqs], "k--", label=f"floor, batch {batches[0]} (weights + dense K/V at copy "
                                                          "bandwidth)")
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(lambda x, _: f"{x / 1024:g}K" if x >= 1024 else f"{x:g}")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("ms per decode step")
    c, dev = result["config"], result["device"]
    ax.set_title(f"{c['model']}, {c['dtype']} on {dev['name']}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path, plt)
