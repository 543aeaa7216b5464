"""Plain-torch references of the kernels: the spec each Triton kernel must match (same signatures, fp32 maths).

Clarity over speed: these are what the tests compare the kernels against, and the CPU fallback.
"""

from __future__ import annotations

import torch

from sparsekv.selection import Selection


def row_lengths(sel: Selection, batch: int, lengths: torch.Tensor | None, device) -> torch.Tensor:
    """Valid keys per batch row [B] int64: `lengths` when rows differ, else the selection's length."""
    if lengths is None:
        return torch.full((batch,), sel.length, dtype=torch.long, device=device)
    return torch.as_tensor(lengths, device=device).long().view(batch)


def selection_positions(sel: Selection, batch: int, heads: int, lengths: torch.Tensor | None = None,
                        device=None) -> torch.Tensor:
    """Every position one decode step reads, [B, H, n] int64, -1 where a slot reads nothing.

    Slot order is the kernels' too: sink, then the sparse part, then the window. With per-row `lengths` the
    window ends at each row's own length, and slots at or past it read nothing.
    """
    L = row_lengths(sel, batch, lengths, device).view(batch, 1, 1)
    if sel.dense:
        pos = torch.arange(int(L.max()), device=device).view(1, 1, -1).expand(batch, heads, -1)
        return torch.where(pos < L, pos, -1)
    sink = torch.arange(sel.sink, device=device).view(1, 1, -1).expand(batch, heads, -1)
    win = L - sel.window + torch.arange(sel.window, device=device).view(1, 1, -1)
    win = torch.where(win >= sel.sink, win, -1).expand(batch, heads, -1)  # a short row: no re-read of sink keys
    parts = [sink]
    if sel.has_sparse:
        parts.append(sel.sparse_positions().to(device).long().expand(batch, heads, -1))
    parts.append(win)
    pos = torch.cat(parts, dim=-1)
    return torch.where((pos >= 0) & (pos < L), pos, -1)


def check_selection(sel: Selection, batch: int, heads: int, lengths: torch.Tensor | None = None) -> None:
    """Reject what the kernels assume away: duplicate positions (a key would count twice in the softmax) and
    sparse positions inside the dense part. Costs a sort and a host sync: for tests and debugging."""
    parts = [t for t in (sel.indices, sel.blocks, sel.buckets) if t is not None]
    pos = selection_positions(sel, batch, heads, lengths, device=parts[0].device if parts else None)
    srt = pos.sort(-1).values
    dup = (srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0)
    if bool(dup.any()):
        raise ValueError("selection has duplicate positions (a key would be attended twice)")


def sparse_decode_reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, sel: Selection,
                            scale: float, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """One decode step of attention over the keys a selection names.

    q: [B, Hq, 1, D]; keys/values: [B, Hkv, >= length, D]; returns [B, Hq, 1, D] in q's dtype.
    The selection has one row per KV head (GQA group shares it) or one per query head; `lengths` [B] gives
    each row's valid length when rows differ.
    """
    B, Hq, _, D = q.shape
    Hkv = keys.shape[1]
    G = Hq // Hkv
    Hs = sel.heads(Hkv)
    pos = selection_positions(sel, B, Hs, lengths, device=q.device)
    if Hs == Hkv:  # one key set per group: q rows of a group share it
        qs = q.float().view(B, Hkv, G, D)
        kv_head = torch.arange(Hkv, device=q.device)
    elif Hs == Hq:  # one key set per query head
        qs = q.float().view(B, Hq, 1, D)
        kv_head = torch.arange(Hq, device=q.device) // G
    else:
        raise ValueError(f"selection has {Hs} heads; expected {Hkv} (KV heads) or {Hq} (query heads)")
    valid = pos >= 0
    idx = pos.clamp(min=0)
    b_idx = torch.arange(B, device=q.device).view(B, 1, 1)
    k_sel = keys[b_idx, kv_head.view(1, -1, 1), idx].float()  # [B, Hs, n, D]
    v_sel = values[b_idx, kv_head.view(1, -1, 1), idx].float()
    logits = torch.einsum("bhgd,bhnd->bhgn", qs, k_sel) * scale
    logits = logits.masked_fill(~valid.unsqueeze(2), float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # a row that reads no key comes out as zeros
    out = torch.einsum("bhgn,bhnd->bhgd", probs, v_sel)
    return out.reshape(B, Hq, 1, D).to(q.dtype)


def topk_reference(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices [..., k] int64 of the k largest scores per row, ties to the lower index, each row ascending.

    A stable descending sort (NaN first, -0.0 tied with +0.0, as torch.sort orders them), its first k, sorted.
    """
    n = scores.shape[-1]
    if not 0 <= k <= n:
        raise ValueError(f"topk: k={k} must be between 0 and the row length {n}")
    order = torch.sort(scores.float(), dim=-1, descending=True, stable=True).indices[..., :k]
    return order.sort(dim=-1).values
