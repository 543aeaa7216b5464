"""The artifact store: round trip, versioning, atomic writes, and the one-line errors for bad artifacts."""

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from sparsekv import artifacts
from sparsekv.artifacts import (SCHEMA_VERSION, ArtifactError, list_artifacts, load_artifact, manifest_digest,
                                remove_stale_temps_under, save_artifact, slugify, upgrade_artifact, verify_artifact)

FP = {"name": "HuggingFaceTB/SmolLM2-135M", "num_layers": 2, "q_heads": 4, "kv_heads": 2, "head_dim": 8,
      "rope": "[('rope_theta', 10000.0)]", "weights_sha256": "ab" * 32}


def _tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "layer_000": {"thresholds": torch.randn(2, 3, generator=g), "codes": torch.randint(0, 4, (5,), generator=g)},
        # a transposed (non-contiguous) view and a bf16 tensor: both must survive the trip
        "layer_001": {"w": torch.randn(4, 3, generator=g).t(), "b": torch.randn(3, generator=g).bfloat16()},
    }


def _save(root, **kw):
    args = dict(method="adamas", model_fingerprint=FP, config={"budget": 64, "bits": 2}, tensors=_tensors(),
                data={"source": "wikitext", "tokens": 4096, "seed": 0})
    args.update(kw)
    return save_artifact(root, **args)


def _manifest(p):
    return json.loads((p / "manifest.json").read_text())


def _rewrite(p, m):
    """Write a crafted manifest with a *valid* digest, so the check under test is the only one that can refuse it."""
    m = dict(m)
    m["manifest_sha256"] = manifest_digest(m)
    (p / "manifest.json").write_text(json.dumps(m))


def _flip_middle(path):
    raw = bytearray(path.read_bytes())
    mid = len(raw) // 2
    raw[mid] ^= 0xFF
    raw[mid + 1] ^= 0xFF
    path.write_bytes(bytes(raw))


def test_slugify():
    assert slugify("HuggingFaceTB/SmolLM2-135M") == "huggingfacetb--smollm2-135m"
    assert slugify("/models/My Model (Q4)/") == "models--my-model-q4"
    with pytest.raises(ArtifactError):
        slugify("///")


def test_round_trip_versions_and_latest(tmp_path):
    p1 = _save(tmp_path)
    p2 = _save(tmp_path, tensors=_tensors(seed=1), report={"recall": 0.9})
    assert p1 == tmp_path / "huggingfacetb--smollm2-135m" / "adamas" / "v1"
    assert p2.name == "v2"

    art = load_artifact(tmp_path, model_name=FP["name"], method="adamas", model_fingerprint=FP)
    assert art.path == p2
    assert art.method == "adamas" and art.config == {"budget": 64, "bits": 2}
    want = _tensors(seed=1)
    assert set(art.tensors) == set(want)
    for stem, named in want.items():
        assert set(art.tensors[stem]) == set(named)
        for k, t in named.items():
            assert art.tensors[stem][k].dtype == t.dtype
            assert torch.equal(art.tensors[stem][k], t)

    m = json.loads((p2 / "manifest.json").read_text())
    assert m["schema_version"] == SCHEMA_VERSION
    assert m["sparsekv_version"] and m["kind"] == "method" and m["method"] == "adamas"
    assert m["model"] == FP and m["report"] == {"recall": 0.9}
    assert m["data"] == {"source": "wikitext", "tokens": 4096, "seed": 0}
    assert m["created"].endswith("+00:00")
    assert set(m["files"]) == {"layer_000.safetensors", "layer_001.safetensors"}
    for fname, info in m["files"].items():
        assert len(info["sha256"]) == 64 and info["bytes"] == (p2 / fname).stat().st_size
    # written with indent=2, sort_keys=True so diffs between versions are readable
    assert (p2 / "manifest.json").read_text().startswith('{\n  "config"')

    # v1 still holds the first tensors; loading by its folder needs no root/model/method
    old = load_artifact(p1)
    assert torch.equal(old.tensors["layer_000"]["thresholds"], _tensors(seed=0)["layer_000"]["thresholds"])
    # the fingerprint's name is enough to find the model folder
    assert load_artifact(tmp_path, method="adamas", model_fingerprint=FP, version="v1").path == p1


