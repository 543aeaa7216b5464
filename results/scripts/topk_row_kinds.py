"""The row kinds of the top-k timing scripts (zero-centred, offset (logits, negative, scaled), uniform, exponential and
attention-like score rows) and their shared timing and trace helpers."""
import time

import torch

KINDS = ("randn", "logits", "neg", "scaled", "unif", "exp", "attn")


def gen(d, rows=32, n=131072, dev="cuda"):
    x = torch.randn(rows, n, device=dev)
    if d == "logits": return x * 3 + 30
    if d == "neg": return -100 - torch.empty_like(x).exponential_()
    if d == "scaled": return x * 0.05 + 4
    if d == "unif": return torch.rand_like(x)
    if d == "exp": return torch.empty_like(x).exponential_()
    if d == "attn": return x * 2 + 6 * (torch.rand_like(x) < 0.01).float()
    return x


def candidate_counts(M, kw, d, plan, total, rows=32, n=131072, k=2048):
    """Each row's candidate count (the sum of its per-chunk counts, read from the call's own scratch) for `total`
    fresh rows of kind d, `rows` a call, through module M's topk with knobs kw and plan `plan`."""
    got = []
    for _ in range(total // rows):
        x = gen(d, rows, n)
        M.topk(x, k, **kw)
        got.append(M._fused_scratch(x.device, rows, plan["p"], plan["chunk"])["cnt"].sum(1))
    return torch.cat(got)


def time_rows(d, rows, n, k, dt, fns, passes, out, t0, save):
    """CUDA-graph time of each (name, topk, knobs) in fns over 4 rotated inputs of kind d, each call checked against
    the reference; one record per function and pass appended to `out`, `save()` after each pass."""
    from triton.testing import do_bench_cudagraph
    from sparsekv.kernels.reference import topk_reference
    torch.manual_seed(0)
    xs = [gen(d, rows, n).to(dt) for _ in range(4)]
    refs = [topk_reference(x, k) for x in xs]
    for _ in range(passes):
        for name, fn, kw in fns:
            try:
                ok = all(torch.equal(fn(x, k, _path="fused", **kw), r) for x, r in zip(xs, refs))
                def run():
                    for x in xs: fn(x, k, _path="fused", **kw)
                us = do_bench_cudagraph(run, rep=200) * 1e3 / 4
            except Exception as e:
                r = dict(dist=d, shape=[rows, n, k, str(dt)], kernel=name, kw=str(kw), error=repr(e)[:400])
                out.append(r); print(r, flush=True); continue
            r = dict(dist=d, shape=[rows, n, k, str(dt)], kernel=name, kw=str(kw), exact=ok, us_rot=round(us, 2),
                     t=round(time.time() - t0))
            out.append(r); print(r, flush=True)
        save()


def trace_rows(fn, kw, x, k, P, calls=8, drop=3):
    """Per-phase times of one input (L2-warm; `calls` calls, the first `drop` dropped), from the `_trace` slots: per
    row the bound known (max over its P programs), compacted (max), gathered, searched and end, in us from the first
    program's start; the median row (each column's median over the rows) and the slowest one, medians over calls."""
    rows = x.shape[0]
    buf = torch.zeros(rows * P * 8, dtype=torch.int64, device=x.device)
    got = []
    for c in range(calls):
        buf.zero_(); fn(x, k, _path="fused", _trace=buf, **kw); torch.cuda.synchronize()
        if c < drop: continue
        t = buf.view(rows * P, 8).double(); t0_ = t[:, 0].min()
        per_row = []
        for r in range(rows):
            g = t[r * P:(r + 1) * P]; sel = g[g[:, 6] == 1][0]
            ends = (g[:, 1].max(), g[:, 2].max(), sel[4], sel[7], sel[3])
            per_row.append([round(float(v - t0_) / 1e3, 2) for v in ends])
        got.append(per_row)
    med = torch.tensor(got).median(0).values
    return dict(cols=["bound known", "compacted", "gathered", "searched", "end"],
                median_row=[round(float(v), 2) for v in med.median(0).values],
                slowest_row=[round(float(v), 2) for v in med[med[:, 4].argmax()]])
