"""CPU: how often the fused top-k's sampled bound fails with sample groups of G adjacent scores (8 in the kernel;
`_g` in the session-19 copy), on randn rows whose top scores come in runs of w adjacent positions (+6 over a fraction
of the row, as retrieval-like attention rows). A failure sends the row to a fallback: fewer than k candidates (the
row read again) or more than CAP (the candidate slices searched from memory). S = 8192, J and J_HI as `_plan` sets
them for 32 x 131072, k 2048; the bound modelled as the sample's J-th largest value. 400 rows per case.

    python results/scripts/topk_sample_groups.py [OUT.json]

Output of session 19: results/topk-session19-h100.json["sample_group_model"]."""
import json
import math
import sys

import numpy as np

N, K, S, CAP = 131072, 2048, 8192, 4096
E = K * S / N
J = math.ceil(E + 5 * math.sqrt(E)) + 2


def main():
    rng = np.random.default_rng(0)

    def row(w, frac):
        x = rng.standard_normal(N).astype(np.float32)
        if w:
            for s0 in rng.integers(0, N - w, int(frac * N / w)):
                x[s0:s0 + w] += 6
        return x

    out = []
    for w, frac in [(0, 0), (16, 0.02), (64, 0.02), (256, 0.02), (1024, 0.02), (64, 0.005), (256, 0.005)]:
        rec = dict(run=w, covered=frac)
        for g in (8, 16, 32):
            few = many = 0
            for _ in range(400):
                x = row(w, frac)
                i = np.arange(S)
                pos = (i // g) * (N // (S // g)) + (i % g)
                bound = np.sort(x[pos])[::-1][J - 1]
                c = int((x >= bound).sum())
                few += c < K
                many += c > CAP
            rec[f"G{g}"] = dict(fewer_than_k=few / 400, over_cap=many / 400)
        out.append(rec)
        print(json.dumps(rec), flush=True)
    if len(sys.argv) > 1:
        json.dump(out, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
