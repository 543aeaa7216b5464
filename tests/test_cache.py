"""SparseCache: preallocated K/V written in place, the method's index beside them, decode steps at device slots,
rows of a batch loaded from one-row caches, buffers released on demand, the regime a captured step holds fixed."""

import pytest
import torch

import sparsekv.decode as decode
from sparsekv.cache import SparseCache, active_cache
from sparsekv.errors import SparseKVError
from sparsekv.methods import get_method
from sparsekv.models import cache_kwarg

L, HKV, HQ, D, MAX = 2, 2, 6, 8, 32


@pytest.fixture(autouse=True)
def _no_cache_left_active():
    """A cache left active would be taken by a later test's attention calls that pass none."""
    yield
    cache = active_cache()
    if cache is not None:
        cache.release()


def _kv(b: int, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, HKV, n, D, generator=g), torch.randn(b, HKV, n, D, generator=g)


def _filled(method, b: int = 1, n: int = 10, seed: int = 0) -> SparseCache:
    cache = SparseCache(method, L, HQ, MAX)
    for layer in range(L):
        cache.update(*_kv(b, n, seed + layer), layer)
    return cache


def test_update_writes_in_place_and_indexes():
    cache = SparseCache(get_method("quest", budget=16, page_size=4), L, HQ, MAX)
    k, v = _kv(1, 10)
    keys, values = cache.update(k, v, 0)
    buf = cache.layers[0].keys
    assert buf.shape == (1, HKV, MAX, D) and keys.shape == (1, HKV, 10, D)  # whole run's slots, valid view returned
    assert torch.equal(keys, k) and torch.equal(values, v) and active_cache() is cache
    k2, v2 = _kv(1, 3, seed=1)
    keys, _ = cache.update(k2, v2, 0)
    assert cache.layers[0].keys.data_ptr() == buf.data_ptr()  # no reallocation, no torch.cat
    assert torch.equal(keys[:, :, 10:], k2) and cache.layer_state(0).length == 13
    assert cache.lengths.tolist() == [13] and cache.get_seq_length(0) == 13
    bounds = cache.layer_state(0).bounds  # quest's page maxima: the index follows the keys as they arrive
    torch.testing.assert_close(bounds[0, :, 0, :D], torch.cat([k, k2], 2)[0, :, :4].amax(1))


def test_a_decode_step_writes_at_the_device_slot():
    cache = _filled(get_method("oracle", budget=8))
    cache.begin_step(10)
    assert cache.lengths.tolist() == [11] and cache.slots.tolist() == [10]
    k, v = _kv(1, 1, seed=3)
    cache.update(k, v, 0)
    assert torch.equal(cache.layers[0].keys[:, :, 10], k[:, :, 0]) and cache.layer_state(0).length == 11
    with pytest.raises(SparseKVError, match="cache is full"):
        cache.begin_step(MAX)


def test_load_row_takes_one_row_caches_as_rows_of_a_batch():
    method = get_method("quest", budget=16, page_size=4)
    short, long = _filled(method, n=6, seed=0), _filled(method, n=11, seed=5)
    batch = SparseCache(method, L, HQ, MAX)
    batch.load_row(0, 2, short)
    batch.load_row(1, 2, long)
    assert batch.lengths.tolist() == [6, 11] and batch.slots.tolist() == [5, 10] and batch.extent == MAX
    for layer in range(L):
        st = batch.layer_state(layer)
        assert st.length == 11 and st.keys.shape[0] == 2
        assert torch.equal(st.keys[0, :, :6], short.layers[layer].keys[0, :, :6])
        assert torch.equal(st.keys[1, :, :11], long.layers[layer].keys[0, :, :11])
        assert torch.equal(st.bounds[1], long.layer_state(layer).bounds[0])  # the method's per-row index comes along
    with pytest.raises(SparseKVError, match="batches of 2 or more rows"):
        batch.load_row(0, 1, short)


def test_release_frees_the_buffers_now():
    cache = _filled(get_method("oracle", budget=8))
    assert active_cache() is cache
    cache.release()
    assert all(layer.keys is None and layer.state is None for layer in cache.layers)
    assert cache.lengths is None and active_cache() is None  # no pointer keeps the buffers alive


def test_cache_overflow_and_bad_dense_layer_are_clear_errors(tiny, prompt_ids):
    with pytest.raises(SparseKVError, match="out of range"):
        SparseCache(get_method("dense"), tiny.num_layers, tiny.q_heads, 10, dense_layers=(5,))
    cache = SparseCache(get_method("dense"), tiny.num_layers, tiny.q_heads, 10)
    with pytest.raises(SparseKVError, match="cache is full"):
        tiny.model(input_ids=prompt_ids[:, :20], **cache_kwarg(tiny.model, cache))


def test_regime_changes_once_the_context_outgrows_the_budget(tiny, prompt_ids):
    """What a captured step holds fixed: per layer that runs the method, whether its budget is below what it sees."""
    cache = decode.make_cache(tiny, get_method("oracle", budget=210), 220, dense_layers=(1,))
    decode._load_prefill(cache, decode.prefill(tiny, prompt_ids))  # 200 keys
    assert cache.regime() == (False,)  # one layer runs the method; 200 keys fit the budget
    cache.begin_step(209)
    assert cache.regime() == (False,)  # 210 keys: still every one
    cache.begin_step(210)
    assert cache.regime() == (True,)
    dense = decode.make_cache(tiny, get_method("dense"), 220)
    decode._load_prefill(dense, decode.prefill(tiny, prompt_ids))
    assert dense.regime() == ()
