"""`calibrate`: fit Adamas' bucket thresholds B1 <= B2 <= B3 to the keys and queries of a dump.

The paper calls the thresholds "predefined" and the authors' code fixes them at (-10, 0, 10) for every model, layer
and head (sparsekv/methods/adamas.py says where). Their right scale depends on the model's q/k magnitudes, so we fit
them, per (layer, KV head) by default, and write them as a versioned artifact the method loads (`artifact=`).

Objective: recall of the exact top-k. For a calibration query q at position p of sequence s, the truth is the
`budget` keys of s at positions <= p with the largest q·k (post-RoPE, what attention scores); Adamas picks the
`budget` keys whose codes are closest to q's. Recall = |picked ∩ truth| / budget, averaged over queries and the query
heads of the KV head. Code distances are small integers, so keys tie at the cut: a tied key counts with the chance a
random order of the tied keys picks it, which never rewards a code that makes everything tie. Queries that see no
more than `budget` keys are skipped (every method picks them all). Sink and window are left out: the objective is
the quality of the distance ranking itself.

Search: candidates for each threshold are quantiles of the transformed key and query coordinates; starts are the
paper's thresholds, symmetric ±c·σ sets and equal-mass quantile sets; then coordinate search, each threshold in turn
over the candidates between its neighbours (every other one in the first sweep, the current one's neighbours after),
until a sweep changes nothing. The paper's thresholds are a start, so the fitted recall on the calibration queries is
never below theirs. Held-out queries (`holdout`) give the before/after numbers that the report leads with.

Query scale (our extension; `query_scales`, default 1, 2, 4, 8): the query is bucketized with thresholds B / s, i.e.
its codes are those of s·q under the keys' B. A coarser query code ranks better: with every query code in an outer
bucket (0 or 3) the L1 distance is the sum of 3 - code_k over the query's 3s plus code_k over its 0s, which falls
linearly as each key code moves toward the query's side (a 1-bit-query / 2-bit-key estimate of q·k), while equal
scales reward keys whose magnitudes match the query's (a key code above a middle query code counts against it).
Thresholds are fitted at each s and the s with the best recall on the calibration queries is kept (s = 1 is the
shared-threshold fit, so the choice never fits worse than it; each s costs one fit). On SmolLM2-135M (8192 jargon
tokens, top-64 recall on held-out queries, mean over layers and KV heads) one fitted set beats the paper's
thresholds and the fitted query scale beats one set (most heads choose s = 8 or 4); on RULER NIAH it lifts Adamas
at budgets 64 and 128: BENCHMARKS.md, "RULER NIAH on the default model, by budget".

Speed: L1 separates over the thresholds. A value's code is at least v exactly when it exceeds B_v, and for codes
|a - b| = Σ_v |[a >= v] - [b >= v]|, so the L1 distance is a sum of one Hamming distance per threshold, each a
product of 0/1 matrices computed once per candidate value and kept: scoring a threshold set is then a few additions
and one histogram (SmolLM2-135M, 30 layers x 3 KV heads, 8192-token dump: about 50 s on 2 CPU cores). L2 is
|a|² + |b|² - 2a·b from the codes. Both are exact and equal the kernels' distances (tests check the reference).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from .activations import Activations
from .offline.stage import save_stage
from .errors import SparseKVError
from .progress import Ticker
from .methods.adamas import CODE_DISTANCES, FIXED_THRESHOLDS, hadamard_for

PER = ("head", "layer", "global")
QUERY_SCALES = (1.0, 2.0, 4.0, 8.0)
OBJECTIVE = ("expected recall of the exact top-{budget} keys (q·k of post-RoPE q/k, causal, own sequence) among the "
             "{budget} keys with the closest codes; ties at the cut counted by their chance of being picked")


@dataclass
class _Block:
    """The queries of one sequence against that sequence's keys (transformed), with the exact top-k."""

    q: torch.Tensor  # [nq, D] transformed queries (the group's query heads stacked)
    k: torch.Tensor  # [nk, D] transformed keys at positions 0 .. nk - 1
    hidden: torch.Tensor  # bool [nq, nk]: key after the query (causal mask)
    truth: torch.Tensor  # int64 [nq, budget]: positions of the exact top-k keys of each query


@dataclass
class _Problem:
    """One KV head of one layer, on one set of queries: what a threshold set is scored on."""

    layer: int
    head: int
    blocks: list[_Block]

    @property
    def queries(self) -> int:
        return sum(b.q.shape[0] for b in self.blocks)


