"""Phase timeline of the fused top-k (32 x 131072 fp32, k 2048) from the session-18 experimental copy, and its time
with the row's bound given (no sample, no search): what the bound costs on the critical path.

    git show 08d3d27:kernels/topk.py > kernels/topk_x.py && patch -p1 kernels/topk_x.py < results/topk-session18-experiments.patch
    python results/scripts/topk_phase_trace.py OUT.json "[dict(), dict(_bmm=True, _vs=True)]"

Per traced call (globaltimer, 32 slots per program; medians over the programs, then the median of 5 calls after one
warm-up): bound program: `ticket` (its sample's loads issued), `sample` (a sum over the sample: the loads are back),
`b_round_t` (end of each search round), `searched`; every program: `known` (the bound read), `compact`; the
selecting program: `gathered`, `s_round_t`, `search`, `end`. L2-cold calls follow a 96 MB write; warm ones do not.
The trace's own stores and sum change the code around the sample (ptxas then issues 4 of its 8 vector loads before
the first key conversion instead of all 8), so read its bound phases as indicative. Then CUDA-graph timings over 4
rotated inputs (`us_rot`). The fixed bound is 2.012 (~2900 candidates a row on randn; exact). Needs CUDA.
Produced results/topk-session18-h100.json ("trace_*" runs; earlier runs of the session used earlier forms of this
script: 16 slots per program, no round times, unif rows too)."""
import json, os, sys, torch
import sparsekv.kernels.topk_x as T
dev = "cuda"
FL = torch.empty(96 << 20, dtype=torch.uint8, device=dev)
res = []
def tr(x, k, cold, **kw):
    rows = x.shape[0]
    buf = torch.zeros(rows * 64 * 32, dtype=torch.int64, device=dev)
    out = []
    for rep in range(6):
        buf.zero_()
        if cold: FL.zero_()
        torch.cuda.synchronize()
        T.topk(x, k, _path="fused", _trace=buf, **kw); torch.cuda.synchronize()
        t = buf.view(-1, 32); t = t[t[:, 0] > 0].double()
        t0 = t[:, 0].min()
        b = t[t[:, 5] == 1]
        sel = t[t[:, 6] == 1]
        m = lambda v: round(float(v.median()) / 1e3, 2)
        out.append(dict(start_spread=round(float((t[:, 0] - t0).max()) / 1e3, 2), b_start=m(b[:, 0] - t0), ticket=m(b[:, 8] - t0),
                        sample=m(b[:, 9] - t0), searched=m(b[:, 10] - t0), known=m(t[:, 1] - t0), compact=m(t[:, 2] - t0),
                        compact_max=round(float((t[:, 2] - t0).max()) / 1e3, 2), sel_start=m(sel[:, 2] - t0),
                        b_round_t=[m(b[:, 16 + i] - t0) if (b[:, 16 + i] > 0).all() else None for i in range(8)],
                        s_round_t=[m(sel[:, 24 + i] - t0) if (sel[:, 24 + i] > 0).all() else None for i in range(8)],
                        gathered=m(sel[:, 4] - t0), b_rounds=m(b[:, 12] * 1e3), s_rounds=m(sel[:, 13] * 1e3), search=m(sel[:, 7] - t0), end=round(float((sel[:, 3] - t0).max()) / 1e3, 2)))
    keys = out[0].keys()
    med = lambda vals: round(sorted(vals)[len(vals) // 2], 2)
    return {k_: ([med([o[k_][i] for o in out[1:]]) if all(o[k_][i] is not None for o in out[1:]) else None
                  for i in range(8)] if isinstance(out[0][k_], list) else med([o[k_] for o in out[1:]])) for k_ in keys}
VARS = eval(sys.argv[2]) if len(sys.argv) > 2 else [dict()]
for dist in ("randn",):
    torch.manual_seed(0)
    x = torch.randn(32, 131072, device=dev)
    for kw in VARS:
        for cold in (True, False):
            r = dict(dist=dist, kw=str(kw), cold=cold, **tr(x, 2048, cold, **kw)); res.append(r); print(r, flush=True)
json.dump(res, open(sys.argv[1], "w"), indent=1)
# the bound given: streaming + select alone
import struct
v = 2.012
s = struct.unpack("<i", struct.pack("<f", v))[0]
torch.manual_seed(0)
x = torch.randn(32, 131072, device=dev)
from sparsekv.kernels.reference import topk_reference
print("fixed-bound exact", torch.equal(T.topk(x, 2048, _path="fused", _lbs=s), topk_reference(x, 2048)))
for cold in (True, False):
    r = dict(dist="randn", kw="fixed bound 2.012", cold=cold, **tr(x, 2048, cold, _lbs=s)); res.append(r); print(r, flush=True)
from triton.testing import do_bench_cudagraph
xs = [torch.randn(32, 131072, device=dev) for _ in range(4)]
def rot(**kw):
    def run():
        for x_ in xs: T.topk(x_, 2048, _path="fused", **kw)
    return do_bench_cudagraph(run, rep=200) * 1e3 / 4
for kw in [dict(), dict(_lbs=s)] + VARS:
    r = dict(kw=str(kw), us_rot=round(rot(**kw), 2)); res.append(r); print(r, flush=True)
json.dump(res, open(sys.argv[1], "w"), indent=1)