@pytest.mark.parametrize("mask", [0o022, 0o027])
def test_a_written_artifact_has_the_umask_s_modes(tmp_path, mask):
    """The version folder and its files are made through `tempfile` (0700 / 0600): they get what the umask gives a
    plain mkdir / open before the rename, so other users and jobs can read a shared store."""
    old = os.umask(mask)
    try:
        p = _save(tmp_path)
    finally:
        os.umask(old)
    modes = {q.name: stat.S_IMODE(q.stat().st_mode) for q in [p, *p.iterdir()]}
    assert modes == {p.name: 0o777 & ~mask, **{q.name: 0o666 & ~mask for q in p.iterdir()}}
    assert len(modes) >= 3  # the folder, its manifest and at least one tensor file


def test_refuses_to_overwrite_explicit_version(tmp_path):
    p = _save(tmp_path, version="calib-a")
    before = (p / "manifest.json").read_text()
    with pytest.raises(ArtifactError, match="already exists"):
        _save(tmp_path, version="calib-a", config={"budget": 128})
    assert (p / "manifest.json").read_text() == before
    assert [d.name for d in p.parent.iterdir()] == ["calib-a"]  # no leftover temporary folder
    # a named version is still "latest" when there is no vN
    assert load_artifact(tmp_path, model_name=FP["name"], method="adamas").path == p


def test_fingerprint_mismatch_names_keys_and_values(tmp_path):
    p = _save(tmp_path)
    other = dict(FP, num_layers=30, weights_sha256="cd" * 32)
    with pytest.raises(ArtifactError) as e:
        load_artifact(p, model_fingerprint=other)
    msg = str(e.value)
    assert "\n" not in msg and "another model" in msg and str(p) in msg
    assert "num_layers 2 != 30" in msg
    assert "weights_sha256 abababababab… != cdcdcdcdcdcd…" in msg
    assert "head_dim" not in msg  # keys that match are not named


def test_corrupted_tensor_file(tmp_path):
    p = _save(tmp_path)
    _flip_middle(p / "layer_001.safetensors")
    with pytest.raises(ArtifactError) as e:
        load_artifact(p)
    msg = str(e.value)
    assert "corrupted" in msg and "layer_001.safetensors" in msg and "sha256 mismatch" in msg
    problems = verify_artifact(p)
    assert len(problems) == 1 and "layer_001.safetensors" in problems[0]
    assert verify_artifact(tmp_path / "huggingfacetb--smollm2-135m" / "adamas" / "nope")  # never raises


def test_truncated_and_garbage_files(tmp_path):
    p = _save(tmp_path)
    f = p / "layer_000.safetensors"
    f.write_bytes(f.read_bytes()[:20])
    with pytest.raises(ArtifactError, match=r"corrupted: layer_000\.safetensors has 20 bytes"):
        load_artifact(p)
    # without hash checks the file still has to parse
    with pytest.raises(ArtifactError, match=r"corrupted: layer_000\.safetensors cannot be read"):
        load_artifact(p, verify=False)

    # garbage whose hash *is* recorded (a writer bug): only parsing catches it
    m = json.loads((p / "manifest.json").read_text())
    f.write_bytes(b"\x00garbage" * 10)
    m["files"][f.name] = {"sha256": artifacts._sha256(f), "bytes": f.stat().st_size}
    _rewrite(p, m)
    with pytest.raises(ArtifactError, match=r"corrupted: layer_000\.safetensors cannot be read"):
        load_artifact(p)
    assert any("layer_000.safetensors cannot be read" in s for s in verify_artifact(p))


