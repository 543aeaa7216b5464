"""Adamas' selection, both kernel paths in one run: code_topk (int16 distances + counting select) against code_scores
(fp16) + the fused top-k, per query head and pooled. usage: python results/scripts/adamas_select_paths.py OUT.json
(results/adamas-select-paths-h100.json is its H100 output, with device notes)."""
import json, sys
import torch
from triton.testing import do_bench_cudagraph as dbg
import sparsekv.kernels.adamas as KA
from sparsekv.kernels.topk import topk
torch.manual_seed(0)
rows = []
for seq in (32768, 131072):
    n = seq - 1; k = 2047
    codes = torch.randint(-32768, 32767, (1, 8, seq, 16), dtype=torch.int16, device="cuda")
    qw = torch.randint(-32768, 32767, (1, 32, 16), dtype=torch.int16, device="cuda")
    for pool in (None, "sum"):
        a = lambda: KA.code_topk(qw, codes, n, 128, k, pool=pool)
        def b():
            s = KA.code_scores(qw, codes, n, 128, pool=pool)
            return topk(s.reshape(-1, n), k)
        ia = a().reshape(-1, k); ib = torch.sort(b(), dim=-1).values
        same = torch.equal(ia, ib)
        ta, tb = dbg(a, rep=200) * 1000, dbg(b, rep=200) * 1000
        rows.append(dict(seq=seq, pool=pool or "head", code_topk_us=ta, scores_topk_us=tb, same_indices=same))
        print(rows[-1], flush=True)
json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, open(sys.argv[1], "w"), indent=1)
