"""Time code_ip_scores (distance "ip") on the H100 at llama3-8b's shape over block and warp settings, against the
L1 code distance of the same codes. CUDA-graph replay
(triton.testing.do_bench_cudagraph), 4 key buffers rotated so the codes come from HBM.

    python results/scripts/adamas_ip_kernel.py OUT.json [SEQ ...]
"""
import json, os, sys, itertools
import torch
import triton
from sparsekv.kernels.adamas import code_ip_scores, code_distance, quantize_pack
from sparsekv.kernels.reference import adamas_bucket_centers, adamas_ip_scores_reference

out, seqs = sys.argv[1], [int(s) for s in sys.argv[2:]] or [131072, 32768]
PLAN = [(128, 4), (256, 4), (512, 8), (1024, 4)]  # (block_l, num_warps)
if os.environ.get("IP_PLAN"):  # e.g. 256:4,512:8
    PLAN = [(int(b), int(w)) for b, w in (x.split(":") for x in os.environ["IP_PLAN"].split(","))]
B, Hkv, G, D = 1, 8, 4, 128
res = {"device": torch.cuda.get_device_name(), "shape": "llama3-8b (8 KV x 4 query heads, D 128), 2-bit codes", "runs": []}
th = torch.tensor([-1.0, 0.0, 1.0], device="cuda").expand(Hkv, 3).contiguous() * torch.linspace(0.5, 2, Hkv, device="cuda")[:, None]
cen = adamas_bucket_centers(th)


def bench(fn):
    """µs per call: the four key buffers in turn, inside one CUDA graph (do_bench_cudagraph)."""
    return triton.testing.do_bench_cudagraph(lambda: [fn(i) for i in range(4)], rep=200) * 1000 / 4


for L in seqs:
    words = [quantize_pack(torch.randn(B, Hkv, L, D, device="cuda", dtype=torch.bfloat16), th) for _ in range(4)]
    q = torch.randn(B, Hkv * G, D, device="cuda")
    # correctness at this size, both paths and pools
    for pool in (None, "sum"):
        a = code_ip_scores(q, words[0], cen, L, D, pool=pool)
        r = adamas_ip_scores_reference(q, words[0], cen, D, pool=pool)
        err = float((a - r).abs().max() / r.abs().max())
        assert err < 1e-5, (pool, err)
    qw = quantize_pack(q[:, :, None].to(torch.bfloat16), th)[:, :, 0]
    for pool in (None, "sum"):
        row = {"seq": L, "pool": pool}
        row["l1_distance_us"] = bench(lambda i: code_distance(qw, words[i % 4], L, D, pool=pool))
        for bl, nw in PLAN:
            try:
                t = bench(lambda i: code_ip_scores(q, words[i % 4], cen, L, D, pool=pool, block_l=bl,
                                                   num_warps=nw))
            except Exception as e:  # out of resources
                t = f"{type(e).__name__}: {str(e)[:80]}"
            row[f"ip_bl{bl}_w{nw}_us"] = t
        print(json.dumps(row), flush=True)
        res["runs"].append(row)
json.dump(res, open(out, "w"), indent=1)
