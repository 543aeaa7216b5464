"""Session 22: the library's fused top-k (kernels/topk.py) with its knobs, all in the same run: the select's candidate
window (`_window`, on by default: each chunk's candidates loaded into a window of lanes with the counts instead of
after them) and tiles two at a time (`_tile_pairs`). 32 x 131072 fp32, k 2048 on seven row kinds, then more shapes;
CUDA-graph timings over 4 rotated inputs, each checked against the reference; per-phase traces of one input (L2-warm,
8 calls, the first 3 dropped); registers / spills of each variant and, with SASS=DIR in the environment, its SASS for
32 x 131072 fp32, k 2048.

    python results/scripts/topk_session22.py OUT.json "[{}, dict(_window=False), dict(_tile_pairs=True)]" [main]

`main`: randn rows of the main shape only (and the traces). Needs CUDA."""
import json, os, sys, time, torch
import sparsekv.kernels.topk as B
sys.path.insert(0, "results/scripts")
from topk_row_kinds import KINDS, time_rows, trace_rows  # noqa: E402
dev = "cuda"; OUT = sys.argv[1]; t0 = time.time()
VARS = eval(sys.argv[2])
MAIN = sys.argv[3:] == ["main"]
res = dict(device=torch.cuda.get_device_name(), rows=[], traces=[], regs=[])
def save(): json.dump(res, open(OUT, "w"), indent=1)
FNS = [("library", B.topk, v) for v in VARS]
x = torch.randn(32, 131072, device=dev)
for kw in VARS:  # registers, spills (and SASS) of each variant's kernel, fp32 and bf16
    for dt in (torch.float32, torch.bfloat16):
        B._topk_kernel.device_caches.clear()
        B.topk(x.to(dt), 2048, _path="fused", **kw)
        for dc in B._topk_kernel.device_caches.values():
            for ck in dc[0].values():
                res["regs"].append(dict(kw=str(kw), dtype=str(dt), regs=ck.n_regs, spills=ck.n_spills))
                print(res["regs"][-1], flush=True)
                if os.environ.get("SASS") and dt == torch.float32:
                    try:
                        text = ck.asm["sass"]
                    except Exception as e:  # no disassembler: the PTX
                        text = f"// no sass: {e!r}\n" + ck.asm["ptx"]
                    tag = "_".join(f"{a}{b}" for a, b in kw.items()) or "default"
                    os.makedirs(os.environ["SASS"], exist_ok=True)
                    open(os.path.join(os.environ["SASS"], f"topk_{tag}.sass"), "w").write(text)
save()
for d in ("randn",) if MAIN else KINDS:
    time_rows(d, 32, 131072, 2048, torch.float32, FNS, 2 if d == "randn" else 1, res["rows"], t0, save)
for rows, n, k, dt in [(8, 131072, 2048, torch.float32), (32, 131072, 2048, torch.bfloat16),
                       (32, 32768, 2048, torch.float32), (32, 131072, 8192, torch.float32),
                       (32, 131072, 4096, torch.float32), (1, 131072, 2048, torch.float32),
                       (32, 8192, 128, torch.float32), (32, 16383, 2047, torch.float32)][:0 if MAIN else None]:
    time_rows("randn", rows, n, k, dt, FNS, 1, res["rows"], t0, save)
for kw in VARS:
    res["traces"].append(dict(kernel="library", kw=str(kw), **trace_rows(B.topk, kw, x, 2048, 4)))
    print(res["traces"][-1], flush=True); save()
