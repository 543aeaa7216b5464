"""The model-family matrix: every family sparsekv accepts, built tiny in memory, decodes exactly as transformers does,
every method honours each layer's own attention (sliding windows, softcapping, scale, per-layer RoPE), dumps recover
pre-RoPE q/k exactly, and what sparsekv cannot run is refused with one line."""

import subprocess
import sys

import pytest
import torch

from sparsekv.decode import generate
from sparsekv.errors import SparseKVError
from sparsekv.methods import get_method
from sparsekv.models import LoadedModel, byte_tokenizer, cache_kwarg, wire
from sparsekv.patterns import FAMILIES, check_call, model_patterns

WINDOW = 32  # the sliding window of every family that has one: well inside the 100-token prompts below
PROMPT = 100
STEPS = 5

COMMON = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=1024, tie_word_embeddings=False)
# model_type -> (config options, what the family exercises)
CONFIGS = {
    "llama": dict(num_hidden_layers=2),
    "mistral": dict(num_hidden_layers=2, sliding_window=WINDOW),  # every layer slides
    "mixtral": dict(num_hidden_layers=2, sliding_window=WINDOW, num_local_experts=2, num_experts_per_tok=1),
    "qwen2": dict(num_hidden_layers=2, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    "qwen3": dict(num_hidden_layers=2, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    "phi3": dict(num_hidden_layers=2, sliding_window=WINDOW, partial_rotary_factor=0.5),  # half the dims rotate
    "gemma": dict(num_hidden_layers=2),
    "gemma2": dict(num_hidden_layers=2, sliding_window=WINDOW, attn_logit_softcapping=1.5, query_pre_attn_scalar=24,
                   final_logit_softcapping=None),  # a softcap small enough to change every logit
    "gemma3_text": dict(num_hidden_layers=3, sliding_window=WINDOW, sliding_window_pattern=3, query_pre_attn_scalar=24,
                        rope_local_base_freq=100.0),  # local layers rotate with their own tables
}
METHODS = [("oracle", {"pooling": "group"}), ("oracle", {"pooling": "head"}), ("streaming", {}), ("quest", {}),
           ("lsh", {}), ("adamas", {}), ("adamas", {"distance": "ip"})]
_BUILT: dict = {}


def build(model_type: str, **overrides) -> LoadedModel:
    """A random-weight model of the family with peaky attention (sparse choices matter), fp32, on the CPU."""
    from transformers import AutoConfig, AutoModelForCausalLM

    key = (model_type, tuple(sorted(overrides.items())))
    if key in _BUILT:
        return _BUILT[key]
    tok = byte_tokenizer()
    cfg = AutoConfig.for_model(model_type, vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                               eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id,
                               **{**COMMON, **CONFIGS[model_type], **overrides})
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg)
        for layer in model.model.layers:
            attn = layer.self_attn
            for proj in ("q_proj", "k_proj", "qkv_proj"):
                if hasattr(attn, proj):
                    getattr(attn, proj).weight.data.mul_(6)
    lm = wire(LoadedModel(model.float(), tok, f"tiny-{model_type}", "in-memory"), "cpu")
    _BUILT[key] = lm
    return lm


def _ids(seed: int = 0, n: int = PROMPT) -> torch.Tensor:
    return torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(seed))


