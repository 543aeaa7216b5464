"""The Triton radix top-k against its torch reference: exact index sets, ties to the lower index, ascending order.

Small shapes under TRITON_INTERPRET=1 on the CPU (bf16 too: the kernel reads scores as integer bits), and the real
shapes (32 x 131072, k 2048 / 8192) on the GPU when one is present.
"""

import pytest
import torch

from sparsekv.kernels.reference import topk_reference
from sparsekv.kernels.topk import topk

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _check(x, k):
    out = topk(x, k)
    ref = topk_reference(x.cpu(), k)
    assert out.dtype == torch.int64 and out.shape == ref.shape
    assert torch.equal(out.cpu(), ref)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("R,N,k", [(3, 1000, 17), (2, 4999, 500), (4, 333, 1)])
def test_random(dtype, R, N, k):
    x = torch.randn(R, N, generator=_gen(R * N + k)).to(dtype)
    _check(x.to(DEV), k)


@pytest.mark.parametrize("dtype", DTYPES)
def test_many_ties(dtype):
    x = torch.randint(-2, 3, (3, 2001), generator=_gen(1)).to(dtype)  # five distinct values
    for k in (1, 250, 1000, 2001):
        _check(x.to(DEV), k)


def test_all_equal_and_k_equals_n():
    x = torch.full((2, 777), 0.5)
    _check(x.to(DEV), 300)
    _check(x.to(DEV), 777)
    _check(torch.randn(1, 1).to(DEV), 1)  # N = 1


def test_low_bits_decide():
    """Keys that share their high 22 bits: every digit pass (and the last one's ties) matters."""
    g = _gen(2)
    base = torch.tensor(1.5).view(torch.int32)
    bits = base + torch.randint(0, 600, (3, 3001), generator=g, dtype=torch.int32)
    x = bits.view(torch.float32)
    x[1] = -x[1]
    _check(x.to(DEV), 123)
    _check(x.to(DEV), 2999)


@pytest.mark.parametrize("dtype", DTYPES)
def test_inf_nan_signed_zero(dtype):
    x = torch.randn(2, 1501, generator=_gen(3))
    x[:, ::3] = float("-inf")
    x[0, 7] = x[0, 900] = float("inf")
    x[1, 10] = x[1, 20] = float("nan")  # ranks above +inf, as in torch.topk
    x[0, 100:110] = 0.0
    x[0, 50:60] = -0.0  # ties with +0.0
    x = x.to(dtype)
    _check(x.to(DEV), 3)
    _check(x.to(DEV), 1200)  # reaches into the -inf entries


def test_batched_shape_out_and_reuse():
    x = torch.randn(2, 3, 1200, generator=_gen(4)).to(DEV)
    out = torch.empty(2, 3, 64, dtype=torch.int64, device=DEV)
    assert topk(x, 64, out=out) is out
    assert torch.equal(out.cpu(), topk_reference(x.cpu(), 64))
    # the same cached scratch again, with another k: the previous call left it clean
    assert torch.equal(topk(x, 5).cpu(), topk_reference(x.cpu(), 5))
    assert topk(x, 0).shape == (2, 3, 0)


def test_bad_arguments():
    x = torch.randn(2, 10, device=DEV)
    with pytest.raises(ValueError, match="row length"):
        topk(x, 11)
    with pytest.raises(ValueError, match="row length"):
        topk_reference(x, 11)
    with pytest.raises(ValueError, match="float32"):
        topk(x.double(), 2)


@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [2048, 8192])
def test_gpu_real_shapes(dtype, k):
    g = torch.Generator(device="cuda").manual_seed(k)
    x = torch.randn(32, 131072, device="cuda", generator=g).to(dtype)
    _check(x, k)
    ties = torch.randint(0, 50, (32, 131072), device="cuda", generator=g).to(dtype)
    _check(ties, k)
    narrow = (5 + 0.3 * torch.randn(32, 131072, device="cuda", generator=g)).to(dtype)  # one octave: fine bound
    _check(narrow, k)
    # the selected scores agree with torch.topk's (its ties may pick other indices)
    vals = x.gather(1, topk(x, k)).float().sort(1).values
    assert torch.equal(vals, torch.topk(x, k).values.float().sort(1).values)


@pytest.mark.skipif(not CUDA, reason="needs a GPU")
def test_gpu_constant_rows_and_small_shapes():
    _check(torch.full((4, 131072), 3.0, device="cuda"), 2048)
    for n, k in [(1, 1), (7, 7), (4097, 1), (5000, 4999)]:
        _check(torch.randn(3, n, device="cuda"), k)


@pytest.mark.skipif(not CUDA, reason="needs a GPU")
def test_gpu_cuda_graph():
    x = torch.randn(8, 131072, device="cuda")
    out = torch.empty(8, 2048, dtype=torch.int64, device="cuda")
    topk(x, 2048, out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        topk(x, 2048, out=out)
    for seed in range(3):
        x.copy_(torch.randn(8, 131072, device="cuda", generator=torch.Generator("cuda").manual_seed(seed)))
        graph.replay()
        assert torch.equal(out, topk_reference(x, 2048))
