"""Chunked causal prefill (kernels/prefill_attention.py) against its torch reference, and the reference against
torch's scaled_dot_product_attention with an explicit mask: under TRITON_INTERPRET=1 on the CPU (small shapes,
fp32/fp16: the interpreter cannot do bf16) and, when a GPU is present, bf16 and D 256 too.

Small blocks (16 x 16) make tiny shapes cross every tile range the kernel splits a query block's keys into: the
window's start, the unmasked band and the causal diagonal."""

import pytest
import torch
import torch.nn.functional as F

from sparsekv.kernels.prefill_attention import prefill_attention
from sparsekv.kernels.reference import prefill_attention_reference

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
SMALL = {"block_m": 16, "block_n": 16}


def _data(B, Hq, Hkv, n, L, D, dtype, seed=0, extra=7):
    """q [B, Hq, n, D] and keys/values: the first L positions of a longer cache buffer (non-contiguous views)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, n, D, generator=g)
    kb = torch.randn(B, Hkv, L + extra, D, generator=g)
    vb = torch.randn(B, Hkv, L + extra, D, generator=g)
    q, kb, vb = (t.to(DEV, dtype) for t in (q, kb, vb))
    return q, kb[:, :, :L], vb[:, :, :L]


def _close(out, ref, dtype):
    tol = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    assert out.shape == ref.shape and out.dtype == ref.dtype and not out.isnan().any()
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def _masked_attention(q, keys, values, scale, span=0, softcap=None):
    """The whole n x L problem at once, materialised mask: the reference's own check (small shapes only)."""
    n, L = q.shape[2], keys.shape[2]
    G = q.shape[1] // keys.shape[1]
    k, v = (t.float().repeat_interleave(G, dim=1) for t in (keys, values))
    p = torch.arange(L - n, L).view(-1, 1)
    j = torch.arange(L).view(1, -1)
    mask = (j <= p) & ((j > p - span) if span else True)
    if softcap is None:
        return F.scaled_dot_product_attention(q.float(), k, v, attn_mask=mask.to(q.device), scale=scale)
    s = softcap * torch.tanh(q.float() @ k.transpose(-1, -2) * scale / softcap)
    return torch.softmax(s.masked_fill(~mask.to(q.device), float("-inf")), -1) @ v


CASES = [  # B, Hq, Hkv, n, L, D, span, softcap
    (1, 2, 2, 37, 37, 64, 0, None),  # plain causal prefill, MHA
    (1, 4, 2, 37, 101, 64, 0, None),  # a later chunk (offset), GQA 2
    (2, 4, 1, 37, 101, 64, 20, None),  # sliding window shorter than the chunk, GQA 4, batch 2
    (1, 4, 2, 37, 101, 64, 50, None),  # window longer than the chunk: all three tile ranges per block
    (1, 4, 1, 40, 40, 64, 0, 30.0),  # softcap
    (1, 2, 1, 21, 90, 128, 33, 20.0),  # D 128, window and softcap together
    (1, 4, 2, 37, 101, 20, 0, None),  # D 20 (tiny test models): padded to 32 lanes
    (1, 4, 1, 30, 70, 96, 25, None),  # D 96 (Phi-3-mini): padded to 128, with a window
    (1, 2, 2, 9, 9, 8, 0, 10.0),  # D 8: below tl.dot's smallest inner size, padded to 16
]


@pytest.mark.parametrize("B,Hq,Hkv,n,L,D,span,softcap", CASES)
def test_reference_matches_masked_sdpa(B, Hq, Hkv, n, L, D, span, softcap):
    q, k, v = _data(B, Hq, Hkv, n, L, D, torch.float32)
    ref = prefill_attention_reference(q, k, v, D**-0.5, span, softcap)
    torch.testing.assert_close(ref, _masked_attention(q, k, v, D**-0.5, span, softcap), atol=1e-5, rtol=1e-5)


