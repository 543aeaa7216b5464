"""SHAPES="[(rows, n, k), ...]" KIND=randn|const|K [CAPS=1] python results/scripts/topk_short_rows.py OUT.json (CUDA).
Top-k on short rows (n <= 16384): the whole-row plan (one program per row, every score a candidate) against the
sampled-bound plan forced by _cap (several programs per row). Exactness against topk_reference on every input."""
import json, sys, torch
from triton.testing import do_bench_cudagraph
from sparsekv.kernels.topk import topk
from sparsekv.kernels.reference import topk_reference
dev = "cuda"
res = {"device": torch.cuda.get_device_name(), "rows": []}
def timed(xs, k, **kw):
    for x in xs:
        assert torch.equal(topk(x, k, **kw), topk_reference(x, k)), (x.shape, k, kw)
    def run():
        for x in xs:
            topk(x, k, **kw)
    return round(do_bench_cudagraph(run, rep=200) * 1e3 / len(xs), 1)
import os
shapes = eval(os.environ.get("SHAPES", "[(32, 8188, 2047), (32, 8192, 128), (9, 8191, 127), (32, 16383, 2047), (8, 8192, 128), (32, 4096, 64), (32, 32768, 2048)]"))
KIND = os.environ.get("KIND", "randn")
for rows, n, k in shapes:
    g = torch.Generator(device=dev).manual_seed(rows * n + k)
    if KIND == "randn":
        xs = [torch.randn(rows, n, device=dev, generator=g) for _ in range(4)]
    elif KIND == "const":
        xs = [torch.full((rows, n), 1.0, device=dev) for _ in range(4)]
    else:  # integer-valued rows in [0, KIND): ties at the k-th value
        xs = [torch.randint(0, int(KIND), (rows, n), device=dev, generator=g).float() for _ in range(4)]
    row = dict(kind=KIND, rows=rows, n=n, k=k, default=timed(xs, k), torch=round(do_bench_cudagraph(lambda: [torch.topk(x, k) for x in xs], rep=200) * 1e3 / 4, 1))
    row["whole_row"] = timed(xs, k, _cap=n)  # every score a candidate (the rule before session 17)
    for cap in (sorted({c for c in (max(256, 2 * k), 4 * k, 8 * k) if c <= 16384}) if os.environ.get("CAPS") else []):
        try:
            row[f"cap{cap}"] = timed(xs, k, _cap=cap)
        except AssertionError as e:
            row[f"cap{cap}"] = f"MISMATCH {e}"
    res["rows"].append(row); print(row, flush=True)
json.dump(res, open(sys.argv[1], "w"), indent=1)
