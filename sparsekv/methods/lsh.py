"""Linear LSH (SimHash): sign bits of random projections, Hamming distance, top-k tokens.

The linear-hashing baseline of Spotlight Attention ("Towards Efficient LLM Generation via Non-linear Hashing-based
KV Cache Retrieval", §3.2 eq. 4 and §4.1 "Linear Hashing"), the hashing MagicPIG (Chen et al., 2024) retrieves
with: H(x) = sign(x R) with R in R^{d x nbits}. `append` hashes every post-RoPE key with its KV head's R and packs
the bits 16 per int16 beside K/V; at a decode step the query is hashed with the same R and the keys whose codes are
closest in Hamming distance are attended (eq. 3: matching bits counted, which is nbits - Hamming).

The codes are Spotlight's layout (1-bit codes, 16 per int16): hashed by the linear case of its hash kernel
(kernels/hash_mlp.py: sign(x R) and the bit-pack in one pass), scored by the Adamas kernels with bits=1
(`kernels/codes.py`: xor + popcount; the torch references of `kernels/reference.py` off the GPU). No second
Hamming kernel.

Defaults and where they come from:
- nbits 128: Spotlight's code length, for which its linear-hashing baseline is evaluated ("the same hash code length
  as Spotlight Attention").
- projection "rotation": Spotlight initialises linear hashing as angular LSH (Andoni et al., 2015), a random rotation
  from the QR decomposition of a Gaussian matrix with det fixed to +1 (Appendix A.5), "offering better performance
  than standard random initialization". With nbits > d the columns are ceil(nbits / d) independent rotations side
  by side. "gaussian" is the plain SimHash hyperplanes (Charikar 2002; MagicPIG).
- one R per (layer, KV head), as Spotlight has "a distinct MLP for each head in every layer" (§4), seeded from `seed`
  and the layer index (query heads use their KV head's R), so runs and the GPU/CPU paths agree bit for bit.
- sink 0, window 0: Spotlight runs with "no local window or global sink tokens" (Table 3, Fig. 3) and evaluates its
  linear-hashing baseline "under a unified framework" with it (§4.1): the whole budget is chosen by hash.
  MagicPIG's own defaults (4 sink, 64 local tokens, §4.1) are one `--sink 4 --window 64` away.
- Spotlight, like Quest, keeps layers 0 and 1 dense ("Frozen Layers [0,1]", Table 2): the runtime's
  `--dense-layers 0,1`.
GQA: pooling "group" sums the group's negated Hamming distances (matching bits summed over the group's query heads,
one choice per KV head); "head" chooses per query head.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import SparseKVError
from ..pooling import Pooling
from .base import CacheShape, register
from .hashing import HashSelect, HashState

PROJECTIONS = ("rotation", "gaussian")


@dataclass
class LSHState(HashState):
    proj: torch.Tensor | None = None  # fp32 [Hkv, D, nbits]: this layer's hyperplanes, one set per KV head


@register
class LSH(HashSelect):
    name = "lsh"
    summary = "SimHash sign bits, Hamming distance -> top-k tokens (linear LSH)"
    default_sink = 0
    default_window = 0

    def __init__(self, budget: float = 1.0, sink: int | None = None, window: int | None = None,
                 pooling: Pooling | str | None = None, nbits: int = 128, seed: int = 0, projection: str = "rotation",
                 head_top: int | None = None, query_margin: float | None = None, **options: Any):
        super().__init__(budget=budget, sink=sink, window=window, pooling=pooling, head_top=head_top,
                         query_margin=query_margin, **options)
        self.nbits, self.seed, self.projection = int(nbits), int(seed), str(projection)
        if self.nbits < 1:
            raise SparseKVError(f"lsh: nbits must be >= 1, got {nbits} (--nbits)")
        if self.projection not in PROJECTIONS:
            raise SparseKVError(f"lsh: unknown projection {projection!r}: use 'rotation' or 'gaussian' (--projection)")

    def new_state(self, layer: int, shape: CacheShape) -> LSHState:
        codes = self.new_codes(shape)
        proj = self.hyperplanes(layer, shape.kv_heads, shape.head_dim).to(shape.device)
        return LSHState(codes=codes, proj=proj)

    def weights(self, state: LSHState) -> tuple[torch.Tensor, None, None]:
        """The linear hash H(x) = sign(x R) (eq. 4) with this layer's hyperplanes: projection, sign and bit-pack in
        one pass (the linear case of the hash kernel Spotlight's MLP uses)."""
        return state.proj, None, None

    def hyperplanes(self, layer: int, kv_heads: int, d: int) -> torch.Tensor:
        """R [kv_heads, d, nbits] in fp32, drawn on the CPU from (seed, layer) so every device gets the same."""
        return _hyperplanes(self.seed, layer, kv_heads, d, self.nbits, self.projection).clone()

    def config(self) -> dict[str, Any]:
        cfg = super().config()
        cfg.update(nbits=self.nbits, seed=self.seed, projection=self.projection)
        return cfg


@functools.lru_cache(maxsize=512)
def _hyperplanes(seed: int, layer: int, kv_heads: int, d: int, nbits: int, projection: str) -> torch.Tensor:
    """LSH.hyperplanes, made once per process: every cache of every generation builds each layer's state, and the
    float64 QR of the rotations takes tens of ms a layer on the CPU (callers get a copy: this one is shared)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + layer)
    if projection == "gaussian":
        return torch.randn(kv_heads, d, nbits, generator=g)
    blocks = -(-nbits // d)
    Q, _ = torch.linalg.qr(torch.randn(kv_heads * blocks, d, d, generator=g, dtype=torch.float64))
    flip = torch.linalg.det(Q) < 0  # Appendix A.5: into SO(d) by flipping the first column
    Q[flip, :, 0] *= -1
    R = Q.view(kv_heads, blocks, d, d).permute(0, 2, 1, 3).reshape(kv_heads, d, blocks * d)
    return R[..., :nbits].float().contiguous()
