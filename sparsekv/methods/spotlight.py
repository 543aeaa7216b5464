"""Spotlight Attention (Li et al., 2025): a learned non-linear hash per (layer, KV head), Hamming distance, top-k.

"Spotlight Attention: Towards Efficient LLM Generation via Non-linear Hashing-based KV Cache Retrieval", §3.2:
every key is hashed as it arrives, H(k) = sign(W2 SiLU(W1 k + b1)) (eq. 5-6), and its bits are packed 16 per int16
beside K/V; at a decode step the query is hashed by its KV head's MLP and the keys whose codes match it in the
most bits (eq. 3, NXOR; = nbits - Hamming distance) are attended. The MLPs come from `sparsekv train-hash`
(sparsekv/train_hash.py: the paper's ranking loss on a dump), loaded from its artifact (`artifact=`). The hash
and bit-pack of a decode step's new key and queries are one fused launch (kernels/hash_mlp.py); ranking and
top-k are the shared 1-bit code kernels (xor + popcount), the same as `lsh`, the linear comparison point with the
same bits.

Defaults and where they come from:
- sink 0, window 0: Spotlight runs "with no local window or global sink tokens" (Table 3, Fig. 3): the whole budget
  is chosen by hash.
- layers 0 and 1 dense ("Frozen Layers [0,1]", Table 2): the runtime's `--dense-layers 0,1`.
- pooling: the artifact's (what its hashes were trained for; "group" by default: the group's matching bits summed,
  one choice per KV head, as `lsh`). `head_top=4` (ours; the paper does not say how a GQA group shares one
  choice) chooses each query head's 4 nearest keys first: better at retrieval, a little slower and lower in
  average recall (sparsekv/methods/hashing.py).
- query_margin: the artifact's (ours; sparsekv/methods/hashing.py): ternary queries, a query bit counts only where
  |y_j| > margin · rms(y), y the MLP's pre-sign outputs. train-hash measures its held-out IoU with binary queries
  and at 0.35 and records the better; 0.35 for artifacts that record none and for `hashes=`. On the default model
  it ranks better (BENCHMARKS.md, "Ternary queries"); where a hash's large outputs are not its reliable bits (a
  synthetic problem whose queries share a large offset, tests/test_train_hash.py) it ranks worse, and train-hash
  records 0 (binary, the paper's).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..artifacts import load_artifact
from ..errors import SparseKVError
from ..pooling import Pooling
from .base import CacheShape, register
from .hashing import HashSelect, HashState


@dataclass
class SpotlightState(HashState):
    w1: torch.Tensor | None = None  # fp32 [Hkv, D, hidden]: this layer's MLPs, one per KV head (None: no hash
    b1: torch.Tensor | None = None  # [Hkv, hidden]                           for this layer, which must be dense)
    w2: torch.Tensor | None = None  # [Hkv, hidden, nbits]
    layer: int = -1


@register
class Spotlight(HashSelect):
    name = "spotlight"
    summary = "learned MLP hash (train-hash), Hamming distance -> top-k tokens (Spotlight Attention)"
    default_sink = 0
    default_window = 0
    default_query_margin = 0.35
    needs_artifact = True

    def __init__(self, budget: float = 1.0, sink: int | None = None, window: int | None = None,
                 pooling: Pooling | str | None = None, artifact: str | Path | None = None,
                 hashes: dict[str, torch.Tensor] | None = None, head_top: int | None = None,
                 query_margin: float | None = None, **options: Any):
        """`artifact`: a train-hash version folder. `hashes` instead: the tensors themselves (w1, b1, w2, layers as
        train_hash.train_hashes returns them; `untrained_hashes` for speed runs and tests)."""
        if (artifact is None) == (hashes is None):
            raise SparseKVError("spotlight needs its trained hashes: --artifact ARTIFACTS/<model>/spotlight/vN "
                                "(from `sparsekv train-hash`)" if artifact is None else
                                "spotlight: give an artifact or hashes, not both")
        self.artifact = None if artifact is None else str(artifact)
        cfg: dict = {}
        if self.artifact is not None:  # read now: a bad path fails before a model loads
            art = load_artifact(self.artifact, method=self.name)
            cfg, hashes = art.config, art.tensors.get("hash", {})
        if pooling is None:
            pooling = cfg.get("pooling", "group")
        if query_margin is None:  # train-hash's choice for these hashes (artifacts before it: the default)
            query_margin = cfg.get("query_margin", self.default_query_margin)
        super().__init__(budget=budget, sink=sink, window=window, pooling=pooling, head_top=head_top,
                         query_margin=query_margin, **options)
        where = f"the artifact at {self.artifact}" if self.artifact else "the hashes given"
        missing = [k for k in ("w1", "b1", "w2", "layers") if k not in hashes]
        if missing:
            raise SparseKVError(f"spotlight: {where} has no {', '.join(missing)} (not a train-hash artifact)")
        self.w1, self.b1, self.w2 = hashes["w1"].float(), hashes["b1"].float(), hashes["w2"].float()
        L, H, D, M = self.w1.shape
        if self.b1.shape != (L, H, M) or self.w2.shape[:3] != (L, H, M) or hashes["layers"].shape != (L,):
            raise SparseKVError(f"spotlight: {where} holds hashes of inconsistent shapes")
        self.nbits = int(self.w2.shape[-1])
        self.trained_cfg = cfg
        self.layers = {int(x): i for i, x in enumerate(hashes["layers"].tolist())}

    @classmethod
    def untrained(cls, num_layers: int, kv_heads: int, head_dim: int) -> dict[str, Any]:
        """Untrained hashes of the paper's sizes (speed does not depend on the weights)."""
        return {"hashes": untrained_hashes(num_layers, kv_heads, head_dim)}

    def new_state(self, layer: int, shape: CacheShape) -> SpotlightState:
        codes = self.new_codes(shape)
        i = self.layers.get(layer)
        if i is None:  # a layer without a hash: fine if it is dense (append/select never run), else they say so
            return SpotlightState(codes=codes, layer=layer)
        if self.w1.shape[1] != shape.kv_heads or self.w1.shape[2] != shape.head_dim:
            raise SparseKVError(f"spotlight: {self.artifact or 'the hashes given'} hash {self.w1.shape[1]} KV heads of "
                                f"dim {self.w1.shape[2]}; this model has {shape.kv_heads} of dim {shape.head_dim}")
        dev = shape.device
        return SpotlightState(codes=codes, w1=self.w1[i].to(dev).contiguous(), b1=self.b1[i].to(dev).contiguous(),
                              w2=self.w2[i].to(dev).contiguous(), layer=layer)

    def weights(self, state: SpotlightState) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This layer's MLPs (eq. 5-6: H(x) = sign(W2 SiLU(W1 x + b1)), one per KV head; query heads use their KV
        head's)."""
        if state.w1 is None:
            trained = ",".join(map(str, sorted(self.layers)))
            raise SparseKVError(f"spotlight: layer {state.layer} has no trained hash in {self.artifact} (layers "
                                f"{trained}); train it (train-hash --layers) or keep it dense (--dense-layers)")
        return state.w1, state.b1, state.w2

    def config(self) -> dict[str, Any]:
        cfg = super().config()
        cfg.update(nbits=self.nbits, artifact=self.artifact,
                   hidden=int(self.w1.shape[-1]), trained_pooling=self.trained_cfg.get("pooling"))
        return cfg


def untrained_hashes(num_layers: int, kv_heads: int, head_dim: int, hidden: int = 128, nbits: int = 128,
                     seed: int = 0) -> dict[str, torch.Tensor]:
    """Hashes of every layer at their initialisation (what train-hash starts from): `hashes=` for speed runs, whose
    timing does not depend on the weights, and for tests."""
    from ..train_hash import HashModel

    m = HashModel(num_layers, kv_heads, head_dim, hidden, nbits, seed=seed)
    return {"w1": m.w1.detach(), "b1": m.b1.detach(), "w2": m.w2.detach(), "layers": torch.arange(num_layers)}
