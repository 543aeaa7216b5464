"""sparse_decode for one-row selection heads: products in registers (_DOT_MIN_ROWS = 2) against tl.dot (1); qk_logits per query head.
usage: python results/scripts/sparse_decode_one_row.py OUT.json (run H of results/code-topk-fused-h100-session24.json; H100 output there). Needs results/sparse-decode-one-row-session24.patch applied."""
import json, sys, torch, itertools
from triton.testing import do_bench_cudagraph as dbg
import sparsekv.kernels.sparse_decode as SD
from sparsekv.kernels.reference import sparse_decode_reference, qk_logits_reference
from sparsekv.selection import Selection
from profile_util import sorted_indices, sparse_inputs  # results/scripts/profile_util.py
torch.manual_seed(0)
L = 131072
K, V, q = sparse_inputs(L)
idx = sorted_indices  # the name the loops below use
cases = {"head_2047_w1": (32, 2047, 0, 1), "group_2048_s128_w512": (8, 2048, 128, 512)}
rows = []
for name, (H, n, sink, win) in cases.items():
    sels = [Selection(L, sink, win, indices=idx(H, n, sink, L - win), padded=False) for _ in range(4)]
    ref = sparse_decode_reference(q, K, V, sels[0], 0.088)
    for dmin, bn, waves, nw in itertools.product((1, 2), (32, 64, 128), (2, 4, 8), (4, 8)):
        if (H == 8 or dmin == 1) and (bn, waves, nw) != (64, 4, 4):
            continue  # the old path (and per KV head, where both run tl.dot): the defaults only (run F swept them)
        SD._DOT_MIN_ROWS = dmin
        kw = dict(block_n=bn, waves=waves, num_warps=nw)
        out = SD.sparse_decode(q, K, V, sels[0], 0.088, **kw)
        err = (out.float() - ref.float()).abs().max().item()
        f = lambda: [SD.sparse_decode(q, K, V, s, 0.088, **kw) for s in sels]
        r = dict(case=name, dot_min_rows=dmin, **kw, us=round(dbg(f, rep=100) * 1000 / 4, 2), err=err)
        rows.append(r); print(r, flush=True)
# qk_logits per query head (the re-rank's 8192 candidates per head)
cand = idx(32, 8192, 0, L)
lref = qk_logits_reference(q, K, cand)
for dmin in (1, 2):
    SD._DOT_MIN_ROWS = dmin
    f = lambda: SD.qk_logits(q, K, cand)
    err = (f() - lref).abs().max().item()
    r = dict(case="qk_logits_head_8192", dot_min_rows=dmin, us=round(dbg(f, rep=100) * 1000, 2), err=err)
    rows.append(r); print(r, flush=True)
SD._DOT_MIN_ROWS = 2
json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, open(sys.argv[1], "w"), indent=1)
