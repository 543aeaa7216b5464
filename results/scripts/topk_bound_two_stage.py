"""Session 22: the bound in two stages (the experimental copy's `_b2`: the first rounds on half the sample bracket
the full sample's J-th key, `_b2` deviations of the halves' split wide; one count of the full sample checks it; the
full sample's rounds finish) against the library, 32 x 131072 fp32, k 2048 on the seven row kinds; CUDA-graph timings
over 4 rotated inputs, each checked against the reference; traces of one randn input (L2-warm).

    git show 1e227d4:kernels/topk.py > kernels/topk_x.py && patch -p1 kernels/topk_x.py < results/topk-session22-experiments.patch
    python results/scripts/topk_bound_two_stage.py OUT.json "[dict(_b2=4.0), dict(_b2=3.0)]"

Needs CUDA."""
import json, sys, time, torch
import sparsekv.kernels.topk as B
import sparsekv.kernels.topk_x as T
sys.path.insert(0, "results/scripts")
from topk_row_kinds import KINDS, time_rows, trace_rows  # noqa: E402
OUT = sys.argv[1]; t0 = time.time()
res = dict(device=torch.cuda.get_device_name(), rows=[], traces=[])
def save(): json.dump(res, open(OUT, "w"), indent=1)
FNS = [("library", B.topk, {})] + [("x", T.topk, v) for v in eval(sys.argv[2])]
for d in KINDS:
    time_rows(d, 32, 131072, 2048, torch.float32, FNS, 2 if d == "randn" else 1, res["rows"], t0, save)
torch.manual_seed(0)
x = torch.randn(32, 131072, device="cuda")
for name, fn, kw in FNS:
    res["traces"].append(dict(kernel=name, kw=str(kw), **trace_rows(fn, kw, x, 2048, 4)))
    print(res["traces"][-1], flush=True); save()
