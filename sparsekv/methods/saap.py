"""SAAP (Mazaré et al., 2025, "Inference-time sparse attention with asymmetric indexing"): every key goes to one
k-means bucket of its pre-RoPE vector, a query classifier picks the ℓ most promising buckets, and the query attends
*all* keys of those buckets plus a dense sink and recent window.

The index comes from `sparsekv index` (sparsekv/saap/fit.py): per (layer, KV head), C unit centroids of the
pre-RoPE keys (spherical k-means, faiss) and the query model (Q-model, an MLP D -> 1024 -> C). At decode time:
- `append` assigns each key to its nearest centroid by inner product (§4 "Asymmetric assignment": keys keep the
  k-means assignment); a key joins its bucket's inverted list on the device when it leaves the dense window
  (sparsekv/saap/lists.py: the lists grow in place, one key per decode step, no rebuild; in a decode step the
  step's `select` carries the append out, by extra programs of its Q-model launch: `ops.bucket_logits(append=)`);
- `select` runs the Q-model on each query head's pre-RoPE query (`ops.bucket_logits`), sums the group's bucket
  distributions (§5 "Batched queries"; pooling "head" instead picks per query head, the paper's "Independent" of
  Appendix E.3), takes the top-ℓ buckets and lays their lists end to end, best bucket first (`ops.bucket_select`,
  the CSR order of the paper's Appendix F; within a list newest key first, see "Budget and cap"); the shared
  sparse-decode kernel attends them with the dense part. The split decode step hands the
  method q and k before RoPE as it computes them, so nothing is rotated back.

Budget and cap. The number of keys in the visited buckets varies from step to step; a captured decode step needs a
fixed shape, so the sparse part is a fixed-size list of `budget - sink - window` positions (the budget counts every
attended key, as for every method), padded with -1 (read as nothing). When the visited buckets hold more keys than
that, the lists of the lowest-ranked buckets are cut: keys are kept bucket by bucket in the Q-model's order, and
within the bucket that straddles the cap its newest keys first (`cap_keep="newest"`, the default; the paper reads
every key of the ℓ buckets and has no cap, so it says nothing of this). Attention decays with distance on average,
so the newest keys of a bucket the cap must cut hold more of the query's mass than its oldest; on RULER NIAH prompts,
where the heavy keys sit in large buckets, keeping the newest read more of the exact attention (`eval --task recall`).
`cap_keep="oldest"` restores position order (each list oldest first, as the paper's CSR
holds it). A budget at or above the visible context reads every key (dense). With ℓ = C and a cap that holds every
key, the step equals dense attention. On a layer with a sliding window, keys that left the window stay in their
lists and hold slots of the cap (read as nothing; being the oldest, newest-first cuts them first).

Defaults and where they come from:
- sink 1, window 2047: "the first token and the most recent 2047 tokens are attended exhaustively" (§3, "1+2047").
- probes ℓ: the paper's ℓ = 32 for C = 1024 (Table 2), i.e. ℓ = C / 32 for an index of C buckets ("the selectivity
  is roughly proportional to ℓ/C", Appendix E.4).
- layer 0 dense (§3 "we perform full attention for the layer 0"): the runtime's `--dense-layers 0`.
- the paper's baselines from the same artifact: `query_model=False` scores buckets by the query's inner product with
  the centroids ("K-means (no rope)"); an index fitted with `--space post` ("K-means (roped inputs)") indexes
  post-RoPE keys and queries.

Two rankings (`centroid_share`, not in the paper; default 0: the Q-model's alone). The Q-model learns the attention
of the text it was fitted on; a query unlike that text (a needle's retrieval at answer time) can find its keys'
buckets by the centroids' inner products where the Q-model ranks them low, and the reverse holds in other layers.
With a share s, the visited buckets are the best of both rankings taken in turn, a share s of them by the centroids
(kernels/reference.py::mixed_order: each bucket's turn is its better rank, the centroids' scaled by 1 / s and
the Q-model's by 1 / (1 - s)), so each ranking keeps its own best buckets instead of an average of the two. The
logits' launch scores the centroids beside the Q-model, and the select's launch takes the turns.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sparsekv.kernels.reference import PendingAppend

from .. import ops
from ..artifacts import load_artifact
from ..errors import SparseKVError
from ..pooling import Pooling
from ..saap.lists import admit, new_lists, record
from ..saap.model import assign
from ..selection import Selection
from .base import CacheShape, LayerState, Method, register

MODEL_KEYS = ("w1", "b1", "w2", "b2")
SPACES = ("pre", "post")
CAP_KEEPS = ("newest", "oldest")


@dataclass
class SaapState(LayerState):
    centroids: torch.Tensor | None = None  # [Hkv, C, D] (None: a layer without an index, which must be dense)
    model: tuple | None = None  # the folded Q-model (w1, b1, w2, b2) of each KV head, or None: centroid scores
    buckets: torch.Tensor | None = None  # int32 [B, Hkv, max_len] (sparsekv/saap/lists.py)
    ordinals: torch.Tensor | None = None  # int32 [B, Hkv, max_len]
    counts: torch.Tensor | None = None  # int32 [B, Hkv, C + 1]
    layer: int = -1


@register
class Saap(Method):
    name = "saap"
    summary = "k-means buckets of pre-RoPE keys, a learned query classifier -> every key of the top-ℓ buckets (SAAP)"
    default_sink = 1
    default_window = 2047
    needs_pre_rope = True
    needs_artifact = True

    def __init__(self, budget: float = 1.0, sink: int | None = None, window: int | None = None,
                 pooling: Pooling | str | None = None, artifact: str | Path | None = None,
                 index: dict[str, torch.Tensor] | None = None, probes: int | None = None,
                 query_model: bool | None = None, space: str | None = None, cap_keep: str | None = None,
                 centroid_share: float | None = None, **options: Any):
        """`artifact`: an `index` version folder. `index` instead: its tensors (centroids [L, Hkv, C, D], layers [L],
        and the folded Q-model w1, b1, w2, b2 when there is one; `random_index` for speed runs and tests), whose
        keys and queries are pre-RoPE unless `space="post"`. `probes`: buckets visited per query (ℓ). `query_model`
        False: score buckets by the centroids (the paper's k-means baseline) even when the index has a Q-model.
        `cap_keep`: which keys of the bucket that straddles the cap are read, "newest" (default) or "oldest".
        `centroid_share`: the share of the visited buckets ranked by the centroids, the rest by the Q-model, taken in
        turn (module docstring; 0, the default: the Q-model's alone)."""
        super().__init__(budget=budget, sink=sink, window=window, pooling=pooling, **options)
        self.cap_keep = "newest" if cap_keep is None else cap_keep
        if self.cap_keep not in CAP_KEEPS:
            raise SparseKVError(f"saap: cap_keep must be 'newest' or 'oldest', got {cap_keep!r} (--cap-keep)")
        self._newest = self.cap_keep == "newest"
        if (artifact is None) == (index is None):
            raise SparseKVError("saap needs its index: --artifact ARTIFACTS/<model>/saap/vN (from `sparsekv index`)"
                                if artifact is None else "saap: give an artifact or an index, not both")
        self.artifact = None if artifact is None else str(artifact)
        fitted: dict = {}
        if self.artifact is not None:  # read now: a bad path fails before a model loads
            art = load_artifact(self.artifact, method=self.name)
            fitted = art.config
            index = {**art.tensors.get("index", {}), **art.tensors.get("query_model", {})}
        where = f"the artifact at {self.artifact}" if self.artifact else "the index given"
        if "centroids" not in index or "layers" not in index:
            raise SparseKVError(f"saap: {where} has no centroids (not an `index` artifact)")
        if space is not None and "space" in fitted and space != fitted["space"]:
            raise SparseKVError(f"saap: {where} indexes {fitted['space']}-RoPE keys; it cannot be used with "
                                f"space={space}")
        self.space = space or fitted.get("space", "pre")
        if self.space not in SPACES:
            raise SparseKVError(f"saap: space must be 'pre' or 'post', got {self.space!r}")
        self.needs_pre_rope = self.space == "pre"  # the cache un-rotates keys and queries only when asked
        self.centroids = index["centroids"].float()
        L, H, C, D = self.centroids.shape
        if index["layers"].shape != (L,):
            raise SparseKVError(f"saap: {where} holds centroids and layers of inconsistent shapes")
        self.layers = {int(x): i for i, x in enumerate(index["layers"].tolist())}
        has_model = all(k in index for k in MODEL_KEYS)
        if query_model and not has_model:
            raise SparseKVError(f"saap: {where} has no query model (fitted with --no-query-model)")
        self.model = tuple(index[k].float() for k in MODEL_KEYS) if has_model and query_model is not False else None
        if self.model is not None:
            w1, b1, w2, b2 = self.model
            M = w1.shape[-1]
            if w1.shape != (L, H, D, M) or b1.shape != (L, H, M) or w2.shape != (L, H, M, C) or b2.shape != (L, H, C):
                raise SparseKVError(f"saap: {where} holds a query model of inconsistent shapes")
        self.centroid_share = 0.0 if centroid_share is None else float(centroid_share)
        if not 0 <= self.centroid_share < 1:
            raise SparseKVError(f"saap: centroid_share must be in [0, 1) (1: the centroids alone, query_model=False), "
                                f"got {centroid_share} (--centroid-share)")
        if self.centroid_share and self.model is None:
            raise SparseKVError(f"saap: centroid_share mixes the Q-model's ranking with the centroids'; "
                                f"{'query_model is off' if has_model else where + ' has no query model'}")
        self.clusters = C
        if self.centroid_share and C > 1 << 15:  # the select kernel packs a bucket's turn, rank and id in 64 bits
            raise SparseKVError(f"saap: centroid_share takes an index of at most 32768 buckets; {where} has {C}")
        self.probes = max(1, round(C / 32)) if probes is None else int(probes)
        if not 1 <= self.probes <= C:
            raise SparseKVError(f"saap: probes must be in [1, {C}] (the index has {C} buckets), got {probes} "
                                "(--probes)")

    @classmethod
    def untrained(cls, num_layers: int, kv_heads: int, head_dim: int) -> dict[str, Any]:
        """Random centroids and an untrained Q-model of the paper's sizes (C 1024, hidden 1024; speed does not depend
        on the weights)."""
        from ..saap.model import random_index

        return {"index": random_index(num_layers, kv_heads, head_dim)}

    def new_state(self, layer: int, shape: CacheShape) -> SaapState:
        buckets, ordinals, counts = new_lists(shape.batch, shape.kv_heads, shape.max_len, self.clusters,
                                              shape.device)
        state = SaapState(buckets=buckets, ordinals=ordinals, counts=counts, layer=layer)
        i = self.layers.get(layer)
        if i is None:  # fine if the layer is dense (append/select never run), else they say so
            return state
        if self.centroids.shape[1] != shape.kv_heads or self.centroids.shape[3] != shape.head_dim:
            raise SparseKVError(f"saap: {self.artifact or 'the index given'} has {self.centroids.shape[1]} KV heads "
                                f"of dim {self.centroids.shape[3]}; this model has {shape.kv_heads} of dim "
                                f"{shape.head_dim}")
        # in the cache's dtype (fp32 off 16-bit caches): a step reads the centroids and the Q-model's weights
        dt = shape.dtype if shape.dtype in (torch.float16, torch.bfloat16) else torch.float32
        state.centroids = self.centroids[i].to(shape.device, dt).contiguous()
        if self.model is not None:
            state.model = tuple(t[i].to(shape.device, dt).contiguous() for t in self.model)
        return state

    def _indexed(self, state: SaapState, x: torch.Tensor | None, what: str) -> torch.Tensor:
        if state.centroids is None:
            fitted = ",".join(map(str, sorted(self.layers)))
            raise SparseKVError(f"saap: layer {state.layer} has no index in {self.artifact or 'the index given'} "
                                f"(layers {fitted}); fit it (index --layers) or keep it dense (--dense-layers)")
        if x is None:
            raise SparseKVError(f"saap: no pre-RoPE {what} given (the cache recovers them for methods with "
                                f"needs_pre_rope)")
        return x

    def append(self, state: SaapState, k: torch.Tensor, v: torch.Tensor, k_pre_rope, pos) -> None:
        """Assign keys [B, Hkv, n, D] at positions [pos, pos + n) to their nearest centroids; the keys that leave the
        dense window with them (those `window` positions earlier, past the sink) join their buckets' lists."""
        x = self._indexed(state, k_pre_rope if self.space == "pre" else k, "keys")
        if isinstance(pos, int):  # a prefill chunk; keys [sink, pos - window) are in the lists already
            record(state.buckets, assign(x, state.centroids), pos)
            first = max(self.sink, pos - self.window)
            admit(state.buckets, state.ordinals, state.counts, first, pos + k.shape[2] - self.window - first,
                  self._newest)
        else:  # a decode step at device positions: its select carries it out (see `select`)
            self.flush(state)
            state.pending = PendingAppend(state.buckets, state.ordinals, state.counts, x, pos, self.sink,
                                          self.window, self._newest)

    def carry_out(self, state: SaapState, a: PendingAppend) -> None:
        """A pending decode-step append on its own (one launch)."""
        ops.saap_append(a.buckets, a.ordinals, a.counts, state.centroids, a.k, a.pos, a.sink, a.window,
                        a.newest_first)

    def select(self, state: SaapState, q: torch.Tensor, q_pre_rope) -> Selection:
        """The step's appended key (pending since `append`) is indexed by the logits' launch: it runs beside the
        Q-model instead of before it, one launch fewer a layer. Every decode step selects after it appends, and the
        lists are read only here, after it."""
        split = self.split(state)
        if split.dense or split.k <= 0 or split.hi <= split.lo:
            self.flush(state)
            return split.selection()
        x = self._indexed(state, q_pre_rope if self.space == "pre" else q, "queries")
        group = x.shape[1] // state.centroids.shape[0] if self.pooling is Pooling.GROUP else 1
        mix = bool(self.centroid_share)
        scores = ops.bucket_logits(x, state.centroids, state.model, append=self.take_pending(state),
                                   centroids_too=mix)  # [B, Hq, C], and the centroids' with the mix
        scores, centroid_scores = scores if mix else (scores, None)
        pos, count = ops.bucket_select(scores, state.counts, state.buckets, state.ordinals, self.probes, group,
                                       state.model is not None, self._newest, split.k, split.lo, split.hi,
                                       split.bounds(), centroid_scores, self.centroid_share)
        return split.selection(indices=pos, count=count)

    def config(self) -> dict[str, Any]:
        cfg = super().config()
        cfg.update(artifact=self.artifact, probes=self.probes, clusters=self.clusters, space=self.space,
                   query_model=self.model is not None, cap_keep=self.cap_keep, centroid_share=self.centroid_share)
        return cfg
