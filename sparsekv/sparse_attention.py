"""The one attention call for a decode step over a `Selection` (and the dense path beside it).

Every method ends here. On a GPU the Triton kernel family (`sparsekv.kernels.sparse_decode`) runs; on the CPU the
torch reference does (the kernels also run there under TRITON_INTERPRET=1, which the tests use, but far slower).
SPARSEKV_KERNELS=0 forces the reference everywhere, =1 forces the kernels.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from sparsekv.kernels.reference import sparse_decode_reference

from .selection import Selection


def sparse_decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, sel: Selection,
                  scale: float, softcap: float | None = None) -> torch.Tensor:
    """q [B, Hq, 1, D] against the keys `sel` names -> [B, Hq, 1, D]. `softcap`: the layer's logit softcapping."""
    if sel.dense and sel.extent is None:  # an eager step: its host length is exact
        lo, L = sel.start, sel.length
        return dense_attention(q, keys[:, :, lo:L], values[:, :, lo:L], scale, softcap=softcap)
    if use_kernels(q.device):
        from sparsekv.kernels.sparse_decode import sparse_decode as kernel

        return kernel(q, keys, values, sel, scale, softcap=softcap)
    return sparse_decode_reference(q, keys, values, sel, scale, softcap=softcap)


def use_kernels(device: torch.device) -> bool:
    flag = os.environ.get("SPARSEKV_KERNELS", "")
    if flag in ("0", "1"):
        return flag == "1"
    return device.type == "cuda"


def dense_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                    mask: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
    """Exact causal attention of q [B, Hq, n, D] over keys [B, Hkv, L, D] where q holds the last n positions.

    GQA goes through SDPA's native grouping, so each KV head is read once for its group (no repeat_interleave).
    An unmasked decode step (n = 1) on the GPU runs our split-K flash-decoding kernel instead. `mask` (bool, True =
    attend, or additive) is the model's own (a sliding window's, padding); `softcap` (which SDPA cannot do) takes
    the plain-torch path below.
    """
    n, L = q.shape[2], keys.shape[2]
    if n == 1 and mask is None and use_kernels(q.device):
        from sparsekv.kernels.sparse_decode import dense_decode

        return dense_decode(q, keys, values, L, scale, softcap=softcap)
    if mask is None and n > 1 and n != L:
        # queries sit at the end of the sequence: query i sees keys up to L - n + i
        mask = torch.ones(n, L, dtype=torch.bool, device=q.device).tril(L - n)
    if softcap:
        return _softcapped(q, keys, values, scale, softcap, mask)
    gqa = q.shape[1] != keys.shape[1]
    if mask is None and n > 1:
        return _sdpa(q, keys, values, is_causal=True, scale=scale, enable_gqa=gqa)
    return _sdpa(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa)


def _softcapped(q, keys, values, scale, softcap, mask, rows: int = 1024) -> torch.Tensor:
    """Attention with logits softcap * tanh(q·k x scale / softcap), in blocks of query rows (the logits of a long
    prefill never exist at once). mask None: causal (n = L) or, for one query, every key."""
    B, Hq, n, D = q.shape
    Hkv, L = keys.shape[1], keys.shape[2]
    G = Hq // Hkv
    kf, vf = keys.float().unsqueeze(2), values.float().unsqueeze(2)  # [B, Hkv, 1, L, D]: each KV head once
    out = torch.empty(B, Hq, n, values.shape[-1], dtype=q.dtype, device=q.device)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        qs = q[:, :, r0:r1].float().view(B, Hkv, G, r1 - r0, D)
        s = softcap * torch.tanh(qs @ kf.transpose(-1, -2) * scale / softcap)  # [B, Hkv, G, r, L]
        if mask is not None:  # [n, L], or the model's [B or 1, 1 or Hq, n, L]
            m = mask[..., r0:r1, :]
            if m.dim() == 4:
                m = m.unsqueeze(2) if m.shape[1] == 1 else m.view(m.shape[0], Hkv, G, r1 - r0, L)
            s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m.float()
        elif n > 1:  # n == L: causal
            causal = torch.ones(r1 - r0, L, dtype=torch.bool, device=q.device).tril(r0)
            s = s.masked_fill(~causal, float("-inf"))
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
