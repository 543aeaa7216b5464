"""Pool NIAH 8K per-prompt scores over all prompt sets; paired bootstrap of each row against dense.

    python results/scripts/niah8k_pool.py

Reads the niah8k groups of results/adamas-ip-smollm2-h100.json (seeds 42, 7, 1; dense and adamas ip 64 / 128),
results/adamas-ip-niah8k-seeds2-5-smollm2-h100.json (seeds 2-5, the same rows) and
results/adamas-ip-oracle-niah8k-smollm2-h100.json (session 16, on the same prompts: the exact top-128 / 256 / 512
per query head, ip at 256 and 512, the re-rank prototype at 128 and 512). Each table pools the prompts that every
row in it has (a group cut by a deadline counts its first prompts); it prints per-set scores, the pooled means, and
95 % bootstrap intervals (4000 resamples of prompts, paired) of row / dense and row - dense."""
import json, random

TABLES = (["dense", "adamas-ip-64", "adamas-ip-128"],
          ["dense", "adamas-ip-64", "adamas-ip-128", "oracle-128-head", "adamas-ip-rr4-128"],
          ["dense", "adamas-ip-128", "oracle-128-head", "adamas-ip-256", "oracle-256-head"],
          ["dense", "adamas-ip-128", "oracle-128-head", "adamas-ip-512", "oracle-512-head"],
          ["dense", "adamas-ip-512", "oracle-512-head", "adamas-ip-rr4-512"])

old = json.load(open("results/adamas-ip-smollm2-h100.json"))["groups"]
cells_by_seed = {}  # seed -> label -> cell
for g in [v for k, v in old.items() if k.startswith("niah8k")] + \
        list(json.load(open("results/adamas-ip-niah8k-seeds2-5-smollm2-h100.json"))["groups"].values()) + \
        list(json.load(open("results/adamas-ip-oracle-niah8k-smollm2-h100.json"))["groups"].values()):
    for c in g["cells"]:
        cells_by_seed.setdefault(g["group"]["seed"], {})[c["label"]] = c


def key(s):
    return s["subtask"], s["depth"], s["answer"]


def pool(labels):
    per = {l: [] for l in labels}
    for seed, cells in cells_by_seed.items():
        if not all(l in cells for l in labels):
            continue
        m = min(len(cells[l]["samples"]) for l in labels)
        for l in labels:
            ss = cells[l]["samples"][:m]
            assert [key(s) for s in ss] == [key(s) for s in cells["dense"]["samples"][:m]], "prompts differ"
            per[l].extend(s["score"] for s in ss)
        print(f"  seed {seed} ({m} prompts):", {l: round(100 * sum(s["score"] for s in cells[l]["samples"][:m]) / m, 1)
                                                 for l in labels})
    n = len(per["dense"])
    mean = {l: 100 * sum(v) / n for l, v in per.items()}
    print(f"  pooled, {n} prompts:", {l: round(m, 2) for l, m in mean.items()})
    random.seed(0)
    for l in labels[1:]:
        rs, ds = [], []
        for _ in range(4000):
            idx = [random.randrange(n) for _ in range(n)]
            d = sum(per["dense"][i] for i in idx); a = sum(per[l][i] for i in idx)
            rs.append(a / d); ds.append(100 * (a - d) / n)
        rs.sort(); ds.sort()
        print(f"  {l}: ratio {mean[l] / mean['dense']:.3f} (95 % CI {rs[100]:.3f}-{rs[3899]:.3f}), "
              f"diff {mean[l] - mean['dense']:+.2f} (CI {ds[100]:+.2f} to {ds[3899]:+.2f})")


for labels in TABLES:
    print(" / ".join(labels))
    pool(labels)
