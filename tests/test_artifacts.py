"""The artifact store: round trip, versioning, atomic writes, and the one-line errors for bad artifacts."""

import json

import pytest
import torch

from sparsekv import artifacts
from sparsekv.artifacts import (SCHEMA_VERSION, ArtifactError, list_artifacts, load_artifact, save_artifact,
                                slugify, verify_artifact)

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
    (p / "manifest.json").write_text(json.dumps(m))
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
    assert "unreadable" in rows[1]["error"]
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


def test_fingerprint_is_the_same_for_fp32_and_bf16_loads():
    """Calibrate on a CPU in fp32, run on a GPU in bf16: the artifact must still match its model."""
    import torch

    from sparsekv.models import load_model

    a, b = load_model("tiny-random"), load_model("tiny-random", dtype=torch.bfloat16)
    assert a.fingerprint() == b.fingerprint()
    with torch.no_grad():
        b.model.model.layers[0].mlp.down_proj.weight[0, 0] += 0.5  # a fine-tune changes it
    assert b.fingerprint()["weights_sha256"] != a.fingerprint()["weights_sha256"]
