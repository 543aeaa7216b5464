"""Per-token decode cost of a SmolLM2-shaped random model (30 layers, 9/3 heads, d 64, bf16) on the GPU after a
4K / 8K prompt, for each method, with the decode step's CUDA graphs on (default) and off (SPARSEKV_GRAPHS=0).

usage: python results/scripts/decode_cost.py [OUT.json]
"""
import json
import os
import sys
import time

import torch

import sparsekv.decode as D
from sparsekv import attention
from sparsekv.methods import get_method
from sparsekv.models import tiny_random

lm = tiny_random(layers=30, q_heads=9, kv_heads=3, head_dim=64, dtype=torch.bfloat16, max_positions=16384)
lm.model.to("cuda").eval()
lm.model.set_attn_implementation(attention.register())
rows = []
for seq in (4096, 8192):
    ids = torch.randint(5, 200, (seq,))
    D.prefill(lm, ids)
    torch.cuda.synchronize()
    t = time.time()
    p = D.prefill(lm, ids)
    torch.cuda.synchronize()
    print(f"seq {seq}: prefill {1000 * (time.time() - t):.1f} ms", flush=True)
    for name, cfg in [("dense", {}), ("oracle", dict(budget=128)), ("streaming", dict(budget=128)),
                      ("adamas", dict(budget=128)), ("quest", dict(budget=128)), ("lsh", dict(budget=128))]:
        for graphs in ("1", "0"):
            os.environ["SPARSEKV_GRAPHS"] = graphs
            m = get_method(name, **cfg)
            dl = (0, 1) if name != "dense" else ()
            try:
                D.generate(lm, None, m, 4, prefilled=p, stop_on_eos=False, dense_layers=dl)  # warm-up, capture
                torch.cuda.synchronize()
                t = time.time()
                D.generate(lm, None, m, 64, prefilled=p, stop_on_eos=False, dense_layers=dl)
                torch.cuda.synchronize()
                ms = 1000 * (time.time() - t) / 64
                rows.append({"seq": seq, "method": name, "budget": cfg.get("budget"), "graphs": graphs == "1",
                             "ms_per_token": round(ms, 2)})
                print(f"  {name:10s} graphs={graphs} {ms:6.2f} ms/token", flush=True)
            except Exception as e:  # noqa: BLE001 - a diagnostic script: report and go on
                print(f"  {name:10s} graphs={graphs} ERROR {type(e).__name__}: {e}"[:300], flush=True)
os.environ.pop("SPARSEKV_GRAPHS")
if len(sys.argv) > 1:
    json.dump({"device": torch.cuda.get_device_name(), "model": "random SmolLM2 shape: 30 layers, 9/3 heads, d 64, "
               "bf16", "tokens_timed": 64, "dense_layers_for_sparse": [0, 1], "rows": rows},
              open(sys.argv[1], "w"), indent=1)
