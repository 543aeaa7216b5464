"""What each layer of a model may attend: its sliding window, logit softcapping, scale and RoPE tables.

Sparse decoding must never read a key the layer could not see, nor score keys differently from the model. The
pattern of every layer is read once from the model's own attention modules (the same attributes they pass to the
attention function), checked against the families sparsekv is tested on, and checked again against what the
model actually passes at every attention call (`check_call`): a model that attends in a way sparsekv does not
implement is refused with one line naming why, never decoded wrongly.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass

import torch

from .errors import SparseKVError


@dataclass(frozen=True)
class AttentionPattern:
    """One layer's attention. `span`: a query sees only its last `span` keys, itself included (transformers'
    sliding window: kv > q - window); 0 = every earlier key. `softcap`: logits s become softcap * tanh(s / softcap)
    before the softmax (Gemma-2). `scaling`: the q·k scale (None: head_dim ** -0.5). `rope`: the layer type whose
    RoPE tables the layer uses, for rotary modules that keep one set per type (Gemma-3's local and global), else
    None."""

    span: int = 0
    softcap: float | None = None
    scaling: float | None = None
    rope: str | None = None

    def start(self, length: int) -> int:
        """First key position the newest of `length` keys may attend."""
        return window_start(length, self.span)

    def describe(self) -> dict:
        return {"span": self.span or None, "softcap": self.softcap, "scaling": self.scaling, "rope": self.rope}


def window_start(length, span: int):
    """First key position the newest of `length` keys may attend under a sliding window of `span` keys (0: every
    key): for a host int, or elementwise for a device tensor of per-row lengths."""
    if not span:
        return 0
    return (length - span).clamp(min=0) if isinstance(length, torch.Tensor) else max(0, length - span)


FULL = AttentionPattern()

LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class Family:
    """A model family sparsekv runs and tests (tests/test_families.py builds each one in memory)."""

    softcap: bool = False  # its attention passes `attn_logit_softcapping` as softcap
    split: bool = False  # the split decode step (sparsekv.step) mirrors its layer code
    notes: str = ""


# model_type -> family. README's "Model families" table says the same.
FAMILIES: dict[str, Family] = {
    "llama": Family(split=True),
    "mistral": Family(split=True, notes="sliding window"),
    "mixtral": Family(notes="sliding window; mixture-of-experts MLP"),
    "qwen2": Family(split=True, notes="sliding window on the layers layer_types names"),
    "qwen3": Family(split=True, notes="per-head q/k norm; sliding window per layer_types"),
    "phi3": Family(notes="fused qkv projection; partial rotary dims; sliding window"),
    "gemma": Family(),
    "gemma2": Family(softcap=True, notes="local sliding / global layers; attention-logit softcapping; "
                                         "query_pre_attn_scalar"),
    "gemma3_text": Family(notes="local sliding / global layers with their own RoPE tables; per-head q/k norm"),
}


def unsupported(model: torch.nn.Module) -> str | None:
    """Why sparsekv cannot run `model` correctly, or None when it can."""
    cfg = model.config
    kind = getattr(cfg, "model_type", "")
    if kind not in FAMILIES:
        return (f"model type {kind!r} is not one sparsekv runs (tested: {', '.join(FAMILIES)}); its attention may "
                f"differ in ways sparse decoding would get wrong")
    other = sorted({t for t in (getattr(cfg, "layer_types", None) or ()) if t not in LAYER_TYPES})
    if other:
        return f"layer type(s) {', '.join(other)} (only {', '.join(LAYER_TYPES)} are supported)"
    if getattr(cfg, "attention_chunk_size", None):
        return "chunked attention (attention_chunk_size) is not supported"
    if getattr(cfg, "use_bidirectional_attention", False):
        return "bidirectional attention (use_bidirectional_attention) is not causal decoding"
    if not getattr(cfg, "is_decoder", True) or getattr(cfg, "is_encoder_decoder", False):
        return "not a decoder-only model"
    layers = decoder_layers(model)
    if layers is None:
        return "no decoder layers with a self_attn module at model.model.layers"
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        if getattr(attn, "layer_idx", None) != i:
            return f"layer {i}'s attention does not know its layer index"
    return None


def check_model(model: torch.nn.Module) -> None:
    why = unsupported(model)
    if why:
        raise SparseKVError(f"cannot run {getattr(model.config, 'model_type', type(model).__name__)} models: {why}")


def decoder_layers(model: torch.nn.Module) -> list | None:
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if layers is None or not all(hasattr(layer, "self_attn") for layer in layers):
        return None
    return list(layers)


def model_patterns(model: torch.nn.Module) -> list[AttentionPattern]:
    """Every layer's pattern, from the attributes its attention module passes to the attention function."""
    check_model(model)
    cfg = model.config
    family = FAMILIES[cfg.model_type]
    per_type = _rope_per_layer_type(model)
    types = getattr(cfg, "layer_types", None)
    out = []
    for i, layer in enumerate(decoder_layers(model)):
        attn = layer.self_attn
        # Qwen2/3 and Gemma keep the window on the module (None on full layers); Mistral, Mixtral and Phi-3 pass
        # the config's window on every layer
        window = attn.sliding_window if hasattr(attn, "sliding_window") else getattr(cfg, "sliding_window", None)
        softcap = getattr(attn, "attn_logit_softcapping", None) if family.softcap else None
        out.append(AttentionPattern(span=int(window or 0), softcap=float(softcap) if softcap else None,
                                    scaling=float(attn.scaling) if getattr(attn, "scaling", None) else None,
                                    rope=types[i] if per_type and types else None))
    return out


def _rope_per_layer_type(model: torch.nn.Module) -> bool:
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    return rotary is not None and "layer_type" in inspect.signature(rotary.forward).parameters


# What the attention function may receive and ignore: bookkeeping, or features our decode has no use for.
_HARMLESS = {"position_ids", "use_cache", "output_attentions", "output_hidden_states", "output_router_logits",
             "return_dict", "cache", "past_key_values", "is_causal"}


def check_call(layer: int, pattern: AttentionPattern, scaling: float | None, dropout: float, kwargs: dict) -> None:
    """Refuse an attention call whose arguments disagree with the layer's pattern or ask for what sparsekv does not
    implement (attention sinks as logits, dropout, non-causal attention, packed sequences, ...)."""
    window = kwargs.get("sliding_window") or 0
    if window != pattern.span:
        raise SparseKVError(f"layer {layer} attends a sliding window of {window or 'all'} keys, where sparsekv "
                            f"expected {pattern.span or 'all'}: this model's attention is not supported")
    softcap = kwargs.get("softcap")
    if (softcap or None) != pattern.softcap:
        raise SparseKVError(f"layer {layer} softcaps attention logits at {softcap}, where sparsekv expected "
                            f"{pattern.softcap}: this model's attention is not supported")
    if scaling is not None and pattern.scaling is not None and not math.isclose(scaling, pattern.scaling,
                                                                               rel_tol=1e-6):
        raise SparseKVError(f"layer {layer} scales q·k by {scaling}, where sparsekv expected {pattern.scaling}")
    if dropout:
        raise SparseKVError(f"layer {layer} asks for attention dropout ({dropout}): sparsekv decodes in eval mode")
    if kwargs.get("is_causal") is False:
        raise SparseKVError(f"layer {layer} attends non-causally: sparsekv decodes causal models only")
    for key, value in kwargs.items():
        if key in _HARMLESS or key in ("sliding_window", "softcap") or value is None or value is False:
            continue
        raise SparseKVError(f"layer {layer}: the model passes {key!r} to its attention, which sparsekv does not "
                            f"implement")