def calibrate_adamas(acts: Activations, *, per: str = "head", bits: int = 2, hadamard: bool = True,
                     distance: str = "l1", budget: int = 64, holdout: float = 0.25, seed: int = 0,
                     max_queries: int = 256, sweeps: int = 3, query_scales: Sequence[float] = QUERY_SCALES,
                     progress: Any = None) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Fit the keys' thresholds and the queries' [num_layers, kv_heads, 2^bits - 1] (fp32) to the dump; returns
    both and the report. The queries' are the keys' divided by the best of `query_scales` (module docstring; pass
    (1,) for one shared set, as the paper has).

    `max_queries`: query positions used per layer (a seeded sample, the same in every layer; each counts once per
    query head), split into fit and held-out by `holdout`. `progress`: a rich Progress or callable(done, total),
    advanced per (layer, KV head).
    """
    scales = check_options(per=per, bits=bits, distance=distance, budget=budget, holdout=holdout,
                           max_queries=max_queries, query_scales=query_scales)
    if hadamard:
        hadamard_for(acts.head_dim, "cpu")  # unsupported head dims fail here, naming the dim
    acts.check_files()  # a corrupt layer stops here, before the fit, not when it is reached
    t0 = time.perf_counter()
    fit_idx, held_idx = _split_queries(acts, budget, holdout, seed, max_queries)
    fixed = torch.tensor(FIXED_THRESHOLDS[bits])
    L, Hkv, n = acts.num_layers, acts.kv_heads, len(FIXED_THRESHOLDS[bits])
    table, query_table = torch.empty(L, Hkv, n), torch.empty(L, Hkv, n)
    keys = ("fit_before", "fit_after", "before", "after") + (("after_shared",) if 1.0 in scales else ())
    recalls = {key: torch.zeros(L, Hkv) for key in keys}
    chosen = torch.ones(L, Hkv)
    tick = Ticker(progress, L * Hkv, "calibrate")

    def fit_and_score(fit: list[_Problem], held: list[_Problem]) -> None:
        best = None
        for s in scales:
            fit_s, held_s = _scaled(fit, s), _scaled(held, s)
            score = _Objective(bits, distance)  # a fresh cache per fit: its matrices belong to these problems
            thr = _fit(fit_s, score, fixed, sweeps)
            fit_r = [score.recall(pf, thr) for pf in fit_s]
            held_r = [score.recall(ph, thr) for ph in held_s]
            if s == 1.0:
                for ph, r in zip(held, held_r):
                    recalls["after_shared"][ph.layer, ph.head] = r
            mean = sum(fit_r) / len(fit_r)  # the objective on the fit set, as _fit scores it
            if best is None or mean > best[0]:  # ties keep the smaller scale
                best = (mean, s, thr, fit_r, held_r)
        _, s, thr, fit_r, held_r = best
        score = _Objective(bits, distance)
        for pf, ph, fit_after, held_after in zip(fit, held, fit_r, held_r):
            table[pf.layer, pf.head], query_table[pf.layer, pf.head], chosen[pf.layer, pf.head] = thr, thr / s, s
            for key, value in (("fit_before", score.recall(pf, fixed)), ("fit_after", fit_after),
                               ("before", score.recall(ph, fixed)), ("after", held_after)):
                recalls[key][pf.layer, pf.head] = value

    everything: tuple[list, list] = ([], [])
    for layer in range(L):
        fit, held = _layer_problems(acts, layer, fit_idx, held_idx, budget, hadamard)
        if per == "head":
            for pf, ph in zip(fit, held):
                fit_and_score([pf], [ph])
                tick.advance(1)
        elif per == "layer":
            fit_and_score(fit, held)
            tick.advance(Hkv)
        else:
            everything[0].extend(fit)
            everything[1].extend(held)
    if per == "global":
        fit_and_score(*everything)
        tick.advance(L * Hkv)

    report = _report(recalls, chosen, fixed, budget, len(fit_idx), len(held_idx), acts.q_heads // Hkv,
                     time.perf_counter() - t0)
    report["search"] = {"per": per, "max_queries": max_queries, "holdout": holdout, "seed": seed, "sweeps": sweeps,
                        "query_scales": scales}
    return table, query_table, report


def check_options(*, per: str = "head", bits: int = 2, distance: str = "l1", budget: int = 64,
                  holdout: float = 0.25, max_queries: int = 256,
                  query_scales: Sequence[float] = QUERY_SCALES) -> list[float]:
    """calibrate_adamas' options, checked before any dump or model is read (one line naming the option); returns
    the query scales, sorted, without repeats."""
    if per not in PER:
        raise SparseKVError(f"--per must be one of {', '.join(PER)}, got {per!r}")
    if bits not in FIXED_THRESHOLDS:
        raise SparseKVError(f"--bits must be 1, 2 or 3, got {bits}")
    if distance == "ip":
        raise SparseKVError("--distance ip has nothing of its own to fit: calibrate with l1 (the default) and run "
                            "adamas with --distance ip (it reads the keys' codes as their buckets' midpoints)")
    if distance not in CODE_DISTANCES:
        raise SparseKVError(f"--distance must be 'l1' or 'l2', got {distance!r}")
    if budget < 1:
        raise SparseKVError(f"--budget must be positive, got {budget}")
    if not 0 < holdout < 1:
        raise SparseKVError(f"--holdout must be in (0, 1), got {holdout}")
    if max_queries < 2:
        raise SparseKVError(f"--max-queries must be 2 or more (a fit set and a held-out set), got {max_queries}")
    scales = sorted({float(x) for x in query_scales})
    if not scales or not all(math.isfinite(x) and x > 0 for x in scales):
        raise SparseKVError(f"--query-scales must be positive numbers, got {list(query_scales)}")
    return scales


def _scaled(problems: list[_Problem], s: float) -> list[_Problem]:
    """The problems with every query times s: the codes of s·q under B are q's under B / s."""
    if s == 1.0:
        return problems
    return [_Problem(p.layer, p.head, [_Block(b.q * s, b.k, b.hidden, b.truth) for b in p.blocks]) for p in problems]


