"""Helpers of the session-24 scripts (they import it from this folder): t (do_bench_cudagraph, µs), prof (torch.profiler:
µs per kernel name per CUDA-graph replay; runs C and D kept 40 characters of each name, later runs 60) and their inputs."""
import torch
from collections import defaultdict
from triton.testing import do_bench_cudagraph as dbg
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


def code_inputs(seq, words=16):
    """Random code words at the llama3-8b shape: (n = seq - 1 keys, k = 2047, key words [1, 8, seq, words], query
    words [1, 32, words]); 16 words = 2-bit codes of d 128, 8 = 1-bit."""
    codes = torch.randint(-32768, 32767, (1, 8, seq, words), dtype=torch.int16, device="cuda")
    qw = torch.randint(-32768, 32767, (1, 32, words), dtype=torch.int16, device="cuda")
    return seq - 1, 2047, codes, qw


def sparse_inputs(L=131072):
    """bf16 K, V [1, 8, L, 128] and q [1, 32, 1, 128] (torch.randn)."""
    K = torch.randn(1, 8, L, 128, dtype=torch.bfloat16, device="cuda")
    V = torch.randn(1, 8, L, 128, dtype=torch.bfloat16, device="cuda")
    q = torch.randn(1, 32, 1, 128, dtype=torch.bfloat16, device="cuda")
    return K, V, q


def sorted_indices(H, n, lo, hi):
    """n distinct sorted positions in [lo, hi) per head: [1, H, n]."""
    return torch.sort(torch.stack([torch.randperm(hi - lo, device="cuda")[:n] + lo for _ in range(H)])[None], -1).values
