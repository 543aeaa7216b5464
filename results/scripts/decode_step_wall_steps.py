"""Per-step wall time of adamas ip / L1 decode at 8K, and the Triton compiles per kernel during each run.

    HAYSTACK=jargon.txt.gz python results/scripts/decode_step_wall_steps.py OUTDIR   (CUDA only)
"""
import gzip, json, os, sys, time
import torch, triton
from sparsekv.models import load_model
from sparsekv.methods import get_method
import sparsekv.decode as dec
from sparsekv.decode import prefill, generate
import sparsekv.kernels.adamas as KA, sparsekv.kernels.topk as KT, sparsekv.kernels.sparse_decode as KS, sparsekv.kernels.count_select as KC

out = sys.argv[1]
lm = load_model("smollm2-135m", device="cuda", dtype=torch.bfloat16, quiet=True)
text = gzip.open(os.environ["HAYSTACK"], "rt", errors="ignore").read()[:200000]
ids = lm.tokenizer(text)["input_ids"][:8000]
pf = prefill(lm, ids)
A = "results/artifacts/smollm2-135m-instruct-q4_1/adamas/v2"
times = []
orig = dec.make_step
def make_step(lm, cache):
    f = orig(lm, cache)
    def g(tok, pos):
        torch.cuda.synchronize(); t = time.perf_counter(); r = f(tok, pos); torch.cuda.synchronize()
        times.append(round(1e3 * (time.perf_counter() - t), 2)); return r
    return g
dec.make_step = make_step
def compiled():
    n = {}
    for mod in (KA, KT, KS, KC):
        for name, fn in vars(mod).items():
            if isinstance(fn, triton.runtime.jit.JITFunction):
                c = 0
                for v in getattr(fn, "device_caches", {}).values():
                    c += len(v[0]) if isinstance(v, tuple) else len(v)
                if c: n[f"{mod.__name__}.{name}"] = c
    return n
res = {}
for label, kw in (("ip", dict(distance="ip")), ("l1", {})):
    meth = get_method("adamas", budget=128, artifact=A, **kw)
    for rep in range(3):
        times.clear(); c0 = compiled()
        generate(lm, None, meth, 40, dense_layers=(0, 1), stop_on_eos=False, prefilled=pf)
        c1 = compiled()
        res[f"{label}-{rep}"] = {"step_ms": list(times), "new_compiles": {k: c1[k] - c0.get(k, 0) for k in c1 if c1[k] != c0.get(k, 0)}}
        print(label, rep, "median", sorted(times)[len(times)//2], "max", max(times), "compiles", res[f"{label}-{rep}"]["new_compiles"], flush=True)
        print("  ", times[:40], flush=True)
json.dump(res, open(f"{out}/step_cost2.json", "w"), indent=1)
