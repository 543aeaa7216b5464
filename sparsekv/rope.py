"""Undo rotary position embeddings: the attention function only ever sees post-RoPE q/k.

HF RoPE computes x*cos + rotate_half(x)*sin, a rotation by the position's angles; rotating back by the same
angles is x*cos - rotate_half(x)*sin. The cos/sin tables come from the model's own rotary module, so every RoPE
variant it supports (scaling, partial rotary dims via zero-angle pairs) is undone exactly.
"""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def unrotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, n, D] post-RoPE; cos/sin [B, n, D] (as the model's rotary module returns) -> pre-RoPE x."""
    cos, sin = cos.unsqueeze(1).to(torch.float32), sin.unsqueeze(1).to(torch.float32)
    xf = x.float()
    # YaRN/longrope scale cos and sin by s; dividing by cos² + sin² (= s²) makes the inverse exact for them too
    return ((xf * cos - rotate_half(xf) * sin) / (cos * cos + sin * sin)).to(x.dtype)


def rope_tables(rotary: torch.nn.Module, like: torch.Tensor, positions: torch.Tensor):
    """cos, sin [B, n, D] for integer positions [B, n], from the model's rotary module."""
    return rotary(like, positions)


def find_rotary(model: torch.nn.Module) -> torch.nn.Module | None:
    """The model's shared rotary-embedding module (Llama/Mistral/Qwen keep it at model.model.rotary_emb)."""
    for name, mod in model.named_modules():
        if name.endswith("rotary_emb"):
            return mod
    return None
