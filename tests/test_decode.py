"""The sparsekv cache + attention function against transformers' own eager attention, and the methods' limits."""

import pytest
import torch

from sparsekv.decode import generate, greedy
from sparsekv.methods import get_method


def _eager(lm, ids, steps):
    lm.model.set_attn_implementation("eager")
    try:
        out = lm.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, do_sample=False,
                                output_scores=True,
                                return_dict_in_generate=True, eos_token_id=None, pad_token_id=256)
    finally:
        lm.model.set_attn_implementation("sparsekv")
    return out.sequences[0, ids.shape[1]:].tolist(), [s[0] for s in out.scores]


def test_dense_matches_eager(tiny, prompt_ids):
    assert tiny.q_heads != tiny.kv_heads and tiny.head_dim & (tiny.head_dim - 1)  # GQA, non-power-of-two dim
    tokens, scores = _eager(tiny, prompt_ids, 12)
    g = generate(tiny, prompt_ids, get_method("dense"), 12, stop_on_eos=False, keep_logits=True)
    assert g.tokens == tokens
    for ours, theirs in zip(g.logits, scores):
        torch.testing.assert_close(ours, theirs.float(), atol=1e-4, rtol=1e-4)


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("vocab", [128256, 49152, 32000, 50257, 96, 64])
def test_greedy_is_argmax(vocab, device):
    """The two-step greedy pick equals argmax: random logits, equal maxima (the first wins), NaN (the first wins)
    and -inf rows, in bf16 and fp32, on every device here."""
    g = torch.Generator().manual_seed(vocab)
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(4, vocab, generator=g).to(dtype)
        x[1] = x[1].round()  # bf16 and rounding: many equal values, equal maxima among them
        x[2, [vocab // 3, vocab // 2, vocab - 1]] = 100.0
        x[3] = float("-inf")
        x[0, [vocab - 2, 5]] = float("nan")
        x = x.to(device)
        assert greedy(x).tolist() == x.argmax(-1).tolist() == [5, x[1].argmax().item(), vocab // 3, 0]


def test_chunked_prefill_matches_single_prefill(tiny, prompt_ids):
    a = generate(tiny, prompt_ids, get_method("dense"), 6, stop_on_eos=False, keep_logits=True)
    b = generate(tiny, prompt_ids, get_method("dense"), 6, stop_on_eos=False, keep_logits=True, prefill_chunk=64)
    assert a.tokens == b.tokens
    torch.testing.assert_close(a.logits[0], b.logits[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("pooling", ["group", "head"])
def test_oracle_with_full_budget_equals_dense(tiny, prompt_ids, pooling):
    dense = generate(tiny, prompt_ids, get_method("dense"), 8, stop_on_eos=False, keep_logits=True)
    # budget == final context: the last step is dense, every earlier one selects all but a few keys ...
    n = prompt_ids.shape[1] + 8
    full = generate(tiny, prompt_ids, get_method("oracle", budget=n, pooling=pooling), 8, stop_on_eos=False,
                    keep_logits=True)
    assert full.tokens == dense.tokens
    for a, b in zip(full.logits, dense.logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert full.stats["selectivity"] == pytest.approx(1.0)


def test_oracle_exact_topk_keeps_all_when_budget_covers_every_key(tiny, prompt_ids):
    """Budget = context - 0 on the sparse path: the oracle selects every key, so output equals dense exactly."""
    dense = generate(tiny, prompt_ids, get_method("dense"), 3, stop_on_eos=False, keep_logits=True)
    # force the sparse path with a budget that covers all but the sink/window split: sink + window + k = length
    m = get_method("oracle", budget=prompt_ids.shape[1] + 2, sink=4, window=8)
    g = generate(tiny, prompt_ids, m, 3, stop_on_eos=False, keep_logits=True)
    for a, b in zip(g.logits, dense.logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_small_budget_changes_the_output(tiny, prompt_ids):
    """The sparse path is really taken: with 8 keys the logits move away from dense."""
    dense = generate(tiny, prompt_ids, get_method("dense"), 2, stop_on_eos=False, keep_logits=True)
    for name in ("oracle", "streaming"):
        g = generate(tiny, prompt_ids, get_method(name, budget=8), 2, stop_on_eos=False, keep_logits=True)
        assert (g.logits[1] - dense.logits[1]).abs().max() > 1e-3
        assert g.stats["mean_attended"] == pytest.approx(8)
        assert g.stats["sparse_steps"] == tiny.num_layers  # one sparse step per layer (2 tokens: 1 decode step)


def test_dense_layers_are_not_sparse(tiny, prompt_ids):
    g = generate(tiny, prompt_ids, get_method("oracle", budget=8), 3, stop_on_eos=False, dense_layers=(0,))
    assert g.stats["sparse_steps"] == 2  # 2 decode steps x 1 sparse layer
    g_all = generate(tiny, prompt_ids, get_method("oracle", budget=8), 3, stop_on_eos=False,
                     dense_layers=(0, 1))
    dense = generate(tiny, prompt_ids, get_method("dense"), 3, stop_on_eos=False)
    assert g_all.tokens == dense.tokens and g_all.stats["sparse_steps"] == 0


def test_the_cache_goes_by_the_name_transformers_takes(tiny, prompt_ids):
    """transformers 5.24 renamed `past_key_values` to `cache` and warns on every call with the old name."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        generate(tiny, prompt_ids, get_method("oracle", budget=16), 3, stop_on_eos=False)
    assert not [w for w in caught if "past_key_values" in str(w.message)]


def test_new_caches_have_a_multiple_of_16_slots(tiny, prompt_ids):
    """A new cache's capacity is rounded up to SLOT_ALIGN (one divisibility class for the kernels' integer arguments:
    no recompile when a generation's length moves), and a shared prefill's buffers are decoded in as they are."""
    import sparsekv.decode as decode

    assert decode.SLOT_ALIGN == 16
    for want, got in [(8, 16), (16, 16), (220, 224)]:
        cache = decode.make_cache(tiny, get_method("dense"), want)
        assert cache.max_len == got
        cache.release()
    pf = decode.prefill(tiny, prompt_ids, room=5)
    n = prompt_ids.shape[1]
    assert pf.key_buffers[0].shape[2] == -(-(n + 5) // 16) * 16 and pf.room >= 5
    cache = decode.make_cache(tiny, get_method("oracle", budget=16), n + 5, prefilled=pf)
    assert cache.max_len == pf.key_buffers[0].shape[2]
    cache.release()


def test_a_shared_prefill_is_decoded_in_place(tiny, prompt_ids, monkeypatch):
    """A prefill with room for the generation lends its K/V buffers to every method's cache (no copy of the
    prompt's K/V), and each method decodes exactly as from its own prefill: the previous method's tokens past the
    prompt are never read."""
    import sparsekv.decode as decode

    pf = decode.prefill(tiny, prompt_ids, room=6)
    seen = []
    make = decode.make_cache

    def spy(*args, **kw):
        cache = make(*args, **kw)
        seen.append(cache.kv)  # read now: a finished generation releases its cache
        return cache

    monkeypatch.setattr(decode, "make_cache", spy)
    for name, opts in [("oracle", {"budget": 24}), ("quest", {"budget": 32}), ("dense", {})]:
        shared = generate(tiny, None, get_method(name, **opts), 6, stop_on_eos=False, keep_logits=True, prefilled=pf)
        assert seen[-1] is not None and seen[-1][0][0].data_ptr() == pf.key_buffers[0].data_ptr()
        alone = generate(tiny, prompt_ids, get_method(name, **opts), 6, stop_on_eos=False, keep_logits=True)
        assert seen[-1] is None
        assert shared.tokens == alone.tokens
        for a, b in zip(shared.logits, alone.logits):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    longer = generate(tiny, None, get_method("dense"), 9, stop_on_eos=False, prefilled=pf)  # no room: copies
    assert seen[-1] is None and len(longer.tokens) == 9
