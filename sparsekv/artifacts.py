"""Versioned artifact store: `<root>/<model-slug>/<method>/<version>/` holding `manifest.json` and `*.safetensors`.

Offline stages (calibrate, train-hash, index, dump) write here; online stages load from here. A load checks the
schema, the manifest's own digest, the model fingerprint and every file's sha256, and stops with one line naming
what differs, because a calibration silently applied to another model (or a half-copied file, or a hand-edited
config) gives wrong results, not an error.

A version folder is self-contained: the manifest names plain `*.safetensors` files directly inside it (no path
separators, no `..`, no absolute paths) and neither the folder, its manifest nor its files may be symbolic links,
so checking or loading an artifact never reads, stats or hashes anything outside its folder.

The manifest digest (`manifest_sha256`, the sha256 of the manifest's canonical JSON without that key) catches edits
and accidents; it is not a signature: whoever can write the folder can also recompute it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import socket
import stat
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from .errors import SparseKVError, one_line

# 2: the manifest carries `manifest_sha256`, and its files must be plain names inside the version folder.
SCHEMA_VERSION = 2
MANIFEST = "manifest.json"
DIGEST = "manifest_sha256"
SUFFIX = ".safetensors"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")  # one folder-safe path component, never hidden
_VERSION_RE = re.compile(r"^v(\d+)$")
TMP_PREFIX = ".tmp-"  # hidden temporary folders of writes in progress (or interrupted)
# A temporary folder whose writer cannot be identified (another host on a shared filesystem, or an older name) is
# stale once it is older than the running process *and* idle this long, so a concurrent write is never removed.
UNKNOWN_WRITER_GRACE_S = 3600.0
_STARTED = time.time()  # this module is imported at the start of a CLI run: "older than the running process"
_log = logging.getLogger(__name__)


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
    if not tensors:
        raise ArtifactError("an artifact needs at least one tensor file; got no tensors")
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
    for gone in remove_stale_temps(parent):
        _log.info("removed %s, a temporary folder left by an interrupted write", gone)
    # Same parent => same filesystem, so the final rename is atomic; the leading dot hides it from list_artifacts,
    # and the name says which process writes it (see remove_stale_temps).
    tmp = Path(tempfile.mkdtemp(prefix=_tmp_prefix(), dir=parent))
    try:
        for stem, named in tensors.items():
            fname = stem + SUFFIX
            save_file({k: _prepare(k, t) for k, t in named.items()}, str(tmp / fname))
            manifest["files"][fname] = {"sha256": _sha256(tmp / fname, fsync=True),
                                        "bytes": (tmp / fname).stat().st_size,
                                        "tensors": {k: {"dtype": str(t.dtype).removeprefix("torch."),
                                                        "shape": list(t.shape)} for k, t in named.items()}}
        _write_json(tmp / MANIFEST, _with_digest(manifest))
        umask_modes(tmp)
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


def _with_digest(manifest: dict) -> dict:
    """The manifest as it will read back from disk (JSON types), with its digest added."""
    body = json.loads(json.dumps(manifest))
    body.pop(DIGEST, None)
    body[DIGEST] = manifest_digest(body)
    return body


def manifest_digest(manifest: dict) -> str:
    """sha256 of the manifest's canonical JSON (sorted keys, no spaces), every field except the digest itself."""
    body = {k: v for k, v in manifest.items() if k != DIGEST}
    canon = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canon.encode("utf-8")).hexdigest()


def _write_json(path: Path, obj: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def umask_modes(path: Path) -> None:
    """Give a folder written through `tempfile` (0700, its files possibly 0600) and everything in it the modes the
    process's umask gives a plain mkdir or open, before it is renamed into place: an artifact store or a dump is
    read by other users and jobs."""
    mask = os.umask(0)
    os.umask(mask)
    for p in [path, *path.rglob("*")]:
        if not p.is_symlink():
            p.chmod((0o777 if p.is_dir() else 0o666) & ~mask)


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


# -- interrupted writes ------------------------------------------------------------------------------------------

def _host() -> str:
    return re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname()) or "host"


def _tmp_prefix() -> str:
    """`.tmp-<pid>@<host>@`: a later write or `list` can tell whether the writer still runs."""
    return f"{TMP_PREFIX}{os.getpid()}@{_host()}@"


def _pid_alive(pid: int) -> bool | None:
    """Whether a process of this host runs with that id; None where that cannot be asked."""
    if os.name == "nt":  # os.kill(pid, 0) would terminate the process there
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists but belongs to someone else, or cannot be asked: assume it runs
        return True
    return True


