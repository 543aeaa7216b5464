"""The fused top-k on tie-heavy long rows against the radix path and torch.topk (32 x 131072, k 2048, CUDA-graph
replay over 4 inputs), beside an earlier copy of the kernel as sparsekv.kernels.topk_x
(`git show f6e0961:kernels/topk.py > kernels/topk_x.py` gives session 9's "before"). Needs CUDA.

    python results/scripts/topk_ties.py OUT.json randn,int3,int40,int600,negdist,halfsteps,const,bf16int

Produced results/topk-ties-h100-session9.json."""
import json, sys, torch
from triton.testing import do_bench_cudagraph
import sparsekv.kernels.topk as A, sparsekv.kernels.topk_x as B
from sparsekv.kernels.reference import topk_reference
dev = "cuda"; out = {"device": torch.cuda.get_device_name(), "rows": []}
def rot(fns):
    def run():
        for f in fns: f()
    return do_bench_cudagraph(run, rep=100) * 1e3 / len(fns)
def gen(d, g):
    n = 131072
    if d == "randn": return torch.randn(32, n, device=dev, generator=g)
    if d.startswith("int"): return torch.randint(0, int(d[3:]), (32, n), device=dev, generator=g).float()
    if d == "negdist":  # Adamas-like pooled L1 code distances, the nearest largest
        return -torch.randint(0, 385, (32, n), device=dev, generator=g).float()
    if d == "const": return torch.ones(32, n, device=dev)
    if d == "bf16int": return torch.randint(0, 40, (32, n), device=dev, generator=g).bfloat16()
    if d == "halfsteps": return torch.randint(0, 5000, (32, n), device=dev, generator=g).float() * 0.5
for d in sys.argv[2].split(","):
    g = torch.Generator(device=dev).manual_seed(0)
    xs = [gen(d, g) for _ in range(4)]
    refs = [topk_reference(x, 2048) for x in xs]
    row = dict(dist=d)
    row["exact_after"] = all(torch.equal(A.topk(x, 2048, _path="fused"), r) for x, r in zip(xs, refs))
    row["exact_before"] = all(torch.equal(B.topk(x, 2048, _path="fused"), r) for x, r in zip(xs, refs))
    row["exact_radix"] = all(torch.equal(A.topk(x, 2048, _path="radix"), r) for x, r in zip(xs, refs))
    row["torch_topk"] = rot([lambda x=x: torch.topk(x, 2048) for x in xs])
    row["radix"] = rot([lambda x=x: A.topk(x, 2048, _path="radix") for x in xs])
    row["fused_before"] = rot([lambda x=x: B.topk(x, 2048, _path="fused") for x in xs])
    row["fused_after"] = rot([lambda x=x: A.topk(x, 2048, _path="fused") for x in xs])
    out["rows"].append(row); print(row, flush=True)
    json.dump(out, open(sys.argv[1], "w"), indent=1)
