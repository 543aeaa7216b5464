"""What every learned offline stage writes and where: the layers it fits, the record of the data it was fitted on,
the checkpoint folder of a run in progress, and the versioned artifact at the end."""

from __future__ import annotations

import hashlib
import inspect
import json
import shutil
from pathlib import Path
from typing import Any, Callable, Sequence

from ..activations import Activations
from ..artifacts import save_artifact, slugify
from ..errors import SparseKVError


def fit_layers(layers: Sequence[int] | None, num_layers: int) -> list[int]:
    """The layers to fit (default: all), checked against the dump's layer count; sorted, no repeats."""
    if layers is None or len(layers) == 0:
        return list(range(num_layers))
    bad = [x for x in layers if not 0 <= int(x) < num_layers]
    if bad:
        raise SparseKVError(f"--layers {','.join(map(str, bad))}: the dump has layers 0..{num_layers - 1}")
    if len(set(layers)) != len(layers):
        raise SparseKVError("--layers lists a layer twice")
    return sorted(int(x) for x in layers)


def with_defaults(fit: Callable, options: dict) -> dict:
    """A stage function's options as it would run them: those given, then its defaults."""
    bound = inspect.signature(fit).bind_partial(**options)
    bound.apply_defaults()
    return dict(bound.arguments)


def check_holdout(holdout: float, patience: int) -> None:
    """A held-out share in [0, 1); none held out leaves nothing to stop on but the fitted sequences."""
    if not 0 <= holdout < 1:
        raise SparseKVError(f"--holdout must be in [0, 1), got {holdout}")
    if holdout == 0 and patience:
        raise SparseKVError("--holdout 0 holds no sequence out, so --patience would stop the run on the sequences it "
                            "fits: give --patience 0 too, or a --holdout above 0")


def data_record(acts: Activations) -> dict:
    """What the artifact was fitted on: the dump's source, token count, seed and identity."""
    return {"source": acts.data.get("source", ""), "tokens": acts.tokens, "seed": acts.data.get("seed"),
            "queries": acts.queries, "dump": str(acts.path), "tokens_sha256": acts.data.get("tokens_sha256"),
            "dump_manifest_sha256": acts.manifest.get("manifest_sha256")}


def checkpoint_dir(root: str | Path, acts: Activations, method: str, identity: dict) -> Path:
    """The folder of a run's checkpoints: hidden beside the artifact's versions (`artifacts list` skips it), named
    by the run's identity (its config and data), so `--resume` finds the run that the same command started."""
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:12]
    model = (acts.manifest.get("model") or {}).get("name") or "model"
    return Path(root) / slugify(str(model)) / method / f".train-{digest}"


def save_stage(root: str | Path, acts: Activations, method: str, tensors: dict, config: dict, report: dict,
               version: str | None = None, work: str | Path | None = None) -> Path:
    """Write a stage's result as a versioned artifact for the dump's model (atomic: sparsekv.artifacts); then the
    run's checkpoint folder `work`, which the artifact supersedes, is removed."""
    path = save_artifact(root, method=method, model_fingerprint=acts.manifest["model"], config=config,
                         tensors=tensors, data=data_record(acts), report=report, version=version)
    if work is not None:
        shutil.rmtree(work, ignore_errors=True)
    return path


def fit_and_save(acts: Activations, root: str | Path, method: str, stage: str, fit: Callable[..., tuple], *,
                 resume: bool = False, version: str | None = None, progress: Any = None, **options: Any
                 ) -> tuple[Path, dict]:
    """A learned stage from dump to artifact: `fit(acts, work=..., resume=..., progress=..., **options)` -> (tensors
    by file stem, config, report) runs with its checkpoints in a hidden folder under `root`, named by the stage's
    options and dump (so `resume` finds the run the same command started), then the artifact is written under
    `root` and the checkpoints removed. Returns (path, report)."""
    identity = {"stage": stage, "options": {k: v for k, v in sorted(options.items()) if k != "device"},
                "data": data_record(acts)}
    work = checkpoint_dir(root, acts, method, identity)
    if resume and not work.is_dir():  # before the dump's tensors load
        raise SparseKVError(f"--resume: no checkpoint at {work}; run without --resume")
    tensors, config, report = fit(acts, work=work, resume=resume, progress=progress, **options)
    return save_stage(root, acts, method, tensors, config, report, version=version, work=work), report
