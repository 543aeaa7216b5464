"""sparse_decode sweep: values gathered with the keys (EARLY_V) or after the softmax, block_n, waves, warps; 4 index sets per timed call (L2-cold gathers).
usage: python results/scripts/sparse_decode_early_v.py OUT.json (run F of results/code-topk-fused-h100-session24.json; H100 output there).
Needs part 4 of results/code-topk-fused-session24.patch (kernels/sparse_decode.py, EARLY_V) applied."""
import json, sys, torch, itertools
from triton.testing import do_bench_cudagraph as dbg
from sparsekv.kernels.sparse_decode import sparse_decode
from sparsekv.kernels.reference import sparse_decode_reference
from sparsekv.selection import Selection
from profile_util import sorted_indices, sparse_inputs  # results/scripts/profile_util.py
torch.manual_seed(0)
L = 131072
K, V, q = sparse_inputs(L)
idx = sorted_indices  # the name the loops below use
cases = {"head_2047_w1": (32, 2047, 0, 1), "group_2048_s128_w512": (8, 2048, 128, 512), "group_2047_w1": (8, 2047, 0, 1)}
rows = []
for name, (H, n, sink, win) in cases.items():
    sels = [Selection(L, sink, win, indices=idx(H, n, sink, L - win), padded=False) for _ in range(4)]
    ref = sparse_decode_reference(q, K, V, sels[0], 0.088)
    for ev, bn, waves, nw in itertools.product((False, True), (32, 64), (2, 4, 8), (4, 8)):
        kw = dict(early_v=ev, block_n=bn, waves=waves, num_warps=nw)
        out = sparse_decode(q, K, V, sels[0], 0.088, **kw)
        err = (out.float() - ref.float()).abs().max().item()
        f = lambda: [sparse_decode(q, K, V, s, 0.088, **kw) for s in sels]
        us = dbg(f, rep=100) * 1000 / 4
        r = dict(case=name, **kw, us=round(us, 2), err=err)
        rows.append(r); print(r, flush=True)
json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, open(sys.argv[1], "w"), indent=1)
