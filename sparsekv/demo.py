"""`sparsekv demo`'s offline stage: dump a little natural text, calibrate Adamas on it, keep the artifact.

A fresh machine may have no corpus, so the text is Debian's jargon file when installed and otherwise the
docstrings of Python's standard library (natural English that ships with every Python). The artifact is kept in
the cache home and reused while the model is unchanged; the demo then evaluates on passkey prompts, which the
calibration never saw.
"""

from __future__ import annotations

import importlib
import inspect
import tempfile
import warnings
from pathlib import Path
from typing import Any

from .activations import dump_activations, load_activations, text_tokens
from .artifacts import ArtifactError, load_artifact, resolve
from .calibrate import calibrate_adamas, save_calibration
from .models import LoadedModel, cache_home

JARGON = Path("/usr/share/doc/jargon-text/jargon.txt.gz")
STDLIB_MODULES = ("argparse", "collections", "dataclasses", "decimal", "email.message", "functools", "inspect",
                  "json", "logging", "pathlib", "pickle", "random", "re", "shutil", "statistics", "string",
                  "subprocess", "tarfile", "textwrap", "threading", "typing", "unittest", "urllib.request",
                  "zipfile", "asyncio", "contextlib", "datetime", "difflib", "heapq", "itertools")
DEMO_TOKENS, DEMO_SEQ, DEMO_QUERIES = 4096, 1024, 32  # small: the demo must take a minute, not ten


def artifact_root() -> Path:
    return cache_home() / "artifacts"


def stdlib_text() -> str:
    """Docstrings of a fixed list of standard-library modules and their public members, in a fixed order."""
    parts = []
    with warnings.catch_warnings():  # touching deprecated members (typing.io, ...) warns
        warnings.simplefilter("ignore")
        for name in STDLIB_MODULES:
            parts += _docs(name)
    return "\n\n".join(p for p in parts if len(p) > 80)


def _docs(name: str) -> list[str]:
    """A module's docstring and those of its public members defined in it."""
    try:
        mod = importlib.import_module(name)
    except ImportError:  # a trimmed Python may lack some
        return []
    parts = [inspect.getdoc(mod) or ""]
    for attr in sorted(vars(mod)):
        obj = getattr(mod, attr)
        if not attr.startswith("_") and getattr(obj, "__module__", None) == mod.__name__:
            parts.append(inspect.getdoc(obj) or "")
    return parts


def calibration_tokens(lm: LoadedModel, tokens: int | None = None) -> tuple[list[int], str]:
    tokens = tokens or DEMO_TOKENS
    if JARGON.is_file():
        return text_tokens(lm, text_file=JARGON, tokens=tokens), str(JARGON)
    ids = list(lm.tokenizer.encode(stdlib_text(), add_special_tokens=False))
    return ids[:tokens], "docstrings of Python's standard library"


def demo_artifact(lm: LoadedModel, budget: int, progress: Any = None) -> tuple[Path, dict | None]:
    """The demo's calibrated Adamas artifact for `lm`: reused if one for this model and budget exists, else made
    (dump -> calibrate -> save). Returns (version folder, the calibration report when it was just made)."""
    root = artifact_root()
    try:
        path = resolve(root, lm.fingerprint()["name"], "adamas")
        art = load_artifact(path, method="adamas", model_fingerprint=lm.fingerprint())
        if art.manifest["config"].get("budget") == budget and "query_thresholds" in art.tensors.get("thresholds", {}):
            return path, None
    except ArtifactError:  # none yet, another model's, another budget, older (one set) or damaged: make a fresh one
        pass
    ids, source = calibration_tokens(lm)
    with tempfile.TemporaryDirectory(prefix="sparsekv-demo-") as tmp:
        dump = dump_activations(lm, ids, Path(tmp) / "dump", seq_len=DEMO_SEQ, queries_per_seq=DEMO_QUERIES,
                                source=source, progress=progress)
        acts = load_activations(dump, lm)
        thresholds, q_thresholds, report = calibrate_adamas(acts, budget=budget, max_queries=4 * DEMO_QUERIES,
                                                            sweeps=2, query_scales=(1.0, 4.0), progress=progress)
        path = save_calibration(root, acts, thresholds, report, per="head", bits=2, hadamard=True, distance="l1",
                                budget=budget, query_thresholds=q_thresholds)
    return path, {**report, "source": source, "tokens": len(ids)}

