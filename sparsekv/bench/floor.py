"""The memory floor: a decode step cannot finish faster than the bytes it must read over the bandwidth the device
actually delivers. That bandwidth is measured, not taken from a datasheet: a large device-to-device copy (bytes
read + written over the time), which is what a well-written streaming kernel can reach.
"""

from __future__ import annotations

import statistics
import time

import torch

GPU_COPY_BYTES = 1 << 30  # >= 1 GiB: far beyond L2, long enough that launch cost vanishes
CPU_COPY_BYTES = 1 << 26


def copy_bandwidth(device: torch.device, nbytes: int | None = None, reps: int = 20) -> dict:
    """Measured copy bandwidth: {"GBps", "bytes", "us", "method"}; GB/s counts bytes read + written."""
    nbytes = nbytes or (GPU_COPY_BYTES if device.type == "cuda" else CPU_COPY_BYTES)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for start, end in events:
            start.record()
            dst.copy_(src)
            end.record()
        torch.cuda.synchronize(device)
        us = statistics.median(s.elapsed_time(e) * 1e3 for s, e in events)
        how = "device-to-device copy_, CUDA events, median"
    else:
        times = []
        for _ in range(max(3, reps // 4)):
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append((time.perf_counter() - t0) * 1e6)
        us = statistics.median(times)
        how = "host memory copy_, perf_counter, median"
    del src, dst
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"GBps": 2 * nbytes / (us * 1e3), "bytes": nbytes, "us": us, "method": how}


def floor_us(bytes_read: int, gbps: float) -> float:
    """Microseconds to read `bytes_read` at `gbps` GB/s."""
    return bytes_read / (gbps * 1e3)
