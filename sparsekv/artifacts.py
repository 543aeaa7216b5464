"""Versioned artifact store: `<root>/<model-slug>/<method>/<version>/` holding `manifest.json` and `*.safetensors`.

Offline stages (calibrate, train-hash, index, dump) write here; online stages load from here. A load checks the
schema, the model fingerprint and every file's sha256, and stops with one line naming what differs, because a
calibration silently applied to another model (or a half-copied file) gives wrong results, not an error.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from .errors import SparseKVError

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
SUFFIX = ".safetensors"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")  # one folder-safe path component, never hidden
_VERSION_RE = re.compile(r"^v(\d+)$")


class ArtifactError(SparseKVError):
    """A missing, corrupted or mismatched artifact; the message is one line saying what and where."""


@dataclass
class Artifact:
    path: Path
    manifest: dict
    tensors: dict[str, dict[str, torch.Tensor]]  # file stem -> {tensor name -> tensor}

    @property
    def config(self) -> dict:
        return self.manifest["config"]

    @property
    def method(self) -> str:
        return self.manifest["method"]

    @property
    def version(self) -> str:
        return self.path.name


def slugify(name: str) -> str:
    """Model name -> folder-safe slug: 'HuggingFaceTB/SmolLM2-135M' -> 'huggingfacetb--smollm2-135m'."""
    parts = [re.sub(r"[^a-z0-9._-]+", "-", p.lower()).strip("-.") for p in re.split(r"[/\\]", name)]
    slug = "--".join(p for p in parts if p)
    if not slug:
        raise ArtifactError(f"cannot make a folder name from model name {name!r}")
    return slug


def sparsekv_version() -> str:
    try:
        from importlib.metadata import version

        return version("sparsekv")
    except Exception:  # not installed (running from a source tree)
        try:
            from . import __version__

            return str(__version__)
        except Exception:
            return "0+unknown"


# -- writing -----------------------------------------------------------------------------------------------------

def save_artifact(root: str | os.PathLike, *, method: str, model_fingerprint: dict, config: dict,
                  tensors: dict[str, dict[str, torch.Tensor]], data: dict | None = None,
                  report: dict | None = None, version: str | None = None, kind: str = "method") -> Path:
    """Write a new version and return its folder. Never overwrites: an existing explicit `version` is an error;
    without one the next free `vN` is taken."""
    _check_name("method", method)
    if version is not None:
        _check_name("version", version)
        if version == "latest":
            raise ArtifactError("'latest' is reserved for loading; name the version something else")
    if not isinstance(model_fingerprint, dict) or not model_fingerprint.get("name"):
        raise ArtifactError("model_fingerprint must be a dict with a 'name' (it names the model folder)")
    for stem in tensors:
        _check_name("tensor file name", stem)
    manifest = {
        "schema_version": SCHEMA_VERSION,
        "sparsekv_version": sparsekv_version(),
        "kind": kind,
        "method": method,
        "config": config,
        "model": model_fingerprint,
        "data": data or {},
        "report": report or {},
        "created": datetime.now(timezone.utc).isoformat(),
        "files": {},
    }
    try:  # fail before touching the disk if the caller passed something JSON cannot hold
        json.dumps(manifest)
    except (TypeError, ValueError) as e:
        raise ArtifactError(f"artifact manifest is not JSON-serialisable: {e}") from None

    parent = Path(root) / slugify(str(model_fingerprint["name"])) / method
    parent.mkdir(parents=True, exist_ok=True)
    if version is not None and (parent / version).exists():
        raise ArtifactError(f"artifact {parent / version} already exists; pick another version or delete it")
    # Same parent => same filesystem, so the final rename is atomic; the leading dot hides it from list_artifacts.
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=parent))
    try:
        for stem, named in tensors.items():
            fname = stem + SUFFIX
            save_file({k: _prepare(k, t) for k, t in named.items()}, str(tmp / fname))
            manifest["files"][fname] = {"sha256": _sha256(tmp / fname, fsync=True),
                                        "bytes": (tmp / fname).stat().st_size,
                                        "tensors": {k: {"dtype": str(t.dtype).removeprefix("torch."),
                                                        "shape": list(t.shape)} for k, t in named.items()}}
        _write_json(tmp / MANIFEST, manifest)
        _fsync_dir(tmp)
        final = _rename_into_place(tmp, parent, version)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(parent)
    return final


def _prepare(name: str, t: Any) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ArtifactError(f"artifact tensor {name!r} is a {type(t).__name__}, not a torch.Tensor")
    t = t.detach().to("cpu").contiguous()
    # Older safetensors refuse views that share storage (e.g. per-head slices of one tensor): own the bytes.
    if t.untyped_storage().nbytes() != t.nbytes:
        t = t.clone()
    return t


def _rename_into_place(tmp: Path, parent: Path, version: str | None) -> Path:
    if version is not None:
        final = parent / version
        if final.exists():  # rename would silently replace an *empty* folder
            raise ArtifactError(f"artifact {final} already exists; pick another version or delete it")
        try:
            os.rename(tmp, final)
        except OSError:
            raise ArtifactError(f"artifact {final} already exists; pick another version or delete it") from None
        return final
    # Another writer (a shard, a second rank) may take vN between our scan and our rename: try the next one.
    n = max(_vnumbers(parent), default=0) + 1
    while True:
        final = parent / f"v{n}"
        if not final.exists():
            try:
                os.rename(tmp, final)
                return final
            except OSError:
                if not final.exists():
                    raise
        n += 1


def _write_json(path: Path, obj: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    """Make the folder entries (new files, the rename) durable, not just the file contents."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # platforms that cannot open folders (Windows)
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _sha256(path: Path, fsync: bool = False) -> str:
    h = hashlib.sha256()
    with open(path, "rb+" if fsync else "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
        if fsync:
            os.fsync(f.fileno())
    return h.hexdigest()


# -- reading -----------------------------------------------------------------------------------------------------

def resolve(root: str | os.PathLike, model_name: str, method: str, version: str = "latest") -> Path:
    """The version folder for (model, method, version); 'latest' is the highest vN, or if there is no vN,
    the newest `created` among explicitly named versions."""
    parent = Path(root) / slugify(model_name) / method
    if version != "latest":
        return parent / version
    numbers = _vnumbers(parent)
    if numbers:
        return parent / f"v{max(numbers)}"
    named = [(_created(d), d) for d in _version_dirs(parent) if (d / MANIFEST).is_file()]
    if not named:
        raise ArtifactError(f"no artifact for model {model_name!r} and method {method!r} under {root}")
    return max(named)[1]


def _created(vdir: Path) -> str:
    try:
        return str(json.loads((vdir / MANIFEST).read_text(encoding="utf-8")).get("created", ""))
    except Exception:  # a broken manifest is never "latest"; load/verify report it when named
        return ""


def load_artifact(path_or_root: str | os.PathLike, *, method: str | None = None,
                  model_fingerprint: dict | None = None, model_name: str | None = None,
                  version: str = "latest", verify: bool = True) -> Artifact:
    """Load a version folder, or resolve one from (root, model_name or model_fingerprint['name'], method, version).

    Checks, in order: manifest present and valid, schema, method, fingerprint (every key of the expected one),
    then each listed file: present, sha256 (if `verify`), parseable."""
    path = Path(path_or_root)
    if model_name is None and model_fingerprint and not (path / MANIFEST).exists() and method:
        model_name = model_fingerprint.get("name")
    if model_name is not None:
        if not method:
            raise ArtifactError("loading by model name needs a method")
        path = resolve(path, model_name, method, version)

    manifest = _read_manifest(path)
    if method is not None and manifest.get("method") != method:
        raise ArtifactError(f"artifact at {path} is for method {manifest.get('method')!r}, not {method!r}")
    if model_fingerprint is not None:
        _check_fingerprint(path, manifest.get("model") or {}, model_fingerprint)

    tensors = {}
    for fname, info in manifest["files"].items():
        problem = _check_file(path, fname, info if isinstance(info, dict) else {}, verify)
        if problem:
            raise ArtifactError(f"artifact at {path} is corrupted: {problem}")
        try:
            tensors[fname.removesuffix(SUFFIX)] = load_file(str(path / fname))
        except Exception as e:
            raise ArtifactError(f"artifact at {path} is corrupted: {fname} cannot be read "
                                f"({_one_line(e)})") from None
    return Artifact(path=path, manifest=manifest, tensors=tensors)


def _read_manifest(path: Path) -> dict:
    """The parsed manifest of a version folder, with schema and shape checked; ArtifactError otherwise."""
    mpath = path / MANIFEST
    if not mpath.is_file():
        raise ArtifactError(f"no artifact at {path}: {MANIFEST} missing")
    try:
        manifest = json.loads(mpath.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ArtifactError(f"artifact at {path} has an unreadable {MANIFEST}: {_one_line(e)}") from None
    if not isinstance(manifest, dict):
        raise ArtifactError(f"artifact at {path} has an unreadable {MANIFEST}: not a JSON object")
    schema = manifest.get("schema_version")
    if schema != SCHEMA_VERSION:
        raise ArtifactError(f"artifact at {path} has schema_version {schema!r}; this sparsekv "
                            f"({sparsekv_version()}) reads schema_version {SCHEMA_VERSION}")
    if not isinstance(manifest.get("files"), dict) or not isinstance(manifest.get("method"), str):
        raise ArtifactError(f"artifact at {path} has an incomplete {MANIFEST}: 'files' or 'method' missing")
    return manifest


def _check_fingerprint(path: Path, recorded: dict, expected: dict) -> None:
    # Round-trip through JSON so tuples/lists and ints/floats compare as they were stored.
    expected = json.loads(json.dumps(expected))
    diffs = [f"{k} {_short(recorded.get(k, '<missing>'))} != {_short(v)}"
             for k, v in expected.items() if recorded.get(k, "<missing>") != v]
    if diffs:
        raise ArtifactError(f"artifact at {path} was fitted on another model (artifact != current): "
                            + ", ".join(diffs))


def _short(v: Any) -> str:
    s = str(v)
    return s[:12] + "…" if re.fullmatch(r"[0-9a-f]{16,}", s) else s  # hashes: 12 chars identify them


def _check_file(path: Path, fname: str, info: dict, verify: bool) -> str | None:
    """One-line problem with a listed file, or None."""
    f = path / fname
    if not f.is_file():
        return f"{fname} missing"
    if not verify:
        return None
    size = f.stat().st_size
    if size != info.get("bytes"):
        return f"{fname} has {size} bytes, expected {info.get('bytes')}"
    got = _sha256(f)
    if got != info.get("sha256"):
        return f"{fname} sha256 mismatch (expected {_short(info.get('sha256'))}, got {_short(got)})"
    return None


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


# -- inspecting --------------------------------------------------------------------------------------------------

def verify_artifact(path: str | os.PathLike) -> list[str]:
    """Every problem with a version folder (empty list = OK). Never raises for a bad artifact."""
    path = Path(path)
    try:
        manifest = _read_manifest(path)
    except ArtifactError as e:
        return [str(e)]
    problems = []
    for fname, info in manifest["files"].items():
        problem = _check_file(path, fname, info if isinstance(info, dict) else {}, verify=True)
        if problem is None:
            try:  # hash matches yet the writer may have produced garbage: the header must parse
                with safe_open(str(path / fname), framework="pt") as st:
                    st.keys()
            except Exception as e:
                problem = f"{fname} cannot be read ({_one_line(e)})"
        if problem:
            problems.append(problem)
    for extra in sorted(p.name for p in path.glob("*" + SUFFIX) if p.name not in manifest["files"]):
        problems.append(f"{extra} is not listed in {MANIFEST}")
    return problems


def list_artifacts(root: str | os.PathLike) -> list[dict]:
    """One dict per version folder under root: path, model (slug), method, version, kind, created, bytes,
    files (count), ok (manifest readable; cheap, no hashing), error (why not ok, else None)."""
    rows = []
    root = Path(root)
    for model_dir in _subdirs(root):
        for method_dir in _subdirs(model_dir):
            for vdir in _version_dirs(method_dir):
                files = [p for p in vdir.iterdir() if p.is_file()]
                row = {"path": str(vdir), "model": model_dir.name, "method": method_dir.name,
                       "version": vdir.name, "kind": None, "created": None,
                       "bytes": sum(p.stat().st_size for p in files), "files": len(files),
                       "ok": True, "error": None}
                try:
                    m = _read_manifest(vdir)
                    row.update(kind=m.get("kind"), created=m.get("created"))
                except ArtifactError as e:
                    row.update(ok=False, error=str(e))
                rows.append(row)
    return rows


def _subdirs(path: Path) -> list[Path]:
    """Visible subfolders, sorted; hidden ones (our temporary folders) are not artifacts."""
    if not path.is_dir():
        return []
    return sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith("."))


def _version_dirs(parent: Path) -> list[Path]:
    # v2 before v10: numeric order for vN, then named versions alphabetically.
    def key(p: Path):
        m = _VERSION_RE.match(p.name)
        return (0, int(m.group(1)), "") if m else (1, 0, p.name)

    return sorted(_subdirs(parent), key=key)


def _vnumbers(parent: Path) -> list[int]:
    return [int(m.group(1)) for p in _subdirs(parent) if (m := _VERSION_RE.match(p.name))]


def _check_name(what: str, name: str) -> None:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ArtifactError(f"{what} {name!r} is not a valid folder/file name (letters, digits, '.', '_', '-')")
