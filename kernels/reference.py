"""Plain-torch references of the kernels: the spec each Triton kernel must match (same signatures, fp32 maths).

Clarity over speed: these are what the tests compare the kernels against, and the CPU fallback.
"""

from __future__ import annotations

import torch

from sparsekv.selection import Selection


def selection_positions(sel: Selection) -> torch.Tensor:
    """All positions a selection reads, [B, H, n] int64 with -1 for padding: sink, then sparse part, then window."""
    if sel.dense:
        raise ValueError("a dense selection has no position list")
    ref = sel.sparse_positions() if sel.has_sparse else None
    if ref is None and sel.sink + sel.window == 0:
        raise ValueError("empty selection: no sink, no window and no sparse part")
    device = ref.device if ref is not None else None
    parts = []
    if sel.sink:
        parts.append(torch.arange(sel.sink, device=device))
    if sel.window:
        parts.append(torch.arange(sel.length - sel.window, sel.length, device=device))
    dense = torch.cat(parts) if parts else torch.empty(0, dtype=torch.long, device=device)
    if ref is None:
        return dense.view(1, 1, -1)
    B, H, _ = ref.shape
    return torch.cat([dense.view(1, 1, -1).expand(B, H, -1), ref], dim=-1)


def sparse_decode_reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, sel: Selection,
                            scale: float) -> torch.Tensor:
    """One decode step of attention over the keys a selection names.

    q: [B, Hq, 1, D]; keys/values: [B, Hkv, >= sel.length, D]; returns [B, Hq, 1, D] in q's dtype.
    The selection has one row per KV head (GQA group shares it) or one per query head.
    """
    B, Hq, _, D = q.shape
    Hkv = keys.shape[1]
    G = Hq // Hkv
    if sel.dense:
        pos = torch.arange(sel.length, device=q.device).view(1, 1, -1).expand(B, Hkv, -1)
    else:
        pos = selection_positions(sel).to(q.device)
        if not sel.has_sparse:  # dense part only: the same positions for every head
            pos = pos.expand(B, Hkv, -1)
    Hs = pos.shape[1]
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
    probs = torch.softmax(logits, dim=-1)
    out = torch.einsum("bhgn,bhnd->bhgd", probs, v_sel)
    return out.reshape(B, Hq, 1, D).to(q.dtype)
