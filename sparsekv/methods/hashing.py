"""Selection by Hamming distance of packed sign codes, shared by the hashing methods (`lsh`: linear, `spotlight`:
learned MLP). A subclass fills `state.codes` ([B, Hkv, max_len, ceil(nbits / 16)] int16, 16 bits a word) in
`append` and says how a query is hashed (`query_words`); ranking is the same for both: matching bits (Spotlight
eq. 3, NXOR), i.e. -Hamming distance, counted by the 1-bit code kernels (kernels/codes.py: xor + popcount) and their
top-k; pooling "group" sums the group's matching bits (one choice per KV head), "head" chooses per query head.
`head_top` m (pooling "group", off by default): each query head's own m nearest keys are chosen first and the sum
picks the rest. A sum of Hamming similarities dilutes one head's sharp match: in SmolLM2's layer 7, where a
duplicate-token head attends 0.8-0.99 to the needle's copy of a digit, the most-attended key of queries peaking
above 0.3 was chosen for 43 % of them, 77 % with m 4, and Spotlight's RULER NIAH rose 2.4 points at 4096; the
forced keys cost some average recall and a few µs a layer: each block's nearest key per query head in the distance
kernel, and a forcing step that shares the counting select's first launch (benchmarks/BENCHMARKS.md, "Each query
head's nearest keys").
`query_margin` t (ours; Spotlight: its artifact's, 0.35 without one; lsh: 0, off): ternary queries. A query bit
counts only where its hash value y_j is far from 0, |y_j| > t · rms(y) over the query's bits; keys are hashed as
before. A bit near 0 is as likely flipped as not, so a key matching it says little: leaving those bits out ranks by
the bits the query is sure of. The distance kernel ANDs each xor with the query's care words (one more operation
per word); on SmolLM2 it raised Spotlight's IoU with the oracle by 0.03 and its RULER NIAH at 4096 by 2.3 points
(BENCHMARKS.md, "Ternary queries")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from sparsekv.kernels.reference import PendingHash

from .. import ops
from ..pooling import Pooling
from ..selection import Selection, code_selection
from .base import CacheShape, LayerState, Method, margin_option, whole_option


@dataclass
class HashState(LayerState):
    codes: torch.Tensor | None = None  # int16 [B, Hkv, max_len, ceil(nbits / 16)]: key hashes, valid up to length


class HashSelect(Method):
    """Base of the hashing methods: subclasses set `nbits` and implement `new_state` and `weights` (the hash).

    A decode step's new key is hashed in the same launch as its queries: `append` leaves it pending and the step's
    select hands it to the query hash (one launch fewer a layer). Every decode step of a layer that indexes selects
    after it appends; a select that reads every key, or the next append, hashes a pending key on its own."""

    nbits: int = 0

    default_query_margin: float = 0.0  # 0: every query bit counts (the papers' Hamming distance)

    def __init__(self, budget: float = 1.0, sink: int | None = None, window: int | None = None,
                 pooling: Pooling | str | None = None, head_top: int | None = None,
                 query_margin: float | None = None, **options: Any):
        super().__init__(budget=budget, sink=sink, window=window, pooling=pooling, **options)
        self.head_top = 0 if head_top is None else whole_option(head_top, 0, f"{self.name}: head_top")
        self.query_margin = margin_option(self.default_query_margin if query_margin is None else query_margin,
                                          f"{self.name}: query_margin")

    def new_codes(self, shape: CacheShape) -> torch.Tensor:
        """An empty code buffer: int16 [B, Hkv, max_len, ceil(nbits / 16)], 16 bits a word."""
        return torch.zeros(shape.batch, shape.kv_heads, shape.max_len, -(-self.nbits // 16), dtype=torch.int16,
                           device=shape.device)

    def weights(self, state: HashState) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """This layer's hash as (w1, b1, w2) of ops.mlp_hash_pack: an MLP, or (w1, None, None) a linear hash."""
        raise NotImplementedError

    def append(self, state: HashState, k: torch.Tensor, v: torch.Tensor, k_pre_rope, pos) -> None:
        """Hash keys [B, Hkv, n, D] at positions [pos, pos + n) into the code buffer, packed. A decode step's key
        (one a row, at device positions) is left pending: the step's select hashes it with the queries."""
        self.flush(state)
        if self.is_step_key(k, pos):
            state.pending = PendingHash(k, state.codes, pos)
        else:
            ops.mlp_hash_pack_into(k, *self.weights(state), state.codes, pos)

    def carry_out(self, state: HashState, a: PendingHash) -> None:
        """Hash a pending decode-step key on its own (one launch)."""
        ops.mlp_hash_pack_into(a.k, *self.weights(state), a.codes, a.slots)

    def query_words(self, state: HashState, q: torch.Tensor) -> torch.Tensor:
        """The queries' packed sign bits [B, Hq, 1, W], each query head through its KV head's hash, followed by W
        care words with a query margin (ternary queries); the pending key is hashed in the same launch."""
        return ops.mlp_hash_pack(q, *self.weights(state), append=self.take_pending(state),
                                 margin=self.query_margin or None)

    def select(self, state: HashState, q: torch.Tensor, q_pre_rope) -> Selection:
        split = self.split(state)
        if split.dense:
            self.flush(state)
            return split.selection()
        q_words = self.query_words(state, q)
        return code_selection(q_words, state.codes, self.nbits, 1, "l1", self.pooling, split, self.head_top)

    def hash_scores(self, state: HashState, q: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """-Hamming(H(q), H(k)) of keys [lo, hi): [B, Hsel, hi - lo], summed over the group with pooling "group"
        (what `select` ranks)."""
        return ops.code_scores(self.query_words(state, q), state.codes[:, :, lo:], hi - lo, self.nbits, bits=1,
                               metric="l1", pool=self.pooling.kernel_pool("sum"))

    def config(self) -> dict[str, Any]:
        cfg = super().config()
        cfg.update(head_top=self.head_top if self.pooling is Pooling.GROUP else 0, query_margin=self.query_margin)
        return cfg
