"""Bootstrap intervals for generation scores: how sure a cell's score is, and how sure its difference to dense and
to the oracle at the same budget is.

A cell's score is RULER's (the mean over subtasks of each subtask's mean, x100; passkey: one stratum), so the
bootstrap resamples prompts within each subtask (stratified) and recomputes it. Cells of one run decode the same
prompts in the same order, so a difference is bootstrapped paired: the same resampled prompts for both cells.
Percentile intervals, 2000 resamples from a fixed seed (the same data gives the same interval).
"""

from __future__ import annotations

import torch

REPS = 2000
LEVEL = 0.95


def _strata(rows: list[dict]) -> dict:
    out: dict = {}
    for i, r in enumerate(rows):
        out.setdefault(r.get("subtask"), []).append(i)
    return out


def _resampled(scores: list[torch.Tensor], strata: dict, reps: int, seed: int) -> list[torch.Tensor]:
    """Each cell's score under the same `reps` stratified resamples of its prompts: [reps] per cell."""
    g = torch.Generator().manual_seed(seed)
    totals = [torch.zeros(reps, dtype=torch.float64) for _ in scores]
    for idx in strata.values():
        idx = torch.tensor(idx)
        pick = idx[torch.randint(len(idx), (reps, len(idx)), generator=g)]
        for t, s in zip(totals, scores):
            t += s[pick].mean(-1)
    return [100.0 * t / len(strata) for t in totals]


def _interval(x: torch.Tensor) -> list[float]:
    lo, hi = torch.quantile(x, torch.tensor([(1 - LEVEL) / 2, (1 + LEVEL) / 2], dtype=torch.float64)).tolist()
    return [round(lo, 3), round(hi, 3)]


def score_interval(rows: list[dict], reps: int = REPS, seed: int = 0) -> list[float]:
    """The 95 % interval of a cell's score from its per-prompt rows (each with "score" in [0, 1], "subtask")."""
    s = torch.tensor([float(r["score"]) for r in rows], dtype=torch.float64)
    return _interval(_resampled([s], _strata(rows), reps, seed)[0])


def difference(rows: list[dict], base: list[dict], reps: int = REPS, seed: int = 0) -> dict:
    """score(rows) - score(base) over the same prompts, with its paired 95 % interval."""
    a, b = (torch.tensor([float(r["score"]) for r in x], dtype=torch.float64) for x in (rows, base))
    ra, rb = _resampled([a, b], _strata(rows), reps, seed)
    n_strata = len(_strata(rows))
    delta = 100.0 * sum(float(a[i].mean() - b[i].mean()) for i in map(torch.tensor, _strata(rows).values())) / n_strata
    return {"delta": round(delta, 3), "ci95": _interval(ra - rb)}


def annotate(results: list[dict]) -> list[dict]:
    """Add to each generation cell (with its "samples") `score_ci95`, and where the run has them at the same length,
    `vs_dense` and `vs_oracle` (the oracle at the same budget): the paired difference and its interval."""
    for r in results:
        if r.get("samples"):
            r["score_ci95"] = score_interval(r["samples"])
    for r in results:
        if not r.get("samples"):
            continue
        for name in ("dense", "oracle"):
            base = next((b for b in results if b is not r and b.get("method") == name and b.get("samples")
                         and b.get("seq_len") == r.get("seq_len") and len(b["samples"]) == len(r["samples"])
                         and (name == "dense" or b.get("budget") == r.get("budget"))), None)
            if base is not None and r.get("method") != name:
                r[f"vs_{name}"] = difference(r["samples"], base["samples"])
    return results
