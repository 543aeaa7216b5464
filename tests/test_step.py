"""The split decode step (the pieces CUDA graphs replay) against the transformers forward it mirrors."""

import functools

import pytest
import torch

import sparsekv.decode as decode
from sparsekv.decode import generate
from sparsekv.errors import SparseKVError
from sparsekv.methods import get_method
from sparsekv.methods.spotlight import untrained_hashes
from sparsekv.saap.model import random_index
from sparsekv.models import LoadedModel, byte_tokenizer
from sparsekv.step import make_step, split_supported


def _both(lm, ids, method, steps, monkeypatch, mode="split"):
    """(transformers' step, the `mode` step) generations of `steps` tokens with method = (name, options)."""
    name, options = method
    ref = generate(lm, ids, get_method(name, **options), steps, stop_on_eos=False, keep_logits=True)
    monkeypatch.setattr(decode, "make_step", functools.partial(make_step, mode=mode))
    got = generate(lm, ids, get_method(name, **options), steps, stop_on_eos=False, keep_logits=True)
    monkeypatch.undo()
    return ref, got


@pytest.mark.parametrize("method", [("dense", {}), ("oracle", {"budget": 8}), ("streaming", {"budget": 16}),
                                    ("quest", {"budget": 32}), ("lsh", {"budget": 24})])
def test_split_step_equals_transformers_step(tiny, prompt_ids, method, monkeypatch):
    ref, got = _both(tiny, prompt_ids, method, 6, monkeypatch)
    assert got.tokens == ref.tokens
    for a, b in zip(got.logits, ref.logits):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # the same selections went through the same attention call; the results say which step ran
    assert got.stats.pop("decode_path") == "split" and ref.stats.pop("decode_path").startswith("eager")
    assert got.stats == pytest.approx(ref.stats)


STATIC_METHODS = [("dense", {}), ("oracle", {"budget": 24}), ("oracle", {"budget": 24, "pooling": "head"}),
                  ("streaming", {"budget": 16}), ("quest", {"budget": 40, "page_size": 8}),
                  ("quest", {"budget": 40, "page_size": 8, "sink": 2, "window": 5}), ("lsh", {"budget": 24}),
                  ("adamas", {"budget": 24}), ("adamas", {"budget": 24, "distance": "ip", "rerank": 2}),
                  ("oracle", {"budget": 0.1}),
                  ("spotlight", {"budget": 24, "hashes": untrained_hashes(2, 2, 20, hidden=32, nbits=48)}),
                  ("saap", {"budget": 40, "sink": 1, "window": 8, "probes": 3,
                            "index": random_index(2, 2, 20, clusters=8, hidden=16)})]


def _method_id(m) -> str:
    return "-".join(map(str, [m[0], *(v for v in m[1].values() if not isinstance(v, dict))]))


@pytest.mark.parametrize("method", STATIC_METHODS, ids=_method_id)
def test_static_step_equals_transformers_step(tiny, prompt_ids, method, monkeypatch):
    """The step exactly as a CUDA graph replays it (selection regions sized to the cache, the step's own region
    masked from the device lengths, write slots from the device) decodes as the transformers call does. The prompt
    is shorter than the budget at first for none of these; a generation longer than the cache's slack would not
    change the regions: they span every slot."""
    ref, got = _both(tiny, prompt_ids, method, 6, monkeypatch, mode="static")
    assert got.tokens == ref.tokens
    for a, b in zip(got.logits, ref.logits):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert got.stats.pop("decode_path") == "static"
    ref.stats.pop("decode_path")
    assert got.stats == pytest.approx(ref.stats)


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
@pytest.mark.parametrize("method", [("oracle", {"budget": 12}), ("quest", {"budget": 24, "page_size": 4}),
                                    ("adamas", {"budget": 12}), ("streaming", {"budget": 12})],
                         ids=lambda m: m[0])
def test_static_step_honours_sliding_windows(family, method, monkeypatch):
    """With a sliding window the region a graph covers starts before the window: the mask keeps each step's
    choice inside it."""
    from test_families import build

    lm = build(family)
    ids = torch.randint(0, 256, (1, 100), generator=torch.Generator().manual_seed(9))
    ref, got = _both(lm, ids, method, 5, monkeypatch, mode="static")
    assert got.tokens == ref.tokens
    for a, b in zip(got.logits, ref.logits):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="an interpreter test: on a GPU the graph tests cover it")
@pytest.mark.parametrize("method", [("adamas", {"budget": 24}), ("lsh", {"budget": 24}),
                                    ("spotlight", {"budget": 24, "hashes": untrained_hashes(2, 2, 20, hidden=32)}),
                                    ("quest", {"budget": 40, "page_size": 8})], ids=lambda m: m[0])
