"""Top-k tuning on the GPU: exactness checks, CUDA-graph timings and a phase trace of `sparsekv.kernels.topk` or of
an experimental copy of it, beside the committed kernel and torch.topk in the same run.

    python results/scripts/topk_tuning.py OUT.json [sweep|main|dists] [MODULE] ["[VARIANTS]"]

MODULE defaults to sparsekv.kernels.topk_x: the copy that `results/topk-session8-experiments.patch` makes of
kernels/topk.py as of commit c0bf871 (`git show c0bf871:kernels/topk.py > kernels/topk_x.py && patch -p1 kernels/topk_x.py
< results/topk-session8-experiments.patch`), or any edited copy. VARIANTS: a Python list of keyword dicts for its `topk` (the first also runs the 40 checks), e.g.
"[{}, dict(_guide=(1.7, 1.2, 0.85, 0.6))]". `sweep` = checks + five shapes, `main` = the 32 x 131072 fp32 shape only,
`dists` = checks + exponential, uniform and attention-like rows + the main shape. Needs CUDA.
Traces run one input 5 times in a row (L2-warm); with TOPK_TRACE_COLD=1 in the environment every traced call follows a
96 MB write (L2-cold, as the timings are). Produced results/topk-imad-h100-session8.json and, with the session-9 copy
(results/topk-session9-experiments.patch, against kernels/topk.py as of f6e0961), results/topk-session9-h100.json."""
import json, os, sys, time
import torch
from triton.testing import do_bench_cudagraph
import importlib; T = importlib.import_module(sys.argv[3] if len(sys.argv) > 3 else "sparsekv.kernels.topk_x")
topk = T.topk; import sparsekv.kernels.topk as B
from sparsekv.kernels.reference import topk_reference

dev = "cuda"
res = {"device": torch.cuda.get_device_name(), "rows": [], "checks": []}
t0 = time.time()
OUT = sys.argv[1]
def rec(**kw):
    kw["t"] = round(time.time() - t0, 1); res["rows"].append(kw); print(kw, flush=True)
    json.dump(res, open(OUT, "w"), indent=1)

def rotated(fn_list):
    def run():
        for f in fn_list: f()
    return do_bench_cudagraph(run, rep=200) * 1e3 / len(fn_list)

FLUSH = torch.empty(96 << 20, dtype=torch.uint8, device=dev) if os.environ.get("TOPK_TRACE_COLD") == "1" else None

def trace(x, k, **kw):
    rows = x.shape[0]
    tr = torch.zeros(rows * 256 * 8, dtype=torch.int64, device=dev)
    for _ in range(5):
        tr.zero_()
        if FLUSH is not None:  # evict the input from L2
            FLUSH.zero_(); torch.cuda.synchronize()
        topk(x, k, _trace=tr, **kw); torch.cuda.synchronize()
    t = tr.view(-1, 8)
    t = t[t[:, 0] > 0]
    start = t[:, 0].min()
    med = lambda v: round(float(v.float().median()) / 1e3, 2)
    sel = t[t[:, 6] == 1]
    b = t[:, 1][t[:, 1] > 0]
    return dict(programs=len(t), bound_med=med(b - start) if len(b) else None, compact_med=med(t[:, 2] - start),
                compact_max=round(float((t[:, 2] - start).max()) / 1e3, 2), sel_gather=med(sel[:, 4] - sel[:, 2]),
                sel_search=med(sel[:, 7] - sel[:, 4]), sel_write=med(sel[:, 3] - sel[:, 7]),
                end=round(float((sel[:, 3] - start).max()) / 1e3, 2))

def check(name, x, k, **kw):
    ok = torch.equal(topk(x, k, _path="fused", **CHK, **kw), topk_reference(x, k))
    res["checks"].append([name, list(x.shape), k, str(x.dtype), kw and str(kw), ok])
    if not ok: print("MISMATCH", name, x.shape, k, kw, flush=True)
    return ok

