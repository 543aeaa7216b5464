"""Sweep count_select.smallest_k's chunk / tile / warps over rows x lengths on the GPU (CUDA-graph replay), every
configuration checked exact against a stable sort. usage: python results/scripts/count_select_chunks.py OUT.json
Rows with chunk/tile/warps None time the planner of the checkout it runs on
(results/count-select-chunks-h100.json is its output on the H100 before the 2048-value cap, with device notes)."""
import json, sys, itertools
import torch
from triton.testing import do_bench_cudagraph as dbg
import sparsekv.kernels.count_select as CS

torch.manual_seed(0)
out = []
def ref(v, k):
    s = torch.sort(v.long() * v.shape[-1] + torch.arange(v.shape[-1], device=v.device), dim=-1).values[:, :k]
    return torch.sort(s % v.shape[-1], dim=-1).values
for rows, vmax in ((8, 1536), (32, 384), (64, 384)):
    for n in (8191, 32767, 131071):
        k = min(2047, n // 4)
        # distances like the real ones: sums of uniform 2-bit codes over 128 dims (one query head, vmax 384) or
        # 4 x 128 (a pooled group of 4, vmax 1536): a bell around the middle with a low tail
        dims = vmax // 3
        v = (torch.randint(0, 4, (rows, n, dims), device="cuda", dtype=torch.int8).sum(-1, dtype=torch.int32)
             .clamp(max=vmax).to(torch.int16))
        r = ref(v, k)
        cfgs = [(None, None, None)] + list(itertools.product((1024, 2048, 4096, 8192), (1024, 2048), (4, 8)))
        for ch, tile, nw in cfgs:
            if ch is not None and tile > ch:
                continue
            f = lambda: CS.smallest_k(v, k, vmax, _chunk=ch, _tile=tile, _num_warps=nw)
            ok = torch.equal(f(), r)
            us = dbg(f, rep=60) * 1000
            out.append(dict(rows=rows, n=n, k=k, chunk=ch, tile=tile, warps=nw, us=us, exact=ok))
            print(rows, n, ch, tile, nw, f"{us:.1f}", ok, flush=True)
json.dump({"device": torch.cuda.get_device_name(), "rows": out}, open(sys.argv[1], "w"), indent=1)
