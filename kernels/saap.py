"""SAAP's visited inverted lists in Triton: one pass over the keys' bucket ids writes the positions of the keys of the
chosen buckets into a fixed-size output, in CSR order (the chosen lists end to end, best bucket first).

Each program takes one chunk of positions of one (batch row, selection head): it reads the bucket and the list
ordinal of each key (8 bytes a key, against the 2·D·2 bytes of its K/V in 16 bits), looks up its bucket's first
slot in the step's small table `bases` (-1: not visited) and stores the position at base + ordinal (ordinals are
negative in newest-first lists, whose bases are then the buckets' last slot + 1: sparsekv/saap/lists.py). Slots are
unique (a bucket's keys have distinct ordinals), so there are no atomics and no ordering between programs; slots
never written keep the -1 the output is filled with. Grid sizes and the output's shape depend on the host bounds
only, and the rows' own bounds are read on the device: the launch can be captured in a CUDA graph.

Reference: `kernels/reference.py::bucket_gather_reference` (same arguments).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 4096  # positions per program: 32 programs per head at 131072 keys


@triton.jit
def _bucket_gather_kernel(BKT, ORD, BASE, OUT, ROW_LO, ROW_HI,
                          s_kb, s_kh, s_bb, s_bh, s_ob, s_oh,
                          n_sel_heads, sel_per_kv, lo, hi, cap, chunk,
                          ROWS: tl.constexpr, BLOCK: tl.constexpr):
    c = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // n_sel_heads
    hs = bh % n_sel_heads
    kv = hs // sel_per_kv
    r_lo = lo
    r_hi = hi
    if ROWS:  # this row's own region (a graph-replayed step scans the region of the longest row)
        r_lo = tl.maximum(r_lo, tl.load(ROW_LO + b).to(tl.int32))
        r_hi = tl.minimum(r_hi, tl.load(ROW_HI + b).to(tl.int32))
    start = lo + c * chunk
    stop = tl.minimum(start + chunk, hi)
    k_off = b.to(tl.int64) * s_kb + kv * s_kh
    for s0 in range(start, stop, BLOCK):
        p = s0 + tl.arange(0, BLOCK)
        ok = (p < stop) & (p >= r_lo) & (p < r_hi)
        bk = tl.load(BKT + k_off + p, mask=ok, other=0)
        od = tl.load(ORD + k_off + p, mask=ok, other=0)
        base = tl.load(BASE + b * s_bb + hs * s_bh + bk, mask=ok, other=-1)
        slot = base + od
        ok = ok & (base >= 0) & (slot < cap)
        tl.store(OUT + b.to(tl.int64) * s_ob + hs * s_oh + slot, p.to(tl.int64), mask=ok)


def bucket_gather(buckets: torch.Tensor, ordinals: torch.Tensor, bases: torch.Tensor, cap: int, lo: int, hi: int,
                  row_lo: torch.Tensor | None = None, row_hi: torch.Tensor | None = None,
                  block: int = 1024) -> torch.Tensor:
    """Contract of `reference.bucket_gather_reference`: int64 [B, Hs, cap], -1 where no key lands."""
    B, Hkv, _ = buckets.shape
    Hs = bases.shape[1]
    out = torch.full((B, Hs, cap), -1, dtype=torch.int64, device=buckets.device)
    if hi <= lo or cap <= 0:
        return out
    if buckets.stride(-1) != 1 or ordinals.stride() != buckets.stride():
        raise ValueError("buckets and ordinals must share a layout with contiguous positions")
    bases = bases.to(torch.int32).contiguous()
    rows = row_lo is not None or row_hi is not None
    bounds = [bases, bases]  # unread without `rows`
    if rows:  # [B] int32 on the device
        bounds = [(torch.full((B,), d, device=buckets.device) if t is None else t.reshape(-1).expand(B))
                  .to(torch.int32).contiguous() for t, d in ((row_lo, lo), (row_hi, hi))]
    grid = (triton.cdiv(hi - lo, CHUNK), B * Hs)
    _bucket_gather_kernel[grid](
        buckets, ordinals, bases, out, *bounds,
        buckets.stride(0), buckets.stride(1), bases.stride(0), bases.stride(1), out.stride(0), out.stride(1),
        Hs, Hs // Hkv, lo, hi, cap, CHUNK, ROWS=rows, BLOCK=block, num_warps=4)
    return out
