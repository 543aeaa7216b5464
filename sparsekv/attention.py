"""The attention function transformers calls for `attn_implementation="sparsekv"`.

Prefill (more than one query) is dense. A decode step (one query) on a layer that is not kept dense goes to
the method's `select`, then to the shared sparse-decode call. The cache tells us the valid length and the method
state (transformers passes the function no cache); without a SparseCache the function is plain dense attention.

A mask function is registered under the same name: a custom name otherwise gets *no* mask from transformers, and
padding in a batch would be silently ignored.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .cache import active_cache
from .sparse_attention import dense_attention, sparse_decode

NAME = "sparsekv"


def sparsekv_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                       **kwargs) -> tuple[torch.Tensor, None]:
    """query [B, Hq, n, D] (post-RoPE), key/value [B, Hkv, L, D] -> ([B, n, Hq, D], None)."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    cache = active_cache()
    layer = getattr(module, "layer_idx", None)
    if cache is not None and cache.recorder is not None:
        cache.recorder(layer, query, key, value, cache)
    sparse = (cache is not None and layer is not None and query.shape[2] == 1 and cache.indexes(layer)
              and cache.method.name != "dense")
    if not sparse:
        if attention_mask is not None and attention_mask.dtype != torch.bool:
            attention_mask = attention_mask.to(query.dtype)
        out = dense_attention(query, key, value, scale, mask=attention_mask)
        return out.transpose(1, 2).contiguous(), None
    state = cache.layer_state(layer)
    q_pre = cache.pre_rope(query, state.length - 1) if cache.method.needs_pre_rope else None
    sel = cache.method.select(state, query, q_pre)
    cache.stats.add_selection(sel)
    out = sparse_decode(query, state.keys, state.values, sel, scale)
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Register the attention and mask functions with transformers (idempotent); returns the name to use."""
    AttentionInterface.register(NAME, sparsekv_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME


register()
