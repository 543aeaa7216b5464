"""The decode step's GEMV kernel (kernels/gemv.py) against torch's linear: fp16 under TRITON_INTERPRET=1 on the CPU,
bf16 at Llama-3-8B's shapes on a GPU."""

import pytest
import torch

from sparsekv import ops
from sparsekv.kernels import gemv
from sparsekv.kernels.reference import linear_reference

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def _r(*shape, dtype=torch.float16, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEV, dtype)


@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("N,K,bias", [(80, 96, False), (48, 300, True), (130, 64, False)])
def test_gemv_matches_linear(rows, N, K, bias):
    """Odd sizes (masked tiles), with and without a bias, 1 to 16 rows, x as a step makes it ([B, 1, K])."""
    x, w = _r(rows, 1, K, seed=rows), _r(N, K, seed=N) / K ** 0.5
    b = _r(N, seed=1) if bias else None
    got = gemv.linear(x, w, b)
    assert got.shape == (rows, 1, N) and got.dtype == x.dtype
    torch.testing.assert_close(got.float(), linear_reference(x.float(), w.float(), None if b is None else b.float()),
                               atol=2e-3, rtol=2e-3)


def test_gemv_rows_are_independent_of_the_batch():
    """A row's result is the same alone and in a batch (a sequence decodes the same in any batch)."""
    x, w = _r(5, 200, seed=3), _r(64, 200, seed=4)
    assert torch.equal(gemv.linear(x, w)[2], gemv.linear(x[2:3], w)[0])


def test_gemv_limits_and_dispatch():
    x, w = _r(17, 32), _r(8, 32)
    with pytest.raises(ValueError, match="at most 16 rows"):
        gemv.linear(x, w)
    with pytest.raises(ValueError, match="does not fit"):
        gemv.linear(x[:2, :16], w)
    with ops.kernels(True):  # 17 rows, or fp32: torch's linear
        torch.testing.assert_close(ops.linear(x, w), linear_reference(x, w))
        assert ops.linear(x[:, :8].float(), w[:, :8].float()).dtype == torch.float32


@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize("N,K", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)])
@pytest.mark.parametrize("rows", [1, 8])
def test_gpu_llama3_shapes_bf16(N, K, rows):
    x, w = _r(rows, 1, K, dtype=torch.bfloat16, seed=K), _r(N, K, dtype=torch.bfloat16, seed=N) / K ** 0.5
    torch.testing.assert_close(gemv.linear(x, w).float(), linear_reference(x.float(), w.float()), atol=2e-2,
                               rtol=2e-2)
