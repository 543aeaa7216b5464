"""Session 21: the select's finish adopted in kernels/topk.py (library) against the kernel before it (22170df), and an
experimental copy with knobs: each program's whole chunk in registers (`_whole`), tiles two at a time (`_pk`), the
ticket first (`_tf`). 32 x 131072 fp32, k 2048 on seven row kinds, then four more shapes; CUDA-graph timings over 4
rotated inputs, each checked against the reference; then per-phase traces of one input (L2-warm, 8 calls, the first 3
dropped).

    git show 22170df:kernels/topk.py > kernels/topk_o.py
    git show 3853bb2:kernels/topk.py > kernels/topk_x.py && patch -p1 kernels/topk_x.py < results/topk-session21-experiments.patch
    python results/scripts/topk_session21.py OUT.json "[dict(_whole=1), dict(_whole=2), dict(_whole=1, _warps_x=16)]"
    python results/scripts/topk_session21.py OUT.json "[dict(_pk=1)]"
    python results/scripts/topk_session21.py OUT.json "[dict(_pk=1, _maxnreg=168), dict(_pk=1, _maxnreg=224)]"
    python results/scripts/topk_session21.py OUT.json "[dict(_pk=1, _tf=1, _maxnreg=224), dict(_pk=1, _tf=1)]"

with kernels/topk.py as of c72aafd ("adopted": the select's finish, one tile at a time). `_whole` 1: every program
loads its chunk (TILE = CHUNK) before its ticket and compacts it in one step after the bound; 2: the ticket first, the
bound program's sample loaded before its chunk; `_warps_x` 16: 16 warps. `_pk` 1: tiles streamed two at a time, one
scan and one sum for both (their flags packed 16 bits apiece); `_tf` 1: the ticket first and the bound program's sample
loaded before its tiles. Needs CUDA. Produced results/topk-session21-h100.json ("rows"/"traces": the first command;
"pairs_runs": the other three)."""
import json, sys, time, torch
import sparsekv.kernels.topk as B
import sparsekv.kernels.topk_o as O
import sparsekv.kernels.topk_x as T
sys.path.insert(0, "results/scripts")
from topk_row_kinds import KINDS, time_rows, trace_rows  # noqa: E402
dev = "cuda"; OUT = sys.argv[1]; t0 = time.time()
res = dict(device=torch.cuda.get_device_name(), rows=[], traces=[])
def save(): json.dump(res, open(OUT, "w"), indent=1)
FNS = [("22170df", O.topk, {}), ("adopted", B.topk, {})] + [("x", T.topk, v) for v in eval(sys.argv[2])]
for d in KINDS:
    time_rows(d, 32, 131072, 2048, torch.float32, FNS, 2 if d == "randn" else 1, res["rows"], t0, save)
for rows, n, k, dt in [(8, 131072, 2048, torch.float32), (32, 131072, 2048, torch.bfloat16),
                       (32, 32768, 2048, torch.float32), (32, 131072, 8192, torch.float32),
                       (32, 131072, 4096, torch.float32)]:
    time_rows("randn", rows, n, k, dt, FNS, 1, res["rows"], t0, save)
# traces: one input, L2-warm, 8 calls, first 3 dropped
torch.manual_seed(0)
x = torch.randn(32, 131072, device=dev)
for name, fn, kw in FNS[1:]:
    res["traces"].append(dict(kernel=name, kw=str(kw), **trace_rows(fn, kw, x, 2048, 4)))
    print(res["traces"][-1], flush=True); save()
