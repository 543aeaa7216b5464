"""Programmatic dependent launch (kernels/device.py): which launches get it, and on a GPU that has it (sm_90+), a
graph-replayed decode with it gives what ordinary launches give: the same tokens, kept logits and statistics."""

import pytest
import torch

from sparsekv.decode import generate_batch
from sparsekv.kernels import device as kd
from sparsekv.methods import get_method
from sparsekv.methods.spotlight import untrained_hashes
from sparsekv.saap.model import random_index


@pytest.fixture
def restore_switch():
    yield
    kd.set_dependent_launch(None)


def test_options_only_on_a_capable_gpu(monkeypatch, restore_switch):
    assert kd.dependent_launch(torch.device("cpu")) == {}
    assert kd.dependent_launch(torch.device("cpu"), early=True) == {}
    if not torch.cuda.is_available():
        return
    cuda = torch.device("cuda", torch.cuda.current_device())
    capable = torch.cuda.get_device_capability(cuda)[0] >= 9
    kd.set_dependent_launch(True)
    assert kd.dependent_launch(cuda) == ({"PDL": kd.WAIT_EXIT, "launch_pdl": True} if capable else {})
    assert kd.dependent_launch(cuda, early=True).get("PDL") == (kd.WAIT_EARLY if capable else None)
    kd.set_dependent_launch(False)
    assert kd.dependent_launch(cuda, early=True) == {}
    kd.set_dependent_launch(None)  # the process default: on unless SPARSEKV_PDL=0
    monkeypatch.setenv("SPARSEKV_PDL", "0")
    assert kd.dependent_launch(cuda) == {}
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("SPARSEKV_PDL")
    assert kd.dependent_launch(cuda) == {}


METHODS = [("dense", {}), ("streaming", {"budget": 60}), ("oracle", {"budget": 64}),
           ("quest", {"budget": 64, "page_size": 8}), ("lsh", {"budget": 64}), ("adamas", {"budget": 64}),
           ("spotlight", {"budget": 64, "hashes": untrained_hashes(2, 2, 20, hidden=32, nbits=48)}),
           ("saap", {"budget": 80, "sink": 1, "window": 16, "probes": 3,
                     "index": random_index(2, 2, 20, clusters=8, hidden=16)})]


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="programmatic dependent launch needs a GPU of compute capability 9.0 or later")
@pytest.mark.parametrize("method", METHODS, ids=lambda m: m[0])
def test_dependent_launches_decode_as_ordinary_ones(method, restore_switch):
    from sparsekv.models import load_model

    lm = load_model("tiny-random", device="cuda")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (1, n), generator=g) for n in (150, 97)]
    name, options = method
    runs = []
    for on in (False, True):
        kd.set_dependent_launch(on)
        runs.append(generate_batch(lm, prompts, get_method(name, **options), [8, 6], keep_logits=True,
                                   stop_on_eos=False))
    plain, dependent = runs
    assert [r.stats["decode_path"] for r in dependent] == ["graph"] * 2
    assert [r.tokens for r in dependent] == [r.tokens for r in plain]
    assert [r.stats for r in dependent] == [r.stats for r in plain]
    for a, b in zip(plain, dependent):
        for p, q in zip(a.logits, b.logits, strict=True):
            torch.testing.assert_close(q, p, atol=0, rtol=0)
