"""The attention function transformers calls for `attn_implementation="sparsekv"`, and its mask function: a decode
step goes to the method's selection, a prefill is dense, and a mask is built only where padding needs one."""

import types

import pytest
import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from sparsekv import ops
from sparsekv.attention import NAME, causal_mask, register, sparsekv_attention
from sparsekv.cache import SparseCache, active_cache
from sparsekv.methods import get_method

HKV, HQ, D, N = 2, 6, 8, 40


@pytest.fixture(autouse=True)
def _no_cache_left_active():
    """A cache left active would be taken by a later test's attention calls that pass none."""
    yield
    cache = active_cache()
    if cache is not None:
        cache.release()


def _cache(method, n: int = N) -> SparseCache:
    """A one-layer cache holding n random keys (an `update` also makes it the active cache)."""
    g = torch.Generator().manual_seed(0)
    cache = SparseCache(method, 1, HQ, 64)
    cache.update(torch.randn(1, HKV, n, D, generator=g), torch.randn(1, HKV, n, D, generator=g), 0)
    return cache


def _call(q, cache):
    layer = types.SimpleNamespace(layer_idx=0)
    st = cache.layer_state(0)
    return sparsekv_attention(layer, q, st.keys[:, :, : st.length], st.values[:, :, : st.length], None)[0]


def test_registered_under_its_name():
    assert register() == NAME
    assert AttentionInterface()[NAME] is sparsekv_attention and AttentionMaskInterface()[NAME] is causal_mask


def test_a_decode_step_reads_what_the_method_selects():
    method = get_method("oracle", budget=12, sink=2, window=4)
    cache = _cache(method)
    q = torch.randn(1, HQ, 1, D, generator=torch.Generator().manual_seed(1))
    out = _call(q, cache)  # [B, 1, Hq, D]
    st = cache.layer_state(0)
    want = ops.sparse_decode(q, st.keys, st.values, method.select(st, q, None), D**-0.5)
    torch.testing.assert_close(out, want.transpose(1, 2))
    assert cache.stats.steps == 1 and cache.stats.sink == 2 and cache.stats.window == 4
    dense = F.scaled_dot_product_attention(q, st.keys[:, :, :N], st.values[:, :, :N], enable_gqa=True)
    assert not torch.allclose(out, dense.transpose(1, 2), atol=1e-4)  # 12 of 40 keys: not the dense answer


def test_the_dense_method_reads_every_key_and_counts_no_sparse_step():
    cache = _cache(get_method("dense"))
    q = torch.randn(1, HQ, 1, D, generator=torch.Generator().manual_seed(2))
    st = cache.layer_state(0)
    dense = F.scaled_dot_product_attention(q, st.keys[:, :, :N], st.values[:, :, :N], enable_gqa=True)
    torch.testing.assert_close(_call(q, cache), dense.transpose(1, 2), atol=1e-5, rtol=1e-5)
    assert cache.stats.steps == 0


def test_prefill_is_dense_and_causal_whatever_the_method():
    cache = _cache(get_method("oracle", budget=4))
    q = torch.randn(1, HQ, N, D, generator=torch.Generator().manual_seed(3))
    st = cache.layer_state(0)
    want = F.scaled_dot_product_attention(q, st.keys[:, :, :N], st.values[:, :, :N], is_causal=True, enable_gqa=True)
    torch.testing.assert_close(_call(q, cache), want.transpose(1, 2), atol=1e-5, rtol=1e-5)
    assert cache.stats.steps == 0  # the method selects at decode steps only


@pytest.mark.parametrize("padding", [None, torch.ones(2, 5, dtype=torch.bool)])
def test_no_mask_without_padding(padding):
    assert causal_mask(batch_size=2, q_length=5, kv_length=5, attention_mask=padding) is None


def test_padding_gets_the_sdpa_mask():
    padding = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)
    mask = causal_mask(batch_size=2, q_length=5, kv_length=5, attention_mask=padding)
    assert mask.shape == (2, 1, 5, 5) and mask.dtype == torch.bool
    assert not mask[0, 0, :, 0].any() and mask[1, 0, 4].all()  # the padded key is never read; causality holds
    assert not mask[1, 0, 0, 1:].any()


def test_kernels_on_the_cpu_need_the_interpreter(monkeypatch):
    """Triton has no CPU backend: asking for the kernels on a CPU without TRITON_INTERPRET=1 is one clear error, not a
    launch failure about drivers; the references and the interpreter stay available."""
    from sparsekv.errors import SparseKVError

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("SPARSEKV_KERNELS", "1")
    with pytest.raises(SparseKVError, match="TRITON_INTERPRET=1"):
        ops.use_kernels("cpu")
    monkeypatch.delenv("SPARSEKV_KERNELS")
    with ops.kernels(True), pytest.raises(SparseKVError, match="SPARSEKV_KERNELS=0"):
        ops.use_kernels(torch.device("cpu"))
    assert not ops.use_kernels("cpu")
    with ops.kernels(False):
        assert not ops.use_kernels("cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with ops.kernels(True):
        assert ops.use_kernels("cpu")
