"""Python cost of building the fused top-k's plan, uncached (the functions' __wrapped__) and cached (lru_cache), on
the machine it runs on: python results/scripts/topk_plan_cost.py OUT.json. Made results/topk-plan-cost-cpu.json."""
import json, platform, sys, timeit
from sparsekv.kernels.topk import _plan, _short_row_plan

cases = {"_plan 131072, k 2048, 32 rows": (_plan, (131072, 2048, 32, 132, None, None, None, None, 5.0)),
         "_plan 8192, k 128, every score (cap 8192)": (_plan, (8192, 128, 32, 132, None, None, 8192, None, 5.0)),
         "_short_row_plan 8192, k 128, 32 rows": (_short_row_plan, (8192, 128, 32, 132, None, None, 5.0))}
res = {"machine": platform.processor() or platform.machine(), "python": platform.python_version(), "us_per_call": {}}
for name, (fn, args) in cases.items():
    n = 5000
    unc = timeit.timeit(lambda: (_plan.cache_clear(), _short_row_plan.cache_clear(), fn(*args)), number=n) / n * 1e6
    fn(*args)
    cached = timeit.timeit(lambda: fn(*args), number=n * 10) / (n * 10) * 1e6
    res["us_per_call"][name] = {"uncached": round(unc, 2), "cached": round(cached, 3)}
    print(name, res["us_per_call"][name])
json.dump(res, open(sys.argv[1], "w"), indent=1)