def test_missing_file_manifest_and_bad_json(tmp_path):
    p = _save(tmp_path)
    (p / "layer_001.safetensors").unlink()
    with pytest.raises(ArtifactError, match=r"corrupted: layer_001\.safetensors missing"):
        load_artifact(p)
    assert verify_artifact(p) == ["layer_001.safetensors missing"]

    (p / "manifest.json").write_text("{not json")
    with pytest.raises(ArtifactError, match="unreadable manifest.json"):
        load_artifact(p)

    (p / "manifest.json").write_text(json.dumps({"schema_version": 99, "files": {}, "method": "adamas"}))
    with pytest.raises(ArtifactError, match="schema_version 99"):
        load_artifact(p)

    (p / "manifest.json").unlink()
    with pytest.raises(ArtifactError) as e:
        load_artifact(p)
    assert str(e.value) == f"no artifact at {p}: manifest.json missing"
    assert verify_artifact(p) == [str(e.value)]


def test_a_path_that_is_no_version_folder_says_what_it_is(tmp_path):
    """Nothing there, a file, or the folder above the versions (the usual slip: .../saap instead of .../saap/v1)."""
    with pytest.raises(ArtifactError, match="no such file or folder"):
        load_artifact(tmp_path / "nope")
    (tmp_path / "f.json").write_text("{}")
    with pytest.raises(ArtifactError, match="a file, not a version folder"):
        load_artifact(tmp_path / "f.json")
    v1, v2 = Path(_save(tmp_path)), Path(_save(tmp_path))  # ARTIFACTS/<model>/adamas/v1 and v2
    with pytest.raises(ArtifactError) as e:
        load_artifact(v1.parent)
    assert str(e.value).endswith(f"the folder holds versions ({v1.name}, {v2.name}): give one of them, e.g. {v2}")


def test_method_mismatch(tmp_path):
    p = _save(tmp_path)
    with pytest.raises(ArtifactError) as e:
        load_artifact(p, method="spotlight")
    assert str(e.value) == f"artifact at {p} is for method 'adamas', not 'spotlight'"


def test_failure_midway_leaves_nothing(tmp_path, monkeypatch):
    real = artifacts.save_file
    calls = []

    def flaky(tensors, filename, *a, **kw):
        calls.append(filename)
        if len(calls) == 2:
            raise OSError("disk full")
        return real(tensors, filename, *a, **kw)

    monkeypatch.setattr(artifacts, "save_file", flaky)
    with pytest.raises(OSError, match="disk full"):
        _save(tmp_path)
    assert len(calls) == 2  # it really got past the first file
    method_dir = tmp_path / "huggingfacetb--smollm2-135m" / "adamas"
    assert list(method_dir.iterdir()) == []
    assert list_artifacts(tmp_path) == []

    monkeypatch.setattr(artifacts, "save_file", real)
    assert _save(tmp_path).name == "v1"  # the failed attempt did not use up a version


def test_list_artifacts(tmp_path):
    a = _save(tmp_path)
    b = _save(tmp_path)
    c = _save(tmp_path, method="spotlight", kind="method")
    (b / "manifest.json").write_text("garbage")
    rows = list_artifacts(tmp_path)
    assert [(r["method"], r["version"]) for r in rows] == [("adamas", "v1"), ("adamas", "v2"), ("spotlight", "v1")]
    assert [r["path"] for r in rows] == [str(a), str(b), str(c)]
    assert [r["ok"] for r in rows] == [True, False, True]
    assert "unreadable" in rows[1]["error"] and rows[1]["problems"] == [rows[1]["error"]]
    r = rows[0]
    assert r["model"] == "huggingfacetb--smollm2-135m" and r["files"] == 3 and r["created"]
    assert r["bytes"] == sum(f.stat().st_size for f in a.iterdir())
    assert list_artifacts(tmp_path / "nowhere") == []


