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


def csv(text: str, kind: Callable = str, option: str = "value", positive: bool = False, unique: bool = False,
        required: bool = False) -> list:
    """A comma-separated list; an empty entry (`64,,128`, a trailing comma) is an error, not silently dropped, and
    so are, when asked, an entry given twice (`unique`: the grid would run it twice) and an empty list
    (`required`)."""
    parts = [p.strip() for p in text.split(",")]
    if text.strip() == "":
        if required:
            raise SparseKVError(f"{option}: give at least one value")
        return []
    if any(p == "" for p in parts):
        raise SparseKVError(f"{option} {text!r}: empty entry in the comma-separated list")
    values = parts if kind is str else [number(p, kind, option, positive) for p in parts]
    twice = [p for p, v in zip(parts, values) if values.count(v) > 1]
    if unique and twice:
        raise SparseKVError(f"{option} {text!r}: {twice[0]} is given twice")
    return values


def budget(value: float, option: str = "--budget") -> float:
    """A budget: a token count (a whole number >= 1) or a fraction in (0, 1)."""
    value = number(value, float, option, positive=True)
    if value >= 1 and value != int(value):
        raise SparseKVError(f"{option} {value:g} is neither a whole token count nor a fraction below 1")
    return value


def budgets(text: str, option: str = "--budget") -> list[float]:
    """A comma-separated list of budgets, each one as `budget` takes it, none twice."""
    return [budget(b, option) for b in csv(text, float, option, unique=True, required=True)]


def dtype(spec: str, option: str = "--dtype") -> str:
    if spec not in ("auto", "fp32", "fp16", "bf16"):
        raise SparseKVError(f"{option} {spec!r}: use auto, fp32, fp16 or bf16")
    return spec


def dense_layers(layers: list[int], num_layers: int | None, option: str = "--dense-layers",
                 what: str = "the model") -> tuple[int, ...]:
    """Layer indices that exist (`num_layers` None: not known before loading; the cache checks them then)."""
    bad = [i for i in layers if num_layers is not None and not 0 <= i < num_layers]
    if bad:
        raise SparseKVError(f"{option} {','.join(map(str, bad))}: {what} has {num_layers} layers "
                            f"(0..{num_layers - 1})")
    return tuple(layers)


# -- against the model's config (models.peek_config: read without loading any weight) ------------------------------

def model_shape(spec: str) -> dict | None:
    """The model's shape (models.config_shape) from its config, read without its weights; None where that needs
    the network or a first fetch (a hub id, a GGUF: checked when it loads). A spec that cannot be a model is
    refused in one line here."""
    from .models import config_shape, peek_config

    config = peek_config(spec)
    return None if config is None else config_shape(config)


def lengths(values: list[int], shape: dict | None, model: str, option: str = "--seq", reserve: int = 0,
            reserve_what: str = "") -> list[int]:
    """Lengths in tokens that fit the model's context (`reserve` more tokens beside each: what a run adds to it),
    checked before the model loads or any prompt is built."""
    from .models import spec_name

    context = (shape or {}).get("max_context") or 0
    for n in values:
        if n <= 0:
            raise SparseKVError(f"{option} must be positive, got {n}")
        if context and n + reserve > context:
            if reserve:
                raise SparseKVError(f"{option} {n} + {reserve} {reserve_what} exceed {spec_name(model)}'s context "
                                    f"({context} tokens)")
            raise SparseKVError(f"{option} {n} is longer than {spec_name(model)} supports ({context} tokens)")
    return values


def model_checks(model: str, *, seqs: list[int] = (), option: str = "--seq", reserve: int = 0, reserve_what: str = "",
                 layers: list[int] = (), artifact_path: str | Path | None = None) -> dict | None:
    """Every check of a run's options against the model, from its config alone, before it loads: lengths
    (`option`) within its context, dense `layers` among its layers, an artifact made from it. Returns its shape
    (None: not known before loading)."""
    shape = model_shape(model)
    lengths(list(seqs), shape, model, option, reserve, reserve_what)
    dense_layers(list(layers), (shape or {}).get("num_layers"))
    artifact(artifact_path, shape, model)
    return shape


def same_model(recorded: dict | None, shape: dict | None, model: str, what: str) -> None:
    """An artifact or dump (`recorded`: its manifest's "model") made from the model `model` names: its name and,
    when the config is known before loading (`shape`), its layer and head counts and head dim; one line names
    every difference. The weights hash and RoPE are checked when the model has loaded."""
    from .models import spec_name

    recorded = recorded or {}
    expected = {"name": spec_name(model), **{k: v for k, v in (shape or {}).items() if k != "max_context"}}
    diffs = [f"{k} {recorded[k]} != {v}" for k, v in expected.items() if k in recorded and recorded[k] != v]
    if diffs:
        raise SparseKVError(f"{what} was made from another model than --model {model} (recorded != given): "
                            + ", ".join(diffs))


