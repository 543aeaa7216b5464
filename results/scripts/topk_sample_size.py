"""Session 22: the bound's sample size. S = 4096 instead of the plan's 8192 (32 x 131072, k 2048): the bound's search
holds 16 keys a thread instead of 32. With J at z = 5 deviations its candidates often overflow CAP = 4096, so: z = 4 /
4.5, or CAP = 8192. Per variant and row kind: CUDA-graph time over 4 rotated inputs (each call checked against the
reference), then how many of 1024 fresh rows take a fallback (C < k: too few candidates; C > CAP: too many), read
from the kernel's per-chunk candidate counts.

    python results/scripts/topk_sample_size.py OUT.json "[{}, dict(_sample=4096, _z=4.0)]"

Needs CUDA."""
import json, sys, time, torch
import sparsekv.kernels.topk as B
sys.path.insert(0, "results/scripts")
from topk_row_kinds import KINDS, candidate_counts, time_rows  # noqa: E402
OUT = sys.argv[1]; t0 = time.time()
VARS = eval(sys.argv[2])
res = dict(device=torch.cuda.get_device_name(), rows=[], fallbacks=[])
def save(): json.dump(res, open(OUT, "w"), indent=1)
FNS = [("library", B.topk, v) for v in VARS]
for d in KINDS:
    time_rows(d, 32, 131072, 2048, torch.float32, FNS, 1, res["rows"], t0, save)
    for kw in VARS:
        plan = B._plan(131072, 2048, 32, B.num_sms(torch.device("cuda")), None, kw.get("_tile"), kw.get("_cap"),
                       kw.get("_sample"), kw.get("_z"))  # None: the plan's own z (5 until session 23)
        c = candidate_counts(B, kw, d, plan, 1024)
        few = int((c < 2048).sum()); many = int((c > plan["cap"]).sum())
        res["fallbacks"].append(dict(dist=d, kw=str(kw), rows=1024, too_few=few, too_many=many, cap=plan["cap"],
                                     s=plan["s"], j=plan["j"], j_hi=plan["j_hi"]))
        print(res["fallbacks"][-1], flush=True)
    save()
