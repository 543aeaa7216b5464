"""CPU model of the fused top-k's select search (kernels/topk.py: `_thresholds`, `_choose`; 5-way, key space, from
the candidates' [min, max]) over the ~1.45 k candidates a sampled bound passes, 64 rows per kind: rounds per row, and
the mean of the maximum over 32 rows (a call ends with its slowest row). Variants: "clamp_late" (each round also
takes the min / max of the interval's keys and clamps the chosen part to them), "clamp_part" (the chosen part clamped
to its own keys' min / max: eight more values per reduction), "finish_B" (rounds only until at most B keys are left
in the interval, then those are ranked directly: `_sf` in the session-19 copy).

    python results/scripts/topk_select_tail_model.py

Output of session 19: results/topk-session19-h100.json["select_tail_model"]."""
import json
import sys

import numpy as np

N, K = 131072, 2048


def keys(x):
    b = x.astype(np.float32).view(np.int32).astype(np.int64)
    return np.where(b < 0, b ^ 0x7FFFFFFF, b) + (1 << 31)


def search(u, need, mode, limit=0):
    lo, hi = int(u.min()), int(u.max())
    above, binc, rounds = 0, len(u), 0
    while lo < hi and above + binc > K and binc > limit:
        q = max(((hi - lo + 1) * 858993459) >> 32, 1)
        ts = [min(lo + i * q, hi + 1) for i in (1, 2, 3, 4)]
        inb = u[(u >= lo) & (u <= hi)]
        c = [int((inb >= t).sum()) for t in ts]
        mn, mx = int(inb.min()), int(inb.max())
        if c[3] >= need:
            lo, n_in, n_up = ts[3], c[3], 0
        elif c[2] >= need:
            lo, hi, n_in, n_up = ts[2], ts[3] - 1, c[2], c[3]
        elif c[1] >= need:
            lo, hi, n_in, n_up = ts[1], ts[2] - 1, c[1], c[2]
        elif c[0] >= need:
            lo, hi, n_in, n_up = ts[0], ts[1] - 1, c[0], c[1]
        else:
            hi, n_in, n_up = ts[0] - 1, binc, c[0]
        if mode == "clamp_late":
            lo, hi = max(lo, mn), min(hi, mx)
        if mode == "clamp_part":
            part = inb[(inb >= lo) & (inb <= hi)]
            lo, hi = int(part.min()), int(part.max())
        above += n_up
        need -= n_up
        binc = n_in - n_up
        rounds += 1
    return rounds


def main():
    rng = np.random.default_rng(0)
    kinds = {"randn": lambda: rng.standard_normal(N), "exp": lambda: rng.exponential(size=N),
             "unif": lambda: rng.random(N), "attn": lambda: rng.standard_normal(N) * 2 + 6 * (rng.random(N) < 0.01),
             "logits": lambda: rng.standard_normal(N) * 3 + 30}
    variants = [("plain", "plain", 0), ("clamp_late", "clamp_late", 0), ("clamp_part", "clamp_part", 0),
                ("finish_8", "plain", 8), ("finish_32", "plain", 32), ("finish_64", "plain", 64)]
    out = {}
    for name, gen in kinds.items():
        rounds = {v[0]: [] for v in variants}
        for _ in range(64):
            u = keys(gen())
            cand = u[u >= np.sort(u)[::-1][int(K * 1.45)]]
            for label, mode, limit in variants:
                rounds[label].append(search(cand, K, mode, limit))
        out[name] = {label: dict(mean=round(float(np.mean(r)), 2), max=int(max(r)),
                                 max_of_32=float(np.mean([max(r[:32]), max(r[32:])]))) for label, r in rounds.items()}
        print(name, json.dumps(out[name]), flush=True)
    if len(sys.argv) > 1:
        json.dump(out, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