def _transformers_logits(lm: LoadedModel, ids: torch.Tensor, steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy decoding by transformers itself (its eager attention and its own cache), logits per step."""
    lm.model.set_attn_implementation("eager")
    try:
        out = lm.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, do_sample=False,
                                output_logits=True, return_dict_in_generate=True, eos_token_id=None,
                                pad_token_id=lm.tokenizer.eos_token_id)
    finally:
        wire(lm)
    return out.sequences[0, ids.shape[1]:].tolist(), [s[0].float() for s in out.logits]


def _close(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> None:
    assert len(ours) == len(theirs)
    for step, (a, b) in enumerate(zip(ours, theirs)):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=2e-4, msg=lambda m: f"decode step {step}: {m}")


def test_the_matrix_covers_every_family():
    assert set(CONFIGS) == set(FAMILIES)


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_patterns_read_from_the_model(family):
    lm = build(family)
    patterns = model_patterns(lm.model)
    types = getattr(lm.config, "layer_types", None) or ["full_attention"] * lm.num_layers
    for i, p in enumerate(patterns):
        sliding = types[i] == "sliding_attention" or family in ("mistral", "mixtral", "phi3")
        assert p.span == (WINDOW if sliding else 0), (i, p)
        assert p.softcap == (1.5 if family == "gemma2" else None)
        assert p.scaling == pytest.approx(lm.model.model.layers[i].self_attn.scaling)
        assert p.rope == (types[i] if family == "gemma3_text" else None)
    if family in ("qwen2", "qwen3", "gemma2", "gemma3_text"):
        assert {p.span for p in patterns} == {0, WINDOW}  # local and global layers side by side


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_dense_decodes_as_transformers(family, one_thread):
    lm = build(family)
    ids = _ids()
    tokens, logits = _transformers_logits(lm, ids, STEPS)
    g = generate(lm, ids, get_method("dense"), STEPS, stop_on_eos=False, keep_logits=True)
    assert g.tokens == tokens
    _close(g.logits, logits)
    assert g.stats["decode_path"].startswith("eager")


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_chunked_prefill_equals_whole_prefill(family, one_thread, monkeypatch):
    """A prompt prefilled in chunks (each after the cached keys, sliding windows and softcaps applied by our own
    attention, no mask built) gives the keys, values and logits of one whole prefill, which are transformers' own
    (its eager attention), and transformers' mask builder is never asked for an n x L mask."""
    import sparsekv.attention as attention
    from sparsekv.decode import prefill

    lm = build(family)
    ids = _ids(3)
    lm.model.set_attn_implementation("eager")
    try:
        theirs = lm.model(ids).logits[:, -1].float()
    finally:
        wire(lm)
    whole = prefill(lm, ids)
    torch.testing.assert_close(whole.logits.float(), theirs, atol=2e-4, rtol=2e-4)
    built = []
    monkeypatch.setattr(attention, "sdpa_mask", lambda *a, **kw: built.append(1))
    parts = prefill(lm, ids, prefill_chunk=24)  # 100 tokens: 24 + 24 + 24 + 24 + 4, windows of 32
    assert built == []
    torch.testing.assert_close(parts.logits, whole.logits, atol=2e-4, rtol=2e-4)
    for a, b in zip(parts.keys + parts.values, whole.keys + whole.values):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="an interpreter test (CPU tensors): on a GPU "
                    "test_prefill_attention.py runs the kernel at head dim 96")
@pytest.mark.parametrize("family,head_dim", [("mistral", 24), ("gemma2", 20)])
def test_chunked_prefill_on_the_kernels_with_a_head_dim_not_a_power_of_two(family, head_dim, one_thread,
                                                                         monkeypatch):
    """The path a GPU takes (our kernels; interpreted here): sliding windows and softcaps in chunks after cached
    keys with head dims such as Phi-3-mini's 96 (here 24 and 20), against the torch references' whole prefill."""
    from sparsekv.decode import prefill

    lm = build(family, head_dim=head_dim)
    ids = _ids(5)
    monkeypatch.setenv("SPARSEKV_KERNELS", "0")
    ref = prefill(lm, ids)
    monkeypatch.setenv("SPARSEKV_KERNELS", "1")
    for chunk in (None, 24):
        got = prefill(lm, ids, prefill_chunk=chunk)
        torch.testing.assert_close(got.logits, ref.logits, atol=2e-4, rtol=2e-4)
        for a, b in zip(got.keys + got.values, ref.keys + ref.values):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", sorted(CONFIGS))
@pytest.mark.parametrize("method", METHODS, ids=lambda m: m[0] + "".join(f"-{v}" for v in m[1].values()))
def test_budget_covering_what_layers_see_equals_dense(family, method, one_thread):
    """With a budget >= the visible context every method is exact. Where every layer slides (mistral, mixtral,
    phi3) a budget of the window is that budget, far below the context: the methods must attend the window
    densely, and nothing before it."""
    lm = build(family)
    ids = _ids(1)
    dense = generate(lm, ids, get_method("dense"), STEPS, stop_on_eos=False, keep_logits=True)
    all_slide = all(p.span for p in lm.patterns)
    budget = WINDOW if all_slide else PROMPT + STEPS
    name, options = method
    g = generate(lm, ids, get_method(name, budget=budget, **options), STEPS, stop_on_eos=False, keep_logits=True)
    assert g.tokens == dense.tokens
    _close(g.logits, dense.logits)
    assert g.stats["selectivity"] == pytest.approx(1.0)
    if all_slide:
        assert g.stats["mean_context"] == pytest.approx(WINDOW)  # what a layer could see, not the cache


