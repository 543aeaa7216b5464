"""Adamas' select at the llama3-8b shape, part by part (distance kernels, count select, the fused top-k on fp16 / fp32 negated distances).
usage: python results/scripts/adamas_select_parts.py OUT.json (run A of results/code-topk-fused-h100-session24.json; H100 output there).
No patch needed."""
import json, sys
import torch
from triton.testing import do_bench_cudagraph as dbg
import sparsekv.kernels.adamas as KA
from sparsekv.kernels import count_select
from sparsekv.kernels.topk import topk
from profile_util import code_inputs  # results/scripts/profile_util.py
torch.manual_seed(0)
rows = []
def t(f): return round(dbg(f, rep=200) * 1000, 2)
for seq in (32768, 131072):
    n, k, codes, qw = code_inputs(seq)
    for pool in (None, "sum"):
        vmax = KA._max_distance(128, 2, "l1", 4 if pool else 1)
        d16 = KA._launch_distance(qw, codes, n, 128, 2, "l1", pool, torch.int16, False, None, 4)
        s16 = KA.code_scores(qw, codes, n, 128, pool=pool)
        s32 = KA.code_scores(qw, codes, n, 128, pool=pool, dtype=torch.float32)
        ref = torch.sort(count_select.smallest_k(d16, k, vmax), dim=-1).values.reshape(-1, k)
        r = dict(seq=seq, pool=pool or "head",
                 dist_int16=t(lambda: KA._launch_distance(qw, codes, n, 128, 2, "l1", pool, torch.int16, False, None, 4)),
                 scores_fp16=t(lambda: KA.code_scores(qw, codes, n, 128, pool=pool)),
                 scores_fp32=t(lambda: KA.code_scores(qw, codes, n, 128, pool=pool, dtype=torch.float32)),
                 count_select=t(lambda: count_select.smallest_k(d16, k, vmax)),
                 topk_fp16=t(lambda: topk(s16.reshape(-1, n), k)),
                 topk_fp32=t(lambda: topk(s32.reshape(-1, n), k)),
                 code_topk=t(lambda: KA.code_topk(qw, codes, n, 128, k, pool=pool)),
                 scores16_topk=t(lambda: topk(KA.code_scores(qw, codes, n, 128, pool=pool).reshape(-1, n), k)),
                 scores32_topk=t(lambda: topk(KA.code_scores(qw, codes, n, 128, pool=pool, dtype=torch.float32).reshape(-1, n), k)),
                 same16=torch.equal(torch.sort(topk(s16.reshape(-1, n), k), -1).values, ref),
                 same32=torch.equal(torch.sort(topk(s32.reshape(-1, n), k), -1).values, ref))
        rows.append(r); print(r, flush=True)
json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, open(sys.argv[1], "w"), indent=1)
