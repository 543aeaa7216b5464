"""Top-k over long score rows, alone: our two select paths (`sparsekv.kernels.topk`: the one-launch fused kernel
and the multi-launch radix select) against `torch.topk`.

The rows are what a decode step ranks for oracle-style selection with per-head pooling: one fp32 row of `seq`
scores per (batch row, query head), k = the keys the budget leaves after sink and window.
"""

from __future__ import annotations

import torch

from .timing import plan_rotation, time_steps

SCORE_DTYPE = torch.float32


def topk_rows(rows: int, n: int, k: int, device: torch.device, copy_gbps: float, seed: int = 0) -> list[dict]:
    g = torch.Generator(device=device).manual_seed(seed)
    scores = torch.randn(rows, n, generator=g, dtype=SCORE_DTYPE, device=device)
    nbytes = scores.numel() * scores.element_size()
    count, how = plan_rotation(nbytes, nbytes, device)
    xs = [scores] + [torch.randn_like(scores) for _ in range(count - 1)]
    ops = [("torch.topk", "torch", lambda s: torch.topk(s, k, dim=-1, sorted=False).indices)]
    if device.type == "cuda":
        try:
            from sparsekv.kernels.topk import TopkConfig, topk

            fused, radix = TopkConfig(path="fused"), TopkConfig(path="radix")
            ops[:0] = [("fused topk", "triton", lambda s: topk(s, k, config=fused)),
                       ("radix topk", "triton", lambda s: topk(s, k, config=radix))]
        except Exception as e:  # kernels not importable: torch.topk alone, and the reason
            ops.insert(0, ("topk kernels", f"unavailable: {type(e).__name__}: {e}"[:200], None))
    out = []
    for name, kernel, fn in ops:
        row = {"op": name, "kernel": kernel, "rows": rows, "n": n, "k": k, "dtype": "float32", "bytes_read": nbytes}
        if fn is not None:
            t = time_steps([(lambda s=s, fn=fn: fn(s)) for s in xs], device, flush=how.startswith("flush"), l2=how)
            row.update(us=t.us, us_graph=t.graph_us, us_eager=t.eager_us, GBps=nbytes / (t.us * 1e3),
                       pct_copy_bw=100 * nbytes / (t.us * 1e3) / copy_gbps, timing=t.to_dict())
        out.append(row)
    base = next((r["us"] for r in out if r["op"] == "torch.topk" and "us" in r), None)
    for r in out:
        if "us" in r and base:
            r["speedup_vs_torch"] = base / r["us"]
    del xs, scores
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out
