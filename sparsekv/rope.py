"""Undo rotary position embeddings: the attention function only ever sees post-RoPE q/k.

HF RoPE computes x*cos + rotate_half(x)*sin, a rotation by the position's angles; rotating back by the same
angles is x*cos - rotate_half(x)*sin. The cos/sin tables come from the model's own rotary module, so every RoPE
variant it supports (scaling, tables per layer type as in Gemma-3, partial rotary dims: Phi-3 rotates only the
first cos.shape[-1] dims and passes the rest through) is undone exactly.
"""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def unrotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, n, D] post-RoPE; cos/sin [B, n, R] (as the model's rotary module returns; R <= D rotary dims)
    -> pre-RoPE x."""
    cos, sin = cos.unsqueeze(1).to(torch.float32), sin.unsqueeze(1).to(torch.float32)
    r = cos.shape[-1]
    xf = x.float()
    rot, rest = xf[..., :r], xf[..., r:]
    # YaRN/longrope scale cos and sin by s; dividing by cos² + sin² (= s²) makes the inverse exact for them too
    back = (rot * cos - rotate_half(rot) * sin) / (cos * cos + sin * sin)
    return (torch.cat((back, rest), dim=-1) if rest.shape[-1] else back).to(x.dtype)


def rope_tables(rotary: torch.nn.Module, like: torch.Tensor, positions: torch.Tensor, layer_type: str | None = None):
    """cos, sin [B, n, R] for integer positions [B, n], from the model's rotary module (`layer_type`: the table set
    of a module that keeps one per layer type, patterns.AttentionPattern.rope)."""
    if layer_type is not None:
        return rotary(like, positions, layer_type)
    return rotary(like, positions)


def find_rotary(model: torch.nn.Module) -> torch.nn.Module | None:
    """The model's shared rotary-embedding module (Llama/Mistral/Qwen keep it at model.model.rotary_emb)."""
    for name, mod in model.named_modules():
        if name.endswith("rotary_emb"):
            return mod
    return None
