"""Per-token decode cost of a SmolLM2-shaped random model (30 layers, 9/3 heads, d 64) on the GPU, 4K prompt."""
import time, torch, sys
from sparsekv.models import tiny_random
from sparsekv import attention
import sparsekv.decode as D
from sparsekv.methods import get_method
lm = tiny_random(layers=30, q_heads=9, kv_heads=3, head_dim=64, dtype=torch.bfloat16, max_positions=16384)
lm.model.to("cuda").eval(); lm.model.set_attn_implementation(attention.register())
for seq in (4096, 8192):
    ids = torch.randint(5, 200, (seq,))
    torch.cuda.synchronize(); t = time.time(); p = D.prefill(lm, ids); torch.cuda.synchronize()
    print(f"seq {seq} prefill {1000*(time.time()-t):.1f} ms (first call)", flush=True)
    t = time.time(); p = D.prefill(lm, ids); torch.cuda.synchronize(); print(f"  prefill again {1000*(time.time()-t):.1f} ms")
    for name, cfg in [("dense", {}), ("oracle", dict(budget=128)), ("streaming", dict(budget=128)),
                      ("adamas", dict(budget=128)), ("quest", dict(budget=128)), ("lsh", dict(budget=128))]:
        m = get_method(name, **cfg)
        dl = (0, 1) if name != "dense" else ()
        try:
            D.generate(lm, None, m, 4, prefilled=p, stop_on_eos=False, dense_layers=dl)
            torch.cuda.synchronize(); t = time.time()
            g = D.generate(lm, None, m, 64, prefilled=p, stop_on_eos=False, dense_layers=dl)
            torch.cuda.synchronize(); dt = time.time() - t
            print(f"  {name:10s} {1000*dt/64:6.2f} ms/token", flush=True)
        except Exception as e:
            print(f"  {name:10s} ERROR {type(e).__name__}: {e}"[:300], flush=True)
