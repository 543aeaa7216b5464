"""The kernels a decode step launches compile for a CUDA GPU (sm_90), checked on a machine without one.

Every method decodes a few tokens of the tiny model on the kernel path under the interpreter (the replayed step's
device-side paths included), a prompt is prefilled in chunks, and the counting select runs with several chunks (the
path of long rows); each distinct launch is then compiled for sm_90 (tests/cuda_compile.py). The interpreter
accepts code the CUDA compiler refuses; this catches that class of error where CI has no GPU.
"""

import functools

import pytest
import torch

import sparsekv.decode as decode
from sparsekv.decode import generate, prefill
from sparsekv.kernels.codes import code_topk
from sparsekv.kernels.count_select import smallest_k
from sparsekv.methods import get_method
from sparsekv.methods.spotlight import untrained_hashes
from sparsekv.saap.model import random_index
from sparsekv.step import make_step

from cuda_compile import can_compile, compile_for_cuda, recording

METHODS = [("dense", {}), ("oracle", {"budget": 24}), ("streaming", {"budget": 16}),
           ("quest", {"budget": 40, "page_size": 8, "sink": 2, "window": 5}), ("lsh", {"budget": 24, "head_top": 2}),
           ("adamas", {"budget": 24}), ("adamas", {"budget": 24, "distance": "ip", "rerank": 2}),
           ("spotlight", {"budget": 24, "hashes": untrained_hashes(2, 2, 20, hidden=32, nbits=48)}),
           ("saap", {"budget": 40, "sink": 1, "window": 8, "probes": 3,
                     "index": random_index(2, 2, 20, clusters=8, hidden=16)})]

# kernels a GPU decode step of these methods launches; the test fails if the workload stops reaching one
EXPECTED = {"_code_distance_kernel", "_force_head_top_kernel", "_base_kernel", "_window_kernel", "_emit_kernel",
            "_row_kernel", "_prefill_kernel"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU every launch compiles for it")
@pytest.mark.skipif(not can_compile(), reason="this Triton has no NVIDIA backend with ptxas")
def test_decode_kernels_compile_for_cuda(tiny, prompt_ids, monkeypatch):
    monkeypatch.setenv("SPARSEKV_KERNELS", "1")
    g = torch.Generator().manual_seed(0)
    specs: dict = {}
    with recording(specs):
        prefill(tiny, prompt_ids[:, :72], prefill_chunk=24)
        monkeypatch.setattr(decode, "make_step", functools.partial(make_step, mode="static"))
        for name, options in METHODS:
            generate(tiny, prompt_ids[:, :72], get_method(name, **options), 2, stop_on_eos=False)
        # rows of several chunks (long contexts): the select's three launches, the forcing step in the first
        qw = torch.randint(-32768, 32767, (1, 4, 8), generator=g, dtype=torch.int32).to(torch.int16)
        kw = torch.randint(-32768, 32767, (1, 1, 500, 8), generator=g, dtype=torch.int32).to(torch.int16)
        code_topk(qw, kw, 500, 128, 60, 1, pool="sum", head_top=3, ties="high", _chunk=128)
        smallest_k(torch.randint(0, 300, (2, 700), generator=g, dtype=torch.int32).to(torch.int16), 50, 300,
                   _chunk=128)
    launched = {s["name"] for s in specs.values()}
    assert EXPECTED <= launched, f"the workload no longer launches {sorted(EXPECTED - launched)}"
    errors = compile_for_cuda(specs.values())
    assert not errors, "\n".join(errors)
