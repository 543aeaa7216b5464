"""Session 23: the fused top-k with `_count4` as two nested selects, the select's second lane count (`_cap2`: rows of
CAP < C <= CAP2 candidates held in CAP2 lanes instead of the slices fallback), the second bound (`_restream`: rows of
fewer than k candidates stream again from the sample's J2-th key instead of the row fallback) and the plan that these
allow (smaller samples), in kernels/topk.py, against the kernel before them (kernels/topk_o.py: `git show
6e7c0b0:kernels/topk.py`). All in the same run: CUDA-graph timings over 4 rotated inputs, each call checked against
the reference (the seven row kinds of 32 x 131072 fp32, k 2048, or randn only with `main`; then more shapes, for the
variants that force no path); per variant and row kind, how many of ROWS fresh rows end with C < k (the row
fallback), C > CAP (the second lane count, or the slices fallback without one) and C > CAP2 (the slices fallback),
from the call's per-chunk counts (a row streamed again shows its second counts); per-phase traces of one input.

    python results/scripts/topk_session23.py OUT.json "[('o', {}), ('lib', {}), ('lib', dict(_z=5.0))]" [main] [rates]

`rates`: the counts only, over 16384 rows per kind and variant, no timing. Needs CUDA (and kernels/topk_o.py for 'o').
"""
import importlib, json, sys, time, torch
sys.path.insert(0, "results/scripts")
from topk_row_kinds import KINDS, candidate_counts, time_rows, trace_rows  # noqa: E402
OUT = sys.argv[1]; t0 = time.time()
MODS = dict(lib="sparsekv.kernels.topk", o="sparsekv.kernels.topk_o")
VARS = [(name, importlib.import_module(MODS[name]), kw) for name, kw in eval(sys.argv[2])]
MAIN = "main" in sys.argv[3:]  # randn rows only for 32 x 131072 (the other shapes and the traces still run)
RATES = "rates" in sys.argv[3:]  # the fallback counts only (ROWS rows per kind and variant), no timing
ROWS = 16384 if RATES else 2048
res = dict(device=torch.cuda.get_device_name(), rows=[], rates=[], traces=[], regs=[])
def save(): json.dump(res, open(OUT, "w"), indent=1)
dev = torch.device("cuda")
x = torch.randn(32, 131072, device=dev)
for name, M, kw in VARS:  # registers and spills of each variant's kernel, fp32
    M._topk_kernel.device_caches.clear()
    M.topk(x, 2048, _path="fused", **kw)
    for dc in M._topk_kernel.device_caches.values():
        for ck in dc[0].values():
            res["regs"].append(dict(kernel=name, kw=str(kw), regs=ck.n_regs, spills=ck.n_spills))
            print(res["regs"][-1], flush=True)
FNS = [(name, M.topk, kw) for name, M, kw in VARS]
for d in ("randn",) if MAIN else KINDS:
    if not RATES:
        time_rows(d, 32, 131072, 2048, torch.float32, FNS, 2 if d == "randn" else 1, res["rows"], t0, save)
    for name, M, kw in VARS:
        zs = (kw["_z"],) if "_z" in kw else ()
        plan = M._plan(131072, 2048, 32, M.num_sms(dev), None, kw.get("_tile"), kw.get("_cap"), kw.get("_sample"), *zs)
        cap2 = kw.get("_cap2", plan.get("cap2", 0)) or plan["cap"]
        c = candidate_counts(M, kw, d, plan, ROWS)
        few, over, over2, top = (int((c < 2048).sum()), int((c > plan["cap"]).sum()), int((c > cap2).sum()),
                                 int(c.max()))
        res["rates"].append(dict(dist=d, kernel=name, kw=str(kw), rows=ROWS, too_few=few, over_cap=over,
                                 over_cap2=over2, max_c=top, cap=plan["cap"], cap2=cap2, s=plan["s"], j=plan["j"],
                                 j_hi=plan["j_hi"]))
        print(res["rates"][-1], flush=True)
    save()
for rows, n, k, dt in [] if RATES else [(8, 131072, 2048, torch.float32), (1, 131072, 2048, torch.float32),
                       (32, 131072, 2048, torch.bfloat16), (32, 32768, 2048, torch.float32),
                       (32, 131072, 4096, torch.float32), (32, 131072, 8192, torch.float32),
                       (32, 131072, 1024, torch.float32), (32, 8192, 128, torch.float32), (9, 8191, 127, torch.float32),
                       (32, 8188, 2047, torch.float32), (32, 16383, 2047, torch.float32), (1, 16384, 512, torch.float32)]:
    time_rows("randn", rows, n, k, dt, [f for f in FNS if "_sample" not in f[2] and f[2].get("_z", 0) >= 0], 1,
              res["rows"], t0, save)  # no forced paths
for name, M, kw in [] if RATES else VARS:
    res["traces"].append(dict(kernel=name, kw=str(kw), **trace_rows(M.topk, kw, x, 2048, 4)))
    print(res["traces"][-1], flush=True); save()
