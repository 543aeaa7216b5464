"""Per-kernel profile (torch.profiler over CUDA-graph replays) of count select, nearest_k's first form (V0) and packed form (V1).
usage: python results/scripts/code_topk_profile.py OUT.json (run C of results/code-topk-fused-h100-session24.json; H100 output there).
Needs results/code-topk-fused-session24.patch applied (kernels/code_topk.py = V1) and the first form as kernels/code_topk_v0.py."""
import json, sys, torch
import sparsekv.kernels.adamas as KA
from sparsekv.kernels import code_topk as V1, code_topk_v0 as V0
from profile_util import t, prof, code_inputs  # results/scripts/profile_util.py
torch.manual_seed(0)
rows = []
for seq in (131072, 32768):
    n, k, codes, qw = code_inputs(seq)
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
