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
                  scale: float) -> torch.Tensor:
    """q [B, Hq, 1, D] against the keys `sel` names -> [B, Hq, 1, D]."""
    if sel.dense:
        L = sel.length
        return dense_attention(q, keys[:, :, :L], values[:, :, :L], scale)
    if use_kernels(q.device):
        from sparsekv.kernels.sparse_decode import sparse_decode as kernel

        return kernel(q, keys, values, sel, scale)
    return sparse_decode_reference(q, keys, values, sel, scale)


def use_kernels(device: torch.device) -> bool:
    flag = os.environ.get("SPARSEKV_KERNELS", "")
    if flag in ("0", "1"):
        return flag == "1"
    return device.type == "cuda"


def dense_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                    mask: torch.Tensor | None = None) -> torch.Tensor:
    """Exact causal attention of q [B, Hq, n, D] over keys [B, Hkv, L, D] where q holds the last n positions.

    GQA goes through SDPA's native grouping, so each KV head is read once for its group (no repeat_interleave).
    An unmasked decode step (n = 1) on the GPU runs our split-K flash-decoding kernel instead.
    """
    n, L = q.shape[2], keys.shape[2]
    if n == 1 and mask is None and use_kernels(q.device):
        from sparsekv.kernels.sparse_decode import dense_decode

        return dense_decode(q, keys, values, L, scale)
    gqa = q.shape[1] != keys.shape[1]
    if mask is None and n > 1:
        if n == L:
            return _sdpa(q, keys, values, is_causal=True, scale=scale, enable_gqa=gqa)
        # queries sit at the end of the sequence: query i sees keys up to L - n + i
        mask = torch.ones(n, L, dtype=torch.bool, device=q.device).tril(L - n)
    return _sdpa(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa)


# cuDNN's SDPA plans anew for every new key length: 1.7 ms of CPU per call on the H100 machine (torch 2.11), i.e.
# every decode step of every layer; measured with torch.profiler (aten::_cudnn_attention_forward). The other
# backends have no such cost, so on CUDA we leave cuDNN out.
_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw) -> torch.Tensor:
    if q.device.type != "cuda":
        return F.scaled_dot_product_attention(q, k, v, **kw)
    with sdpa_kernel(_SDPA_BACKENDS):
        return F.scaled_dot_product_attention(q, k, v, **kw)
