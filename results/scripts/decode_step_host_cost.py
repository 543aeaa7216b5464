"""NOGC_FIRST=1 FREEZE=1 (optional) python results/scripts/decode_step_host_cost.py OUT.json (CUDA): host time of one
layer's eager decode step per method at SmolLM2's attention shape (results/decode-step-host-cost-h100.json)."""
import gc, json, time, torch, sys
res = {"device": torch.cuda.get_device_name(), "what": "one layer's eager decode step (append, select, sparse_decode) at SmolLM2's attention shape (9 query / 3 KV heads, d 64), bf16, budget 128, context 8040-8339: per-step host time without a sync, Python's garbage collector on and off", "runs": []}
from sparsekv.bench.decode_step import random_inputs
from sparsekv.bench.shapes import from_name
from sparsekv.methods import CacheShape, get_method
from sparsekv.sparse_attention import sparse_decode
shape = from_name("smollm2-135m"); dev = torch.device("cuda")
L0, n = 8000, 400
import os
ORDER = (False, True) if os.environ.get("NOGC_FIRST") else (True, False)
if os.environ.get("FREEZE"):
    gc.freeze()
res["order"] = ORDER; res["gc_freeze"] = bool(os.environ.get("FREEZE"))
from sparsekv.kernels.sparse_decode import dense_decode
for label, name, opts in [("dense (our split-K kernel alone)", None, {}), ("adamas-l1", "adamas", dict(budget=128)), ("adamas-ip", "adamas", dict(budget=128, distance="ip")),
                          ("oracle", "oracle", dict(budget=128)), ("quest", "quest", dict(budget=128))]:
    x = random_inputs(shape, L0 + n, 1, torch.bfloat16, dev)
    if name is None:
        a = lambda L: dense_decode(x.q, x.keys, x.values, L, 0.125)
    else:
        m = get_method(name, **opts)
    st = None if name is None else m.new_state(0, CacheShape(1, shape.kv_heads, shape.q_heads, shape.head_dim, L0 + n, x.keys.dtype, dev))
    if st is not None:
        st.keys, st.values = x.keys, x.values
    for pos in (range(0, L0 - 1, 4096) if st is not None else []):
        c = min(4096, L0 - 1 - pos); st.length = pos + c
        kk = x.keys[:, :, pos:pos + c]
        m.append(st, kk, x.values[:, :, pos:pos + c], kk if m.needs_pre_rope else None, pos)
    def step(L):
        st.length = L
        kk = x.keys[:, :, L - 1:L]
        m.append(st, kk, x.values[:, :, L - 1:L], kk if m.needs_pre_rope else None, L - 1)
        return sparse_decode(x.q, x.keys, x.values, m.select(st, x.q, x.q if m.needs_pre_rope else None), 0.125)
    if name is not None:
        a = step
    for L in range(L0, L0 + 40): a(L)
    torch.cuda.synchronize()
    for gcon in ORDER:
        if not gcon: gc.disable()
        per = []
        t0 = time.perf_counter()
        for L in range(L0 + 40, L0 + 340):
            t = time.perf_counter(); a(L); per.append(round((time.perf_counter() - t) * 1e6))
        c = time.perf_counter() - t0; torch.cuda.synchronize(); w = time.perf_counter() - t0
        gc.enable()
        big = [(i, v) for i, v in enumerate(per) if v > 3000]
        res["runs"].append(dict(method=label, gc=gcon, cpu_us_per_step=round(c / 300 * 1e6), wall_us_per_step=round(w / 300 * 1e6),
                                median_us=sorted(per)[150], steps_over_3ms=[(L0 + 40 + i, v) for i, v in big]))
        json.dump(res, open(sys.argv[1], "w"), indent=1)
        print(label, "gc" if gcon else "nogc", "cpu/step", round(c / 300 * 1e6), "wall/step", round(w / 300 * 1e6),
              "median", sorted(per)[150], "spikes>3ms", len(big), big[:12], flush=True)