def _newest_mtime(folder: Path) -> float:
    """Newest modification time of the folder and everything in it (links not followed)."""
    newest = folder.lstat().st_mtime
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=False):
        for name in dirnames + filenames:
            try:
                newest = max(newest, os.lstat(os.path.join(dirpath, name)).st_mtime)
            except OSError:
                pass
    return newest


def _is_stale(folder: Path) -> bool:
    """A hidden temporary folder left by a write that will never finish: untouched since before this process
    started, and its writer (named in the folder's name) is gone; a writer that cannot be identified must also
    have been idle for UNKNOWN_WRITER_GRACE_S."""
    try:
        if not stat.S_ISDIR(folder.lstat().st_mode):  # never a link, never a file
            return False
        newest = _newest_mtime(folder)
    except OSError:
        return False
    if newest >= _STARTED:
        return False
    m = re.match(re.escape(TMP_PREFIX) + r"(\d+)@([^@]+)@", folder.name)
    if m and m.group(2) == _host():
        pid = int(m.group(1))
        if pid == os.getpid():
            return False
        alive = _pid_alive(pid)
        if alive is not None:
            return not alive
    return newest < _STARTED - UNKNOWN_WRITER_GRACE_S


def remove_stale_temps(folder: str | os.PathLike) -> list[Path]:
    """Remove the stale hidden `.tmp-*` folders directly in `folder` (left by a write that was killed) and return
    them. Folders of writes still in progress are kept."""
    folder = Path(folder)
    try:
        entries = sorted(p for p in folder.iterdir() if p.name.startswith(TMP_PREFIX))
    except OSError:
        return []
    removed = []
    for p in entries:
        if _is_stale(p):
            try:
                shutil.rmtree(p)
            except OSError:
                continue
            removed.append(p)
    return removed


def remove_stale_temps_under(root: str | os.PathLike) -> list[Path]:
    """remove_stale_temps at every level of a store above the version folders: root, model and method folders."""
    root = Path(root)
    removed = remove_stale_temps(root)
    for model_dir in _subdirs(root):
        removed += remove_stale_temps(model_dir)
        for method_dir in _subdirs(model_dir):
            removed += remove_stale_temps(method_dir)
    return removed


# -- reading -----------------------------------------------------------------------------------------------------

