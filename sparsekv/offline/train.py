"""One training loop for every learned offline stage: AdamW (or Adam) with linear warm-up and cosine decay, gradient
clipping, checkpoints every N steps, `resume` to the same weights, and progress with the loss and a held-out metric.

A stage hands it a model (every (layer, KV head) of the layers it fits as one batched module: each head's
parameters are independent slices, so one optimizer step is every head's own step) and `loss_at(step)`, a
function of the step alone (sparsekv/offline/data.py draws a step's example from (seed, step)). With the RNG of
the data fixed by the step and the model's state, optimizer state and step restored from the checkpoint, a resumed
run computes the same updates as an uninterrupted one (bit for bit on the CPU; on a GPU up to the determinism of
its kernels). Checkpoints are written to a temporary file and renamed, so a kill never leaves half of one; on
Ctrl-C / SIGTERM the loop writes one before it stops.

Checkpoints carry the run's `identity` (the stage's config and its data): resuming with another config or dump is
refused in one line rather than continuing a different run.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ..errors import SparseKVError
from ..progress import Ticker
from .precision import tf32_matmul

CHECKPOINT = "checkpoint.pt"


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation settings; the defaults are Spotlight's Table 4 (AdamW, betas (0.9, 0.98), weight decay 0.1,
    max lr 1e-3 to 0 with 81 linear warm-up steps and cosine annealing, clipping 1.0, 8192 iterations)."""

    iters: int = 8192
    lr: float = 1e-3
    min_lr: float = 0.0
    warmup: int = 81
    optimizer: str = "adamw"  # or "adam" (SAAP's)
    betas: tuple[float, float] = (0.9, 0.98)
    weight_decay: float = 0.1
    clip: float | None = 1.0
    checkpoint_every: int = 512
    eval_every: int = 0  # held-out metric every N steps (0: at the end only)
    seed: int = 0
    tf32: bool = False  # fp32 matrix products on TF32 tensor cores while training on CUDA (no effect on the CPU)
    best_by: str = ""  # a held-out metric: the run ends with the weights of its best evaluation ("" : the last ones)
    best_mode: str = "min"  # "min" or "max": which values of best_by are better
    patience: int = 0  # with best_by: stop after this many evaluations without a better value (0: run every step)
    min_delta: float = 0.0  # with best_by: a value is better only when it beats the best by this fraction of it

    def check(self) -> None:
        if self.iters < 1:
            raise SparseKVError(f"--iters must be >= 1, got {self.iters}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise SparseKVError(f"--lr must be a finite number > 0, got {self.lr}")
        if not (math.isfinite(self.min_lr) and 0 <= self.min_lr):
            raise SparseKVError(f"min_lr must be a finite number >= 0, got {self.min_lr}")
        if self.checkpoint_every < 0 or self.eval_every < 0:
            raise SparseKVError(f"--checkpoint-every and --eval-every must be >= 0, got {self.checkpoint_every} and "
                                f"{self.eval_every}")
        if self.warmup < 0:
            raise SparseKVError(f"warmup must be >= 0, got {self.warmup}")
        if self.optimizer not in ("adamw", "adam"):
            raise SparseKVError(f"optimizer must be adamw or adam, got {self.optimizer!r}")
        if self.patience < 0:
            raise SparseKVError(f"--patience must be >= 0, got {self.patience}")
        if not 0.0 <= self.min_delta < 1.0:
            raise SparseKVError(f"--min-delta must be in [0, 1), got {self.min_delta}")
        if self.patience and not self.best_by:
            raise SparseKVError("patience needs a held-out metric to follow (best_by)")
        if self.best_mode not in ("min", "max"):
            raise SparseKVError(f"best_mode must be min or max (the direction in which best_by improves, for patience "
                                f"and the weights kept), got {self.best_mode!r}")

    def lr_at(self, step: int) -> float:
        """Linear warm-up over `warmup` steps, then cosine from lr to min_lr at the last step."""
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        span = max(1, self.iters - self.warmup)
        t = min(1.0, (step - self.warmup) / span)
        return self.min_lr + 0.5 * (self.lr - self.min_lr) * (1 + math.cos(math.pi * t))


@dataclass
class TrainResult:
    steps: int
    seconds: float  # training time, the interrupted runs' included
    resumed_from: int  # 0: a fresh run
    losses: list[tuple[int, float]] = field(default_factory=list)  # (step, mean loss over the steps since the last)
    evals: list[tuple[int, dict]] = field(default_factory=list)  # (step, held-out metrics)
    best: dict | None = None  # with best_by: {"by", "step", "value"} of the weights the run ended with
    stopped_early: bool = False  # patience ran out before the last step

    def report(self) -> dict:
        out = {"steps": self.steps, "seconds": round(self.seconds, 2), "resumed_from": self.resumed_from,
               "loss_curve": [[s, round(v, 6)] for s, v in self.losses],
               "heldout_curve": [[s, m] for s, m in self.evals]}
        if self.best is not None:
            out.update(kept=self.best, stopped_early=self.stopped_early)
        return out


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """Adam or AdamW over the model's trainable parameters; on CUDA the fused implementation (one kernel for every
    parameter's update instead of several passes per tensor; the same update rule)."""
    params = [p for p in model.parameters() if p.requires_grad]
    fused = bool(params) and all(p.is_cuda and p.is_floating_point() for p in params)
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, betas=cfg.betas, fused=fused or None)
    return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, fused=fused or None)


