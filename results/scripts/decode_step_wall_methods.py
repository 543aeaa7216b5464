"""Per-token decode wall time at 8K for several methods, and where the adamas step synchronises with the host.

    N=8000 HAYSTACK=jargon.txt.gz python results/scripts/decode_step_wall_methods.py OUTDIR   (DEV=cpu to try it here)
"""
import json, os, sys, time, traceback, warnings
import torch
from sparsekv.models import load_model
from sparsekv.methods import get_method
from sparsekv.decode import prefill, generate

out = sys.argv[1]
DEV = os.environ.get("DEV", "cuda"); N = int(os.environ.get("N", 8192))
lm = load_model("smollm2-135m", device=DEV, dtype=torch.bfloat16 if DEV == "cuda" else torch.float32, quiet=True)
import gzip
text = gzip.open(os.environ["HAYSTACK"], "rt", errors="ignore").read()[:200000]
ids = lm.tokenizer(text)["input_ids"][:N]
pf = prefill(lm, ids)
A = "results/artifacts/smollm2-135m-instruct-q4_1/adamas/v2"
specs = {"dense": ("dense", {}), "oracle-128-head": ("oracle", dict(budget=128, pooling="head", window=1)),
         "adamas-l1-128": ("adamas", dict(budget=128, artifact=A)),
         "adamas-ip-128": ("adamas", dict(budget=128, artifact=A, distance="ip")),
         "quest-128": ("quest", dict(budget=128))}
res = {}
for label, (m, kw) in specs.items():
    try:
        meth = get_method(m, **kw)
        generate(lm, None, meth, 8, dense_layers=(0, 1), stop_on_eos=False, prefilled=pf)  # warm
        (torch.cuda.synchronize() if DEV == "cuda" else None); t = time.perf_counter()
        g = generate(lm, None, meth, 65, dense_layers=(0, 1), stop_on_eos=False, prefilled=pf)
        (torch.cuda.synchronize() if DEV == "cuda" else None); dt = (time.perf_counter() - t - 0) / 64
        res[label] = {"ms_per_token": round(1e3 * dt, 2)}
        print(label, res[label], flush=True)
    except Exception as e:
        res[label] = {"error": repr(e)}; print(label, e, flush=True)
sites = {}
def show(message, category, filename, lineno, file=None, line=None):
    if "synchron" not in str(message):
        return
    st = "".join(f for f in traceback.format_stack()[:-2] if "sparsekv" in f or "kernels" in f or "step_cost" not in f and "site-packages/torch" not in f)[-1500:]
    sites[st] = sites.get(st, 0) + 1
warnings.showwarning = show
warnings.simplefilter("always")
for label in ("adamas-ip-128", "adamas-l1-128", "dense"):
    m, kw = specs[label]
    meth = get_method(m, **kw)
    sites.clear()
    if DEV == "cuda": torch.cuda.set_sync_debug_mode("warn")
    generate(lm, None, meth, 3, dense_layers=(0, 1), stop_on_eos=False, prefilled=pf)
    if DEV == "cuda": torch.cuda.set_sync_debug_mode(0)
    res[label]["sync_sites_3_tokens"] = [{"count": c, "stack": s} for s, c in sorted(sites.items(), key=lambda x: -x[1])]
    print(label, "sync sites", len(sites), sum(sites.values()), flush=True)
    for s, c in sorted(sites.items(), key=lambda x: -x[1])[:4]:
        print(c, s[-700:], flush=True)
# profile one adamas ip step's CPU time by op
from torch.profiler import profile, ProfilerActivity
meth = get_method("adamas", budget=128, artifact=A, distance="ip")
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    generate(lm, None, meth, 5, dense_layers=(0, 1), stop_on_eos=False, prefilled=pf)
tab = prof.key_averages().table(sort_by="cpu_time_total", row_limit=40)
print(tab)
res["profile_ip_5_tokens"] = tab
json.dump(res, open(f"{out}/step_cost.json", "w"), indent=1)
