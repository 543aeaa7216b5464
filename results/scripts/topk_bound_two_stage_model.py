"""Session 22: a CPU model of the bound's rounds, one search over the whole sample (S = 8192, J 187, J_HI 198:
32 x 131072, k 2048) against the two-stage bound of the experimental copy (`_b2`: a bracket on half the sample, a
count of the full sample at its ends, the full sample's rounds from there), on 8 rows of each row kind; the same
fifths as `_thresholds`. Prints rounds per row and how often the bracket's check failed.

    python results/scripts/topk_bound_two_stage_model.py

Its printout: "two_stage_model" in results/topk-session22-cpu.json.
"""
import math, sys
import torch
def keys(x):  # u-space keys of fp32 (u = skey + 2**31)
    b = x.view(torch.int32).long()
    b = torch.where(b == -2**31, torch.zeros_like(b), b)
    s = b ^ ((b >> 31) & 0x7FFFFFFF)
    return s + 2**31
def thresholds(lo, hi):
    q = max(((hi - lo + 1) * 858993459) >> 32, 1); top = hi + 1
    return [min(lo + i * q, top) for i in (1, 2, 3, 4)]
def search(u, lo, hi, above, need, binc, stop):
    r = 0
    while lo < hi and above + binc > stop and need > 0:
        t = thresholds(lo, hi); n = [int((u >= ti).sum()) - above for ti in t]; r += 1
        d = [ni >= need for ni in n]
        if d[3]: lo, n_in, n_up = t[3], n[3], 0
        elif d[2]: lo, hi, n_in, n_up = t[2], t[3] - 1, n[2], n[3]
        elif d[1]: lo, hi, n_in, n_up = t[1], t[2] - 1, n[1], n[2]
        elif d[0]: lo, hi, n_in, n_up = t[0], t[1] - 1, n[0], n[1]
        else: hi, n_in, n_up = t[0] - 1, binc, n[0]
        above += n_up; need -= n_up; binc = n_in - n_up
    return lo, r
def bracket(u, lo, hi, RA, RB, WIDE):
    c_lo, c_hi, r = 2**31, 0, 0
    go = lo < hi
    while go and c_lo - c_hi > WIDE:
        t = thresholds(lo, hi); n = [int((u >= ti).sum()) for ti in t]; r += 1
        nlo, nclo = lo, c_lo
        for ti, ni in zip(t, n):
            if ni >= RA: nlo, nclo = ti, ni
        nhi, nchi = hi, c_hi
        for ti, ni in reversed(list(zip(t, n))):
            if ni <= RB: nhi, nchi = ti - 1, ni
        go = (nlo != lo or nhi != hi) and nlo < nhi
        lo, hi, c_lo, c_hi = nlo, nhi, nclo, nchi
    return lo, hi, r
S, STRIDE, J, J_HI = 8192, 128, 187, 198
sys.path.insert(0, "results/scripts")
from topk_row_kinds import KINDS, gen
for zb in (3.0, 4.0):
    half = J / 2
    RA = math.ceil(half + zb * math.sqrt(J) / 2)
    RB = max(0, math.floor(half - zb * math.sqrt(J) / 2))
    WIDE = 2 * (RA - RB)
    for d in KINDS:
        torch.manual_seed(0)
        x = gen(d, 8, 131072, "cpu")
        tot0 = tot1 = tot2 = fails = 0
        for row in x:
            i = torch.arange(S); pos = (i // 8) * STRIDE + (i % 8)
            u = keys(row[pos]); ua = keys(row[(torch.arange(S // 2) // 8) * 2 * STRIDE + torch.arange(S // 2) % 8])
            L0, r0 = search(u, 1, 2**32 - 1, 0, J, S, J_HI)
            lo, hi, r1 = bracket(ua, 1, 2**32 - 1, RA, RB, WIDE)
            n_lo, n_hi = int((u >= lo).sum()), int((u > hi).sum())
            if n_lo >= J and n_hi < J:
                L1, r2 = search(u, lo, hi, n_hi, J - n_hi, n_lo - n_hi, J_HI)
            else:
                fails += 1; L1, r2 = search(u, 1, 2**32 - 1, 0, J, S, J_HI)
            assert int((u >= L0).sum()) >= J and int((u >= L1).sum()) >= J  # both bounds leave J sample keys
            tot0 += r0; tot1 += r1; tot2 += r2
        n = len(x)
        print(f"z {zb} {d:7s} full rounds {tot0/n:.2f} | half rounds {tot1/n:.2f} + check + full rounds "
              f"{tot2/n:.2f} | check failed {fails}/{n}  RA {RA} RB {RB} WIDE {WIDE}")
