"""Per-kernel profile (torch.profiler over CUDA-graph replays) of count select, nearest_k's first form (V0) and packed form (V1).
usage: python results/scripts/code_topk_profile.py OUT.json (run C of results/code-topk-fused-h100-session24.json; H100 output there).
Needs results/code-topk-fused-session24.patch applied (kernels/code_topk.py = V1) and the first form as kernels/code_topk_v0.py."""
import json, sys, torch
from collections import defaultdict
from triton.testing import do_bench_cudagraph as dbg
import sparsekv.kernels.adamas as KA
from sparsekv.kernels import code_topk as V1, code_topk_v0 as V0
torch.manual_seed(0)
def t(f): return round(dbg(f, rep=100) * 1000, 2)
def prof(f, reps=20):
    f(); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        f()
        with torch.cuda.graph(g):
            f()
    torch.cuda.synchronize()
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(reps): g.replay()
        torch.cuda.synchronize()
    acc = defaultdict(float)
    for e in p.events():
        if e.device_type.name == "CUDA":
            acc[e.name[:40]] += e.device_time / reps
    return {k: round(v, 2) for k, v in acc.items() if v > 0.1}
rows = []
for seq in (131072, 32768):
    n = seq - 1; k = 2047
    codes = torch.randint(-32768, 32767, (1, 8, seq, 16), dtype=torch.int16, device="cuda")
    qw = torch.randint(-32768, 32767, (1, 32, 16), dtype=torch.int16, device="cuda")
    for pool in (None, "sum"):
        ref = KA.code_topk(qw, codes, n, 128, k, pool=pool)
        r = dict(seq=seq, pool=pool or "head")
        f = lambda: KA.code_topk(qw, codes, n, 128, k, pool=pool)
        r["count_select"] = (t(f), prof(f))
        f = lambda: V0.nearest_k(qw, codes, n, 128, k, pool=pool)
        r["v0"] = (t(f), prof(f))
        for kw in ({}, dict(_tile=512), dict(_tile=1024), dict(_tile=512, _num_warps=4), dict(_tile=1024, _num_warps=16),
                   dict(_tile=512, _chunk=seq // 32), dict(_tile=512, _chunk=seq // 64)):
            f = lambda: V1.nearest_k(qw, codes, n, 128, k, pool=pool, **kw)
            ok = torch.equal(f(), ref)
            r["v1" + str(kw)] = (t(f), ok, prof(f))
        rows.append(r); print(json.dumps(r), flush=True)
json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, open(sys.argv[1], "w"), indent=1)
