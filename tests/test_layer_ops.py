"""The fused elementwise ops of a decode step's layer (kernels/layer_ops.py) against their torch references, under
TRITON_INTERPRET=1 on the CPU (fp32, fp16) and on the GPU (bf16 too)."""

import pytest
import torch

from sparsekv.kernels import layer_ops as k
from sparsekv.kernels import reference as ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEV == "cuda" else [])


def _r(*shape, dtype, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEV, dtype)


def _close(a, b, dtype):
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [64, 96, 576])
def test_rms_norm(dtype, n):
    x, r, w = _r(1, 1, n, dtype=dtype), _r(1, 1, n, dtype=dtype, seed=1), _r(n, dtype=dtype, seed=2)
    for residual in (None, r):
        y, h = k.rms_norm(x, w, 1e-5, residual)
        y_ref, h_ref = ref.rms_norm_reference(x, w, 1e-5, residual)
        _close(h, h_ref, dtype)
        _close(y, y_ref, dtype)
    rows = _r(2, 3, 16, dtype=dtype, seed=3)  # per-head norms (qwen3's q/k norm): many rows
    _close(k.rms_norm(rows, w[:16], 1e-6)[0], ref.rms_norm_reference(rows, w[:16], 1e-6)[0], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D,R", [(64, 64), (128, 128), (96, 48), (20, 20)])
def test_rope(dtype, D, R):
    q = _r(2, 1, 6, D, dtype=dtype).transpose(1, 2)  # [B, H, 1, D] as the step makes it: a transposed view
    ang = _r(2, 1, R // 2, dtype=torch.float32, seed=4)
    cos = torch.cat((ang.cos(), ang.cos()), -1).to(dtype)
    sin = torch.cat((ang.sin(), ang.sin()), -1).to(dtype)
    _close(k.rope(q, cos, sin), ref.rope_reference(q, cos, sin), dtype)
    if R == D:  # the same rotation transformers applies
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        theirs, _ = apply_rotary_pos_emb(q.float(), q.float(), cos.float(), sin.float())
        _close(k.rope(q, cos, sin), theirs, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype):
    g, u = _r(1, 1, 3000, dtype=dtype), _r(1, 1, 3000, dtype=dtype, seed=1)
    _close(k.silu_mul(g, u), ref.silu_mul_reference(g, u), dtype)
    joined = _r(3, 1, 2 * 1100, dtype=dtype, seed=2)  # a batch's joined gate/up product: strided halves, no copy
    g, u = joined.chunk(2, dim=-1)
    assert not g.is_contiguous()
    out = k.silu_mul(g, u)
    assert out.shape == (3, 1, 1100) and out.is_contiguous()
    _close(out, ref.silu_mul_reference(g, u), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv(dtype):
    keys, values = _r(2, 3, 40, 16, dtype=dtype), _r(2, 3, 40, 16, dtype=dtype, seed=1)
    kk, vv = _r(2, 1, 3, 16, dtype=dtype, seed=2).transpose(1, 2), _r(2, 3, 1, 16, dtype=dtype, seed=3)
    slot = torch.tensor([7, 39], dtype=torch.int32, device=DEV)
    a, b = keys.clone(), values.clone()
    k.write_kv(a, b, slot, kk, vv)
    ref.write_kv_reference(keys, values, slot, kk, vv)
    assert torch.equal(a, keys) and torch.equal(b, values)
    assert torch.equal(a[1, :, 39], kk[1, :, 0]) and torch.equal(b[0, :, 7], vv[0, :, 0])
    with pytest.raises(ValueError, match="one token per row"):
        k.write_kv(a, b, slot[:1], kk, vv)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D,R", [(16, 16), (20, 10)])
def test_rope_write_kv(dtype, D, R):
    """RoPE of q and k and the K/V write in one launch = rope of each + write_kv: the rotated k lands at each row's
    slot (partial rotary: the dims past R pass through), the other slots keep their values."""
    q = _r(2, 1, 6, D, dtype=dtype).transpose(1, 2)  # [B, Hq, 1, D] transposed views, as the step makes them
    kk, vv = _r(2, 1, 3, D, dtype=dtype, seed=1).transpose(1, 2), _r(2, 3, 1, D + 4, dtype=dtype, seed=2)
    ang = _r(2, 1, R // 2, dtype=torch.float32, seed=4)
    cos, sin = torch.cat((ang.cos(), ang.cos()), -1).to(dtype), torch.cat((ang.sin(), ang.sin()), -1).to(dtype)
    keys, values = _r(2, 3, 40, D, dtype=dtype, seed=5), _r(2, 3, 40, D + 4, dtype=dtype, seed=6)
    slot = torch.tensor([7, 39], dtype=torch.int32, device=DEV)
    a, b = keys.clone(), values.clone()
    q_rot, k_rot = k.rope_write_kv(q, kk, vv, cos, sin, a, b, slot)
    q_ref, k_ref = ref.rope_write_kv_reference(q, kk, vv, cos, sin, keys, values, slot)
    _close(q_rot, q_ref, dtype)
    _close(k_rot, k_ref, dtype)
    _close(a, keys, dtype)
    assert torch.equal(b, values) and torch.equal(a[1, :, 39], k_rot[1, :, 0])
    assert not torch.equal(k_rot, kk)
