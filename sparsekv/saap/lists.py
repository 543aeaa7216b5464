"""SAAP's inverted lists on the device, grown one key at a time without a rebuild.

The paper's index (Appendix F) is CSR: Off [C + 1] and Idx [N], bucket c's keys at Idx[Off[c] : Off[c + 1]]. A
CSR array must be rebuilt (or shifted) to take a new key, so the decode state keeps the same lists in scattered
form, per (batch row, KV head):
  buckets  [B, H, max_len] int32: the bucket of the key at each position (C: no key there yet);
  ordinals [B, H, max_len] int32: its index in its bucket's list (a bucket's keys in position order);
  counts   [B, H, C + 1]  int32: each list's length (the last column takes the "no key" sentinel).
A key's bucket is recorded when it is appended (`record`); it joins its bucket's list when it leaves the dense
window (`admit`), so the lists hold exactly the keys the sparse part chooses from (positions [sink, length -
window) of a layer without a sliding window) and a visited list has no key the window attends anyway. Both are a
gather and a few scatters at device positions in a decode step (no host read, fixed shapes: graph-capturable); a
prefill chunk takes n keys at once.
The CSR of the visited buckets is what a step reads: `slot_bases` gives each chosen bucket's first slot in a
fixed-size output (the chosen lists end to end, best bucket first) and the key at position p lands in slot
base[bucket[p]] + ordinals[p] (`ops.bucket_gather`): the keys the paper's kernel reads through Idx, in its order.

Newest first (`newest_first=True`, the same flag to admit, admit_at and slot_bases): each list is laid out newest
key first, so that an output cut at its last slot drops the OLDEST keys of the bucket it cuts. The ordinals are then
stored as -1 - index (a key's index in its list does not change as the list grows, so nothing is rewritten), and a
chosen bucket's base is its first slot plus its length: slot = start + n - 1 - index, in [start, start + n) as
before. The gather (kernel and reference) is unchanged: slot = base + ordinal, kept while base >= 0 and slot < cap.
"""

from __future__ import annotations

import torch


def new_lists(batch: int, heads: int, max_len: int, clusters: int, device) -> tuple[torch.Tensor, ...]:
    """Empty (buckets, ordinals, counts) for a cache of max_len slots."""
    buckets = torch.full((batch, heads, max_len), clusters, dtype=torch.int32, device=device)
    ordinals = torch.zeros(batch, heads, max_len, dtype=torch.int32, device=device)
    counts = torch.zeros(batch, heads, clusters + 1, dtype=torch.int32, device=device)
    return buckets, ordinals, counts


def record(buckets: torch.Tensor, new: torch.Tensor, pos: int | torch.Tensor) -> None:
    """Write the buckets `new` [B, H, n] of keys at positions [pos, pos + n): `pos` a host int, or in a decode step
    (n = 1) the device slots [B]."""
    if isinstance(pos, int):
        buckets[:, :, pos : pos + new.shape[2]] = new.to(buckets.dtype)
    else:
        buckets[torch.arange(new.shape[0], device=new.device), :, pos.long()] = new[:, :, 0].to(buckets.dtype)


def admit(buckets: torch.Tensor, ordinals: torch.Tensor, counts: torch.Tensor, start: int, n: int,
          newest_first: bool = False) -> None:
    """Append the keys at positions [start, start + n) (buckets recorded) to their lists, in position order
    (`newest_first`: ordinals stored as -1 - index, module docstring)."""
    if n <= 0:
        return
    new = buckets[:, :, start : start + n].long()
    srt, order = torch.sort(new, dim=-1, stable=True)  # each key's rank among the chunk's keys of its bucket
    per = torch.zeros_like(counts).scatter_add_(-1, new, torch.ones_like(new, dtype=counts.dtype))
    first = (per.cumsum(-1) - per).gather(-1, srt)  # where each sorted key's bucket starts in the sorted chunk
    rank = torch.arange(n, device=new.device) - first
    ordinal = torch.empty_like(rank).scatter_(-1, order, counts.gather(-1, srt) + rank)
    ordinals[:, :, start : start + n] = (-1 - ordinal if newest_first else ordinal).to(ordinals.dtype)
    counts += per


def admit_at(buckets: torch.Tensor, ordinals: torch.Tensor, counts: torch.Tensor, pos: torch.Tensor,
             valid: torch.Tensor, newest_first: bool = False) -> None:
    """One key per batch row, at device positions pos [B] (rows where `valid` [B] is False take none): a decode
    step's, graph-capturable."""
    rows = torch.arange(pos.shape[0], device=pos.device)
    p = pos.long().clamp(min=0)
    b = buckets[rows, :, p].long()  # [B, H]
    ok = valid.view(-1, 1)
    index = counts.gather(-1, b[:, :, None])[:, :, 0]
    ordinals[rows, :, p] = torch.where(ok, -1 - index if newest_first else index, ordinals[rows, :, p])
    counts.scatter_add_(-1, b[:, :, None], ok.to(counts.dtype).expand_as(b)[:, :, None].contiguous())


def slot_bases(counts: torch.Tensor, chosen: torch.Tensor, newest_first: bool = False) -> torch.Tensor:
    """counts [B, Hs, C + 1] (the lists' lengths, per selection head) and the chosen buckets [B, Hs, l] (best
    first) -> int32 [B, Hs, C + 1]: each chosen bucket's first slot when the chosen lists are laid end to end in
    that order (`newest_first`: its first slot plus its length, for ordinals stored as -1 - index), -1 for the
    others (and for the sentinel C)."""
    cnt = counts.gather(-1, chosen)
    ends = cnt.cumsum(-1)
    base = torch.full_like(counts, -1)
    return base.scatter_(-1, chosen, (ends if newest_first else ends - cnt).to(base.dtype))