def checks():
    g = torch.Generator(device=dev).manual_seed(1)
    n_ok = n = 0
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        for rows, cols, k in [(32, 131072, 2048), (8, 131072, 2048), (32, 32768, 2048), (32, 131072, 8192),
                              (32, 131072, 4096), (5, 100003, 777), (3, 16384, 100), (64, 4096, 1), (1, 20000, 19999)]:
            x = torch.randn(rows, cols, device=dev, generator=g).to(dt)
            n += 1; n_ok += check("randn", x, k)
    x = torch.randn(32, 131072, device=dev, generator=g)
    for name, y in [("ties", torch.randint(0, 50, x.shape, device=dev, generator=g).float()),
                    ("sorted", torch.arange(131072, device=dev).float().expand(32, -1).contiguous()),
                    ("rsorted", torch.arange(131072, 0, -1, device=dev).float().expand(32, -1).contiguous()),
                    ("clustered", x + 10 * (torch.arange(131072, device=dev) // 4096 == 7).float()),
                    ("constant", torch.ones(32, 131072, device=dev)),
                    ("-inf pad", torch.where(torch.arange(131072, device=dev) < 70000, x, float("-inf"))),
                    ("nan", torch.where(torch.rand(x.shape, device=dev, generator=g) < 0.02, float("nan"), x)),
                    ("exp", torch.empty_like(x).exponential_(generator=g))]:
        n += 1; n_ok += check(name, y, 2048)
    for kw in [dict(_cap=2048), dict(_z=-30.0)]:
        n += 1; n_ok += check("forced", x[:4], 2048, **kw)
    # a CUDA graph of several calls on changing inputs
    xs = [torch.randn(32, 131072, device=dev, generator=g) for _ in range(3)]
    outs = [torch.empty(32, 2048, dtype=torch.int64, device=dev) for _ in xs]
    gr = torch.cuda.CUDAGraph()
    topk(xs[0], 2048, out=outs[0], _path="fused", **CHK); torch.cuda.synchronize()
    with torch.cuda.graph(gr):
        for x_, o_ in zip(xs, outs): topk(x_, 2048, out=o_, _path="fused", **CHK)
    for rep in range(3):
        for x_ in xs: x_.normal_(generator=g)
        gr.replay(); torch.cuda.synchronize()
        n += 1; n_ok += all(torch.equal(o_, topk_reference(x_, 2048)) for x_, o_ in zip(xs, outs))
    rec(what="checks", passed=n_ok, of=n)

def gen(rows, n, dist):
    x = torch.randn(rows, n, device=dev)
    if dist == "exp": x = torch.empty(rows, n, device=dev).exponential_()
    if dist == "unif": x = torch.rand(rows, n, device=dev)
    if dist == "attn": x = x * 2 + 6 * (torch.rand(rows, n, device=dev) < 0.01).float()
    return x

def run(rows, n, k, dt, variants, tr=True, dist="randn"):
    torch.manual_seed(0)
    xs = [gen(rows, n, dist).to(dt) for _ in range(4)]
    refs = [topk_reference(x, k) for x in xs]
    out = []
    rec(shape=[rows, n, k, str(dt), dist], what="torch.topk", us_rot=rotated([lambda x=x: torch.topk(x, k) for x in xs]))
    for v in variants:
        kw = dict(_path="fused", **v)
        try:
            ok = all(torch.equal(topk(x, k, **kw), r) for x, r in zip(xs, refs))
        except Exception as e:
            rec(shape=[rows, n, k, str(dt)], variant=str(v), error=repr(e)[:300]); continue
        usr = rotated([lambda x=x: topk(x, k, **kw) for x in xs])
        rec(shape=[rows, n, k, str(dt), dist], what="fused", variant=str(v), exact=ok, us_rot=usr,
            trace=trace(xs[0], k, **kw) if tr else None)
        out.append((usr if ok else 1e9, v))
    return out

def base(rows, n, k, dt):
    torch.manual_seed(0)
    xs = [torch.randn(rows, n, device=dev).to(dt) for _ in range(4)]
    rec(shape=[rows, n, k, str(dt)], what="committed fused", us_rot=rotated([lambda x=x: B.topk(x, k, _path="fused") for x in xs]))

if __name__ == "__main__":
    mode = sys.argv[2] if len(sys.argv) > 2 else "sweep"
    V = eval(sys.argv[4]) if len(sys.argv) > 4 else [{}]
    CHK = V[0]
    if mode != "main":
        checks()
    shapes = [(32, 131072, 2048, torch.float32), (32, 131072, 2048, torch.bfloat16), (8, 131072, 2048, torch.float32),
              (32, 32768, 2048, torch.float32), (32, 131072, 8192, torch.float32)]
    if mode == "main":
        shapes = shapes[:1]
    if mode == "dists":
        for dist in ("exp", "unif", "attn"):
            run(32, 131072, 2048, torch.float32, V, tr=True, dist=dist)
        shapes = shapes[:1]
    for i, shape in enumerate(shapes):
        base(*shape)
        run(*shape, V if i == 0 else V[:2], tr=True)
