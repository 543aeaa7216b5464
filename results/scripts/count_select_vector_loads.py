"""code_topk with count select before / after vector loads (run I of results/code-topk-fused-h100-session24.json; H100 output there).
usage: python results/scripts/count_select_vector_loads.py OUT.json. Needs results/count-select-vector-loads-session24.patch applied and the committed kernels/count_select.py copied to kernels/count_select_before.py."""
import json, sys, torch
import sparsekv.kernels.adamas as KA
from sparsekv.kernels import count_select_before as OLD
from profile_util import t, prof, code_inputs  # results/scripts/profile_util.py
torch.manual_seed(0)
rows = []
for seq in (131072, 32768):
    n, k, codes, qw = code_inputs(seq)
    for pool in (None, "sum"):
        vmax = KA._max_distance(128, 2, "l1", 4 if pool else 1)
        def old():
            d = KA._launch_distance(qw, codes, n, 128, 2, "l1", pool, torch.int16, False, None, 4)
            return OLD.smallest_k(d, k, vmax)
        new = lambda: KA.code_topk(qw, codes, n, 128, k, pool=pool)
        same = torch.equal(old(), new())
        r = dict(seq=seq, pool=pool or "head", same=same, before=(t(old), prof(old)), after=(t(new), prof(new)),
                 before_again=t(old), after_again=t(new))
        rows.append(r); print(json.dumps(r), flush=True)
json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, open(sys.argv[1], "w"), indent=1)
