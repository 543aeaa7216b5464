"""count_select.smallest_k with the sampled window (base + window + emit) against the first design's three histogram
passes, per-kernel times; then code_topk end to end. usage: python results/scripts/count_select_window.py OUT.json
(results/count-select-window-h100.json). The first design is read from .scratch/gpu/count_select_old.py:
    git show 32ab6f4:kernels/count_select.py > .scratch/gpu/count_select_old.py
    sed -i 's/^from .device/from sparsekv.kernels.device/; s/^from .topk/from sparsekv.kernels.topk/' .scratch/gpu/count_select_old.py"""
import json, sys, importlib.util, torch
from torch.profiler import profile, ProfilerActivity
from triton.testing import do_bench_cudagraph as dbg
import sparsekv.kernels.count_select as CS
import sparsekv.kernels.adamas as KA
spec = importlib.util.spec_from_file_location("sparsekv.kernels.count_select_old", ".scratch/gpu/count_select_old.py")
OLD = importlib.util.module_from_spec(spec); spec.loader.exec_module(OLD)
torch.manual_seed(0)
rows = []
def rec(**kw):
    rows.append(kw); print(kw, flush=True)
    json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, open(sys.argv[1], "w"), indent=1)
def per_kernel(f):
    g = torch.cuda.CUDAGraph()
    f(); torch.cuda.synchronize()
    with torch.cuda.graph(g):
        f()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20): g.replay()
        torch.cuda.synchronize()
    return {e.key: round(e.device_time_total / e.count, 2) for e in prof.key_averages() if e.device_time_total > 0}
for R, n, vmax, k in [(32, 131071, 384, 2047), (8, 131071, 1536, 2047), (32, 32767, 384, 2047), (8, 32767, 1536, 2047),
                      (32, 8191, 384, 127), (64, 131071, 384, 2047)]:
    a = torch.randint(0, 4, (R, n, 128), dtype=torch.int8, device="cuda")
    v = (a - torch.randint(0, 4, (R, 1, 128), dtype=torch.int8, device="cuda")).abs().sum(-1, dtype=torch.int32)
    del a
    if vmax > 384:
        v = v * 4 + torch.randint(0, 4, v.shape, device="cuda", dtype=torch.int32)
    v = v.clamp(0, vmax).to(torch.int16)
    ref = torch.sort(torch.sort(v.int() * n + torch.arange(n, device="cuda"), -1).values[:, :k] % n, -1).values
    for name, f in [("old", lambda: OLD.smallest_k(v, k, vmax)), ("window", lambda: CS.smallest_k(v, k, vmax)),
                    ("window, base 4 warps", lambda: CS.smallest_k(v, k, vmax, _base_warps=4)),
                    ("window, base 16 warps", lambda: CS.smallest_k(v, k, vmax, _base_warps=16)),
                    ("window, forced miss", lambda: CS.smallest_k(v, k, vmax, _force_miss=True))]:
        ok = torch.equal(f(), ref)
        rec(rows=R, n=n, vmax=vmax, k=k, what=name, exact=ok, us=dbg(f, rep=100) * 1000,
            per_kernel_us=per_kernel(f) if "miss" not in name else None)
for seq in (131072, 32768):
    n = seq - 1
    codes = torch.randint(-32768, 32767, (1, 8, seq, 16), dtype=torch.int16, device="cuda")
    qw = torch.randint(-32768, 32767, (1, 32, 16), dtype=torch.int16, device="cuda")
    for pool in (None, "sum"):
        f = lambda: KA.code_topk(qw, codes, n, 128, 2047, pool=pool)
        d = KA.code_distance(qw, codes, n, 128, pool=pool)
        d = d.reshape(-1, n)
        ref = torch.sort(torch.sort(d.long() * n + torch.arange(n, device="cuda"), -1).values[:, :2047] % n, -1).values
        rec(seq=seq, pool=pool or "head", what="code_topk", exact=torch.equal(f().reshape(-1, 2047), ref),
            us=dbg(f, rep=100) * 1000, per_kernel_us=per_kernel(f))
