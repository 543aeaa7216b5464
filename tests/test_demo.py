"""The demo's offline stage: calibrate once on text every machine has, then reuse the artifact."""

import pytest
import torch

from sparsekv import demo
from sparsekv.artifacts import load_artifact, save_artifact


@pytest.fixture
def small_demo(tmp_path, monkeypatch):
    """The demo's offline stage at test size, its artifacts under tmp_path, on a machine without jargon-text."""
    monkeypatch.setenv("SPARSEKV_HOME", str(tmp_path))
    monkeypatch.setattr(demo, "JARGON", tmp_path / "no-jargon.txt.gz")  # a machine without jargon-text
    monkeypatch.setattr(demo, "DEMO_TOKENS", 1024)
    monkeypatch.setattr(demo, "DEMO_SEQ", 512)
    monkeypatch.setattr(demo, "DEMO_QUERIES", 16)


def test_demo_artifact_is_made_once_then_reused(tiny, tmp_path, small_demo):
    path, report = demo.demo_artifact(tiny, budget=16)
    assert report is not None and report["source"] == "docstrings of Python's standard library"
    assert report["tokens"] == 1024 and 0 <= report["mean"]["after"] <= 1
    art = load_artifact(path, method="adamas", model_fingerprint=tiny.fingerprint())
    assert art.manifest["config"]["budget"] == 16 and path.is_relative_to(tmp_path)
    again, report2 = demo.demo_artifact(tiny, budget=16)
    assert again == path and report2 is None  # reused, not recalibrated
    other, report3 = demo.demo_artifact(tiny, budget=32)  # another budget: a new version
    assert other != path and report3 is not None
    assert "query_thresholds" in load_artifact(other, method="adamas").tensors["thresholds"]


def test_demo_refits_an_artifact_without_query_thresholds(tiny, small_demo):
    """Artifacts from before query thresholds (one set) are not reused: the demo fits a new version."""
    fp = tiny.fingerprint()
    old = save_artifact(demo.artifact_root(), method="adamas", model_fingerprint=fp, config={"budget": 16, "bits": 2},
                        tensors={"thresholds": {"thresholds": torch.zeros(fp["num_layers"], fp["kv_heads"], 3)}})
    path, report = demo.demo_artifact(tiny, budget=16)
    assert path != old and report is not None


def test_stdlib_text_is_natural_and_deterministic():
    a, b = demo.stdlib_text(), demo.stdlib_text()
    assert a == b and len(a) > 50_000 and "the" in a.split()
    pytest.importorskip("argparse")
