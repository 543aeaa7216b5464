"""Adamas (Yan et al., 2025): Hadamard transform, 2-bit bucket codes, L1 distance, top-k.

Algorithm 1 of the paper ("ADAMAS: Hadamard Sparse Attention for Efficient Long-Context Inference"), as `append` and
`select` run it: every key is transformed (H_K = KH, line 1), bucketized into {0..3}^d by thresholds B1 < B2 < B3
(line 2, Eq. 5: code = #thresholds strictly below the value) and packed 8 codes per int16 (line 3) into a buffer
beside K/V (line 4). At a decode step the query goes through the same three steps; the Manhattan distance between
its codes and every key's (line 5, Eq. 6) ranks the keys and the top-k closest are attended (lines 6-8, the shared
top-k and sparse decode).

Defaults and where they come from:
- thresholds (-10, 0, 10): the paper only says "predefined"; the authors' code fixes these for every model, layer
  and head (FibonaccciYan/Adamas: kernels/include/decode/decode_page.cuh `thresholds[3] = {-10, 0, 10}`, and
  evaluation/adamas_attention.py), applied to the orthonormal Hadamard transform (HadaCore, scale 1/sqrt(d)) of the
  post-RoPE q/k. The paper's 1-/3-bit ablations give no thresholds: we use (0,) and (-15, -10, ..., 15), which
  contain the 2-bit ones, so more bits only refine the codes. `sparsekv calibrate` fits per-(layer, KV head)
  thresholds to a model instead (`artifact=`), and by default a coarser set for the queries (the keys' divided by a
  fitted scale: sparsekv/calibrate.py, "Query scale"); the paper uses one set for both.
- sink 0, window 1: the authors' decode kernel (page size 1) always attends the last page, i.e. the newest token,
  and picks the other budget - 1 keys by distance; there is no attention sink. The budget counts all of them.
- The authors keep layers 0 and 1 dense (`skip_layer = 2`); here that is the runtime's `--dense-layers 0,1`.
Distance "ip" (ours, not in the paper): the query is Hadamard-transformed but not quantized, and each key's codes
are read as their buckets' midpoints (kernels/reference.py::adamas_bucket_centers of the key thresholds): the score
q · c[code(k)] estimates q · k, where the L1 distance between two codes only compares their signs and rough sizes.
Same codes, same cache, nothing more to fit; the query thresholds go unused. On SmolLM2 it keeps far more of the
exact top-k keys than L1 and stays near dense on RULER NIAH and passkey at small budgets (BENCHMARKS.md, "RULER NIAH
on the default model, by budget"); its scoring kernel (kernels/codes.py::code_ip_scores) costs more than L1's: a
decode step at 131072 tokens takes 160 against 89 µs on the H100 (BENCHMARKS.md, "Decode step of one layer").
Re-rank (ours, `rerank=F`, off by default): the distance picks F x k candidates and the exact q·k of their cached
keys keeps k (selection.rerank_exact; the oracle's choice among them). On SmolLM2's RULER NIAH 8K with ip it cannot
help at budget 128, where the exact top-128 itself keeps no more of dense than ip; at budget 512 the exact selection
comes close to dense and ip does not, and a prototype of this re-rank recovered part of that gap. It costs: at 131072
tokens, budget 2048, F = 4, per query head, a step takes 243 against 160 µs on the H100, more than dense (the
candidates' keys read by kernels/sparse_decode.py::qk_logits; BENCHMARKS.md, "Decode step of one layer").
GQA: the query heads of a group use their KV head's thresholds. Pooling "head", the default, chooses per query head,
as the authors' repeat_kv implementation does (and as `sparsekv calibrate` fits: each query head's own top-k); "group"
sums the group's negated distances and makes one choice per KV head, which reads fewer keys but ranks worse: with
the same thresholds it scored lower on SmolLM2's RULER NIAH at 4K and 8K, budgets 64 and 128. `head_top` m (ours,
pooling "group", L1 or L2 codes; off by default) chooses each query head's own m nearest keys first and the rest by
the group's sum, as for lsh and Spotlight (sparsekv/methods/hashing.py): one choice per KV head that keeps every
head's sharpest matches. With m 4 it scored as the default on SmolLM2's RULER NIAH at 4K and 8K (budget 128, fixed
thresholds, 104 prompts: +0.2 and +1.0 points, intervals about ±5) and decodes at 131072 tokens 6-12 % faster
(BENCHMARKS.md, "Adamas with one choice per KV head and each query head's nearest keys").
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from sparsekv.kernels.reference import (PendingCodes, adamas_bucket_centers, code_pack_reference, hadamard_matrix,
                                        quantize_pack_reference)

from .. import ops
from ..artifacts import load_artifact
from ..errors import SparseKVError
from ..pooling import Pooling
from ..selection import BudgetSplit, Selection, code_selection, rerank_exact, topk_selection
from .base import CacheShape, LayerState, Method, register, whole_option

FIXED_THRESHOLDS = {1: (0.0,), 2: (-10.0, 0.0, 10.0), 3: (-15.0, -10.0, -5.0, 0.0, 5.0, 10.0, 15.0)}
CODE_DISTANCES = ("l1", "l2")  # between the query's codes and the keys' (the paper: l1)
DISTANCES = CODE_DISTANCES + ("ip",)  # ip: the query itself against the keys' bucket centers (asymmetric)


@dataclass
class AdamasState(LayerState):
    codes: torch.Tensor | None = None  # int16 [B, Hkv, max_len, W]: packed codes of every key, valid up to length
    thresholds: torch.Tensor | None = None  # fp32 [Hkv, 2^bits - 1]: this layer's B1..B3 per KV head, for keys
    q_thresholds: torch.Tensor | None = None  # the same for its group's queries (the keys' unless calibrated apart)
    centers: torch.Tensor | None = None  # fp32 [Hkv, 2^bits]: each key bucket's value, for distance "ip"


@register
class Adamas(Method):
    name = "adamas"
    summary = "Hadamard + 2-bit codes, L1 distance (or the query against the codes: ip) -> top-k tokens (Adamas)"
    default_sink = 0
    default_window = 1
    default_pooling = Pooling.HEAD  # the authors' repeat_kv: every query head picks its own keys (docstring, GQA)

    def __init__(self, budget: float = 1.0, sink: int | None = None, window: int | None = None,
                 pooling: Pooling | str | None = None, artifact: str | Path | None = None,
                 thresholds: Sequence[float] | torch.Tensor | None = None, hadamard: bool | None = None,
                 bits: int | None = None, distance: str | None = None, rerank: int | None = None,
                 head_top: int | None = None, **options: Any):
        """`hadamard`, `bits`, `distance` left as None take the artifact's settings, else the paper's
        (True, 2, "l1"). An artifact's bits and transform cannot be overridden: its thresholds live in that space.
        `rerank` F > 1 (ours): the codes pick F x k candidates and their exact q·k keeps k (selection.rerank_exact).
        `head_top` m (ours, pooling "group"): each query head's m nearest keys first (module docstring, GQA)."""
        super().__init__(budget=budget, sink=sink, window=window, pooling=pooling, **options)
        self.rerank = 1 if rerank is None else whole_option(rerank, 1, "adamas: rerank")
        self.head_top = 0 if head_top is None else whole_option(head_top, 0, "adamas: head_top")
        if artifact is not None and thresholds is not None:
            raise SparseKVError("adamas: give an artifact or explicit thresholds, not both")
        self.artifact = None if artifact is None else str(artifact)
        self._table: torch.Tensor | None = None  # [layers, Hkv, 2^bits - 1] from the artifact: keys'
        self._q_table: torch.Tensor | None = None  # and queries' (older artifacts have one set: the keys')
        fitted: dict = {}
        if self.artifact is not None:  # read now, so a bad path fails before a model is loaded
            art = load_artifact(self.artifact, method=self.name)
            fitted = art.config
            self._table = art.tensors.get("thresholds", {}).get("thresholds")
            self._q_table = art.tensors.get("thresholds", {}).get("query_thresholds", self._table)
            if self._table is None:
                raise SparseKVError(f"adamas: the artifact at {self.artifact} holds no thresholds (not a calibration)")
        for key, given in (("hadamard", hadamard), ("bits", bits)):
            if given is not None and key in fitted and given != fitted[key]:
                raise SparseKVError(f"adamas: the artifact at {self.artifact} was fitted with {key}={fitted[key]}; "
                                    f"it cannot be used with {key}={given}")
        self.hadamard = bool(fitted.get("hadamard", True) if hadamard is None else hadamard)
        self.bits = int(fitted.get("bits", 2) if bits is None else bits)
        self.distance = str(fitted.get("distance", "l1") if distance is None else distance)
        if self.bits not in FIXED_THRESHOLDS:
            raise SparseKVError(f"adamas: bits must be 1, 2 or 3, got {self.bits} (--bits)")
        if self.distance not in DISTANCES:
            raise SparseKVError(f"adamas: unknown distance {self.distance!r}: use 'l1', 'l2' or 'ip' (--distance)")
        if self.head_top and self.distance == "ip":
            raise SparseKVError("adamas: head_top ranks code distances (l1, l2), not distance 'ip' (--head-top, "
                                "--distance)")
        n = 2**self.bits - 1
        if self._table is not None:
            for what, t in (("thresholds", self._table), ("query thresholds", self._q_table)):
                if t.ndim != 3 or t.shape[-1] != n or t.shape != self._table.shape:
                    raise SparseKVError(f"adamas: the artifact at {self.artifact} holds {what} of shape "
                                        f"{list(t.shape)}, expected [layers, kv_heads, {n}] for both")
            self._table = check_thresholds(self._table.float(), n, f"the artifact at {self.artifact}")
            self._q_table = check_thresholds(self._q_table.float(), n, f"the artifact at {self.artifact} (queries)")
            self.thresholds = None
        else:
            given = FIXED_THRESHOLDS[self.bits] if thresholds is None else thresholds
            self.thresholds = check_thresholds(torch.as_tensor(given, dtype=torch.float32).flatten(), n,
                                               "thresholds")
        self._bound = None  # the model the artifact was checked against

    # -- Algorithm 1 -----------------------------------------------------------------------------------------------
    def new_state(self, layer: int, shape: CacheShape) -> AdamasState:
        if self.hadamard:
            hadamard_for(shape.head_dim, shape.device)  # fail on the first layer, naming the dim
        thr = self.layer_thresholds(layer, shape.kv_heads).to(shape.device)
        q_thr = self.layer_thresholds(layer, shape.kv_heads, queries=True).to(shape.device)
        words = code_pack_reference(torch.zeros(1, shape.head_dim, dtype=torch.uint8), self.bits).shape[-1]
        codes = torch.zeros(shape.batch, shape.kv_heads, shape.max_len, words, dtype=torch.int16,
                            device=shape.device)
        return AdamasState(codes=codes, thresholds=thr.contiguous(), q_thresholds=q_thr.contiguous(),
                           centers=adamas_bucket_centers(thr).contiguous())

    def append(self, state: AdamasState, k: torch.Tensor, v: torch.Tensor, k_pre_rope, pos) -> None:
        """Lines 1-4 for keys [B, Hkv, n, D] at positions [pos, pos + n): their codes go into the cache. A decode
        step's key (one a row, at device positions) is left pending: the step's select codes it with the query, in
        the same launch."""
        self.flush(state)
        if self.is_step_key(k, pos):
            state.pending = PendingCodes(k, state.thresholds, state.codes, pos)
        else:
            ops.quantize_pack_into(k, state.thresholds, state.codes, pos, bits=self.bits, transform=self.hadamard)

    def carry_out(self, state: AdamasState, a: PendingCodes) -> None:
        """Code a pending decode-step key on its own (one launch)."""
        ops.quantize_pack_into(a.k, a.thresholds, a.codes, a.slots, bits=self.bits, transform=self.hadamard)

    def select(self, state: AdamasState, q: torch.Tensor, q_pre_rope) -> Selection:
        """Lines 1-3 for the query (its group's query thresholds), line 5 against keys [start + sink, length -
        window), top-k."""
        split = self.split(state)
        if split.dense:
            self.flush(state)
            return split.selection()
        if self.rerank == 1:
            return self.select_by_codes(state, q, split)
        p = state.pattern
        return rerank_exact(self.select_by_codes(state, q, split.widened(split.k * self.rerank)), q, state.keys,
                            split.k, p.scaling, p.softcap)

    def select_by_codes(self, state: AdamasState, q: torch.Tensor, split: BudgetSplit) -> Selection:
        """The top split.k keys of [split.lo, split.hi) by the configured distance."""
        D = q.shape[-1]
        lo, hi = split.lo, split.hi
        if self.distance == "ip":
            self.flush(state)
            return topk_selection(self.ip_scores(state, q, lo, hi), split)
        q_words = ops.quantize_pack(q, state.q_thresholds, bits=self.bits, transform=self.hadamard,
                                    append=self.take_pending(state))
        return code_selection(q_words, state.codes, D, self.bits, self.distance, self.pooling, split, self.head_top)

    def ip_scores(self, state: AdamasState, q: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """Distance "ip": the query (Hadamard-transformed, not quantized) against the codes of keys [lo, hi) read as
        their buckets' centers, q · c[code(k)] ~ q · k; [B, H, hi - lo], pooled as configured (the group's sum)."""
        D = q.shape[-1]
        qh = q[:, :, 0].float()
        if self.hadamard:
            qh = qh @ hadamard_for(D, q.device)
        return ops.code_ip_scores(qh, state.codes[:, :, lo:], state.centers, hi - lo, D, self.bits,
                                  pool=self.pooling.kernel_pool("sum"))

    # -- helpers ---------------------------------------------------------------------------------------------------
    def encode(self, x: torch.Tensor, thresholds: torch.Tensor) -> torch.Tensor:
        """x [B, H, n, D] -> packed codes [B, H, n, W] (torch reference of lines 1-3); thresholds [Hkv, T] serve
        x's heads in groups (query heads use their KV head's row)."""
        return quantize_pack_reference(x, thresholds, bits=self.bits, transform=self.hadamard)

    def layer_thresholds(self, layer: int, kv_heads: int, queries: bool = False) -> torch.Tensor:
        """[kv_heads, 2^bits - 1]: the artifact's for this layer (the keys', or with `queries` the queries'), else
        the fixed ones for every head."""
        if self._table is None:
            return self.thresholds.expand(kv_heads, -1).clone()
        if self._bound is None:
            raise SparseKVError("adamas: the artifact is not checked against a model; call method.bind(model) "
                                "before use (decode.make_cache does)")
        L, H, _ = self._table.shape
        if not 0 <= layer < L or H != kv_heads:
            raise SparseKVError(f"adamas: the artifact at {self.artifact} has thresholds for {L} layers x {H} KV "
                                f"heads; layer {layer} with {kv_heads} KV heads asked")
        return (self._q_table if queries else self._table)[layer].clone()

    def config(self) -> dict[str, Any]:
        cfg = super().config()
        if self._table is None:
            thresholds = self.thresholds.tolist()
        elif torch.equal(self._q_table, self._table):
            thresholds = "artifact (per layer and KV head)"
        else:
            thresholds = "artifact (per layer and KV head; the queries' apart)"
        cfg.update(hadamard=self.hadamard, bits=self.bits, distance=self.distance, rerank=self.rerank,
                   head_top=self.head_top if self.pooling is Pooling.GROUP else 0, artifact=self.artifact,
                   thresholds=thresholds)
        return cfg


def check_thresholds(t: torch.Tensor, n: int, what: str) -> torch.Tensor:
    """n thresholds per row, non-decreasing, no NaN (±inf are allowed: an empty or catch-all bucket)."""
    if t.shape[-1] != n:
        raise SparseKVError(f"adamas: {what} must have {n} values per head for these bits, got {t.shape[-1]}")
    if torch.isnan(t).any():
        raise SparseKVError(f"adamas: {what} contain NaN")
    if (t[..., 1:] < t[..., :-1]).any():
        raise SparseKVError(f"adamas: {what} must be non-decreasing (B1 <= B2 <= ...)")
    return t


def hadamard_for(d: int, device: torch.device | str) -> torch.Tensor:
    """The orthonormal H_d in fp32 (cached by the reference); a clear error for dims it does not exist for."""
    try:
        return hadamard_matrix(d, torch.float32, device)
    except ValueError as e:
        raise SparseKVError(f"adamas: no Hadamard transform for head dim {d} ({e}); "
                            f"use hadamard=False (--no-hadamard)") from None
