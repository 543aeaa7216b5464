"""Kernel-by-kernel profile of the bench's adamas decode step (llama3-8b, 131072 and 32768, pooling head and group).
usage: python results/scripts/adamas_step_profile.py OUT.json (run E of results/code-topk-fused-h100-session24.json; H100 output there).
No patch needed."""
import json, sys, torch
from profile_util import t, prof  # results/scripts/profile_util.py
torch.manual_seed(0)
from sparsekv.bench.decode_step import DecodeBench, build_index
from sparsekv.bench.shapes import from_name as get_shape
from sparsekv.methods import get_method
rows = []
for seq in (131072, 32768):
    b = DecodeBench(get_shape("llama3-8b"), seq, 1, torch.bfloat16, torch.device("cuda"), 3000.0, {})
    for opts in (dict(), dict(pooling="group")):
        m = get_method("adamas", budget=2048, **opts)
        x = b.base
        x.state = build_index(m, x, b.shape, seq)
        step = b._method_step(m, x)
        step()
        r = dict(seq=seq, opts=opts, us=t(step), kernels=prof(step))
        rows.append(r); print(json.dumps(r), flush=True)
        x.state = None
json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, open(sys.argv[1], "w"), indent=1)
