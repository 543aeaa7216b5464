"""Warp-stall samples per loop of a kernel, from Nsight Compute's source page exported as CSV:

    ncu --section SourceCounters ... -o REPORT python prog.py
    ncu -i REPORT.ncu-rep --page source --csv --print-source sass > sass.csv
    python results/scripts/ncu_stalls.py sass.csv [TOP] [--json OUT]

A loop is a backward branch's range of SASS addresses. For each loop holding over 1 % of the samples it prints its
instruction count, its share of all samples and its leading stall reasons; then the TOP instructions by samples.
Shares are of all samples: a sample is one warp's state at one moment, so they split warp-time, not issue slots."""
import csv
import json
import re
import sys
from collections import defaultdict


def read(path):
    rows = list(csv.reader(open(path)))
    hdr = next(r for r in rows if "Address" in r)
    col = {h: i for i, h in enumerate(hdr)}
    stall = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    ins = []
    for r in rows[rows.index(hdr) + 1:]:
        try:
            a = int(r[col["Address"]], 16)
        except (ValueError, IndexError):
            continue
        f = lambda h: float(r[col[h]] or 0)
        ins.append(dict(addr=a, sass=r[col["Source"]].strip(), samples=f("Warp Stall Sampling (All Samples)"),
                        executed=f("Instructions Executed"), stalls={h[6:]: f(h) for h in stall}))
    return ins


def loops(ins):
    addrs = {x["addr"] for x in ins}
    out = set()
    for x in ins:
        m = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", x["sass"])
        if m and int(m.group(1), 16) < x["addr"] and int(m.group(1), 16) in addrs:
            out.add((int(m.group(1), 16), x["addr"]))
    return sorted(out)


def _leading(stalls, tot, n):
    return {k: round(v / tot, 4) for k, v in sorted(stalls.items(), key=lambda kv: -kv[1])[:n]}


def summary(path, top=20):
    ins = read(path)
    tot = sum(x["samples"] for x in ins) or 1.0
    base = min(x["addr"] for x in ins)
    res = dict(samples=tot, instructions=len(ins), loops=[], top=[])
    for lo, hi in loops(ins):
        sel = [x for x in ins if lo <= x["addr"] <= hi]
        s = sum(x["samples"] for x in sel)
        if s / tot <= 0.01:
            continue
        agg = defaultdict(float)
        for x in sel:
            for k, v in x["stalls"].items():
                agg[k] += v
        res["loops"].append(dict(offset=hex(lo - base), instructions=len(sel), share=round(s / tot, 4),
                                 stalls=_leading(agg, tot, 8)))
    for x in sorted(ins, key=lambda x: -x["samples"])[:top]:
        res["top"].append(dict(offset=hex(x["addr"] - base), sass=x["sass"][:70], share=round(x["samples"] / tot, 4),
                               executed=x["executed"], stalls=_leading(x["stalls"], tot, 3)))
    return res


if __name__ == "__main__":
    args = sys.argv[1:]
    out = args[args.index("--json") + 1] if "--json" in args else None
    args = [a for i, a in enumerate(args) if a != "--json" and (i == 0 or args[i - 1] != "--json")]
    res = summary(args[0], int(args[1]) if len(args) > 1 else 20)
    print(f"{res['samples']:.0f} samples over {res['instructions']} instructions")
    for l in res["loops"]:
        print(f"loop +{l['offset']}: {l['instructions']} instructions, {l['share']:.1%} of samples;",
              ", ".join(f"{k} {v:.1%}" for k, v in l["stalls"].items()))
    for x in res["top"]:
        why = ", ".join(f"{k} {v:.1%}" for k, v in x["stalls"].items())
        print(f"+{x['offset']:>7} {x['share']:5.1%} {x['sass']:60s}", why)
    if out:
        json.dump(res, open(out, "w"), indent=1)