def save_calibration(root: str | Path, acts: Activations, thresholds: torch.Tensor, report: dict, *,
                     per: str, bits: int, hadamard: bool, distance: str, budget: int, holdout: float = 0.25,
                     seed: int = 0, query_thresholds: torch.Tensor | None = None,
                     version: str | None = None) -> Path:
    """Write the thresholds as an `adamas` artifact for the dump's model; returns the version folder.
    `query_thresholds` (default: the keys' own) are the queries' (calibrate_adamas' second result)."""
    config = {"per": per, "bits": bits, "hadamard": hadamard, "distance": distance, "budget": budget,
              "holdout": holdout, "seed": seed, "space": "orthonormal Hadamard of post-RoPE q/k" if hadamard
              else "post-RoPE q/k (no transform)", "code": "number of thresholds strictly below the value"}
    query = thresholds if query_thresholds is None else query_thresholds
    if query.shape != thresholds.shape:
        raise SparseKVError(f"query thresholds of shape {list(query.shape)} for keys' of {list(thresholds.shape)}")
    tensors = {"thresholds": thresholds.float().contiguous(), "query_thresholds": query.float().contiguous()}
    return save_stage(root, acts, "adamas", {"thresholds": tensors}, config, report, version=version)


# -- data ----------------------------------------------------------------------------------------------------------

