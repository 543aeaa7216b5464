"""Checks of user input that run before any model loads or work starts: each raises SparseKVError with one line
that names the option, so a bad input costs nothing and a run never dies after its work (an output it cannot
write, a list entry it silently dropped)."""

from __future__ import annotations

import gzip
import math
import os
import tempfile
from pathlib import Path
from typing import Callable

from .errors import SparseKVError

TEXT_SNIFF = 8192  # bytes read to tell text from binary


def device(spec: str, option: str = "--device") -> str:
    """'auto' (cuda when present), 'cpu', 'cuda' or 'cuda:N' with N an existing device -> the device to use."""
    import torch

    if spec == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if spec == "cpu":
        return spec
    if spec == "cuda" or (spec.startswith("cuda:") and spec[5:].isdigit()):
        if not torch.cuda.is_available():
            raise SparseKVError(f"{option} {spec}: no CUDA device on this machine")
        if ":" in spec and int(spec[5:]) >= torch.cuda.device_count():
            raise SparseKVError(f"{option} {spec}: this machine has {torch.cuda.device_count()} CUDA device(s)")
        return spec
    raise SparseKVError(f"{option} {spec!r}: use auto, cpu, cuda or cuda:N")


def number(text: str | float | int, kind: Callable = float, option: str = "value", positive: bool = False):
    """One number of `kind` (int or float), finite, optionally > 0."""
    try:
        value = kind(text)
    except (TypeError, ValueError):
        raise SparseKVError(f"{option} {text!r}: expected {'an integer' if kind is int else 'a number'}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise SparseKVError(f"{option} {text!r}: must be a finite number")
    if positive and value <= 0:
        raise SparseKVError(f"{option} must be positive, got {text}")
    return value


def csv(text: str, kind: Callable = str, option: str = "value", positive: bool = False) -> list:
    """A comma-separated list; an empty entry (`64,,128`, a trailing comma) is an error, not silently dropped."""
    parts = [p.strip() for p in text.split(",")]
    if text.strip() == "":
        return []
    if any(p == "" for p in parts):
        raise SparseKVError(f"{option} {text!r}: empty entry in the comma-separated list")
    if kind is str:
        return parts
    return [number(p, kind, option, positive) for p in parts]


def budget(value: float, option: str = "--budget") -> float:
    """A budget: a token count (a whole number >= 1) or a fraction in (0, 1)."""
    value = number(value, float, option, positive=True)
    if value >= 1 and value != int(value):
        raise SparseKVError(f"{option} {value:g} is neither a whole token count nor a fraction below 1")
    return value


def dense_layers(layers: list[int], num_layers: int, option: str = "--dense-layers") -> tuple[int, ...]:
    bad = [i for i in layers if not 0 <= i < num_layers]
    if bad:
        raise SparseKVError(f"{option} {','.join(map(str, bad))}: the model has {num_layers} layers "
                            f"(0..{num_layers - 1})")
    return tuple(layers)


def output_file(path: Path | None, option: str = "--json") -> Path | None:
    """A file we will write after the work: its folder exists or can be made, accepts a new file (tried, not
    guessed from permission bits), and the path is not a folder."""
    if path is None:
        return None
    path = Path(path)
    if path.is_dir():
        raise SparseKVError(f"{option} {path}: is a folder; give a file name")
    _writable_folder(path.parent, option, path)
    return path


def output_folder(path: Path, option: str = "--out") -> Path:
    """A folder we will create or add to: not an existing file, and writable (or creatable) where it goes."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise SparseKVError(f"{option} {path}: exists and is not a folder")
    _writable_folder(path if path.is_dir() else path.parent, option, path)
    return path


def _writable_folder(folder: Path, option: str, target: Path) -> None:
    existing = folder
    while not existing.exists():  # the first existing ancestor must take the folders we would make
        if existing.parent == existing:
            break
        existing = existing.parent
    if not existing.is_dir():
        raise SparseKVError(f"{option} {target}: {existing} is not a folder")
    try:
        fd, probe = tempfile.mkstemp(prefix=".sparsekv-write-check-", dir=existing)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise SparseKVError(f"{option} {target}: cannot write in {existing} ({e.strerror or e})") from None


def text_file(path: Path, option: str) -> Path:
    """An existing text file (.gz read through): not a folder, not binary (NUL bytes or not UTF-8)."""
    path = Path(path)
    if not path.exists():
        raise SparseKVError(f"{option} {path}: file not found")
    if not path.is_file():
        raise SparseKVError(f"{option} {path}: not a file")
    try:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rb") as f:
            head = f.read(TEXT_SNIFF)
    except (OSError, EOFError) as e:
        raise SparseKVError(f"{option} {path}: cannot read it ({e})") from None
    if b"\x00" in head or not _utf8_prefix(head):
        raise SparseKVError(f"{option} {path}: not a text file (binary content)")
    return path


def _utf8_prefix(data: bytes) -> bool:
    """Whether `data` is UTF-8, allowing a multi-byte character cut at the end of the sample."""
    for cut in range(4):
        try:
            data[: len(data) - cut].decode("utf-8")
            return True
        except UnicodeDecodeError:
            continue
    return False
