"""Attention shapes of real models, by name: what one layer's decode step is benchmarked on.

A dataclass plus a table of presets and `from_name`, as gpt-fast's `ModelArgs` does; `from_model` reads the same
fields from a loaded model's config (`--model`).
"""

from __future__ import annotations

import difflib
from dataclasses import asdict, dataclass

from ..errors import SparseKVError


@dataclass(frozen=True)
class Shape:
    name: str
    q_heads: int
    kv_heads: int
    head_dim: int
    layers: int = 0  # the per-layer bench times one layer; `--e2e` builds them all
    hidden: int = 0  # the whole model's dimensions, for `--e2e` (0: attention shape only)
    intermediate: int = 0
    vocab: int = 0
    rope_theta: float = 10000.0

    def __post_init__(self):
        if min(self.q_heads, self.kv_heads, self.head_dim) <= 0 or self.q_heads % self.kv_heads:
            raise SparseKVError(f"shape {self.name!r}: {self.q_heads} query heads must be a positive multiple of "
                                f"{self.kv_heads} KV heads, head dim {self.head_dim} positive")

    @property
    def group(self) -> int:
        return self.q_heads // self.kv_heads

    def kv_bytes(self, seq: int, batch: int, itemsize: int) -> int:
        """K and V of one layer's cache."""
        return 2 * batch * self.kv_heads * seq * self.head_dim * itemsize

    def to_dict(self) -> dict:
        return asdict(self)


SHAPES: dict[str, Shape] = {s.name: s for s in (  # from each model's config.json
    Shape("llama3-8b", 32, 8, 128, 32, 4096, 14336, 128256, 500000.0),
    Shape("llama2-7b", 32, 32, 128, 32, 4096, 11008, 32000, 10000.0),
    Shape("mistral-7b", 32, 8, 128, 32, 4096, 14336, 32768, 1000000.0),
    Shape("qwen2.5-7b", 28, 4, 128, 28, 3584, 18944, 152064, 1000000.0),
    Shape("smollm2-135m", 9, 3, 64, 30, 576, 1536, 49152, 100000.0),
    Shape("one-head", 1, 1, 128),  # one query head on one KV head of dim 128 (per-head retrieval timings)
)}


def from_name(name: str) -> Shape:
    key = name.strip().lower()
    if key not in SHAPES:
        near = difflib.get_close_matches(key, SHAPES, n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise SparseKVError(f"unknown shape {name!r}{hint}; available: {', '.join(SHAPES)}")
    return SHAPES[key]


def from_model(spec: str) -> Shape:
    """The attention shape of a model (`--model`): loaded on the CPU only to read its config."""
    from ..models import load_model

    lm = load_model(spec, device="cpu", quiet=True)
    return Shape(lm.name, lm.q_heads, lm.kv_heads, lm.head_dim, lm.num_layers)