def test_static_step_through_the_kernels(tiny, prompt_ids, method, monkeypatch):
    """The Triton path of a replayed step (per-row write slots into the code buffer or the page bounds, each row's
    region applied inside the distance or page-score kernel), under the interpreter on the CPU, against the eager
    transformers call on the same kernels."""
    monkeypatch.setenv("SPARSEKV_KERNELS", "1")
    ref, got = _both(tiny, prompt_ids[:, :72], method, 3, monkeypatch, mode="static")
    assert got.tokens == ref.tokens
    for a, b in zip(got.logits, ref.logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def _tiny_qwen3() -> LoadedModel:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tok = byte_tokenizer()
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                      use_sliding_window=False, tie_word_embeddings=True)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(cfg).eval()
    return LoadedModel(model, tok, "tiny-qwen3", "in-memory")


def test_split_step_handles_qwen3_qk_norm(prompt_ids, monkeypatch):
    from sparsekv.attention import NAME

    lm = _tiny_qwen3()
    lm.model.set_attn_implementation(NAME)
    assert split_supported(lm) is None
    ref, got = _both(lm, prompt_ids, ("oracle", {"budget": 16}), 4, monkeypatch)
    assert got.tokens == ref.tokens
    for a, b in zip(got.logits, ref.logits):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_other_architectures_keep_the_transformers_step(tiny):
    from transformers import GPT2Config, GPT2LMHeadModel

    lm = LoadedModel(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=300)), byte_tokenizer(),
                     "tiny-gpt2", "in-memory")
    assert "not 'gpt2'" in split_supported(lm)
    cache = decode.make_cache(tiny, get_method("dense"), 8)
    with pytest.raises(SparseKVError, match="cannot run this model"):
        make_step(lm, cache, mode="split")
    lm.model.config.model_type = "llama"  # a Llama name is not enough: the module layout is checked too
    assert "module layout" in split_supported(lm)
    with pytest.raises(SparseKVError, match="unknown decode-step mode"):
        make_step(tiny, cache, mode="fast")
    if not torch.cuda.is_available():
        with pytest.raises(SparseKVError, match="CUDA"):
            make_step(tiny, cache, mode="graph")


GPU_METHODS = [("dense", {}), ("oracle", {"budget": 8}), ("quest", {"budget": 32}), ("lsh", {"budget": 24}),
               ("spotlight", {"budget": 24, "hashes": untrained_hashes(2, 2, 20, hidden=32)}),
               ("saap", {"budget": 64, "sink": 1, "window": 8, "probes": 3,
                         "index": random_index(2, 2, 20, clusters=8, hidden=16)})]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("method", GPU_METHODS, ids=lambda m: m[0])
def test_graph_step_equals_transformers_step_on_gpu(method, monkeypatch):
    from sparsekv.models import tiny_random

    lm = tiny_random(dtype=torch.float16)
    lm.model.cuda()
    ids = torch.randint(0, 256, (1, 300), generator=torch.Generator().manual_seed(1)).cuda()
    ref, got = _both(lm, ids, method, 10, monkeypatch, mode="graph")
    assert got.tokens == ref.tokens
    for a, b in zip(got.logits, ref.logits):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
    again = generate(lm, ids, get_method(method[0], **method[1]), 10, stop_on_eos=False)  # graphs reused
    assert again.tokens == ref.tokens


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("method", GPU_METHODS + [("adamas", {"budget": 24}), ("streaming", {"budget": 16}),
                                    ("lsh", {"budget": 24, "pooling": "group", "head_top": 2})],
                         ids=lambda m: m[0] + ("_head_top" if m[1].get("head_top") else ""))
