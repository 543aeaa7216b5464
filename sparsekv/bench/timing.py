"""Time a step two ways on a GPU, CUDA-graph replay and eager, both with CUDA events and the median; on a CPU,
perf_counter.

Graph replay shows what the kernels cost once launch overhead is gone (how a serving stack runs decode); eager
shows what a plain PyTorch loop pays. Either way the step reads memory that must not still sit in L2 from the
previous run (H100: 50 MB), or the benchmark times the cache rather than HBM: when the step reads less than a few
L2s, the caller passes several copies of its inputs and the runs rotate among them; when the copies would not fit
in memory, the L2 is flushed before each timed run instead (outside the events).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

import torch

H100_L2_BYTES = 50 * 2**20
ROTATE_FACTOR = 4  # rotated copies together read this many L2s, so a copy is evicted before its next run
TARGET_S = 0.25  # time spent per measurement (graph and eager each)
MIN_STEPS_PER_GRAPH = 8  # steps captured per graph, so one graph launch is spread over several steps


@dataclass
class Timing:
    """Microseconds per step. `us` is the headline: graph replay when it worked, else eager (or CPU)."""

    us: float
    graph_us: float | None
    eager_us: float
    graph_p10_us: float | None = None
    graph_p90_us: float | None = None
    timer: str = ""
    runs: int = 0  # timed graph replays (GPU) or calls (CPU)
    steps_per_run: int = 1
    buffers: int = 1
    l2: str = ""
    graph_error: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def l2_bytes(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or H100_L2_BYTES)


def plan_rotation(working_set: int, copy_bytes: int, device: torch.device, memory_fraction: float = 0.6
                  ) -> tuple[int, str]:
    """(copies of the inputs to rotate among, how L2 is kept out of the timing) for a step that reads
    `working_set` bytes, where one more copy of its inputs costs `copy_bytes` of device memory."""
    if device.type != "cuda":
        return 1, "n/a (cpu)"
    l2 = l2_bytes(device)
    if working_set >= 2 * l2:
        return 1, f"working set {working_set / 2**20:.0f} MiB > 2x L2"
    want = max(2, math.ceil(ROTATE_FACTOR * l2 / max(working_set, 1)))
    free = torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    can = 1 + int(memory_fraction * free // max(copy_bytes, 1))
    if want <= can:
        return want, f"rotate {want} copies ({want * working_set / 2**20:.0f} MiB read per cycle)"
    return 1, f"flush L2 before each run ({want} copies would not fit in memory)"


def time_steps(fns: Sequence[Callable[[], object]], device: torch.device, flush: bool = False,
               graph: bool = True, target_s: float = TARGET_S, l2: str = "") -> Timing:
    """Time one step; call i runs fns[i % len(fns)] (the rotated copies). `flush`: zero a buffer larger than L2
    before each timed run (then each graph holds one step)."""
    if device.type != "cuda":
        return _time_cpu(fns, target_s)
    est = _estimate(fns, device)
    flush_buf = torch.empty(max(256 * 2**20, 4 * l2_bytes(device)), dtype=torch.uint8, device=device) if flush else None
    eager = _eager(fns, est, flush_buf, target_s)
    g = g10 = g90 = None
    err = None
    runs, inner = 0, 1
    if graph:
        try:
            inner = 1 if flush else len(fns) * max(1, math.ceil(MIN_STEPS_PER_GRAPH / len(fns)))
            runs = int(min(200, max(10, target_s / max(est * inner, 1e-7))))
            g, g10, g90 = _graph(fns, inner, runs, flush_buf, device)
        except Exception as e:  # a step that syncs with the host (or allocates oddly) cannot be captured
            try:
                torch.cuda.synchronize(device)
            except Exception:  # a broken capture can leave an error pending: it was reported above
                pass
            err = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]
    del flush_buf
    return Timing(us=g if g is not None else eager, graph_us=g, eager_us=eager, graph_p10_us=g10, graph_p90_us=g90,
                  timer="cuda-graph+cuda-events" if g is not None else "cuda-events", runs=runs, steps_per_run=inner,
                  buffers=len(fns), l2=l2, graph_error=err)


def _estimate(fns, device) -> float:
    """Seconds per step, from a synchronised eager pass (after one warm-up pass that compiles kernels)."""
    for f in fns:
        f()
    torch.cuda.synchronize(device)
    n = max(3, len(fns))
    t0 = time.perf_counter()
    for i in range(n):
        fns[i % len(fns)]()
    torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) / n


def _eager(fns, est, flush_buf, target_s) -> float:
    reps = int(min(1000, max(20, target_s / max(est, 1e-7))))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for i, (start, end) in enumerate(events):
        if flush_buf is not None:
            flush_buf.zero_()
        start.record()
        fns[i % len(fns)]()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in events)


def _graph(fns, inner, runs, flush_buf, device):
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up on a side stream before capture, as torch.cuda.graphs asks
        for f in fns:
            f()
    torch.cuda.current_stream(device).wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(inner):
            fns[i % len(fns)]()
    g.replay()
    torch.cuda.synchronize(device)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(runs)]
    for start, end in events:
        if flush_buf is not None:
            flush_buf.zero_()
        start.record()
        g.replay()
        end.record()
    torch.cuda.synchronize(device)
    per_step = sorted(s.elapsed_time(e) * 1e3 / inner for s, e in events)
    del g
    return statistics.median(per_step), _pct(per_step, 0.1), _pct(per_step, 0.9)


def _time_cpu(fns, target_s) -> Timing:
    for f in fns:
        f()
    t0 = time.perf_counter()
    fns[0]()
    est = time.perf_counter() - t0
    reps = int(min(200, max(5, target_s / max(est, 1e-7))))
    times = []
    for i in range(reps):
        t0 = time.perf_counter()
        fns[i % len(fns)]()
        times.append((time.perf_counter() - t0) * 1e6)
    us = statistics.median(times)
    return Timing(us=us, graph_us=None, eager_us=us, timer="cpu-perf_counter", runs=reps, buffers=len(fns),
                  l2="n/a (cpu)")


def _pct(sorted_vals: list[float], p: float) -> float:
    return sorted_vals[min(len(sorted_vals) - 1, int(p * len(sorted_vals)))]