def test_rejects_bad_names_and_unserialisable_config(tmp_path):
    with pytest.raises(ArtifactError, match="method '../x'"):
        _save(tmp_path, method="../x")
    with pytest.raises(ArtifactError, match="not JSON-serialisable"):
        _save(tmp_path, config={"dtype": torch.float16})
    with pytest.raises(ArtifactError, match="'name'"):
        _save(tmp_path, model_fingerprint={"num_layers": 2})
    assert list_artifacts(tmp_path) == []


# -- a version folder is self-contained and its manifest cannot be edited ------------------------------------------

def _outside_copy(p, tmp_path, name="layer_000.safetensors"):
    """A valid tensor file outside the store with the same bytes (so its recorded size and sha256 match)."""
    out = tmp_path / "outside"
    out.mkdir(exist_ok=True)
    (out / name).write_bytes((p / name).read_bytes())
    return out / name


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "separator"])
def test_manifest_names_outside_the_folder_are_refused(tmp_path, kind):
    p = _save(tmp_path / "store")
    outside = _outside_copy(p, tmp_path)
    name = {"dotdot": "../../../../outside/layer_000.safetensors", "absolute": str(outside),
            "separator": "sub/layer_000.safetensors"}[kind]
    if kind == "separator":  # a real file there, hash right: only the name rule can refuse it
        (p / "sub").mkdir()
        (p / "sub" / "layer_000.safetensors").write_bytes(outside.read_bytes())
    assert (p / name).resolve().is_file()  # the name does reach a valid, correctly hashed file
    m = _manifest(p)
    m["files"][name] = m["files"].pop("layer_000.safetensors")
    _rewrite(p, m)
    problems = verify_artifact(p)
    assert len(problems) == 1 and repr(name) in problems[0], problems
    assert {"dotdot": "separator", "absolute": "absolute path", "separator": "separator"}[kind] in problems[0]
    with pytest.raises(ArtifactError) as e:
        load_artifact(p)
    assert str(e.value) == problems[0] and "\n" not in str(e.value)
    with pytest.raises(ArtifactError):
        load_artifact(p, verify=False)


def test_verify_never_reports_on_a_file_outside_the_folder(tmp_path):
    p = _save(tmp_path / "store")
    secret = tmp_path / "secret.safetensors"
    secret.write_bytes(b"x" * 12345)
    m = _manifest(p)
    m["files"]["../../../../secret.safetensors"] = {"sha256": "00" * 32, "bytes": 1}
    _rewrite(p, m)
    problems = verify_artifact(p)
    assert problems and not any("12345" in s or "sha256 mismatch" in s for s in problems), problems


def test_symlinked_file_is_refused(tmp_path):
    p = _save(tmp_path / "store")
    outside = _outside_copy(p, tmp_path)
    (p / "layer_000.safetensors").unlink()
    (p / "layer_000.safetensors").symlink_to(outside)  # same bytes: size and hash would match
    assert verify_artifact(p) == ["layer_000.safetensors is a symbolic link; files must be real files inside "
                                  "the version folder"]
    for verify in (True, False):
        with pytest.raises(ArtifactError, match="layer_000.safetensors is a symbolic link"):
            load_artifact(p, verify=verify)


def test_symlinked_version_folder_and_manifest_are_refused(tmp_path):
    p = _save(tmp_path / "store")
    link = p.parent / "linked"
    link.symlink_to(p, target_is_directory=True)
    problems = verify_artifact(link)
    assert len(problems) == 1 and "is a symbolic link" in problems[0] and str(link) in problems[0]
    with pytest.raises(ArtifactError, match="is a symbolic link"):
        load_artifact(link)
    rows = {r["version"]: r for r in list_artifacts(tmp_path / "store")}
    assert rows["v1"]["ok"] and not rows["linked"]["ok"] and rows["linked"]["files"] == 0
    load_artifact(p)  # the real folder is fine

    q = _save(tmp_path / "store")
    real = tmp_path / "manifest-elsewhere.json"
    real.write_text((q / "manifest.json").read_text())
    (q / "manifest.json").unlink()
    (q / "manifest.json").symlink_to(real)
    with pytest.raises(ArtifactError, match="manifest.json that is a symbolic link"):
        load_artifact(q)
    assert "symbolic link" in verify_artifact(q)[0]


