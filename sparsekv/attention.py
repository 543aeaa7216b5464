"""The attention function transformers calls for `attn_implementation="sparsekv"`.

Prefill (more than one query) is dense, under the model's own mask. A decode step (one query) on a layer that is
not kept dense goes to the method's `select`, then to the shared sparse-decode call; dense layers and the dense
method read every key the layer may see through the same call. The cache tells us the valid length, the method
state and each layer's attention pattern (sliding window, softcapping, scale: patterns.py), and every call is
checked against that pattern (transformers passes the function no cache); without a SparseCache the function is
plain dense attention.

A mask function is registered under the same name (a custom name otherwise gets *no* mask from transformers, and
padding in a batch would be silently ignored). It builds no mask where none is needed (no padding): the attention
function then applies causality and the layer's window itself, so the chunks of a long prompt never hold an
n x L mask in memory.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from . import ops
from .cache import SparseCache, active_cache
from .patterns import check_call
from .sparse_attention import dense_attention

NAME = "sparsekv"


def sparsekv_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                       **kwargs) -> tuple[torch.Tensor, None]:
    """query [B, Hq, n, D] (post-RoPE), key/value [B, Hkv, L, D] -> ([B, n, Hq, D], None)."""
    cache = active_cache()
    layer = getattr(module, "layer_idx", None)
    span, softcap = kwargs.get("sliding_window") or 0, kwargs.get("softcap")
    if cache is not None and layer is not None:
        # what the model passes must be what the cache's pattern for this layer says (patterns.py)
        check_call(layer, cache.pattern(layer), scaling, dropout, kwargs)
        if cache.recorder is not None:
            cache.recorder(layer, query, key, value, cache)
        if query.shape[2] == 1:
            return decode_attention(cache, layer, query), None
        span, softcap = cache.pattern(layer).span, cache.pattern(layer).softcap
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        attention_mask = attention_mask.to(query.dtype)
    out = dense_attention(query, key, value, scale, mask=attention_mask, softcap=softcap, span=span)
    return out.transpose(1, 2).contiguous(), None


def decode_attention(cache: SparseCache, layer: int, query: torch.Tensor,
                     q_pre: torch.Tensor | None = None) -> torch.Tensor:
    """One decode step of `layer` after its cache update: the method's selection (or every key the layer may see,
    on dense layers and for the dense method), then the shared sparse-decode call. query [B, Hq, 1, D] ->
    [B, 1, Hq, D]. The layer's pattern decides the keys it may see, its scale and its softcapping; no mask is
    read, so the eager and the split decode step run exactly this. `q_pre`: the query before RoPE where the caller
    has it (the split step), else it is rotated back when the method needs it."""
    state = cache.layer_state(layer)
    pattern = state.pattern
    scale = pattern.scaling if pattern.scaling is not None else query.shape[-1] ** -0.5
    if cache.runs_method(layer):
        if not cache.method.needs_pre_rope:
            q_pre = None
        elif q_pre is None:  # at the query's position: each row's write slot in a decode step (device: ragged rows)
            q_pre = cache.pre_rope(query, cache.slots if cache.step_pos is not None else state.length - 1, layer)
        sel = cache.method.select(state, query, q_pre)
        cache.stats.add_selection(sel)
    else:
        sel = state.selection(dense=True)
    out = ops.sparse_decode(query, state.keys, state.values, sel, scale, softcap=pattern.softcap)
    return out.transpose(1, 2).contiguous()


def causal_mask(*args, attention_mask: torch.Tensor | None = None, allow_is_causal_skip: bool = True,
                **kwargs) -> torch.Tensor | None:
    """transformers' SDPA mask where the batch has padding or the model adds to causality; else none (None): the
    attention function knows causality and each layer's window (`sliding_window`, or the cache's pattern)."""
    if allow_is_causal_skip and (attention_mask is None or bool(attention_mask.all())):
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, allow_is_causal_skip=allow_is_causal_skip, **kwargs)


def register() -> str:
    """Register the attention and mask functions with transformers (idempotent); returns the name to use."""
    AttentionInterface.register(NAME, sparsekv_attention)
    AttentionMaskInterface.register(NAME, causal_mask)
    return NAME


register()
