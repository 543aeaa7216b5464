"""Sessions 22-23: how often a row's candidates overflow the select's window (a chunk with more than WIN candidates:
the row is gathered again, packed), per row count, from the kernel's per-chunk candidate counts after each call;
1024 fresh randn rows of 131072 scores per shape, k 2048, default plan and `_loop_rule`.

    python results/scripts/topk_window_overflow.py OUT.json

Needs CUDA."""
import json, sys, torch
import sparsekv.kernels.topk as B
res = dict(device=torch.cuda.get_device_name(), shapes=[])
dev = torch.device("cuda")
for rows in (1, 2, 4, 8, 16, 32):
    plan = B._plan(131072, 2048, rows, B.num_sms(dev))
    pairs, win = B._loop_rule(plan, 32)
    over = 0; counts = []
    for _ in range(1024 // rows):
        x = torch.randn(rows, 131072, device=dev)
        B.topk(x, 2048)
        cnt = B._fused_scratch(x.device, rows, plan["p"], plan["chunk"])["cnt"]  # the call's own scratch (cuda:0)
        over += int((cnt.max(1).values > win).sum()) if win else 0
        counts.append(cnt.float().mean().item())
    res["shapes"].append(dict(rows=rows, p=plan["p"], cap=plan["cap"], window=win, pairs=pairs,
                              rows_seen=1024 // rows * rows, rows_over_window=over,
                              mean_chunk_count=round(sum(counts) / len(counts), 2)))
    print(res["shapes"][-1], flush=True)
json.dump(res, open(sys.argv[1], "w"), indent=1)
