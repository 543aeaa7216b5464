"""Session 21: registers and spills of the fused top-k kernel as compiled (fp32 and bf16 rows, 32 x 131072, k 2048),
the library one tile at a time against the experimental copy's tiles two at a time (`_pk`), and the bound program's
times per row from the `_trace` slots (L2-warm, 8 calls, the first 3 dropped; medians over the calls, then the rows).

    git show 3853bb2:kernels/topk.py > kernels/topk_x.py && patch -p1 kernels/topk_x.py < results/topk-session21-experiments.patch
    python results/scripts/topk_pairs_diag.py

(kernels/topk.py as of c72aafd). Needs CUDA. Its printout is "pairs_diag" in results/topk-session21-h100.json."""
import torch
import sparsekv.kernels.topk as B
import sparsekv.kernels.topk_x as T
dev = "cuda"
def regs(fn, label):
    out = []
    for dc in fn.device_caches.values():
        for ck in dc[0].values():
            out.append((ck.n_regs, ck.n_spills, getattr(ck.metadata, "num_warps", None)))
    print(label, out, flush=True)
torch.manual_seed(0)
for dt in (torch.float32, torch.bfloat16):
    x = torch.randn(32, 131072, device=dev).to(dt)
    B.topk(x, 2048, _path="fused"); T.topk(x, 2048, _path="fused", _pk=1)
regs(B._topk_kernel, "adopted"); regs(T._topk_kernel, "x")
x = torch.randn(32, 131072, device=dev)
for name, fn, kw in [("adopted", B.topk, {}), ("pk", T.topk, dict(_pk=1))]:
    P = 4; buf = torch.zeros(32 * P * 8, dtype=torch.int64, device=dev)
    acc = []
    for c in range(8):
        buf.zero_(); fn(x, 2048, _path="fused", _trace=buf, **kw); torch.cuda.synchronize()
        if c < 3: continue
        t = buf.view(32, P, 8).double(); t0 = t[:, :, 0].min()
        b = (t[:, :, 5] == 1)  # the bound program of each row
        start_b = ((t[:, :, 0] - t0) * b).sum(1) / 1e3
        seen_b = ((t[:, :, 1] - t0) * b).sum(1) / 1e3
        seen_max = (t[:, :, 1] - t0).max(1).values / 1e3
        start_max = (t[:, :, 0] - t0).max(1).values / 1e3
        comp_b = ((t[:, :, 2] - t0) * b).sum(1) / 1e3
        comp_other = ((t[:, :, 2] - t0) * ~b).max(1).values / 1e3
        acc.append(torch.stack([start_b, seen_b, seen_max, start_max, comp_b, comp_other], 1))
    m = torch.stack(acc).median(0).values.median(0).values
    print(name, "median over rows: bound prog start, bound written(seen by it), seen by last, last start, bound prog compacted, others compacted:",
          [round(float(v), 2) for v in m], flush=True)
