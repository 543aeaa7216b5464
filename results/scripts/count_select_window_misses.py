"""How often the counting select's window misses on real Adamas distances (SmolLM2, eager decode: the row kernel).
Wraps count_select.smallest_k: after every call, reads the window histogram the call left and counts the rows whose
k-th smallest fell outside it. usage (GPU, the SmolLM2 GGUF in the model cache):
    python results/scripts/count_select_window_misses.py OUT.json
(results/count-select-window-misses-smollm2-h100.json; the essay haystack: $HAYSTACK, else Debian's jargon file)"""
import json, os, sys, time
import torch
import sparsekv.kernels.count_select as CS
from sparsekv.models import load_model
from sparsekv.eval.runner import RunSpec, run_grid
stats = {"calls": 0, "rows": 0, "missed_rows": 0, "missed_calls": 0, "n": {}, "k": {}}
orig = CS.smallest_k
def wrapped(values, k, max_value, **kw):
    out = orig(values, k, max_value, **kw)
    x = values.reshape(-1, values.shape[-1])
    rows, n = x.shape
    if rows and k:
        pl = CS.plan(n, rows, values.device, chunk=kw.get("_chunk"), tile=kw.get("_tile"))
        gh = CS._SCRATCH[(values.device, rows, pl["p"])]["gh"]
        cum = gh.cumsum(-1)
        miss = (cum[:, 0] >= k) | (cum[:, CS.WIN.value - 2] < k)
        m = int(miss.sum())
        stats["calls"] += 1; stats["rows"] += rows; stats["missed_rows"] += m; stats["missed_calls"] += m > 0
        stats["n"][str(n // 1024)] = stats["n"].get(str(n // 1024), 0) + 1
        stats["k"][str(k)] = stats["k"].get(str(k), 0) + 1
    return out
CS.smallest_k = wrapped
HAY = os.environ.get("HAYSTACK", "/usr/share/doc/jargon-text/jargon.txt.gz")
lm = load_model("smollm2-135m", device="cuda", dtype=torch.bfloat16, quiet=True)
ART = "results/artifacts/smollm2-135m-instruct-q4_1/adamas/v2"
res = []
for task, seq, n, budgets, topt in [("ruler", 4096, 2, (64, 128), {"subtasks": "niah", "haystack_file": HAY}),
                                    ("ruler", 8192, 1, (64,), {"subtasks": "niah", "haystack_file": HAY}),
                                    ("passkey", 4096, 10, (64,), {})]:
    for b in budgets:
        for key in ("calls", "rows", "missed_rows", "missed_calls"):
            stats[key] = 0
        t = time.time()
        cells = run_grid(lm, task, [RunSpec("adamas", b, {"artifact": ART})], seq, n, 42, (0, 1), task_options=topt)
        res.append(dict(task=task, seq=seq, n=n, budget=b, score=cells[0]["score"], seconds=round(time.time() - t, 1),
                        **{k: v for k, v in stats.items() if k not in ("n", "k")}))
        print(res[-1], flush=True)
        json.dump({"device": torch.cuda.get_device_name(), "rows": res}, open(sys.argv[1], "w"), indent=1)