def test_a_longer_generation_compiles_nothing_new_on_gpu(method, monkeypatch):
    """Triton specialises integer arguments on divisibility by 16: a generation whose capacity puts a kernel's
    sizes in another class than the last one's (capacity 304, then 512: Quest's pages were 19, then 32) must reuse
    every compiled kernel, or its first step pays the compiles (~0.5 s at 32768 tokens)."""
    import triton

    from sparsekv.models import tiny_random

    knobs = getattr(triton, "knobs", None)
    if knobs is None or not hasattr(knobs.runtime, "jit_cache_hook"):
        pytest.skip("this Triton has no compile hook")
    lm = tiny_random(dtype=torch.float16)
    lm.model.cuda()
    ids = torch.randint(0, 256, (1, 300), generator=torch.Generator().manual_seed(1)).cuda()
    name, options = method
    generate(lm, ids, get_method(name, **options), 4, stop_on_eos=False)  # capacity 304
    compiled = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda *a, **kw: compiled.append(kw.get("repr")))
    generate(lm, ids, get_method(name, **options), 212, stop_on_eos=False)  # capacity 512
    assert compiled == [], "\n".join(compiled)


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_split_step_honours_sliding_windows(family, monkeypatch):
    """Sliding-window members of the Llama family take the split (graphable) step: it reads each layer's window from
    the cache, and decodes exactly as the transformers call does."""
    from test_families import build

    lm = build(family)
    assert split_supported(lm) is None and any(p.span for p in lm.patterns)
    ids = torch.randint(0, 256, (1, 100), generator=torch.Generator().manual_seed(7))
    for method in [("dense", {}), ("oracle", {"budget": 12}), ("quest", {"budget": 24, "page_size": 4})]:
        ref, got = _both(lm, ids, method, 5, monkeypatch)
        assert got.tokens == ref.tokens
        for a, b in zip(got.logits, ref.logits):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_graph_step_honours_sliding_windows_on_gpu(family, monkeypatch):
    from test_families import build

    lm = build(family)
    lm.model.cuda()
    try:
        ids = torch.randint(0, 256, (1, 300), generator=torch.Generator().manual_seed(1)).cuda()
        for method in [("dense", {}), ("oracle", {"budget": 12}), ("adamas", {"budget": 16})]:
            ref, got = _both(lm, ids, method, 8, monkeypatch, mode="graph")
            assert got.tokens == ref.tokens
            for a, b in zip(got.logits, ref.logits):
                torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)
    finally:
        lm.model.cpu()


def test_length_dependent_rope_keeps_the_transformers_step():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=256,
                      rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    lm = LoadedModel(LlamaForCausalLM(cfg), byte_tokenizer(), "tiny-dynamic-rope", "in-memory")
    assert "recomputes its tables" in split_supported(lm)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU memory")
def test_generation_from_a_shared_prefill_adds_no_kv_copy_on_gpu():
    """Peak memory of a generation from a prefill with room: its method state and the step's temporaries, not a
    second copy of the prompt's K/V."""
    import dataclasses

    from sparsekv.bench.e2e import random_model
    from sparsekv.bench.shapes import SHAPES
    from sparsekv.decode import prefill

    lm = random_model(dataclasses.replace(SHAPES["llama3-8b"], layers=2), torch.bfloat16, torch.device("cuda"))
    ids = torch.randint(3, 250, (1, 65536), generator=torch.Generator().manual_seed(0))
    pf = prefill(lm, ids, room=16)
    kv = sum(k.numel() * k.element_size() * 2 for k in pf.key_buffers)
    for name, opts in [("dense", {}), ("oracle", {"budget": 2048})]:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        generate(lm, None, get_method(name, **opts), 16, stop_on_eos=False, prefilled=pf)
        grew = torch.cuda.max_memory_allocated() - before
        assert grew < kv / 2, (name, grew, kv)
        torch._C._cuda_clearCublasWorkspaces()  # cuBLAS keeps a workspace per new stream (the graph's): not a cache
        assert torch.cuda.memory_allocated() - before < 64 << 20  # the generation's cache is freed when it ends


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU memory")
def test_chunked_prefill_memory_is_bounded_on_gpu():
    """A 131072-token prompt prefilled in chunks of 8192 through the causal prefill kernel (no n x L mask): peak
    memory grows by the K/V cache plus a few chunk-sized activations; in fp32 the result equals the whole prefill's
    (SDPA, whose fp32 GQA path materialises the logits: 8192 tokens keep them small) at 8192 tokens."""
    import dataclasses

    from sparsekv.bench.e2e import random_model
    from sparsekv.bench.shapes import SHAPES
    from sparsekv.decode import prefill

    shape = dataclasses.replace(SHAPES["llama3-8b"], layers=2)
    lm = random_model(shape, torch.bfloat16, torch.device("cuda"))
    ids = torch.randint(3, 250, (1, 131072), generator=torch.Generator().manual_seed(0))
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    pf = prefill(lm, ids, prefill_chunk=8192)
    kv = sum(k.numel() * k.element_size() * 2 for k in pf.key_buffers)
    chunk_acts = 8 * 8192 * (shape.hidden + 2 * shape.intermediate) * 2
    assert torch.cuda.max_memory_allocated() - before < kv + chunk_acts, (torch.cuda.max_memory_allocated(), kv)
    del pf, lm
    lm = random_model(shape, torch.float32, torch.device("cuda"))
    short = ids[:, :8192]
    whole, parts = prefill(lm, short), prefill(lm, short, prefill_chunk=2048)
    torch.testing.assert_close(parts.logits, whole.logits, atol=2e-3, rtol=2e-3)
    for a, b in zip(parts.keys, whole.keys):
        torch.testing.assert_close(a, b, atol=2e-3, rtol=2e-3)
