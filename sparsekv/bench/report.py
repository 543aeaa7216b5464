"""The human side of a bench result: rich tables of the decode-step rows and the top-k comparison."""

from __future__ import annotations

from rich.table import Table


def _f(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def title(result: dict) -> str:
    c, dev = result["config"], result["device"]
    s = c["shape"]
    seqs = c["seq"]
    t = (f"one decode step, one layer: {s['name']} ({s['q_heads']}q/{s['kv_heads']}kv x {s['head_dim']}), "
         f"{'seq ' + str(seqs[0]) + ', ' if len(seqs) == 1 else ''}batch {c['batch']}, {c['dtype']} on {dev['name']}")
    if c["cpu_fallback"]:
        t += f" [CPU FALLBACK: not GPU numbers; seq capped at {c['cpu_seq_cap']}]"
    return t


def caption(result: dict) -> str:
    floors = ", ".join(f"{f['dense_floor_us']:.1f} µs" + ("" if len(result["floor"]) == 1 else f" @ {f['seq']}")
                       for f in result["floor"])
    return (f"copy bandwidth {result['copy_bandwidth']['GBps']:.0f} GB/s; dense floor {floors}; "
            f"timer {result['timer'].split(' ')[0]}; speedup vs the best dense (e = eager basis)")


def rows_table(result: dict) -> Table:
    multi = len(result["config"]["seq"]) > 1
    t = Table(title=title(result), caption=caption(result))
    cols = (["seq"] if multi else []) + ["method", "budget", "kernel", "µs graph", "µs eager", "µs attend",
                                         "speedup", "GB/s", "% BW", "selectivity", "sel/sink/win"]
    for col in cols:
        t.add_column(col, justify="left" if col in ("method", "kernel") else "right")
    for r in result["rows"]:
        eager_basis = r.get("speedup_basis") == "eager" and r["us_graph"] is not None
        cells = [r["method"], "-" if r["budget"] is None else f"{r['budget']:g}", r["kernel"].split(":", 1)[-1],
                 _f(r["us_graph"], ".1f"), _f(r["us_eager"], ".1f"), _f(r["us_attend"], ".1f"),
                 _f(r["speedup"], ".2f") + ("e" if eager_basis else ""), _f(r["GBps"], ".0f"),
                 _f(r["pct_copy_bw"], ".0f"), f"{r['selectivity']:.4f}", f"{r['selected']}/{r['sink']}/{r['window']}"]
        t.add_row(*([str(r["seq"])] if multi else []), *cells)
    return t


def topk_table(result: dict) -> Table | None:
    if not result.get("topk"):
        return None
    t = Table(title="top-k alone over fp32 score rows (rows = batch x query heads)")
    for col in ("seq", "rows", "k", "op", "kernel", "µs graph", "µs eager", "GB/s", "vs torch.topk"):
        t.add_column(col, justify="left" if col in ("op", "kernel") else "right")
    for r in result["topk"]:
        t.add_row(str(r["n"]), str(r["rows"]), str(r["k"]), r["op"], r["kernel"], _f(r.get("us_graph"), ".1f"),
                  _f(r.get("us_eager"), ".1f"), _f(r.get("GBps"), ".0f"), _f(r.get("speedup_vs_torch"), ".2f"))
    return t


def e2e_table(result: dict) -> Table:
    c, dev = result["config"], result["device"]
    t = Table(title=f"whole-model decode: {c['model']} ({c['layers']} layers), {c['dtype']} on {dev['name']}",
              caption=f"copy bandwidth {result['copy_bandwidth']['GBps']:.0f} GB/s; floor = (weights + dense K/V "
                      f"of every row per step) / copy bandwidth; ms per step, tokens/s of all rows")
    for col in ("seq", "batch", "method", "budget", "ms/step", "tokens/s", "vs dense", "floor ms", "% floor",
                "prefill s", "peak GB", "selectivity", "decode path"):
        t.add_column(col, justify="left" if col in ("method", "decode path") else "right")
    for r in result["rows"]:
        t.add_row(str(r["seq"]), str(r["batch"]), r["method"], "-" if r["budget"] is None else f"{r['budget']:g}",
                  _f(r["ms_per_token"], ".2f"), _f(r["tokens_per_s"], ".1f"), _f(r["speedup_vs_dense"], ".2f"),
                  _f(r["floor_ms"], ".2f"), _f(100 * r["of_floor"], ".0f"), _f(r["prefill_s"], ".2f"),
                  _f(r["peak_gb"], ".1f"), _f(r["selectivity"], ".4f"), str(r["decode_path"]))
    return t
