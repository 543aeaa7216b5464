"""code_topk.nearest_k (first form: one scan per row per tile) against code_topk (count select): exactness, timings, knobs.
usage: python results/scripts/code_topk_check.py OUT.json (run B of results/code-topk-fused-h100-session24.json; H100 output there).
Needs kernels/code_topk.py of that first form (described in the JSON; the patch holds the later, packed form)."""
import json, sys, torch
import sparsekv.kernels.adamas as KA
from sparsekv.kernels.code_topk import nearest_k
from profile_util import t, code_inputs  # results/scripts/profile_util.py
torch.manual_seed(0)
rows = []
for seq in (32768, 131072):
    n, k, codes, qw = code_inputs(seq)
    c1, q1 = code_inputs(seq, 8)[2:]
    for pool in (None, "sum"):
        ref = KA.code_topk(qw, codes, n, 128, k, pool=pool)
        r = dict(seq=seq, pool=pool or "head", count_select=t(lambda: KA.code_topk(qw, codes, n, 128, k, pool=pool)))
        for kw in ({}, dict(_window=True), dict(_chunk=4096 if seq > 40000 else 1024), dict(_chunk=16384 if seq > 40000 else 4096),
                   dict(_tile=128), dict(_tile=512), dict(_num_warps=4), dict(_num_warps=16), dict(_z=5.0),
                   dict(_z=-30.0), dict(_z=-30.0, _z2=-30.0), dict(_cap=4096, _cap2=0), dict(_cap=2048, _cap2=0)):
            try:
                got = nearest_k(qw, codes, n, 128, k, pool=pool, **kw)
                ok = torch.equal(got, ref)
                r[str(kw)] = (t(lambda: nearest_k(qw, codes, n, 128, k, pool=pool, **kw)), ok)
            except Exception as e:
                r[str(kw)] = repr(e)[:200]
        ref1 = KA.code_topk(q1, c1, n, 128, k, bits=1, pool=pool)
        r["lsh_count_select"] = t(lambda: KA.code_topk(q1, c1, n, 128, k, bits=1, pool=pool))
        r["lsh_nearest"] = (t(lambda: nearest_k(q1, c1, n, 128, k, bits=1, pool=pool)),
                            torch.equal(nearest_k(q1, c1, n, 128, k, bits=1, pool=pool), ref1))
        rows.append(r); print(r, flush=True)
json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, open(sys.argv[1], "w"), indent=1)