def artifact(path: str | Path | None, shape: dict | None, model: str, option: str = "--artifact") -> None:
    """Artifacts (one path, or several comma-separated) made from the model `model` names, read from their
    manifests alone (no tensor is loaded)."""
    if path is None:
        return
    from .artifacts import artifact_paths, read_manifest

    for one in artifact_paths(path):
        same_model(read_manifest(one).get("model"), shape, model, f"{option} {one}")


def sink_window(method: str, sink: int, window: int, budget: float, context: int | None = None) -> None:
    """A sparse step spends sink + window of its budget on fixed keys: more than the budget is refused before any
    work (it would fail at the first decode step). A fractional budget is resolved against `context` (unchecked
    without one); a budget that covers the whole context reads every key, sink and window aside."""
    from .selection import resolve_budget, sink_window_error

    if budget < 1 and context is None:
        return
    tokens = resolve_budget(budget, context) if budget < 1 else int(budget)
    if context is not None and tokens >= context:
        return
    of = f" of {context}" if budget < 1 else ""
    if sink + window > tokens:
        raise sink_window_error(method, sink, window, f"--budget {budget:g} ({tokens} tokens{of})")


def method_sink_window(method: str, sink: int | None, window: int | None, budget: float,
                       context: int | None = None) -> None:
    """`sink_window` for a registered method, its own defaults (its paper's) where sink or window is not given."""
    from .methods.base import REGISTRY

    cls = REGISTRY.get(method)
    if cls is not None:
        sink_window(method, cls.default_sink if sink is None else sink,
                    cls.default_window if window is None else window, budget, context)


def dump(path: str | Path, option: str = "--acts", model: str | None = None, check=None):
    """An activations dump whose every file is whole (sha256, each hashed once per process): a corrupt layer stops
    the run before any work, not when that layer is reached. With `model`: made from that model (same_model).
    `check(acts)`: what needs the manifest only (a stage's layers, lengths), run before the files are hashed."""
    from .activations import load_activations

    if path is None:
        raise SparseKVError(f"{option}: give a `sparsekv dump` folder")
    if not Path(path).exists():
        raise SparseKVError(f"{option} {path}: no such folder (give a `sparsekv dump` folder)")
    acts = load_activations(path)
    if check is not None:
        check(acts)
    acts.check_files()
    if model is not None:
        same_model(acts.manifest.get("model"), model_shape(model), model, f"{option} {path}")
    return acts


def cpu_stage_device(spec: str, model: str | None, option: str = "--device") -> None:
    """An offline stage that computes on the CPU uses --device only to load --model: a device given without a
    model would be silently ignored, so it is refused."""
    device(spec, option)
    if model is None and spec not in ("auto", "cpu"):
        raise SparseKVError(f"{option} {spec}: this stage computes on the CPU; {option} only places --model "
                            f"(give --model, or leave {option} out)")


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


PLOT_FORMATS = (".png", ".pdf", ".svg", ".jpg", ".jpeg", ".webp", ".eps", ".ps", ".tif", ".tiff")  # matplotlib's


def plot_file(path: Path | None, option: str = "--plot") -> Path | None:
    """A figure we will write after the work (output_file), named with a format matplotlib writes: checked before
    the run, so a long eval or bench does not end in a figure it cannot save."""
    if path is None:
        return None
    path = output_file(path, option)
    if path.suffix.lower() not in PLOT_FORMATS:
        raise SparseKVError(f"{option} {path}: the name must end in one of {', '.join(PLOT_FORMATS)} (the figure's "
                            f"format)")
    return path


def distinct_outputs(paths: dict[str, Path | None]) -> None:
    """A command's output files ({option: path}), no file named by two options: the last one written would replace
    the other."""
    seen: dict[Path, str] = {}
    for option, path in paths.items():
        if path is None:
            continue
        key = Path(path).resolve()
        if key in seen:
            raise SparseKVError(f"{seen[key]} and {option} name the same file ({path}): give two names")
        seen[key] = option


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
    """An existing text file (.gz read through): not a folder, not empty, not binary (NUL bytes), UTF-8."""
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
    if not head:
        raise SparseKVError(f"{option} {path}: the file is empty")
    if b"\x00" in head:
        raise SparseKVError(f"{option} {path}: not a text file (binary content)")
    if not _utf8_prefix(head):
        raise SparseKVError(f"{option} {path}: not UTF-8 text (convert it first, e.g. iconv -t UTF-8)")
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
