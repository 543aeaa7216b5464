"""The 40 exactness checks of results/scripts/topk_tuning.py (9 shapes x 3 dtypes, tie / sorted / clustered /
constant / -inf-padded / NaN / exponential rows, both fallbacks forced, a CUDA graph over changing inputs) for each
variant (a dict of `topk` knobs) of the experimental copy in turn, or of MODULE.

    python results/scripts/topk_variant_checks.py OUT.json "[dict(_sf=32), dict(_g=32)]" [MODULE]

Needs CUDA. Produced the "checks" of results/topk-session19-h100.json (and, with MODULE sparsekv.kernels.topk, the
session-22 checks of the library)."""
import sys

out, V = sys.argv[1], eval(sys.argv[2])
module = sys.argv[3] if len(sys.argv) > 3 else "sparsekv.kernels.topk_x"
sys.argv = ["topk_tuning.py", out, "main", module]
sys.path.insert(0, "results/scripts")
import topk_tuning as TT  # noqa: E402

for v in V:
    TT.CHK = v
    TT.checks()
    TT.rec(what="variant done", variant=str(v))