def _split_queries(acts: Activations, budget: int, holdout: float, seed: int,
                   max_queries: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded fit / held-out split of the dump's query rows that see more than `budget` keys."""
    pos = acts.positions()
    eligible = torch.nonzero(pos["q_pos"] >= budget).flatten()
    if len(eligible) < 2:
        raise SparseKVError(f"the dump at {acts.path} has {len(eligible)} queries past position {budget}: need 2 or "
                            f"more to calibrate for budget {budget} (dump longer sequences or lower --budget)")
    gen = torch.Generator().manual_seed(seed)
    take = eligible[torch.randperm(len(eligible), generator=gen)[:max_queries]]
    n_held = min(max(1, round(holdout * len(take))), len(take) - 1)
    return take[n_held:].sort().values, take[:n_held].sort().values


def _layer_problems(acts: Activations, layer: int, fit_idx: torch.Tensor, held_idx: torch.Tensor, budget: int,
                    hadamard: bool) -> tuple[list[_Problem], list[_Problem]]:
    data = acts.layer(layer)
    span = acts.patterns()[layer].span
    Hkv, Hq = acts.kv_heads, acts.q_heads
    H = hadamard_for(acts.head_dim, "cpu") if hadamard else None
    offsets = acts.seq_offsets
    out: tuple[list, list] = ([], [])
    for h in range(Hkv):
        keys = data["k_post"][h].float()
        tkeys = keys @ H if H is not None else keys
        group = range(h * (Hq // Hkv), (h + 1) * (Hq // Hkv))
        for idx, dest in ((fit_idx, out[0]), (held_idx, out[1])):
            blocks = []
            for s in data["q_seq"][idx].unique().tolist():
                rows = idx[data["q_seq"][idx] == s]
                qpos = data["q_pos"][rows].repeat(len(group))
                nk = int(qpos.max()) + 1
                k = keys[offsets[s] : offsets[s] + nk]
                q = torch.cat([data["q_post"][g, rows].float() for g in group])
                # keys the query cannot see: later ones, and with a sliding window those before it
                k_idx = torch.arange(nk).unsqueeze(0)
                hidden = (k_idx > qpos.unsqueeze(1)) | (k_idx < qpos.unsqueeze(1) + 1 - span if span else False)
                truth = (q @ k.T).masked_fill(hidden, -math.inf).topk(budget, dim=1).indices
                blocks.append(_Block(q @ H if H is not None else q, tkeys[offsets[s] : offsets[s] + nk], hidden,
                                     truth))
            dest.append(_Problem(layer, h, blocks))
    return out


# -- objective -----------------------------------------------------------------------------------------------------

def codes(x: torch.Tensor, thresholds: torch.Tensor) -> torch.Tensor:
    """Number of thresholds strictly below each value (paper eq. 5), as the method and kernels compute it."""
    return (x.unsqueeze(-1) > thresholds).sum(-1)


class _Objective:
    """Scores threshold sets on problems: mean expected recall. For L1 it keeps each threshold value's Hamming
    matrices (while `max_bytes` allows), so a threshold set costs a few additions (module docstring, "Speed")."""

    def __init__(self, bits: int, metric: str, max_bytes: int = 1 << 30):
        self.bits, self.metric, self.max_bytes = bits, metric, max_bytes
        self.cache: dict[tuple[int, float], torch.Tensor] = {}
        self.bytes = 0

    def __call__(self, problems: list[_Problem], thr: torch.Tensor) -> float:
        return sum(self.recall(p, thr) for p in problems) / len(problems)

    def recall(self, problem: _Problem, thr: torch.Tensor) -> float:
        hits = sum(float(self.block_recall(b, thr).sum()) for b in problem.blocks)
        return hits / problem.queries

    def distances(self, blk: _Block, thr: torch.Tensor) -> torch.Tensor:
        """Code distances int64 [nq, nk], equal to the method's (reference and kernels)."""
        if self.metric == "l2":  # |a - b|² = |a|² + |b|² - 2a·b, exact in fp32 for these small integers
            a, b = codes(blk.q, thr).float(), codes(blk.k, thr).float()
            return ((a * a).sum(1, keepdim=True) + (b * b).sum(1) - 2 * a @ b.T).to(torch.int64)
        total = torch.zeros(blk.hidden.shape, dtype=torch.int64)
        for c in thr.tolist():
            total += self.level(blk, c)
        return total

    def level(self, blk: _Block, c: float) -> torch.Tensor:
        """Hamming distance [nq, nk] between [q > c] and [k > c]: one threshold's share of the L1 distance."""
        def make() -> torch.Tensor:
            a, b = (blk.q > c).float(), (blk.k > c).float()
            small = torch.uint8 if blk.q.shape[1] < 256 else torch.int16
            return (a.sum(1, keepdim=True) + b.sum(1) - 2 * a @ b.T).to(small)

        return self._kept((id(blk), c), make)

    def base(self, blk: _Block, bins: int, top: int) -> torch.Tensor:
        """int32 [nq, nk]: row r's histogram starts at bin r·bins; hidden keys are pushed past `top`."""
        def make() -> torch.Tensor:
            rows = torch.arange(blk.hidden.shape[0], dtype=torch.int32).unsqueeze(1) * bins
            return rows + blk.hidden.to(torch.int32) * (top + 1)

        return self._kept((id(blk), "base"), make)

    def _kept(self, key: tuple, make) -> torch.Tensor:
        if key in self.cache:
            return self.cache[key]
        m = make()
        if self.bytes + m.nbytes <= self.max_bytes:
            self.cache[key] = m
            self.bytes += m.nbytes
        return m

    def block_recall(self, blk: _Block, thr: torch.Tensor) -> torch.Tensor:
        """Expected recall per query [nq] of the `budget` closest-coded keys against the exact top-`budget`.

        Distances are integers in [0, top]: a histogram per query gives the cut (the budget-th smallest distance)
        and how many keys tie at it, in one pass instead of a selection per row. For L1 the bin indices are `base`
        plus each threshold's Hamming matrix, so nothing else is computed per threshold set."""
        nq, budget = blk.truth.shape
        top = blk.q.shape[1] * (2**self.bits - 1) ** (2 if self.metric == "l2" else 1)
        bins = 2 * top + 2
        base = self.base(blk, bins, top)
        if self.metric == "l2":
            idx = base + self.distances(blk, thr)
        else:
            levels = [self.level(blk, c) for c in thr.tolist()]
            idx = base + levels[0]
            for m in levels[1:]:
                idx += m
        hist = torch.bincount(idx.flatten(), minlength=nq * bins).view(nq, bins)[:, : top + 1]
        cum = hist.cumsum(1)
        cut = (cum < budget).sum(1, keepdim=True)  # the first distance whose cumulative count reaches the budget
        below = torch.where(cut > 0, cum.gather(1, (cut - 1).clamp(min=0)), 0)
        share = (budget - below) / hist.gather(1, cut)  # each key tied at the cut is picked with this chance
        d = idx.gather(1, blk.truth) - base[:, :1]  # the truth keys' distances (all visible)
        return ((d < cut).sum(1) + share.squeeze(1) * (d == cut).sum(1)) / budget


# -- search --------------------------------------------------------------------------------------------------------

def _fit(problems: list[_Problem], score: _Objective, fixed: torch.Tensor, sweeps: int) -> torch.Tensor:
    n = fixed.numel()
    kv = torch.cat([b.k.flatten() for p in problems for b in p.blocks])
    qv = torch.cat([b.q.flatten() for p in problems for b in p.blocks])
    grid = torch.linspace(0, 1, 18)[1:-1]
    candidates = torch.cat([_quantile(kv, grid), _quantile(qv, grid), torch.zeros(1)]).unique()
    sigma = float(kv.std())
    starts = [fixed]
    for c in (0.5, 1.0, 1.5, 2.0):  # symmetric ±c·σ around 0
        starts.append(torch.zeros(1) if n == 1 else c * sigma * torch.linspace(-1, 1, n))
    for vals in (kv, torch.cat([kv, qv])):  # equal-mass buckets
        starts.append(_quantile(vals, torch.arange(1, n + 1) / (n + 1)))

    best, best_score = fixed, score(problems, fixed)
    for t in starts[1:]:
        s = score(problems, t)
        if s > best_score:
            best, best_score = t, s
    for sweep in range(sweeps):  # the first sweep scans every other candidate, later ones the current's neighbours
        changed = False
        for i in range(n):
            lo = float(best[i - 1]) if i > 0 else -math.inf
            hi = float(best[i + 1]) if i < n - 1 else math.inf
            inside = candidates[(candidates >= lo) & (candidates <= hi)]
            j = int(torch.searchsorted(inside, best[i]))
            for c in (inside[::2] if sweep == 0 else inside[max(0, j - 2) : j + 3]).tolist():
                if c == float(best[i]):
                    continue
                t = best.clone()
                t[i] = c
                s = score(problems, t)
                if s > best_score:
                    best, best_score, changed = t, s, True
        if not changed:
            break
    return best.float()


def _quantile(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    if x.numel() > 1 << 16:  # candidates need rough quantiles: a strided sample is plenty (and sorts fast)
        x = x[:: x.numel() // (1 << 16) + 1]
    return torch.quantile(x, q.to(x.dtype))


# -- report --------------------------------------------------------------------------------------------------------

def _report(recalls: dict, scales: torch.Tensor, fixed: torch.Tensor, budget: int, n_fit: int, n_held: int,
            group: int, seconds: float) -> dict:
    def r(x: torch.Tensor) -> float:
        return round(float(x), 4)

    layers = [{"layer": i, **{key: r(v[i].mean()) for key, v in recalls.items()},
               "heads": [{**{key: r(v[i, h]) for key, v in recalls.items()}, "query_scale": float(scales[i, h])}
                         for h in range(scales.shape[1])]}
              for i in range(scales.shape[0])]
    return {
        "objective": OBJECTIVE.format(budget=budget),
        "budget": budget,
        "fixed_thresholds": fixed.tolist(),
        "queries_fit": n_fit * group,
        "queries_heldout": n_held * group,
        "mean": {key: r(v.mean()) for key, v in recalls.items()},
        "layers": layers,
        "seconds": round(seconds, 2),
        "query_scales_chosen": {str(s): int((scales == s).sum()) for s in scales.unique().tolist()},
        "note": "before = the paper's fixed thresholds, after = fitted (queries' thresholds = keys' / query_scale), "
                "after_shared = fitted with one set for queries and keys (scale 1); fit_* on the calibration queries, "
                "the others on held-out queries; query counts are per KV head (query positions x group heads)",
    }
