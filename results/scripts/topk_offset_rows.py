"""The fused top-k on rows whose values sit away from zero (key-space fifths waste rounds there): committed kernel vs
the session-18 copy with the bound's search started from the sample's [min, max] (_bmm) and value-space fifths (_vs).

    git show 08d3d27:kernels/topk.py > kernels/topk_x.py && patch -p1 kernels/topk_x.py < results/topk-session18-experiments.patch
    python results/scripts/topk_offset_rows.py OUT.json ["[dict(_bmm=True), ...]"]

32 x 131072, k 2048; CUDA-graph timings over 4 rotated inputs, each checked against the reference. Needs CUDA.
Produced results/topk-session18-h100.json ("offset_rows_f": the first form, 5 row kinds; "offset_rows_g")."""
import json, sys, torch
from triton.testing import do_bench_cudagraph
import sparsekv.kernels.topk as B
import sparsekv.kernels.topk_x as T
from sparsekv.kernels.reference import topk_reference
sys.path.insert(0, "results/scripts")
from topk_row_kinds import KINDS, gen  # noqa: E402
dev = "cuda"
res = dict(device=torch.cuda.get_device_name(), rows=[])
VARS = eval(sys.argv[2]) if len(sys.argv) > 2 else [{}, dict(_bmm=True), dict(_bmm=True, _vs=True)]
for d in KINDS:
    torch.manual_seed(0)
    xs = [gen(d) for _ in range(4)]
    refs = [topk_reference(x, 2048) for x in xs]
    for name, fn, kw in [("committed", B.topk, {})] + [("x", T.topk, v) for v in VARS]:
        ok = all(torch.equal(fn(x, 2048, _path="fused", **kw), r) for x, r in zip(xs, refs))
        def run():
            for x in xs: fn(x, 2048, _path="fused", **kw)
        us = do_bench_cudagraph(run, rep=200) * 1e3 / 4
        r = dict(dist=d, kernel=name, kw=str(kw), exact=ok, us_rot=round(us, 2)); res["rows"].append(r); print(r, flush=True)
json.dump(res, open(sys.argv[1], "w"), indent=1)