def train(model: torch.nn.Module, loss_at: Callable[[int], torch.Tensor], cfg: TrainConfig, *,
          checkpoint_dir: str | Path | None = None, resume: bool = False, identity: dict | None = None,
          evaluate: Callable[[], dict] | None = None, progress: Any = None, label: str = "train",
          show: str | None = None) -> TrainResult:
    """Run `cfg.iters` steps of `loss_at(step).backward()` + one optimizer step on `model`; returns the curves.

    checkpoint_dir: where `checkpoint.pt` goes (every `cfg.checkpoint_every` steps, at the end, and on an
    interrupt); `resume`: continue from it (refused if its identity differs); `evaluate()`: held-out metrics,
    every `cfg.eval_every` steps and at the end, in full fp32; `show`: the key of the metric shown beside the loss
    in progress. With `cfg.best_by` the model ends with the weights of the best evaluation, and with `cfg.patience`
    the run stops once that many evaluations in a row did not improve on it (a small dump overfits long before
    a paper's iteration count); with `cfg.min_delta` an improvement counts only from that fraction of the best
    value on (a plateau's last small gains stop the run instead of prolonging it).
    """
    cfg.check()
    opt = make_optimizer(model, cfg)
    ident = {"train": _plain(asdict(cfg)), **(identity or {})}
    ckpt = Path(checkpoint_dir) / CHECKPOINT if checkpoint_dir is not None else None
    start, losses, evals, before, best = 0, [], [], 0.0, None
    if resume:
        if ckpt is None or not ckpt.exists():
            raise SparseKVError(f"--resume: no checkpoint at {ckpt or '(no checkpoint folder)'}; run without --resume")
        start, losses, evals, before, best = _load(ckpt, model, opt, ident)
    tick = Ticker(progress, cfg.iters, label)
    tick.advance(start)
    t0, window, since = time.perf_counter(), 0.0, 0
    step, stop = start, _out_of_patience(best, evals, cfg)  # a resumed run that had stopped stays stopped
    save = lambda: _save(ckpt, model, opt, step, losses, evals, best, ident, before + time.perf_counter() - t0)
    try:
        with tf32_matmul(cfg.tf32):
            while step < cfg.iters and not stop:
                for group in opt.param_groups:
                    group["lr"] = cfg.lr_at(step)
                opt.zero_grad(set_to_none=True)
                loss = loss_at(step)
                if not torch.isfinite(loss):
                    raise SparseKVError(f"{label}: the loss is {loss.item()} at step {step}; lower the learning rate")
                loss.backward()
                if cfg.clip and hasattr(model, "clip_grads_"):  # a batched model clips each head on its own
                    model.clip_grads_(cfg.clip)
                elif cfg.clip:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
                opt.step()
                step += 1
                window, since = window + float(loss.detach()), since + 1
                tick.advance()
                last = step == cfg.iters
                if evaluate is not None and (last or (cfg.eval_every and step % cfg.eval_every == 0)):
                    with tf32_matmul(False):
                        evals.append((step, evaluate()))
                    if cfg.best_by:
                        best, stop = _track_best(best, evals, model, cfg)
                if since and (step % max(1, cfg.iters // 64) == 0 or last or stop):
                    losses.append((step, window / since))
                    window, since = 0.0, 0
                if losses:
                    shown = f"{label} loss {losses[-1][1]:.4f}"
                    if show and evals:
                        shown += f" · held-out {show} {evals[-1][1][show]:.3f}"
                    tick.update(shown)
                if ckpt is not None and (last or stop or (cfg.checkpoint_every and step % cfg.checkpoint_every == 0)):
                    save()
    except KeyboardInterrupt:
        if ckpt is not None and step > start:
            save()
        raise
    kept = None
    if best is not None:
        model.load_state_dict(best["model"])
        kept = {"by": cfg.best_by, "step": best["step"], "value": best["value"]}
    return TrainResult(step, before + time.perf_counter() - t0, start, losses, evals, kept, stop)


def _track_best(best: dict | None, evals: list, model: torch.nn.Module, cfg: TrainConfig) -> tuple[dict | None, bool]:
    """After an evaluation: the best one so far (its step, value and a copy of the weights) and whether patience has
    run out."""
    step, metrics = evals[-1]
    v = float(metrics[cfg.best_by])
    if best is None or _better(v, best["value"], cfg):
        weights = {k: t.detach().clone() for k, t in model.state_dict().items()}
        return {"step": step, "value": v, "model": weights}, False
    return best, _out_of_patience(best, evals, cfg)


def _better(v: float, best: float, cfg: TrainConfig) -> bool:
    """Whether v improves on best in cfg.best_mode's direction by at least cfg.min_delta of |best|."""
    margin = cfg.min_delta * abs(best)
    return v < best - margin if cfg.best_mode == "min" else v > best + margin


def _out_of_patience(best: dict | None, evals: list, cfg: TrainConfig) -> bool:
    """Whether cfg.patience evaluations have followed the best one without beating it."""
    return bool(best and cfg.patience) and sum(s > best["step"] for s, _ in evals) >= cfg.patience


def _plain(x: Any) -> Any:
    """JSON-like (tuples as lists) so an identity compares equal after a round trip through the checkpoint."""
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def _save(path: Path, model, opt, step: int, losses, evals, best, identity: dict, seconds: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    torch.save({"step": step, "model": model.state_dict(), "optimizer": opt.state_dict(), "losses": losses,
                "evals": evals, "best": best, "identity": _plain(identity), "seconds": seconds}, tmp)
    os.replace(tmp, path)


def _load(path: Path, model, opt, identity: dict) -> tuple[int, list, list, float, dict | None]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:
        raise SparseKVError(f"--resume: the checkpoint {path} cannot be read ({type(e).__name__}); run without "
                            f"--resume to start over") from None
    want, have = _plain(identity), state.get("identity", {})
    if have != want:
        diffs = sorted(k for k in set(want) | set(have) if want.get(k) != have.get(k))
        raise SparseKVError(f"--resume: the checkpoint {path} belongs to another run (differs in: "
                            f"{', '.join(diffs)}); rerun with the same options or without --resume")
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    best = state.get("best")
    if best is not None:
        dev = next(iter(model.state_dict().values())).device
        best = {**best, "model": {k: t.to(dev) for k, t in best["model"].items()}}
    return (int(state["step"]), list(state["losses"]), list(state["evals"]), float(state.get("seconds", 0.0)),
            best)
