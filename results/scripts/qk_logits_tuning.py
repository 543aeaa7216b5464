"""python results/scripts/qk_logits_tuning.py OUT.json (needs CUDA; made results/qk-logits-tuning-h100.json).
qk_logits tuning at the llama3-8b shape: every key of 131072 (the oracle) and 32 x 8188 indices per query head
(--rerank 4 at budget 2048), CUDA-graph replay, plus the rest of the re-rank (softmax, top-k, gather)."""
import json, sys, torch
from triton.testing import do_bench_cudagraph
from sparsekv.kernels.sparse_decode import qk_logits
from sparsekv.selection import topk
torch.manual_seed(0)
dev = "cuda"
B, Hkv, G, L, D = 1, 8, 4, 131072, 128
q = torch.randn(B, Hkv * G, 1, D, device=dev, dtype=torch.bfloat16)
k = torch.randn(B, Hkv, L, D, device=dev, dtype=torch.bfloat16)
m = 4 * 2047
idx_h = torch.stack([torch.randperm(L, device=dev)[:m] for _ in range(Hkv * G)]).view(B, Hkv * G, m)
idx_g = torch.stack([torch.randperm(L, device=dev)[:m] for _ in range(Hkv)]).view(B, Hkv, m)
res = {"device": torch.cuda.get_device_name(), "rows": []}
def t(fn):
    fn(); torch.cuda.synchronize()
    return round(do_bench_cudagraph(fn, rep=100) * 1e3, 1)
def rec(**kw):
    res["rows"].append(kw); print(kw, flush=True)
for name, idx in (("head", idx_h), ("group", idx_g)):
    for bn in (16, 32, 64, 128):
        for nw in (2, 4, 8):
            for waves in (2, 4, 8):
                try:
                    rec(case=name, block_n=bn, num_warps=nw, waves=waves,
                        us=t(lambda: qk_logits(q, k, idx, block_n=bn, num_warps=nw, waves=waves)))
                except Exception as e:
                    rec(case=name, block_n=bn, num_warps=nw, waves=waves, error=str(e)[:100])
for bn in (64, 128):
    for ns in (2, 3, 4):
        rec(case="every", block_n=bn, num_stages=ns, us=t(lambda: qk_logits(q, k, block_n=bn, num_stages=ns)))
lg = qk_logits(q, k, idx_h)
rec(case="softmax head", us=t(lambda: torch.softmax(lg * D**-0.5, dim=-1)))
sc = torch.softmax(lg * D**-0.5, dim=-1)
rec(case="topk 32 x 8188 k 2047", us=t(lambda: topk(sc, 2047)))
sel = topk(sc, 2047)
rec(case="gather", us=t(lambda: torch.gather(idx_h, 2, sel)))
json.dump(res, open(sys.argv[1], "w"), indent=1)
