"""Five calls of the fused top-k on 32 x 131072 fp32 (k 2048), for Nsight Compute to profile one of them:

    ncu --clock-control none --section SourceCounters --section WarpStateStats --section SchedulerStats \\
        --section LaunchStats --section SpeedOfLight -k regex:_topk_kernel --launch-skip 3 --launch-count 1 \\
        -f -o REPORT python results/scripts/topk_ncu.py [MODULE] ["KWARGS"]
    ncu -i REPORT.ncu-rep --page source --csv --print-source sass > sass.csv
    python results/scripts/ncu_stalls.py sass.csv

MODULE defaults to sparsekv.kernels.topk; KWARGS is a Python dict for its `topk` (e.g. an experimental copy's knobs).
Produced the `ncu` part of results/topk-session9-h100.json."""
import sys
import importlib

import torch

T = importlib.import_module(sys.argv[1] if len(sys.argv) > 1 else "sparsekv.kernels.topk")
kw = eval(sys.argv[2]) if len(sys.argv) > 2 else {}
x = torch.randn(32, 131072, device="cuda")
for _ in range(5):
    T.topk(x, 2048, _path="fused", **kw)
torch.cuda.synchronize()