def test_edited_manifest_is_refused(tmp_path):
    p = _save(tmp_path, config={"budget": 64, "bits": 2, "hadamard": True})
    assert verify_artifact(p) == [] and load_artifact(p).config["hadamard"] is True
    original = (p / "manifest.json").read_text()
    for edit in (lambda m: m["config"].update(hadamard=False), lambda m: m["model"].update(num_layers=30),
                 lambda m: m["report"].update(recall=1.0)):
        m = json.loads(original)
        edit(m)
        (p / "manifest.json").write_text(json.dumps(m, indent=2, sort_keys=True))
        problems = verify_artifact(p)
        assert len(problems) == 1 and "edited manifest.json" in problems[0], problems
        with pytest.raises(ArtifactError, match="edited manifest.json"):
            load_artifact(p)
        with pytest.raises(ArtifactError, match="edited manifest.json"):
            load_artifact(p, verify=False)
    m = json.loads(original)
    del m["manifest_sha256"]
    (p / "manifest.json").write_text(json.dumps(m))
    assert "no manifest_sha256" in verify_artifact(p)[0]
    # reformatting alone (another indent, key order) is not an edit
    m = json.loads(original)
    (p / "manifest.json").write_text(json.dumps(dict(reversed(list(m.items())))))
    assert verify_artifact(p) == [] and load_artifact(p).config["hadamard"] is True


def test_a_manifest_without_files_is_refused(tmp_path):
    p = _save(tmp_path)
    m = _manifest(p)
    m["files"] = {}
    _rewrite(p, m)
    assert verify_artifact(p) == [f"artifact at {p} lists no files in its manifest.json"]
    with pytest.raises(ArtifactError, match="lists no files"):
        load_artifact(p)
    with pytest.raises(ArtifactError, match="at least one tensor file"):
        _save(tmp_path, tensors={})


def test_list_checks_every_version_as_verify_does(tmp_path):
    a, b, c = _save(tmp_path), _save(tmp_path), _save(tmp_path)
    _flip_middle(b / "layer_001.safetensors")
    (c / "layer_000.safetensors").unlink()
    rows = list_artifacts(tmp_path)
    assert [r["ok"] for r in rows] == [True, False, False]
    assert "layer_001.safetensors sha256 mismatch" in rows[1]["error"]
    assert rows[2]["error"] == "layer_000.safetensors missing"
    assert [r["problems"] for r in rows] == [verify_artifact(x) for x in (a, b, c)]


def _dead_pid():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _tmp_folder(parent, name, age_s):
    d = parent / name
    d.mkdir(parents=True)
    (d / "layer_000.safetensors").write_bytes(b"half written")
    t = artifacts._STARTED - age_s
    for x in (d / "layer_000.safetensors", d):
        os.utime(x, (t, t))
    return d


def test_stale_temporary_folders_are_removed_by_the_next_write_and_by_list(tmp_path):
    method_dir = tmp_path / "huggingfacetb--smollm2-135m" / "adamas"
    host = artifacts._host()
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) as live:
        try:
            killed = _tmp_folder(method_dir, f".tmp-{_dead_pid()}@{host}@abc", age_s=10)  # writer SIGKILLed
            writing = _tmp_folder(method_dir, f".tmp-{live.pid}@{host}@def", age_s=10)  # writer still runs
            newer = _tmp_folder(method_dir, f".tmp-{_dead_pid()}@{host}@ghi", age_s=-5)  # after this process began
            old_unknown = _tmp_folder(method_dir, ".tmp-legacy1", age_s=artifacts.UNKNOWN_WRITER_GRACE_S + 60)
            recent_unknown = _tmp_folder(method_dir, ".tmp-1@other-host@jkl", age_s=60)
            p = _save(tmp_path)
            assert p.name == "v1"
            left = sorted(x.name for x in method_dir.iterdir())
            assert left == sorted([writing.name, newer.name, recent_unknown.name, "v1"])
            assert not killed.exists() and not old_unknown.exists()
        finally:
            live.kill()
    live.wait()
    # the writer is gone now: `list` removes its folder too (and looks at the model and root levels as well)
    top = _tmp_folder(tmp_path, ".tmp-dump-x", age_s=artifacts.UNKNOWN_WRITER_GRACE_S + 60)
    assert remove_stale_temps_under(tmp_path) == [top, writing]
    assert [r["version"] for r in list_artifacts(tmp_path)] == ["v1"]


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "sparsekv.cli", "artifacts", *args], capture_output=True,
                          text=True, timeout=300)


