"""Dense attention: a prefill (or a chunk of one) and the masked cases, beside the sparse decode call (`ops`).

On a GPU a decode step runs our split-K flash-decoding kernel and a chunk after cached keys, a sliding window or
softcapped logits run our causal prefill kernel (`ops.prefill_attention`: no mask in memory); a plain causal prefill
runs SDPA's flash kernel. Without kernels the torch references do the same.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from . import ops


def dense_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                    mask: torch.Tensor | None = None, softcap: float | None = None, span: int = 0) -> torch.Tensor:
    """Exact causal attention of q [B, Hq, n, D] over keys [B, Hkv, L, D] where q holds the last n positions.

    GQA goes through native grouping, so each KV head is read once for its group (no repeat_interleave). `mask`
    (bool, True = attend, or additive) is the model's own where it needs one (padding); without it causality and
    the layer's sliding window (`span`: the last span keys up to each query) are applied here, with no mask in
    memory. `softcap`: the layer's logit softcapping (which SDPA cannot do).
    """
    n, L = q.shape[2], keys.shape[2]
    if mask is None:
        if n == 1 and (span == 0 or span >= L) and not softcap and not ops.use_kernels(q.device):
            return _sdpa(q, keys, values, scale=scale, enable_gqa=q.shape[1] != keys.shape[1])
        if n == 1:
            return ops.dense_decode(q, keys, values, L, scale, span=span, softcap=softcap)
        if n == L and not softcap and (span == 0 or span >= L):
            return _sdpa(q, keys, values, is_causal=True, scale=scale, enable_gqa=q.shape[1] != keys.shape[1])
        return ops.prefill_attention(q, keys, values, scale, span=span, softcap=softcap)
    if softcap:
        return _softcapped(q, keys, values, scale, softcap, mask)
    return _sdpa(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != keys.shape[1])


def _softcapped(q, keys, values, scale, softcap, mask, rows: int = 1024) -> torch.Tensor:
    """Attention with logits softcap * tanh(q·k x scale / softcap) under the model's `mask`, in blocks of query
    rows (the logits of a long prefill never exist at once)."""
    B, Hq, n, D = q.shape
    Hkv, L = keys.shape[1], keys.shape[2]
    G = Hq // Hkv
    kf, vf = keys.float().unsqueeze(2), values.float().unsqueeze(2)  # [B, Hkv, 1, L, D]: each KV head once
    out = torch.empty(B, Hq, n, values.shape[-1], dtype=q.dtype, device=q.device)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        qs = q[:, :, r0:r1].float().view(B, Hkv, G, r1 - r0, D)
        s = softcap * torch.tanh(qs @ kf.transpose(-1, -2) * scale / softcap)  # [B, Hkv, G, r, L]
        m = mask[..., r0:r1, :]  # [n, L], or the model's [B or 1, 1 or Hq, n, L]
        if m.dim() == 4:
            m = m.unsqueeze(2) if m.shape[1] == 1 else m.view(m.shape[0], Hkv, G, r1 - r0, L)
        s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m.float()
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)
        out[:, :, r0:r1] = (p @ vf).reshape(B, Hq, r1 - r0, -1).to(q.dtype)
    return out


# cuDNN's SDPA plans anew for every new key length: 1.7 ms of CPU per call on the H100 machine (torch 2.11), i.e.
# every decode step of every layer; measured with torch.profiler (aten::_cudnn_attention_forward). The other
# backends have no such cost, so on CUDA we leave cuDNN out.
_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw) -> torch.Tensor:
    if q.device.type != "cuda":
        return F.scaled_dot_product_attention(q, k, v, **kw)
    with sdpa_kernel(_SDPA_BACKENDS):
        return F.scaled_dot_product_attention(q, k, v, **kw)
