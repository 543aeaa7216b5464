"""Pool NIAH 8K per-prompt scores over all prompt sets: dense vs adamas ip 64/128, paired bootstrap of the ratio.

    python results/scripts/niah8k_pool.py

Reads the niah8k groups of results/adamas-ip-smollm2-h100.json (seeds 42, 7, 1) and
results/adamas-ip-niah8k-seeds2-5-smollm2-h100.json (seeds 2-5); prints per-set scores, the pooled means and 95 %
bootstrap intervals (4000 resamples of prompts, paired) of adamas / dense and adamas - dense."""
import json, random
old = json.load(open("results/adamas-ip-smollm2-h100.json"))["groups"]
groups = {k: v for k, v in old.items() if k.startswith("niah8k")}
groups.update(json.load(open("results/adamas-ip-niah8k-seeds2-5-smollm2-h100.json"))["groups"])
per = {}  # label -> list of per-prompt scores (aligned across labels)
rows = []
for name, g in groups.items():
    cells = {c["label"]: c for c in g["cells"]}  # dense, adamas-ip-64, adamas-ip-128
    n = len(cells["dense"]["samples"])
    rows.append((name, n, {l: round(c["score"], 1) for l, c in cells.items()}))
    for l, c in cells.items():
        assert len(c["samples"]) == n
        per.setdefault(l, []).extend(s["score"] for s in c["samples"])
for r in rows: print(r)
N = len(per["dense"]); print("prompts", N)
mean = {l: 100 * sum(v) / N for l, v in per.items()}
print({l: round(m, 2) for l, m in mean.items()})
random.seed(0)
for l in ("adamas-ip-64", "adamas-ip-128"):
    rs, ds = [], []
    for _ in range(4000):
        idx = [random.randrange(N) for _ in range(N)]
        d = sum(per["dense"][i] for i in idx); a = sum(per[l][i] for i in idx)
        rs.append(a / d); ds.append(100 * (a - d) / N)
    rs.sort(); ds.sort()
    print(l, "ratio", round(mean[l] / mean["dense"], 3), "95% CI", round(rs[100], 3), round(rs[3899], 3),
          "diff", round(mean[l] - mean["dense"], 2), "CI", round(ds[100], 2), round(ds[3899], 2))
