"""nearest_k, final form (two-operand scan), against code_topk (count select): chunk / warps / bound sub-tile / select warps / caps, per-kernel profile.
usage: python results/scripts/code_topk_sweep.py OUT.json (run G of results/code-topk-fused-h100-session24.json; H100 output there).
Needs results/code-topk-fused-session24.patch applied. Its C_* / over_cap fields read a scratch buffer under the wrong key (rows = KV heads, not the output rows): they are not counts; ignore them."""
import json, sys, torch
import sparsekv.kernels.adamas as KA
from sparsekv.kernels import code_topk as CT
from profile_util import t, prof, code_inputs  # results/scripts/profile_util.py
torch.manual_seed(0)
rows = []
for seq in (131072, 32768):
    n, k, codes, qw = code_inputs(seq)
    for pool in (None, "sum"):
        ref = KA.code_topk(qw, codes, n, 128, k, pool=pool)
        f = lambda: KA.code_topk(qw, codes, n, 128, k, pool=pool)
        r = dict(seq=seq, pool=pool or "head", count_select=(t(f), prof(f)))
        c1, c2 = (seq // 64, seq // 32)
        for kw in ({}, dict(_chunk=c1, _num_warps=4), dict(_chunk=c1, _num_warps=8), dict(_chunk=c2, _num_warps=4),
                   dict(_chunk=c2, _num_warps=8), dict(_chunk=c1, _num_warps=4, _select_warps=16),
                   dict(_chunk=c1, _num_warps=4, _sub=4096), dict(_chunk=c1, _num_warps=4, _sub=4096, _bound_warps=16),
                   dict(_chunk=c1, _num_warps=4, _cap2=0), dict(_chunk=c1, _num_warps=4, _cap=8192, _cap2=0, _select_warps=16)):
            f = lambda: CT.nearest_k(qw, codes, n, 128, k, pool=pool, **kw)
            try:
                ok = torch.equal(f(), ref)
                pl = CT._plan(n, k, 8, 132, False, kw.get("_chunk"), None, kw.get("_cap"), kw.get("_cap2"), None, None, 10.0)
                sc = CT._scratch(torch.device("cuda"), ref.shape[1], pl["p"], pl["chunk"], pl["s"])
                C = sc["cnt"].sum(-1)
                r[str(kw)] = (t(f), ok, prof(f), dict(S=pl["s"], cap=pl["cap"], cap2=pl["cap2"], C_max=int(C.max()), C_min=int(C.min()), over_cap=int((C > pl["cap"]).sum())))
            except Exception as e:
                r[str(kw)] = repr(e)[:300]
        rows.append(r); print(json.dumps(r), flush=True)
json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, open(sys.argv[1], "w"), indent=1)
