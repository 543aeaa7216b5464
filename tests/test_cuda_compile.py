"""The kernels a decode step launches compile for a CUDA GPU (sm_90), checked on a machine without one.

Every method decodes a few tokens of the tiny model on the kernel path under the interpreter (the replayed step's
device-side paths included), a prompt is prefilled in chunks, and the counting select runs with several chunks (the
path of long rows); each distinct launch is then compiled for sm_90 (tests/cuda_compile.py), and so are the
variants only a GPU launches (`gpu_paths`: inline PTX, paired reductions, int64 code lanes; and each kernel as a
programmatic dependent launch). The interpreter accepts code the CUDA compiler refuses; this catches that class of
error where CI has no GPU.
"""

import functools

import pytest
import torch
import triton

import sparsekv.decode as decode
from sparsekv.decode import generate, prefill
from sparsekv.kernels.codes import code_topk
from sparsekv.kernels.count_select import smallest_k
from sparsekv.kernels.gemv import linear
from sparsekv.kernels.hash_mlp import mlp_hash_pack
from sparsekv.kernels.quest import page_scores
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
            "_row_kernel", "_prefill_kernel", "_gemv_kernel", "_partial_kernel", "_merge_kernel", "_page_scores_kernel"}


def gpu_paths(spec: dict):
    """The launch as a GPU makes it where the interpreter cannot: POPC on (an inline PTX popcount;
    kernels/codes.py), PAIR on (two-operand reductions; kernels/topk/fused.py), and 2-bit codes read as int64 lane
    pairs (codes.py::_launch_distance with popc 2: half the int32 lanes, their words' sums in bytes while they fit)."""
    c = spec["consts"]
    for flag in ("POPC", "PAIR"):
        if c.get(flag) is False:
            yield {**spec, "consts": {**c, flag: True}}
    if spec["name"] in ("_code_distance_kernel", "_force_head_top_kernel") and c.get("FAST") \
            and c["LANE_BITS"] == 32 and c["NW"] % 2 == 0:
        nw = c["NW"] // 2
        yield {**spec, "sig": {**spec["sig"], "QW": "*i64", "KW": "*i64"},
               "consts": {**c, "POPC": True, "LANE_BITS": 64, "NW": nw, "BLOCK_W": triton.next_power_of_2(nw),
                          "BYTE_SUM": nw * 12 <= 255}}


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
        code_topk(torch.cat([qw, qw], -1), kw, 500, 128, 60, 1, pool="sum", head_top=3, _chunk=128)  # ternary
        for win in (16, 64):  # the window histogram's two widths (count_select.sample_plan)
            smallest_k(torch.randint(0, 300, (2, 700), generator=g, dtype=torch.int32).to(torch.int16), 50, 300,
                       _chunk=128, _win=win)
        # Adamas' codes at head dim 128 (16 words a key: the GPU's int64 lanes, below), per query head and pooled
        qw = torch.randint(-32768, 32767, (1, 4, 16), generator=g, dtype=torch.int32).to(torch.int16)
        kw = torch.randint(-32768, 32767, (1, 1, 300, 16), generator=g, dtype=torch.int32).to(torch.int16)
        for pool in (None, "sum"):
            code_topk(qw, kw, 300, 128, 40, 2, pool=pool, ties="high", _chunk=128)
        code_topk(qw, kw, 300, 128, 40, 2, pool="sum", head_top=2, _chunk=128)  # Adamas --head-top
        # Quest's page scores in a bf16 model (its operands in bf16, the tiny model's in fp32), pooled and per head,
        # at d 128 and at a head dim below tl.dot's least inner size
        for d in (128, 2):
            q, bounds = torch.randn(1, 4, d).bfloat16(), torch.randn(1, 2, 40, 2 * d).bfloat16()
            page_scores(q, bounds, 40, "max")
            page_scores(q, bounds, 40, None)
        # the linear layers of a bf16/fp16 model's decode step
        linear(torch.randn(2, 64).half(), torch.randn(48, 64).half(), torch.randn(48).half())
        # a decode step's query hash on a GPU: the hidden units split over programs (too few rows to fill it)
        h = untrained_hashes(1, 2, 64)
        mlp_hash_pack(torch.randn(1, 4, 1, 64, generator=g), h["w1"][0], h["b1"][0], h["w2"][0], split=True)
        mlp_hash_pack(torch.randn(1, 4, 1, 64, generator=g), h["w1"][0], h["b1"][0], h["w2"][0], split=True,
                      margin=0.35)  # ternary queries (Spotlight's default)
    launched = {s["name"] for s in specs.values()}
    assert EXPECTED <= launched, f"the workload no longer launches {sorted(EXPECTED - launched)}"
    todo = list(specs.values()) + [v for s in specs.values() for v in gpu_paths(s)]
    assert len(todo) > len(specs)  # the GPU-only paths are among them
    # each kernel once more as a programmatic dependent launch (kernels/device.py: griddepcontrol on sm_90)
    first = {}
    for s in specs.values():
        first.setdefault(s["name"], s)
    dependent = [{**s, "consts": {**s["consts"], "PDL": 1}} for s in first.values() if "PDL" in s["consts"]]
    assert {s["name"] for s in dependent} >= EXPECTED - {"_prefill_kernel"}
    todo += dependent
    errors = compile_for_cuda(todo)
    assert not errors, "\n".join(errors)
