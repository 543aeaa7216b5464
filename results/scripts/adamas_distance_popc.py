"""Adamas distance kernel: SWAR byte sums (popc=0) against one POPC per int32 plane (1) and int64 lane pairs
through a carry-save adder (2), exactness on odd shapes, then CUDA-graph timings at the llama3-8b shape; 1-bit codes
too. usage: python results/scripts/adamas_distance_popc.py OUT.json (results/adamas-distance-popc-h100.json)."""
import json, sys, itertools
import torch
from triton.testing import do_bench_cudagraph as dbg
import sparsekv.kernels.adamas as KA
from sparsekv.kernels.reference import adamas_distance_reference
torch.manual_seed(0)
rows = []
def rec(**kw):
    rows.append(kw); print(kw, flush=True)
    json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, open(sys.argv[1], "w"), indent=1)
# exactness on odd shapes first (int16 lanes, odd word counts, both pools, GQA 1/4/8)
for (B, Hq, Hkv, L, d) in [(1, 32, 8, 1000, 128), (2, 8, 1, 777, 64), (1, 4, 4, 333, 96), (1, 16, 2, 513, 80)]:
    W = (d + 7) // 8
    kw_ = torch.randint(-32768, 32767, (B, Hkv, L + 5, W), dtype=torch.int16, device="cuda")
    qw = torch.randint(-32768, 32767, (B, Hq, W), dtype=torch.int16, device="cuda")
    for pool in (None, "sum", "min"):
        r = adamas_distance_reference(qw, kw_[:, :, :L], d, 2, "l1", pool=pool).to("cuda")
        ok = {m: torch.equal(KA._launch_distance(qw, kw_, L, d, 2, "l1", pool, torch.int32, False, None, 4, popc=m), r)
              for m in (0, 1, 2)}
        # 1-bit (Hamming) too
        W1 = (d + 15) // 16
        k1 = torch.randint(-32768, 32767, (B, Hkv, L + 5, W1), dtype=torch.int16, device="cuda")
        q1 = torch.randint(-32768, 32767, (B, Hq, W1), dtype=torch.int16, device="cuda")
        r1 = adamas_distance_reference(q1, k1[:, :, :L], d, 1, "l1", pool=pool).to("cuda")
        ok1 = {m: torch.equal(KA._launch_distance(q1, k1, L, d, 1, "l1", pool, torch.int32, False, None, 4, popc=m), r1)
               for m in (0, 1)}
        rec(check=[B, Hq, Hkv, L, d, pool], ok_2bit=ok, ok_1bit=ok1)
for seq in (131072, 32768):
    n = seq - 1
    codes = torch.randint(-32768, 32767, (1, 8, seq, 16), dtype=torch.int16, device="cuda")
    qw = torch.randint(-32768, 32767, (1, 32, 16), dtype=torch.int16, device="cuda")
    for pool in (None, "sum"):
        ref = KA._launch_distance(qw, codes, n, 128, 2, "l1", pool, torch.int16, False, None, 4, popc=False)
        for popc, bl, nw in itertools.product((0, 1, 2), (128, 256, 512), (4, 8)):
            f = lambda: KA._launch_distance(qw, codes, n, 128, 2, "l1", pool, torch.int16, False, bl, nw, popc=popc)
            same = torch.equal(f(), ref)
            rec(seq=seq, pool=pool or "head", popc=popc, block_l=bl, warps=nw, same=same, us=dbg(f, rep=100) * 1000)

# LSH-shaped 1-bit codes (128 bits = 8 int16 words per key)
for seq in (131072, 32768):
    n = seq - 1
    codes = torch.randint(-32768, 32767, (1, 8, seq, 8), dtype=torch.int16, device="cuda")
    qw = torch.randint(-32768, 32767, (1, 32, 8), dtype=torch.int16, device="cuda")
    for pool in (None, "sum"):
        ref = KA._launch_distance(qw, codes, n, 128, 1, "l1", pool, torch.int16, False, None, 4, popc=0)
        for popc in (0, 1):
            f = lambda: KA._launch_distance(qw, codes, n, 128, 1, "l1", pool, torch.int16, False, None, 4, popc=popc)
            rec(seq=seq, bits=1, pool=pool or "head", popc=popc, same=torch.equal(f(), ref), us=dbg(f, rep=100) * 1000)