@pytest.mark.parametrize("family", ["mistral", "qwen2", "gemma2", "gemma3_text", "phi3"])
@pytest.mark.parametrize("method", METHODS, ids=lambda m: m[0] + "".join(f"-{v}" for v in m[1].values()))
def test_small_budgets_select_only_keys_the_layer_sees(family, method, monkeypatch, one_thread):
    """Below the window, every selection on a sliding layer lies inside it (and the sink is the window's first
    keys); full layers choose over the whole cache. The selections are checked as the decode makes them."""
    lm = build(family)
    name, options = method
    if name == "quest":  # pages of 4 (of the default 16 none would fit a budget of 12 beside the last page)
        options = {**options, "page_size": 4}
    m = get_method(name, budget=12, **options)
    seen = []
    select = m.select

    def checked(state, q, q_pre):
        sel = select(state, q, q_pre)
        pos = sel.positions(1, sel.heads(state.keys.shape[1]))
        read = pos[pos >= 0]
        lo = max(0, state.length - state.pattern.span) if state.pattern.span else 0
        assert sel.start == lo and not sel.dense
        assert read.numel() and int(read.min()) >= lo and int(read.max()) < state.length
        seen.append(state.pattern.span)
        return sel

    monkeypatch.setattr(m, "select", checked)
    g = generate(lm, _ids(2), m, STEPS, stop_on_eos=False)
    assert WINDOW in seen
    # Quest's pages are clipped to the region the sparse part may come from: up to the budget
    assert 8 < g.stats["mean_attended"] <= 12 if name == "quest" else g.stats["mean_attended"] == pytest.approx(12)
    spans = {p.span for p in lm.patterns}
    assert set(seen) == spans  # every kind of layer ran the method


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_sliding_layers_within_the_budget_run_their_window_densely(family, one_thread):
    """A budget above the window but below the context: sliding layers attend their whole window (dense), full
    layers choose; the mistral model (all layers slide) is then exactly dense although the budget is < context."""
    lm = build(family)
    ids = _ids(3)
    dense = generate(lm, ids, get_method("dense"), STEPS, stop_on_eos=False, keep_logits=True)
    g = generate(lm, ids, get_method("oracle", budget=WINDOW + 8), STEPS, stop_on_eos=False, keep_logits=True)
    if family == "mistral":
        _close(g.logits, dense.logits)
        assert g.stats["selectivity"] == pytest.approx(1.0)
    else:  # gemma2: one sliding, one full layer; the full layer reads WINDOW + 8 of ~100 keys
        assert g.stats["selectivity"] < 1.0
        assert g.stats["mean_context"] == pytest.approx((WINDOW + PROMPT + STEPS / 2) / 2, abs=2)


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_dump_recovers_pre_rope_exactly(family, tmp_path):
    """Dumped pre-RoPE keys and queries, rotated again with the model's own RoPE (its tables for that layer's type,
    its partial rotary dims), give the post-RoPE ones; the dump records each layer's attention pattern."""
    import sys as _sys

    from sparsekv.activations import dump_activations, load_activations
    from sparsekv.rope import find_rotary, rope_tables

    lm = build(family)
    out = dump_activations(lm, _ids(4, 96)[0].tolist(), tmp_path / "d", seq_len=48, queries_per_seq=8,
                           dtype=torch.float32)
    acts = load_activations(out, lm)
    assert acts.patterns() == model_patterns(lm.model)
    rotary = find_rotary(lm.model)
    apply = _sys.modules[type(lm.model.model.layers[0].self_attn).__module__].apply_rotary_pos_emb
    pos = acts.positions()
    for layer, pattern in enumerate(acts.patterns()):
        d = acts.layer(layer)
        k_pos = pos["k_pos"].view(1, -1)
        q_pos = pos["q_pos"].view(1, -1)
        cos_k, sin_k = rope_tables(rotary, d["k_pre"], k_pos, pattern.rope)
        cos_q, sin_q = rope_tables(rotary, d["q_pre"], q_pos, pattern.rope)
        q_again, _ = apply(d["q_pre"].unsqueeze(0), d["q_pre"].unsqueeze(0), cos_q, sin_q)
        _, k_again = apply(d["k_pre"].unsqueeze(0), d["k_pre"].unsqueeze(0), cos_k, sin_k)
        torch.testing.assert_close(k_again[0], d["k_post"], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(q_again[0], d["q_post"], atol=1e-5, rtol=1e-5)


def test_recall_honours_the_dumped_windows(tmp_path):
    """On a dump of an all-sliding model, the oracle at a budget of the window reads every key each query sees:
    attention-mass recall 1 (over the whole cache it would be well below)."""
    from sparsekv.activations import dump_activations, load_activations
    from sparsekv.eval.recall import recall_grid
    from sparsekv.eval.runner import RunSpec

    lm = build("mistral")
    acts = load_activations(dump_activations(lm, _ids(5, 128)[0].tolist(), tmp_path / "d", seq_len=128,
                                             queries_per_seq=16, dtype=torch.float32))
    full, small = recall_grid(acts, [RunSpec("oracle", WINDOW), RunSpec("oracle", 8)], min_context=WINDOW + 1)
    assert full["attention_mass_recall"] == pytest.approx(1.0)
    assert full["mean_context"] == pytest.approx(WINDOW)
    assert small["attention_mass_recall"] < 1.0 and small["selectivity"] == pytest.approx(8 / WINDOW)


def test_calls_that_disagree_with_the_pattern_are_refused():
    p = model_patterns(build("gemma2").model)
    sliding = next(i for i, x in enumerate(p) if x.span)
    ok = {"sliding_window": WINDOW, "softcap": 1.5, "position_ids": torch.zeros(1, 1)}
    check_call(sliding, p[sliding], p[sliding].scaling, 0.0, ok)
    for bad, message in [({"sliding_window": 16}, "sliding window of 16"), ({"softcap": None}, "softcaps"),
                         ({"s_aux": torch.zeros(2)}, "'s_aux'"), ({"is_causal": False}, "non-causally")]:
        with pytest.raises(SparseKVError, match=message):
            check_call(sliding, p[sliding], p[sliding].scaling, 0.0, {**ok, **bad})
    with pytest.raises(SparseKVError, match="scales q·k"):
        check_call(sliding, p[sliding], 1.0, 0.0, ok)
    with pytest.raises(SparseKVError, match="dropout"):
        check_call(sliding, p[sliding], p[sliding].scaling, 0.1, ok)


def test_a_model_changed_under_the_cache_is_refused_not_decoded():
    """The cache's patterns come from the model when it is made; a window changed afterwards is caught at the
    next attention call, before any decode step."""
    from sparsekv.decode import make_cache

    lm = build("qwen2")
    cache = make_cache(lm, get_method("oracle", budget=8), PROMPT + 4)
    layer = next(i for i, p in enumerate(lm.patterns) if p.span)
    attn = lm.model.model.layers[layer].self_attn
    attn.sliding_window = WINDOW // 2
    try:
        with pytest.raises(SparseKVError, match=f"layer {layer} attends a sliding window of {WINDOW // 2}"):
            lm.model(input_ids=_ids(6), **cache_kwarg(lm.model, cache), position_ids=torch.arange(PROMPT).view(1, -1))
    finally:
        attn.sliding_window = WINDOW


def _save(lm_model, path):
    lm_model.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("kind,message", [
    ("gpt2", "cannot run gpt2 models: model type 'gpt2' is not one sparsekv runs"),
    ("gemma3-bidirectional", "bidirectional attention"),
])
def test_a_refused_model_is_one_line_and_exit_2(kind, message, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = byte_tokenizer()
    if kind == "gpt2":
        cfg = AutoConfig.for_model("gpt2", n_layer=1, n_embd=32, n_head=2, vocab_size=len(tok))
    else:
        cfg = AutoConfig.for_model("gemma3_text", vocab_size=len(tok), num_hidden_layers=2, sliding_window=WINDOW,
                                   use_bidirectional_attention=True, pad_token_id=tok.eos_token_id, **COMMON)
    with pytest.raises(SparseKVError, match=message):
        wire(LoadedModel(AutoModelForCausalLM.from_config(cfg), tok, kind, "in-memory"))
    folder = _save(AutoModelForCausalLM.from_config(cfg), tmp_path / kind)
    r = subprocess.run([sys.executable, "-m", "sparsekv.cli", "eval", "--model", folder, "--seq", "200", "--n", "1"],
                       capture_output=True, text=True, timeout=300)
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert r.returncode == 2 and lines and message in lines[-1] and "Traceback" not in r.stderr, r.stderr
