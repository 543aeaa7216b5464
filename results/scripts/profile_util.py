"""t (do_bench_cudagraph, µs) and prof (torch.profiler: µs per kernel name per CUDA-graph replay), exec-ed by the session-24 scripts."""
import torch
from collections import defaultdict
from triton.testing import do_bench_cudagraph as dbg
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
            acc[e.name[:60]] += e.device_time / reps
    return {k: round(v, 2) for k, v in acc.items() if v > 0.1}
