"""Triton compilations per decode step: each method's layer step (append, select, sparse_decode) at lengths
L0 .. L0 + n - 1 (as decoding grows the context), SmolLM2's attention shape, bf16; a fresh temporary
TRITON_CACHE_DIR unless one is set (results/triton-compiles-h100.json).
python results/scripts/triton_compiles.py OUT.json [L0] [n]"""
import json, os, sys, tempfile, time
os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp())
import torch, triton
from sparsekv.bench.decode_step import random_inputs
from sparsekv.bench.shapes import from_name
from sparsekv.methods import CacheShape, get_method
from sparsekv.sparse_attention import sparse_decode
import sparsekv.kernels.sparse_decode, sparsekv.kernels.topk, sparsekv.kernels.adamas, sparsekv.kernels.count_select
import sparsekv.kernels.quest, sparsekv.kernels.hadamard

def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()

def jit_fns():
    out = {}
    for mod in [m for n, m in sys.modules.items() if n.startswith("sparsekv.kernels.")]:
        for name, obj in vars(mod).items():
            if isinstance(obj, triton.runtime.jit.JITFunction):
                out[f"{mod.__name__.split('.')[-1]}.{name}"] = obj
    return out

def n_compiled(fn):
    caches = getattr(fn, "device_caches", None)
    if caches:
        return sum(len(v[0]) for v in caches.values())
    return len(getattr(fn, "cache", {}).get(0, {}))

L0 = int(sys.argv[2]) if len(sys.argv) > 2 else 8000
n = int(sys.argv[3]) if len(sys.argv) > 3 else 40
shape = from_name("smollm2-135m")
runs = [("adamas-l1", dict(budget=128)), ("adamas-ip", dict(budget=128, distance="ip")),
        ("oracle", dict(budget=128)), ("quest", dict(budget=128)), ("lsh", dict(budget=128))]
res = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "triton": triton.__version__, "L0": L0, "steps": n, "runs": []}
fns = jit_fns()
for label, opts in runs:
    m = get_method(label.split("-")[0], **opts)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    x = random_inputs(shape, L0 + n, 1, torch.bfloat16 if dev.type == "cuda" else torch.float32, dev)
    st = m.new_state(0, CacheShape(1, shape.kv_heads, shape.q_heads, shape.head_dim, L0 + n, x.keys.dtype, dev))
    st.keys, st.values = x.keys, x.values
    for pos in range(0, L0 - 1, 4096):
        c = min(4096, L0 - 1 - pos)
        st.length = pos + c
        kk = x.keys[:, :, pos:pos + c]
        m.append(st, kk, x.values[:, :, pos:pos + c], kk if m.needs_pre_rope else None, pos)
    sync()
    before = {k: n_compiled(f) for k, f in fns.items()}
    steps = []
    for L in range(L0, L0 + n):
        t = time.perf_counter()
        st.length = L
        m.append(st, x.keys[:, :, L - 1:L], x.values[:, :, L - 1:L], x.keys[:, :, L - 1:L] if m.needs_pre_rope else None, L - 1)
        sel = m.select(st, x.q, x.q if m.needs_pre_rope else None)
        sparse_decode(x.q, x.keys, x.values, sel, 0.125)
        sync()
        steps.append(round((time.perf_counter() - t) * 1e3, 2))
    after = {k: n_compiled(f) for k, f in fns.items()}
    new = {k: after[k] - before[k] for k in fns if after[k] != before[k]}
    slow = [(L0 + i, s) for i, s in enumerate(steps) if s > 50]
    r = dict(method=label, new_compiles=new, total_new=sum(new.values()), slow_steps_ms=slow,
             median_step_ms=sorted(steps)[len(steps) // 2], compile_s=round(sum(s for _, s in slow) / 1e3, 1))
    res["runs"].append(r); print(r, flush=True)
    json.dump(res, open(sys.argv[1], "w"), indent=1)
res["variants"] = {k: n_compiled(f) for k, f in fns.items() if n_compiled(f)}
print(res["variants"], flush=True)
json.dump(res, open(sys.argv[1], "w"), indent=1)
