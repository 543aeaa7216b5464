"""count_select before/after the runtime masked-lane offset in `_scatter_offsets` (session 8), on Adamas code
distances (8 rows, k 2047). Needs CUDA and a copy of the old module as sparsekv/kernels/count_select_old.py
(`git show c0bf871:kernels/count_select.py > kernels/count_select_old.py`). Usage: python THIS OUT.json"""
import json, sys, torch
from triton.testing import do_bench_cudagraph
from sparsekv.kernels.adamas import quantize_pack, quantize_pack_into, code_distance
from sparsekv.kernels import count_select as NEW, count_select_old as OLD
dev = "cuda"
res = {"device": torch.cuda.get_device_name(), "rows": []}
def ref(d, k):
    n = d.shape[-1]
    return torch.topk(-(d.long() * n + torch.arange(n, device=dev)), k, dim=-1).indices.sort(-1).values
for L in (131072, 32768):
    torch.manual_seed(0)
    K = torch.randn(1, 8, L, 128, device=dev, dtype=torch.bfloat16)
    q = torch.randn(1, 32, 1, 128, device=dev, dtype=torch.bfloat16)
    thr = torch.tensor([[-1., 0., 1.]] * 8, device=dev)
    codes = torch.empty(1, 8, L, 16, dtype=torch.int16, device=dev)
    quantize_pack_into(K, thr, codes, 0); del K
    qw = quantize_pack(q, thr)
    n, k = L - 1, 2047
    dist = code_distance(qw, codes, n, 128, pool="sum")
    want = ref(dist, k).view(8, k)
    d16 = dist.to(torch.int16).view(8, n)
    for rep in range(2):
        for name, mod in (("before", OLD), ("after", NEW)):
            f = lambda: mod.smallest_k(d16, k, 1535)
            ok = bool(torch.equal(f(), want))
            r = dict(L=L, rows=8, k=k, what=name, us=do_bench_cudagraph(f, rep=200) * 1e3, exact=ok, rep=rep)
            res["rows"].append(r); print(r, flush=True)
json.dump(res, open(sys.argv[1], "w"), indent=1)