def test_reference_row_blocks():
    """Rows split in blocks when B * Hq * L is large (here 838 rows a block): the same rows as chunks of one block."""
    q, k, v = _data(1, 2, 1, 900, 40000, 16, torch.float32)
    whole = prefill_attention_reference(q, k, v, 0.25, span=3000)
    L0 = 40000 - 900
    for r0 in range(0, 900, 300):
        part = prefill_attention_reference(q[:, :, r0:r0 + 300], k[:, :, :L0 + r0 + 300], v[:, :, :L0 + r0 + 300],
                                           0.25, span=3000)
        torch.testing.assert_close(whole[:, :, r0:r0 + 300], part, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("B,Hq,Hkv,n,L,D,span,softcap", CASES)
def test_kernel_matches_reference(B, Hq, Hkv, n, L, D, span, softcap, dtype):
    q, k, v = _data(B, Hq, Hkv, n, L, D, dtype, seed=n + L)
    out = prefill_attention(q, k, v, D**-0.5, span, softcap, **SMALL)
    _close(out, prefill_attention_reference(q, k, v, D**-0.5, span, softcap), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("D,n,L,span", [(64, 37, 101, 0), (64, 130, 130, 0), (128, 70, 150, 40)])
def test_default_blocks(dtype, D, n, L, span):
    q, k, v = _data(1, 2, 1, n, L, D, dtype, seed=D)
    _close(prefill_attention(q, k, v, D**-0.5, span), prefill_attention_reference(q, k, v, D**-0.5, span), dtype)


def test_chunks_compose_to_full_prefill():
    """Prefilling 96 tokens in chunks of 32 over the growing cache gives the rows of one whole prefill."""
    q, k, v = _data(1, 4, 2, 96, 96, 64, torch.float32, seed=3)
    full = prefill_attention(q, k, v, 0.125, span=40, **SMALL)
    for c0 in range(0, 96, 32):
        part = prefill_attention(q[:, :, c0:c0 + 32], k[:, :, :c0 + 32], v[:, :, :c0 + 32], 0.125, span=40, **SMALL)
        torch.testing.assert_close(part, full[:, :, c0:c0 + 32], atol=1e-5, rtol=1e-5)


def test_strided_q_and_single_query():
    """q as a transposed view of [B, n, Hq, D] (the projection's layout), and a chunk of one query (n = 1)."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 29, 4, 32, generator=g).to(DEV).transpose(1, 2)
    _, k, v = _data(1, 4, 2, 29, 60, 32, torch.float32)
    _close(prefill_attention(q, k, v, 0.2, span=9, **SMALL), prefill_attention_reference(q, k, v, 0.2, span=9),
           torch.float32)
    q1 = q[:, :, -1:]
    _close(prefill_attention(q1, k, v, 0.2, **SMALL), prefill_attention_reference(q1, k, v, 0.2), torch.float32)


def test_rejects_bad_shapes():
    q, k, v = _data(1, 3, 2, 4, 8, 16, torch.float32)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        prefill_attention(q, k, v, 0.25)
    q, k, v = _data(1, 2, 1, 4, 8, 320, torch.float32)
    with pytest.raises(ValueError, match="head dim must be between 1 and 256"):
        prefill_attention(q, k, v, 0.25)
    q, k, v = _data(1, 2, 1, 9, 8, 16, torch.float32)
    with pytest.raises(ValueError, match="L >= n"):
        prefill_attention(q, k, v, 0.25)


@pytest.mark.skipif(not CUDA, reason="bf16 and real shapes need a GPU (the interpreter has no bf16)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [64, 96, 128, 256])
@pytest.mark.parametrize("span,softcap", [(0, None), (300, None), (0, 50.0)])
def test_cuda_default_config(dtype, D, span, softcap):
    q, k, v = _data(2, 8, 2, 517, 1500, D, dtype, seed=D)
    out = prefill_attention(q, k, v, D**-0.5, span, softcap)
    _close(out, prefill_attention_reference(q, k, v, D**-0.5, span, softcap), dtype)
