"""cProfile of eager sparse decode steps (oracle, adamas; budget 128, layers 0-1 dense) on a SmolLM2-shaped random
model at 4K on the GPU: ms per token after 40 tokens of warm-up, then the top functions by own time.

usage: python results/scripts/profile_select.py
"""
import time, torch, cProfile, pstats, io, os
from sparsekv.models import tiny_random
from sparsekv import attention
import sparsekv.decode as D
from sparsekv.methods import get_method
lm = tiny_random(layers=30, q_heads=9, kv_heads=3, head_dim=64, dtype=torch.bfloat16, max_positions=16384)
lm.model.to("cuda").eval(); lm.model.set_attn_implementation(attention.register())
ids = torch.randint(5, 200, (4096,))
p = D.prefill(lm, ids)
for name, cfg in [("oracle", dict(budget=128)), ("adamas", dict(budget=128))]:
    m = get_method(name, **cfg)
    D.generate(lm, None, m, 40, prefilled=p, stop_on_eos=False, dense_layers=(0, 1))
    torch.cuda.synchronize(); t = time.time()
    D.generate(lm, None, m, 32, prefilled=p, stop_on_eos=False, dense_layers=(0, 1))
    torch.cuda.synchronize(); print(name, f"{1000*(time.time()-t)/32:.2f} ms/token", flush=True)
    pr = cProfile.Profile(); pr.enable()
    D.generate(lm, None, m, 16, prefilled=p, stop_on_eos=False, dense_layers=(0, 1))
    torch.cuda.synchronize(); pr.disable()
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25); print(s.getvalue()[:5000])