def test_cli_exit_codes(tmp_path):
    r = _cli("verify", str(tmp_path / "missing" / "v1"))
    assert r.returncode == 2, r
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "no such file or folder" in lines[0], r.stderr

    good = _save(tmp_path)
    bad = _save(tmp_path, config={"hadamard": True})
    m = _manifest(bad)
    m["config"]["hadamard"] = False
    (bad / "manifest.json").write_text(json.dumps(m))
    dead = _tmp_folder(good.parent, f".tmp-{_dead_pid()}@{artifacts._host()}@x", age_s=10)
    r = _cli("verify", str(good))
    assert r.returncode == 0 and "ok" in r.stdout, r
    r = _cli("verify", str(bad))
    assert r.returncode == 1 and "edited manifest.json" in r.stderr and "error:" not in r.stderr, r
    r = _cli("list", str(tmp_path))
    assert r.returncode == 1 and "edited manifest.json" in r.stdout, r
    removed = [ln for ln in r.stdout.splitlines() if ln.startswith("removed ")]
    assert removed == [f"removed 1 temporary folder(s) left by interrupted writes: {dead}"] and not dead.exists()
    r = _cli("list", str(tmp_path / "nowhere"))
    assert r.returncode == 2 and r.stderr.startswith("error: no artifact store"), r


def test_schema_1_artifacts_are_refused_until_upgraded(tmp_path):
    p = _save(tmp_path, config={"hadamard": True})
    m = _manifest(p)
    del m["manifest_sha256"]
    m["schema_version"] = 1
    (p / "manifest.json").write_text(json.dumps(m))  # as written before manifests carried a digest
    with pytest.raises(ArtifactError, match=r"schema_version 1, .* `sparsekv artifacts upgrade "):
        load_artifact(p)
    assert "schema_version 1" in verify_artifact(p)[0]

    broken = _save(tmp_path)
    (broken / "manifest.json").write_text(json.dumps(dict(_manifest(broken), schema_version=1)))
    _flip_middle(broken / "layer_000.safetensors")
    with pytest.raises(ArtifactError, match="cannot be upgraded: layer_000.safetensors sha256 mismatch"):
        upgrade_artifact(broken)
    assert _manifest(broken)["schema_version"] == 1  # left as it was

    assert upgrade_artifact(p) == p
    art = load_artifact(p)
    assert art.config["hadamard"] is True and art.manifest["upgraded"]["from_schema_version"] == 1
    assert art.manifest["schema_version"] == SCHEMA_VERSION and verify_artifact(p) == []
    with pytest.raises(ArtifactError, match="nothing to upgrade"):
        upgrade_artifact(p)
    assert sorted(x.name for x in p.iterdir()) == ["layer_000.safetensors", "layer_001.safetensors", "manifest.json"]
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE((p / "manifest.json").stat().st_mode) == 0o666 & ~mask  # rewritten through `tempfile`


def test_resolve_refuses_a_version_that_is_a_path(tmp_path):
    _save(tmp_path)
    with pytest.raises(ArtifactError, match="version '../v1'"):
        load_artifact(tmp_path, model_name=FP["name"], method="adamas", version="../v1")
