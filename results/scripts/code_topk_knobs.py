"""nearest_k's packed form with measurement knobs: restream branch off, no CAP2 lanes, select warps, stores / scan left out, chunk, sample.
usage: python results/scripts/code_topk_knobs.py OUT.json (run D of results/code-topk-fused-h100-session24.json; H100 output there).
Needs the patch applied, kernels/code_topk_knobs.py copied to kernels/code_topk_v0.py."""
import json, sys, torch
import sparsekv.kernels.adamas as KA
from sparsekv.kernels import code_topk_v0 as V
from sparsekv.kernels.topk import topk
from profile_util import t, prof, code_inputs  # results/scripts/profile_util.py
torch.manual_seed(0)
rows = []
for seq in (131072,):
    n, k, codes, qw = code_inputs(seq)
    for pool in (None, "sum"):
        ref = KA.code_topk(qw, codes, n, 128, k, pool=pool)
        r = dict(seq=seq, pool=pool or "head")
        for kw in ({}, dict(_second=False), dict(_cap2=0), dict(_second=False, _cap2=0), dict(_swarps=4), dict(_swarps=16),
                   dict(_store=0), dict(_store=1), dict(_chunk=2048, _num_warps=4, _store=0), dict(_chunk=2048, _num_warps=4),
                   dict(_chunk=4096, _num_warps=4), dict(_sample=1024), dict(_sample=2048)):
            f = lambda: V.nearest_k(qw, codes, n, 128, k, pool=pool, **kw)
            ok = torch.equal(f(), ref)
            r["v" + str(kw)] = (t(f), ok, prof(f))
        # the fused top-k on u-bits (VMAX - d) viewed as fp16: contiguous integer keys
        vmax = KA._max_distance(128, 2, "l1", 4 if pool else 1)
        d16 = KA._launch_distance(qw, codes, n, 128, 2, "l1", pool, torch.int16, False, None, 4)
        u = (vmax - d16).view(torch.float16)
        f = lambda: topk(u.view(-1, n), k)
        r["topk_u16"] = (t(f), torch.equal(f().view_as(ref), ref), prof(f))
        rows.append(r); print(json.dumps(r), flush=True)
json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, open(sys.argv[1], "w"), indent=1)