def resolve(root: str | os.PathLike, model_name: str, method: str, version: str = "latest") -> Path:
    """The version folder for (model, method, version); 'latest' is the highest vN, or if there is no vN,
    the newest `created` among explicitly named versions."""
    _check_name("method", method)
    parent = Path(root) / slugify(model_name) / method
    if version != "latest":
        _check_name("version", version)
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

    Checks, in order: manifest present and valid (schema, file names inside the folder, digest, no links), method,
    fingerprint (every key of the expected one), then each listed file: present, a regular file, sha256 (if
    `verify`), parseable."""
    path = Path(path_or_root)
    if model_name is None and model_fingerprint and not (path / MANIFEST).exists() and method:
        model_name = model_fingerprint.get("name")
    if model_name is not None:
        if not method:
            raise ArtifactError("loading by model name needs a method")
        path = resolve(path, model_name, method, version)

    manifest = read_manifest(path)
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
                                f"({one_line(e)})") from None
    return Artifact(path=path, manifest=manifest, tensors=tensors)


def manifest_path(path: str | os.PathLike) -> Path:
    """The manifest file of a version folder, refusing a version folder or manifest that is a symbolic link."""
    path = Path(path)
    if path.is_symlink():
        raise ArtifactError(f"artifact at {path} is a symbolic link; a version folder must be a real folder "
                            f"(copy it rather than linking it)")
    mpath = path / MANIFEST
    if mpath.is_symlink():
        raise ArtifactError(f"artifact at {path} has a {MANIFEST} that is a symbolic link; it must be a real file")
    if not mpath.is_file():
        raise ArtifactError(f"no artifact at {path}: {no_version_reason(path)}")
    return mpath


def no_version_reason(path: Path) -> str:
    """What the user gave instead of a version folder, in words: nothing, a file, or a folder above the versions."""
    if not path.exists():
        return "no such file or folder"
    if not path.is_dir():
        return "a file, not a version folder"
    below = sorted((d for d in path.iterdir() if (d / MANIFEST).is_file()), key=lambda d: (len(d.name), d.name))
    if below:
        names = ", ".join(d.name for d in below[:4]) + (", ..." if len(below) > 4 else "")
        return f"{MANIFEST} missing; the folder holds versions ({names}): give one of them, e.g. {below[-1]}"
    return f"{MANIFEST} missing"


def artifact_paths(spec: str | os.PathLike | None) -> list[str]:
    """The version folders of an `--artifact` value: one path, or several comma-separated."""
    return [p for p in (x.strip() for x in str(spec or "").split(",")) if p]


def read_manifest(path: str | os.PathLike) -> dict:
    """The manifest of a version folder with every check that needs no tensor file: no links, schema, shape, file
    names confined to the folder, at least one file, and the digest over its content. ArtifactError otherwise."""
    path = Path(path)
    manifest = _read_manifest(path)
    recorded = manifest.get(DIGEST)
    if not isinstance(recorded, str):
        raise ArtifactError(f"artifact at {path} has no {DIGEST} in its {MANIFEST}; it was not written by sparsekv "
                            f"or was edited by hand: write it again")
    if recorded != manifest_digest(manifest):
        raise ArtifactError(f"artifact at {path} has an edited {MANIFEST}: its content (config, model, data or "
                            f"files) no longer matches its {DIGEST}; write it again rather than editing it")
    return manifest


def _parse_manifest(path: Path, mpath: Path) -> dict:
    """The manifest file as a JSON object, else one ArtifactError line."""
    try:
        manifest = json.loads(mpath.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ArtifactError(f"artifact at {path} has an unreadable {MANIFEST}: {one_line(e)}") from None
    if not isinstance(manifest, dict):
        raise ArtifactError(f"artifact at {path} has an unreadable {MANIFEST}: not a JSON object")
    return manifest


def _read_manifest(path: Path) -> dict:
    """The parsed manifest of a version folder: no links, schema, shape, and file names confined to the folder
    checked; ArtifactError otherwise. The digest is not checked here: loads and checks use read_manifest."""
    manifest = _parse_manifest(path, manifest_path(path))
    schema = manifest.get("schema_version")
    if schema == 1:
        raise ArtifactError(f"artifact at {path} has schema_version 1, from before manifests carried a digest; this "
                            f"sparsekv ({sparsekv_version()}) reads schema_version {SCHEMA_VERSION}: check it and "
                            f"run `sparsekv artifacts upgrade {path}`, or write it again (dump, calibrate)")
    if schema != SCHEMA_VERSION:
        raise ArtifactError(f"artifact at {path} has schema_version {schema!r}; this sparsekv "
                            f"({sparsekv_version()}) reads schema_version {SCHEMA_VERSION}")
    _check_body(path, manifest)
    return manifest


def _check_body(path: Path, manifest: dict) -> None:
    if not isinstance(manifest.get("files"), dict) or not isinstance(manifest.get("method"), str):
        raise ArtifactError(f"artifact at {path} has an incomplete {MANIFEST}: 'files' or 'method' missing")
    if not manifest["files"]:
        raise ArtifactError(f"artifact at {path} lists no files in its {MANIFEST}")
    for fname in manifest["files"]:
        problem = _bad_file_name(fname)
        if problem:
            raise ArtifactError(f"artifact at {path} has a {MANIFEST} naming {problem}")


def _bad_file_name(fname: Any) -> str | None:
    """Why a manifest's file name is refused (a path leaving the folder, or not a plain tensor file), or None."""
    if not isinstance(fname, str) or not fname:
        return f"an empty or non-text file name {fname!r}"
    if os.path.isabs(fname) or fname.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", fname):
        return f"an absolute path {fname!r}; files must be inside the version folder"
    if "/" in fname or "\\" in fname or os.sep in fname or (os.altsep and os.altsep in fname):
        return f"a path {fname!r} with a separator; files must be plain names inside the version folder"
    if fname in (".", "..") or not _NAME_RE.match(fname) or not fname.endswith(SUFFIX):
        return f"a file {fname!r} that is not a plain {SUFFIX} name (letters, digits, '.', '_', '-')"
    return None


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
    """One-line problem with a listed file, or None. A name that would leave the folder is never touched, and a
    symbolic link is never followed."""
    bad = _bad_file_name(fname)
    if bad:
        return f"{MANIFEST} names {bad}"
    f = path / fname
    try:
        st = f.lstat()
    except FileNotFoundError:
        return f"{fname} missing"
    except OSError as e:
        return f"{fname} cannot be read ({one_line(e)})"
    if stat.S_ISLNK(st.st_mode):
        return f"{fname} is a symbolic link; files must be real files inside the version folder"
    if not stat.S_ISREG(st.st_mode):
        return f"{fname} is not a regular file"
    if not verify:
        return None
    try:  # O_NOFOLLOW: the file checked is the file hashed, even if it is swapped for a link meanwhile
        fd = os.open(f, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0))
    except OSError as e:
        return f"{fname} cannot be read ({one_line(e)})"
    with os.fdopen(fd, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size != info.get("bytes"):
            return f"{fname} has {size} bytes, expected {info.get('bytes')}"
        h = hashlib.sha256()
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    got = h.hexdigest()
    if got != info.get("sha256"):
        return f"{fname} sha256 mismatch (expected {_short(info.get('sha256'))}, got {_short(got)})"
    return None


# -- inspecting --------------------------------------------------------------------------------------------------

def verify_artifact(path: str | os.PathLike) -> list[str]:
    """Every problem with a version folder (empty list = OK): the manifest's checks (read_manifest), then each
    listed file (present, a regular file, size, sha256, parseable), then unlisted tensor files. Never raises for a
    bad artifact, and never looks at a file outside the folder."""
    path = Path(path)
    try:
        manifest = read_manifest(path)
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
                problem = f"{fname} cannot be read ({one_line(e)})"
        if problem:
            problems.append(problem)
    for extra in sorted(p.name for p in path.glob("*" + SUFFIX) if p.name not in manifest["files"]):
        problems.append(f"{extra} is not listed in {MANIFEST}")
    return problems


def list_artifacts(root: str | os.PathLike) -> list[dict]:
    """One dict per version folder under root: path, model (slug), method, version, kind, created, bytes,
    files (count of regular files), ok (verify_artifact found nothing: every file is hashed), problems (its list)
    and error (the first problem, else None). A version folder that is a link is listed, not ok, not looked into."""
    rows = []
    root = Path(root)
    for model_dir in _subdirs(root):
        for method_dir in _subdirs(model_dir):
            for vdir in _version_dirs(method_dir):
                sizes = [] if vdir.is_symlink() else _regular_file_sizes(vdir)
                row = {"path": str(vdir), "model": model_dir.name, "method": method_dir.name,
                       "version": vdir.name, "kind": None, "created": None,
                       "bytes": sum(sizes), "files": len(sizes)}
                try:  # shown even for a manifest that fails its checks: they say what it claims to be
                    m = json.loads(manifest_path(vdir).read_text(encoding="utf-8"))
                    if isinstance(m, dict):
                        row.update(kind=m.get("kind"), created=m.get("created"))
                except (ArtifactError, OSError, ValueError):
                    pass  # verify_artifact says why
                problems = verify_artifact(vdir)
                row.update(ok=not problems, problems=problems, error=problems[0] if problems else None)
                rows.append(row)
    return rows


def _regular_file_sizes(folder: Path) -> list[int]:
    sizes = []
    for p in folder.iterdir():
        st = p.lstat()
        if stat.S_ISREG(st.st_mode):
            sizes.append(st.st_size)
    return sizes


def upgrade_artifact(path: str | os.PathLike) -> Path:
    """Bring an artifact of schema_version 1 (no manifest digest) to the current schema: check it as verify does
    (file names inside the folder, every file's size, sha256 and header), then rewrite its manifest with the new
    schema_version, an `upgraded` record and the digest (written beside it and renamed over it). Upgrading vouches
    for the manifest as it is: a config edited by hand before is not detected."""
    path = Path(path)
    mpath = manifest_path(path)
    manifest = _parse_manifest(path, mpath)
    schema = manifest.get("schema_version")
    if schema == SCHEMA_VERSION:
        raise ArtifactError(f"artifact at {path} already has schema_version {SCHEMA_VERSION}; nothing to upgrade "
                            f"(check it with `sparsekv artifacts verify`)")
    if schema != 1:
        raise ArtifactError(f"artifact at {path} has schema_version {schema!r}; only schema_version 1 can be "
                            f"upgraded")
    _check_body(path, manifest)
    for fname, info in manifest["files"].items():
        problem = _check_file(path, fname, info if isinstance(info, dict) else {}, verify=True)
        if problem is None:
            try:
                with safe_open(str(path / fname), framework="pt") as st:
                    st.keys()
            except Exception as e:
                problem = f"{fname} cannot be read ({one_line(e)})"
        if problem:
            raise ArtifactError(f"artifact at {path} cannot be upgraded: {problem}")
    manifest.pop(DIGEST, None)
    manifest.update(schema_version=SCHEMA_VERSION,
                    upgraded={"from_schema_version": schema, "sparsekv_version": sparsekv_version(),
                              "time": datetime.now(timezone.utc).isoformat()})
    fd, tmp = tempfile.mkstemp(prefix=f".{MANIFEST}.", dir=path)
    os.close(fd)
    try:
        _write_json(Path(tmp), _with_digest(manifest))
        umask_modes(Path(tmp))
        os.replace(tmp, mpath)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path)
    return path


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
