"""The 40 exactness checks of results/scripts/topk_tuning.py (9 shapes x 3 dtypes, tie / sorted / clustered /
constant / -inf-padded / NaN / exponential rows, both fallbacks forced, a CUDA graph over changing inputs) for each
variant of the experimental copy in turn.

    python results/scripts/topk_variant_checks.py OUT.json "[dict(_sf=32), dict(_g=32)]"

Needs CUDA. Produced the "checks" of results/topk-session19-h100.json."""
import sys

out, V = sys.argv[1], eval(sys.argv[2])
sys.argv = ["topk_tuning.py", out, "main", "sparsekv.kernels.topk_x"]
sys.path.insert(0, "results/scripts")
import topk_tuning as TT  # noqa: E402

for v in V:
    TT.CHK = v
    TT.checks()
    TT.rec(what="variant done", variant=str(v))
