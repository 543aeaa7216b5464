"""Training examples from a dump: for a step, one sequence's sampled queries and all of that sequence's keys, for
every layer being fitted at once (the layers' tensors are stacked so one batched model trains them together).

A step's example is a function of (seed, step) alone, so an interrupted run resumed from a checkpoint sees exactly
the examples it would have seen (sparsekv/offline/train.py: the same weights). Queries and keys stay on `device`
for the whole run: a dump is a few hundred MB for the default model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..activations import Activations
from ..errors import SparseKVError
from .stage import check_holdout


@dataclass
class Example:
    """One step's data. q [L, Hq, nq, D] (the dumped queries of one sequence, a seeded sample), k [L, Hkv, nk, D]
    (all its keys, position order), q_pos [nq] (each query's position: it sees keys [0, q_pos]), seq: its index."""

    q: torch.Tensor
    k: torch.Tensor
    q_pos: torch.Tensor
    seq: int
    # with DumpExamples(pre_rope=True, with_post=True): the post-RoPE q/k too, which the model's attention scores
    q_post: torch.Tensor | None = None
    k_post: torch.Tensor | None = None
    rows: torch.Tensor | None = None  # the queries' indices into the dump's query rows (DumpExamples.example)

    def attention_qk(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The q/k whose products are the model's attention logits (post-RoPE)."""
        return (self.q, self.k) if self.q_post is None else (self.q_post, self.k_post)


class DumpExamples:
    """The dump's queries and keys of `layers` (post-RoPE, or pre-RoPE with `pre_rope`), split into fit and held-out
    queries by sequence: the last `holdout` share of the sequences (at least one when there are two or more) are held
    out, so a held-out query never comes from a sequence the model was fitted on."""

    def __init__(self, acts: Activations, layers: Sequence[int], *, pre_rope: bool = False, holdout: float = 0.1,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 min_keys: int = 1, progress: Callable[[int], None] | None = None, with_post: bool = False):
        if not layers:
            raise SparseKVError("no layers to fit")
        check_holdout(holdout, patience=0)
        n_seq = len(acts.seq_lengths)
        n_held = 0 if holdout == 0 or n_seq < 2 else max(1, round(n_seq * holdout))
        if n_held >= n_seq:  # before any layer is read
            raise SparseKVError(f"--holdout {holdout:g} holds out all {n_seq} sequences of the dump at {acts.path}: "
                                f"none is left to fit on; lower --holdout")
        self.acts, self.layers, self.device = acts, list(layers), torch.device(device)
        suffix = "pre" if pre_rope else "post"
        qs, ks = [], []
        post = pre_rope and with_post  # SAAP: pre-RoPE inputs, post-RoPE attention targets
        qps, kps = [], []
        for i in self.layers:
            t = acts.layer(i)
            qs.append(t[f"q_{suffix}"].to(self.device, dtype))
            ks.append(t[f"k_{suffix}"].to(self.device, dtype))
            if post:
                qps.append(t["q_post"].to(self.device, dtype))
                kps.append(t["k_post"].to(self.device, dtype))
            if progress is not None:
                progress(1)
        self.q, self.k = torch.stack(qs), torch.stack(ks)  # [L, Hq, S, D], [L, Hkv, T, D]
        self.q_post, self.k_post = (torch.stack(qps), torch.stack(kps)) if post else (None, None)
        pos = acts.positions()
        self.q_pos, self.q_seq = pos["q_pos"], pos["q_seq"]
        self.offsets, self.lengths = acts.seq_offsets, acts.seq_lengths
        self.fit_seqs = list(range(n_seq - n_held))
        self.held_seqs = list(range(n_seq - n_held, n_seq))
        # queries that see fewer than min_keys keys teach nothing (every key is in any top-k)
        self._rows = {s: torch.nonzero((self.q_seq == s) & (self.q_pos + 1 >= min_keys)).flatten()
                      for s in range(n_seq)}
        if not any(len(self._rows[s]) for s in self.fit_seqs):
            raise SparseKVError(f"the dump at {acts.path} has no query that sees {min_keys} keys or more in its "
                                f"fit sequences: dump longer sequences (--seq)")

    @property
    def head_dim(self) -> int:
        return int(self.k.shape[-1])

    def example(self, seq: int, rows: torch.Tensor) -> Example:
        """The queries `rows` (indices into the dump's query rows, all of sequence `seq`) and that sequence's keys."""
        lo, n = self.offsets[seq], self.lengths[seq]
        r = rows.to(self.device)
        post = {} if self.q_post is None else {"q_post": self.q_post[:, :, r], "k_post": self.k_post[:, :, lo : lo + n]}
        return Example(self.q[:, :, r], self.k[:, :, lo : lo + n], self.q_pos[rows].to(self.device), seq, **post,
                       rows=rows)

    def rows_of(self, seq: int) -> torch.Tensor:
        """The query rows of sequence `seq` that take part (they see at least min_keys keys)."""
        return self._rows[seq]

    def sample(self, seed: int, step: int, n_queries: int,
               keep: Callable[[torch.Tensor, int], torch.Tensor] | None = None) -> Example:
        """Step `step`'s example: a fit sequence and up to `n_queries` of its queries, drawn from (seed, step).
        `keep(q_pos, n_keys) -> bool [nq]`: a filter on the candidates from their positions and the sequence's key
        count (SAAP keeps long-range queries only)."""
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        seqs = [s for s in self.fit_seqs if len(self._rows[s])]
        seq = seqs[int(torch.randint(len(seqs), (1,), generator=g))]
        rows = self._rows[seq]
        if keep is not None:
            rows = rows[keep(self.q_pos[rows].to(self.device), int(self.lengths[seq])).cpu()]
            if not len(rows):
                rows = self._rows[seq]
        pick = rows[torch.randperm(len(rows), generator=g)[:n_queries].sort().values]
        return self.example(seq, pick)

    def held_out(self, max_queries: int, seed: int = 0) -> list[Example]:
        """The held-out queries, one example per held-out sequence (a seeded sample of at most `max_queries` in
        all); the fit sequences' when nothing is held out (a one-sequence dump: said in the report)."""
        seqs = self.held_seqs or self.fit_seqs
        rows = torch.cat([self._rows[s] for s in seqs])
        g = torch.Generator().manual_seed(seed)
        rows = rows[torch.randperm(len(rows), generator=g)[:max_queries].sort().values]
        out = []
        for s in seqs:
            mine = rows[self.q_seq[rows] == s]
            if len(mine):
                out.append(self.example(s, mine))
        return out
