"""Per-token decode cost of Adamas and LSH with the counting select (`code_topk`) against the previous path (float
scores + the shared top-k), in the same run: a SmolLM2-shaped random model (30 layers, 9/3 heads, d 64, bf16) on the
GPU after a 4K / 8K prompt, budget 128, layers 0-1 dense, the decode step's CUDA graphs on (select stays eager).
16 tokens of warm-up (Triton compiles its variants there), then 64 timed.

usage: python results/scripts/select_decode_cost.py [OUT.json]
"""
import json
import sys
import time

import torch

import sparsekv.decode as D
import sparsekv.kernels.adamas as KA
from sparsekv import attention
from sparsekv.methods import get_method
from sparsekv.models import tiny_random

supported = KA.code_topk_supported
lm = tiny_random(layers=30, q_heads=9, kv_heads=3, head_dim=64, dtype=torch.bfloat16, max_positions=16384)
lm.model.to("cuda").eval()
lm.model.set_attn_implementation(attention.register())
rows = []
for seq in (4096, 8192):
    p = D.prefill(lm, torch.randint(5, 200, (seq,)))
    for name in ("dense", "adamas", "lsh"):
        for path in (("count",) if name == "dense" else ("count", "scores+topk")):
            KA.code_topk_supported = supported if path == "count" else (lambda *a: False)
            m = get_method(name, **({} if name == "dense" else dict(budget=128)))
            dl = (0, 1) if name != "dense" else ()
            D.generate(lm, None, m, 16, prefilled=p, stop_on_eos=False, dense_layers=dl)  # warm-up, compile, capture
            torch.cuda.synchronize()
            t = time.time()
            D.generate(lm, None, m, 64, prefilled=p, stop_on_eos=False, dense_layers=dl)
            torch.cuda.synchronize()
            ms = 1000 * (time.time() - t) / 64
            rows.append({"seq": seq, "method": name, "select": None if name == "dense" else path,
                         "ms_per_token": round(ms, 2)})
            print(f"seq {seq} {name:8s} {path:12s} {ms:6.2f} ms/token", flush=True)
KA.code_topk_supported = supported
if len(sys.argv) > 1:
    json.dump({"device": torch.cuda.get_device_name(), "model": "random SmolLM2 shape: 30 layers, 9/3 heads, d 64, "
               "bf16", "budget": 128, "dense_layers_for_sparse": [0, 1], "graphs": True, "warmup_tokens": 16,
               "tokens_timed": 64, "rows": rows}, open(sys.argv[1], "w"), indent=1)
