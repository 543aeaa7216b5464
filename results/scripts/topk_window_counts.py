"""Session 22: why the select's candidate window loses on rows of 4 chunks. The experimental copy takes each lane's
chunk count from the scalar counts (a where-chain, `_wsel=1`) instead of a per-lane load (`_wsel=0`, the library's
form); both against the library's default in the same run (32 x 131072 and 8 x 131072 fp32, k 2048, randn; CUDA-graph
timings over 4 rotated inputs, each checked against the reference).

    git show 1e227d4:kernels/topk.py > kernels/topk_x.py && patch -p1 kernels/topk_x.py < results/topk-session22-experiments.patch
    python results/scripts/topk_window_counts.py OUT.json

Needs CUDA."""
import json, sys, time, torch
import sparsekv.kernels.topk as B
import sparsekv.kernels.topk_x as T
sys.path.insert(0, "results/scripts")
from topk_row_kinds import time_rows  # noqa: E402
OUT = sys.argv[1]; t0 = time.time()
res = dict(device=torch.cuda.get_device_name(), rows=[])
def save(): json.dump(res, open(OUT, "w"), indent=1)
FNS = [("library", B.topk, {}), ("library", B.topk, dict(_window=True)),
       ("x", T.topk, dict(_window=True, _wsel=1)), ("x", T.topk, dict(_window=True, _wsel=1, _tile_pairs=False)),
       ("library", B.topk, dict(_window=True, _tile_pairs=False)), ("library", B.topk, dict(_tile_pairs=False))]
for rows in (32, 8):
    time_rows("randn", rows, 131072, 2048, torch.float32, FNS, 2, res["rows"], t0, save)
