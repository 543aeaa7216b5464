"""The decode loop that queues step t + 1 before it reads token t (on a GPU) gives what the step-by-step loop gives:
the same tokens, kept logits and statistics, with per-row limits and an EOS that stops a generation early."""

import pytest
import torch

import sparsekv.decode as decode
from sparsekv.decode import generate, generate_batch
from sparsekv.methods import get_method

METHODS = [("quest", {"budget": 64}), ("streaming", {"budget": 60}), ("lsh", {"budget": 64}), ("dense", {})]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _run(lm, prompts, method, limits, ahead, monkeypatch, eos=None):
    monkeypatch.setattr(decode, "_runs_ahead", lambda device: ahead)
    monkeypatch.setattr(decode, "_eos_ids", lambda lm: set() if eos is None else {eos})
    name, options = method
    if len(prompts) == 1:
        return [generate(lm, prompts[0], get_method(name, **options), limits[0], keep_logits=True)]
    return generate_batch(lm, prompts, get_method(name, **options), limits, keep_logits=True)


def _same(a, b):
    assert [g.tokens for g in a] == [g.tokens for g in b]
    assert [g.stats for g in a] == [g.stats for g in b]
    for x, y in zip(a, b):
        assert len(x.logits) == len(x.tokens)
        for p, q in zip(x.logits, y.logits, strict=True):
            torch.testing.assert_close(p, q, atol=0, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("method", METHODS, ids=lambda m: m[0])
def test_queued_steps_equal_the_step_by_step_loop(tiny_on, device, rows, method, monkeypatch):
    lm = tiny_on(device)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (1, n), generator=g) for n in (150, 90, 121)[:rows]]
    limits = [9, 6, 8][:rows]
    plain = _run(lm, prompts, method, limits, False, monkeypatch)
    _same(_run(lm, prompts, method, limits, True, monkeypatch), plain)
    # an EOS id that ends the first row early: the step queued for its next token is taken back
    stop = plain[0].tokens[3]
    plain_eos = _run(lm, prompts, method, limits, False, monkeypatch, eos=stop)
    assert len(plain_eos[0].tokens) == plain[0].tokens.index(stop) + 1 < limits[0]
    _same(_run(lm, prompts, method, limits, True, monkeypatch, eos=stop), plain_eos)


@pytest.fixture
def tiny_on():
    from sparsekv.models import load_model

    return lambda device: load_model("tiny-random", device=device)
