"""Ragged batches: prompts of different lengths decoded together, each row equal to its own batch-1 generation."""

import functools

import pytest
import torch

import sparsekv.decode as decode
from sparsekv.decode import generate, generate_batch, prefill
from sparsekv.errors import SparseKVError
from sparsekv.methods import get_method
from sparsekv.step import make_step

# budgets below some prompts' context and above others': short rows read every key, long rows select
METHODS = [("dense", {}), ("oracle", {"budget": 120}), ("streaming", {"budget": 100}), ("quest", {"budget": 128}),
           ("lsh", {"budget": 120}), ("adamas", {"budget": 120}), ("oracle", {"budget": 120, "pooling": "head"}),
           ("adamas", {"budget": 120, "sink": 4, "window": 16}), ("oracle", {"budget": 120, "sink": 2, "window": 9})]
LENGTHS = (200, 90, 143)


def _prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 256, (1, n), generator=g) for n in LENGTHS]


@pytest.mark.parametrize("mode", [None, "static"])
@pytest.mark.parametrize("method", METHODS, ids=lambda m: "-".join(map(str, [m[0], *m[1].values()])))
def test_ragged_batch_equals_each_prompt_alone(tiny, one_thread, method, mode, monkeypatch):
    name, options = method
    prompts = _prompts()
    alone = [generate(tiny, p, get_method(name, **options), 7, stop_on_eos=False, keep_logits=True) for p in prompts]
    if mode:
        monkeypatch.setattr(decode, "make_step", functools.partial(make_step, mode=mode))
    together = generate_batch(tiny, prompts, get_method(name, **options), 7, stop_on_eos=False, keep_logits=True)
    assert [g.tokens for g in together] == [g.tokens for g in alone]
    for a, b in zip(together, alone):
        for x, y in zip(a.logits, b.logits, strict=True):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
    assert [g.prompt_tokens for g in together] == list(LENGTHS)


def test_batch_rows_stop_on_their_own(tiny, one_thread):
    """Per-row token limits (and EOS) end each row on its own; shared prefills are left intact for reuse."""
    prompts = _prompts()
    pfs = [prefill(tiny, p, room=9) for p in prompts]
    keys = [pf.keys[0].clone() for pf in pfs]
    got = generate_batch(tiny, None, get_method("quest", budget=64), [3, 9, 5], stop_on_eos=False, prefilled=pfs)
    assert [len(g.tokens) for g in got] == [3, 9, 5]
    for b, pf in enumerate(pfs):
        assert torch.equal(pf.keys[0], keys[b])
        again = generate(tiny, None, get_method("quest", budget=64), [3, 9, 5][b], stop_on_eos=False, prefilled=pf)
        assert again.tokens == got[b].tokens


def test_batch_refusals(tiny):
    with pytest.raises(SparseKVError, match="no prompts"):
        generate_batch(tiny, [], get_method("dense"), 4)
    with pytest.raises(SparseKVError, match="2 max_new_tokens for 3 prompts"):
        generate_batch(tiny, _prompts(), get_method("dense"), [4, 4])


def test_eval_batches_equal_single_prompts(tiny, one_thread):
    """`eval --batch-size`: a passkey grid decoded three prompts at a time scores and predicts as one at a time."""
    from sparsekv.eval.runner import RunSpec, make_samples, run_grid

    samples, _ = make_samples(tiny, "passkey", 300, 4)
    specs = [RunSpec("dense", None), RunSpec("adamas", 64, {"sink": 4, "window": 8}), RunSpec("quest", 48)]
    one = run_grid(tiny, "passkey", specs, 300, 4, samples=samples)
    three = run_grid(tiny, "passkey", specs, 300, 4, samples=samples, batch_size=3)
    for a, b in zip(one, three):
        assert [r["prediction"] for r in a["samples"]] == [r["prediction"] for r in b["samples"]]
        assert a["score"] == b["score"] and a["n"] == b["n"] == 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("method", METHODS, ids=lambda m: "-".join(map(str, [m[0], *m[1].values()])))
def test_ragged_batch_replays_one_graph_on_gpu(method):
    """On the GPU a ragged batch replays one captured step per regime, and each row equals its own generation."""
    from sparsekv.models import load_model

    lm = load_model("tiny-random", device="cuda")
    name, options = method
    prompts = [p.cuda() for p in _prompts()]
    alone = [generate(lm, p, get_method(name, **options), 7, stop_on_eos=False, keep_logits=True) for p in prompts]
    together = generate_batch(lm, prompts, get_method(name, **options), 7, stop_on_eos=False, keep_logits=True)
    assert together[0].stats["decode_path"] == "graph"
    for a, b in zip(together, alone):
        assert a.tokens == b.tokens
        for x, y in zip(a.logits, b.logits, strict=True):
            torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)


def test_buffers_are_freed_when_their_last_user_goes(tiny):
    """A prefill's K/V live as long as the Prefill (no cache or attention pointer keeps them), and a generation's
    cache is released when it ends, without waiting for the garbage collector."""
    import gc
    import weakref

    gc.disable()
    try:
        pf = prefill(tiny, _prompts()[0], room=4)
        kept = weakref.ref(pf.key_buffers[0])
        generate(tiny, None, get_method("adamas", budget=64), 4, stop_on_eos=False, prefilled=pf)
        generate_batch(tiny, None, get_method("quest", budget=64), 3, stop_on_eos=False, prefilled=[pf, pf])
        del pf
        assert kept() is None
    finally:
        gc.enable()
