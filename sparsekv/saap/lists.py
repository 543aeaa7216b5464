"""SAAP's inverted lists on the device, grown one key at a time without a rebuild.

The paper's index (Appendix F) is CSR: Off [C + 1] and Idx [N], bucket c's keys at Idx[Off[c] : Off[c + 1]]. A
CSR array must be rebuilt (or shifted) to take a new key, so the decode state keeps the same lists in scattered
form, per (batch row, KV head):
  buckets  [B, H, max_len] int32: the bucket of the key at each position (C: no key there yet);
  ordinals [B, H, max_len] int32: its index in its bucket's list (a bucket's keys in position order);
  counts   [B, H, C + 1]  int32: each list's length (the last column takes the "no key" sentinel).
A key's bucket is recorded when it is appended; it joins its bucket's list when it leaves the dense window, so the
lists hold exactly the keys the sparse part chooses from (positions [sink, length - window) of a layer without a
sliding window) and a visited list has no key the window attends anyway. A prefill chunk takes n keys at once here
(`record`, `admit`); a decode step's key, at device positions, takes no launch of its own (`ops.saap_append`, or
extra programs of the step's Q-model launch, `ops.bucket_logits(append=)`: its bucket, and the key leaving the
window into its list; no host read, fixed shapes: graph-capturable).
The CSR of the visited buckets is what a step reads (`ops.bucket_select`): each chosen bucket's first slot in a
fixed-size output (the chosen lists end to end, best bucket first) and the key at position p lands in slot
base[bucket[p]] + ordinals[p]: the keys the paper's kernel reads through Idx, in its order.

Newest first (`newest_first=True`, the same flag to admit, ops.saap_append and ops.bucket_select): each list is laid
out newest key first, so that an output cut at its last slot drops the OLDEST keys of the bucket it cuts. The
ordinals are then stored as -1 - index (a key's index in its list does not change as the list grows, so nothing is
rewritten), and a chosen bucket's base is its first slot plus its length: slot = start + n - 1 - index, in
[start, start + n) as before. The gather (kernel and reference) is unchanged: slot = base + ordinal, kept while
base >= 0 and slot < cap.
"""

from __future__ import annotations

import torch


def new_lists(batch: int, heads: int, max_len: int, clusters: int, device) -> tuple[torch.Tensor, ...]:
    """Empty (buckets, ordinals, counts) for a cache of max_len slots."""
    buckets = torch.full((batch, heads, max_len), clusters, dtype=torch.int32, device=device)
    ordinals = torch.zeros(batch, heads, max_len, dtype=torch.int32, device=device)
    counts = torch.zeros(batch, heads, clusters + 1, dtype=torch.int32, device=device)
    return buckets, ordinals, counts


def record(buckets: torch.Tensor, new: torch.Tensor, pos: int) -> None:
    """Write the buckets `new` [B, H, n] of keys at positions [pos, pos + n) (a prefill chunk)."""
    buckets[:, :, pos : pos + new.shape[2]] = new.to(buckets.dtype)


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
