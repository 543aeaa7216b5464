"""Per-row critical path of the fused top-k (session-19 experimental copy, 32 x 131072 fp32, k 2048): which phase makes
the slowest of the 32 rows slow, since the call ends with its last row.

    git show 08d3d27:kernels/topk.py > kernels/topk_x.py && patch -p1 kernels/topk_x.py < results/topk-session19-experiments.patch
    python results/scripts/topk_row_trace.py OUT.json "[dict(), dict(_sf=32)]" same|rot

`same`: one input traced 8 times (the first 3 dropped; L2-warm), medians per row over the calls, then the rows sorted
by their end, plus the call with the bound given (`_lbs`, 2.012). `rot`: four inputs in turn (L2-cold data, as the
timings; the small counters stay in L2), 12 traced calls, per call the slowest and the median row. Times are µs
from the first program's start (globaltimer, 0.256 µs steps); `b_rounds` / `s_rounds` count the bound's and the
select's search rounds. Needs CUDA. Produced results/topk-session19-h100.json ("row_trace_*")."""
import json, sys, struct, torch
import sparsekv.kernels.topk_x as T

dev = "cuda"
VARS = eval(sys.argv[2])
MODE = sys.argv[3] if len(sys.argv) > 3 else "same"
P = 4  # programs a row on the H100 (132 SMs, 32 rows)
us = lambda v: round(float(v) / 1e3, 2)


def rows_of(buf):
    t = buf.view(-1, 32)[:32 * P].double()
    t0 = t[:, 0].min()
    rows = []
    for r in range(32):
        g = t[r * P:(r + 1) * P]
        sel = g[g[:, 6] == 1][0]
        b = g[g[:, 5] == 1]
        rows.append(dict(row=r, sample=us(b[0, 9] - t0) if len(b) else None,
                         searched=us(b[0, 10] - t0) if len(b) else None, known_max=us(g[:, 1].max() - t0),
                         compact_max=us(g[:, 2].max() - t0), gathered=us(sel[4] - t0), search=us(sel[7] - t0),
                         end=us(sel[3] - t0), b_rounds=int(b[0, 12]) if len(b) else None, s_rounds=int(sel[13])))
    return rows


torch.manual_seed(0)
xs = [torch.randn(32, 131072, device=dev) for _ in range(4 if MODE == "rot" else 1)]
buf = torch.zeros(32 * 64 * 32, dtype=torch.int64, device=dev)
res = []
extra = [dict(_lbs=struct.unpack("<i", struct.pack("<f", 2.012))[0])] if MODE == "same" else []
for kw in VARS + extra:
    calls = []
    for rep in range(16 if MODE == "rot" else 8):
        buf.zero_()
        T.topk(xs[rep % len(xs)], 2048, _path="fused", _trace=buf, **kw)
        torch.cuda.synchronize()
        if rep >= (4 if MODE == "rot" else 3):
            calls.append((rep % len(xs), rows_of(buf)))
    if MODE == "rot":
        out = dict(kw=str(kw), mode=MODE, calls=[])
        for inp, rows in calls:
            rows.sort(key=lambda d: -d["end"])
            out["calls"].append(dict(input=inp, slowest=rows[0], second=rows[1], median=rows[16]))
    else:  # per row, the median over the calls; rows sorted by end
        med = []
        for r in range(32):
            d = dict(row=r)
            for k_ in calls[0][1][0]:
                if k_ != "row":
                    vals = sorted(c[1][r][k_] for c in calls if c[1][r][k_] is not None)
                    d[k_] = vals[len(vals) // 2] if vals else None
            med.append(d)
        med.sort(key=lambda d: -d["end"])
        out = dict(kw=str(kw), mode=MODE, slowest=med[:6], median_row=med[16], fastest=med[-1],
                   end_per_call=[max(r_["end"] for r_ in c[1]) for c in calls])
    res.append(out)
    print(json.dumps(out)[:2000], flush=True)
json.dump(res, open(sys.argv[1], "w"), indent=1)
