"""The Triton top-k against its torch reference: exact index sets, ties to the lower index, ascending order.

Small shapes under TRITON_INTERPRET=1 on the CPU (bf16 too: the kernel reads scores as integer bits), and the real
shapes (32 x 131072, k 2048 / 8192) on the GPU when one is present. The one-launch kernel's in-kernel fallbacks
(too many candidates: from the candidate slices; too few: from the row) are forced with its tuning knobs
(TopkConfig's `cap` near k, `z` very negative), and the multi-launch radix path with `path="radix"`. The plan
(`kernels/topk/plan.py`, plain Python) is tested on its own at the end.
"""

import dataclasses
import math

import pytest
import torch
import triton

from sparsekv.kernels.topk import TopkConfig, default_path, describe_default, topk, topk_reference
from sparsekv.kernels.topk.fused import fused_scratch
from sparsekv.kernels.topk.plan import (CAP_MAX, P_MAX, cdiv, fused_plan, long_row_plan, loop_rule, next_pow2,
                                        sample_size, short_row_plan)

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


@pytest.fixture(autouse=True, params=["radix", "fused"] if CUDA else ["default"])
def path(request, monkeypatch):
    """On a GPU every test runs both paths (the default is the fused one: test_default_path_rule)."""
    if request.param != "default":
        monkeypatch.setenv("SPARSEKV_TOPK", request.param)
    return request.param
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _check(x, k, **knobs):
    """topk (with TopkConfig(**knobs) when given) against the reference."""
    out = topk(x, k, config=TopkConfig(**knobs) if knobs else None)
    ref = topk_reference(x.cpu(), k)
    assert out.dtype == torch.int64 and out.shape == ref.shape
    assert torch.equal(out.cpu(), ref)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _call_plan(rows, n, k, **knobs):
    """The plan topk runs on DEV (the interpreter's on the CPU) with these knobs."""
    from sparsekv.kernels.device import num_sms
    return fused_plan(rows, n, k, num_sms(torch.device(DEV)) if CUDA else None, **knobs)


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
def test_select_ends_on_the_intervals_largest_key(dtype):
    """The k-th largest score one step (one ulp of its dtype) above the (k+1)-th and far from the (k-1)-th: the
    select's search reaches an interval whose largest key is the k-th (need = 1) and ends there with a max. Then the
    same with the k-th largest twice (ties to the lower index), and with the step the other way round."""
    g = _gen(11)
    k, n = 123, 1200
    wide = dtype == torch.float32
    ib = torch.int32 if wide else torch.int16
    bits = ((0x3F800000 if wide else 0x0800) + 16 * torch.randperm(n, generator=g)).repeat(3, 1)  # 16 steps apart
    bits[1] |= -(1 << 31) if wide else 0x8000  # row 1 negative: one step down is one more in the low bits
    x = bits.to(ib).view(dtype)  # (the 16-bit patterns fit int16 as two's complement)
    for r, step in enumerate((-1, 1, 0)):  # row 2: a tie at the k-th largest
        order = torch.sort(x[r].float(), descending=True, stable=True).indices
        x.view(ib)[r, order[k]] = x.view(ib)[r, order[k - 1]] + step
    top = x.float().sort(descending=True).values
    assert (top[:2, k - 1] > top[:2, k]).all() and top[2, k - 1] == top[2, k]
    _check(x.to(DEV), k)
    _check(x.to(DEV), k + 1)


@pytest.mark.parametrize("pairs", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_paired_tiles(dtype, pairs):
    """The streaming loop two tiles at a time (one packed scan) and one at a time (the `tile_pairs` knob; the default
    is `loop_rule`'s): random rows (a whole number of chunks or not), ties, NaNs, a -inf tail and both fallbacks."""
    g = _gen(12)
    rnd = torch.randn(3, 4096, generator=g)
    odd = torch.randn(2, 4999, generator=g)
    ties = torch.randint(0, 6, (2, 3001), generator=g).float()
    nan = torch.randn(2, 3001, generator=g)
    nan[:, ::3] = float("nan")
    pad = torch.randn(2, 3001, generator=g)
    pad[:, 1500:] = float("-inf")
    for x, k in [(rnd, 100), (rnd, 700), (odd, 77), (odd, 600), (ties, 500), (nan, 1200), (pad, 1600)]:
        _check(x.to(dtype).to(DEV), k, tile_pairs=pairs)
    _check(rnd.to(dtype).to(DEV), 90, tile_pairs=pairs, cap=256)
    _check(rnd.to(dtype).to(DEV), 90, tile_pairs=pairs, z=-30.0)
    _check(rnd.to(dtype).to(DEV), 90, tile_pairs=pairs, z=-30.0, z2=-30.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_candidate_window(dtype):
    """The select's gather: each chunk's candidates in a window of lanes loaded with the counts, or (a chunk with more
    candidates than its window) gathered again, packed; rows of both kinds in one launch, and the packed gather
    alone (`window=False`)."""
    n, k = 4096, 300
    plan = long_row_plan(n, k, 4, 16, 512, 128)  # the interpreter's plan on the CPU
    win = plan.cap // triton.next_power_of_2(plan.p)
    x = torch.randn(4, n, generator=_gen(13))
    x[1] = torch.arange(n, dtype=torch.float32)  # every candidate in the last chunk: more than its window
    x[2, :512] += 4.0  # most candidates in the first chunk
    x[3, 7::8] = float("nan")  # NaNs in every chunk
    if not CUDA:
        assert plan.has_bound and win < 2 * k
    for knobs in ({}, {"window": True}, {"window": False}, {"window": True, "tile_pairs": False}):
        _check(x.to(dtype).to(DEV), k, **knobs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_second_lane_count(dtype, path):
    """`cap2`: a row of CAP < C <= CAP2 candidates takes CAP2 lanes instead of the slices fallback. One launch holds
    a row within CAP, one within CAP2 and one above it (the fallback): the sampled positions hold randn scores, the
    others randn scaled up, which lets more of them pass the sample's bound."""
    n, k, cap, cap2 = 4096, 90, 512, 1024
    plan = _call_plan(3, n, k, cap=cap)  # the call's plan (its sample does not depend on DEV)
    i = torch.arange(plan.s)
    off_sample = torch.ones(n, dtype=torch.bool)
    off_sample[(i // 8) * plan.stride + i % 8] = False
    x = torch.randn(3, n, generator=_gen(14))
    x[1, off_sample] *= 1.6
    x[2, off_sample] *= 3.0
    x = x.to(dtype).to(DEV)
    _check(x, k, cap=cap, cap2=cap2)
    if path != "radix":  # the fused call's per-chunk counts
        c = fused_scratch(x.device, 3, plan.p, plan.chunk)["cnt"].sum(1).cpu()
        assert c[0] <= cap < c[1] <= cap2 < c[2], c
    _check(x, k, cap=cap, cap2=cap2, window=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_second_bound_restream(dtype, path):
    """A row with fewer than k candidates streams again from the sample's J2-th key: B sampled scores raised far
    above the rest put the first bound among them (B > J_HI: C about B < k); B < J2 lets the second bound through
    (row 0), B > J2 does not and the row takes the fallback from the row (row 2); row 1 is plain. One launch."""
    n, k = 4096, 90
    plan = _call_plan(3, n, k)  # the call's plan (its sample does not depend on DEV)
    i = torch.arange(plan.s)
    sampled = (i // 8) * plan.stride + i % 8
    x = torch.randn(3, n, generator=_gen(15))
    lo_b, hi_b = (plan.j_hi + plan.j2) // 2, plan.j2_hi + 10  # B for rows 0 and 2
    assert plan.has_bound and plan.j_hi < lo_b < plan.j2 and plan.j2_hi < hi_b < k
    pick = sampled[torch.randperm(len(sampled), generator=_gen(16))]
    x[0, pick[:lo_b]] += 8.0
    x[2, pick[:hi_b]] += 8.0
    x = x.to(dtype).to(DEV)
    _check(x, k)
    if path != "radix":
        c = fused_scratch(x.device, 3, plan.p, plan.chunk)["cnt"].sum(1).cpu()
        assert c[0] >= k and c[2] < k, c  # row 0 streamed again (counts rewritten), row 2 still too few
    _check(x, k, window=False, tile_pairs=False)


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_forced_fallbacks(dtype):
    """Both in-kernel fallbacks, on random rows and on rows of ties."""
    g = _gen(5)
    rnd = torch.randn(2, 1200, generator=g).to(dtype).to(DEV)
    ties = torch.randint(0, 4, (2, 1200), generator=g).to(dtype).to(DEV)
    for x in (rnd, ties):
        for k in (1, 90, 700):
            _check(x, k, cap=max(256, k))  # cap about k: more candidates than registers -> from the slices
        _check(x, 90, z=-30.0)  # bound far too high: fewer than k candidates -> the row again, lower bound
        _check(x, 90, z=-30.0, z2=-30.0)  # the second bound too high as well -> from the row
    _check(rnd, 1200, z=-30.0)
    _check(rnd, 1200, z=-30.0, z2=-30.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_slices_fallback_bound_above_inf(dtype):
    """NaNs at the sampled positions put the bound at NaN's key, but the row holds fewer NaNs than k: the +infs
    that the bound's score (+inf, clamped) lets through are needed, and the from-the-slices search must start below
    them (at the clamped bound), not at the bound itself."""
    n, k, s = 4096, 300, 256
    i = torch.arange(s)
    sampled = (i // 8) * (n // (s // 8)) + i % 8  # the strided sample's positions (topk's plan)
    x = torch.randn(2, n, generator=_gen(8))
    x[:, torch.randperm(n, generator=_gen(9))[:2000]] = float("inf")
    x[:, sampled[:64]] = float("nan")  # 64 NaNs: well above the sample's J (~43) but fewer than k
    if DEV == "cpu":  # the interpreter's plan; on the GPU the sample differs, the row is still a valid check
        _check(x.to(dtype).to(DEV), k, sample=s, cap=512)
    _check(x.to(dtype).to(DEV), k, cap=512)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_adversarial_rows(dtype):
    g = _gen(6)
    n = 2500
    asc = torch.arange(n, dtype=torch.float32).repeat(2, 1)
    nan = torch.randn(2, n, generator=g)
    nan[:, ::2] = float("nan")  # more NaNs than k
    pad = torch.randn(2, n, generator=g)
    pad[:, 100:] = float("-inf")  # a long -inf tail, k reaching into it
    for x, k in [(asc, 300), (asc.flip(-1), 300), (nan, 700), (pad, 900), (pad, 40),
                 (torch.full((2, n), -2.0), 2499), (torch.randn(2, n, generator=g) * 1e-30, 77)]:
        _check(x.to(dtype).contiguous().to(DEV), k)


def test_chunking_and_radix_path():
    """Many chunks and tiles per row (the candidate gather), rows a whole number of chunks (no masks in the
    streaming loop), and the older multi-launch path."""
    x = torch.randn(3, 3000, generator=_gen(7)).to(DEV)
    _check(x, 100, chunk=64, tile=16)
    _check(x, 100, sample=64)
    even = torch.randn(2, 2048, generator=_gen(8)).to(DEV)
    for dtype in DTYPES:
        _check(even.to(dtype), 300)
    _check(x[:, :1500].contiguous(), 250, path="radix")
    _check(x[:, :1500].to(torch.bfloat16), 250, path="radix")


@pytest.mark.parametrize("dtype", DTYPES)
def test_two_operand_reductions(dtype):
    """The GPU's two-operand reductions (counts, max and min), forced in the interpreter too."""
    g = _gen(9)
    cases = [(torch.randn(2, 1500, generator=g), 60, {}), (torch.randint(0, 3, (2, 1024), generator=g), 200, {}),
             (torch.randn(2, 1500, generator=g), 60, dict(cap=256))]
    for x, k, knobs in cases:
        _check(x.to(dtype).to(DEV), k, pair=True, **knobs)


def test_bad_arguments():
    x = torch.randn(2, 10, device=DEV)
    with pytest.raises(ValueError, match="row length"):
        topk(x, 11)
    with pytest.raises(ValueError, match="row length"):
        topk_reference(x, 11)
    with pytest.raises(ValueError, match="float32"):
        topk(x.double(), 2)
    with pytest.raises(ValueError, match="topk: the input needs at least one dimension"):
        topk(torch.tensor(1.0, device=DEV), 1)
    y = torch.randn(2, 4096, device=DEV)
    for cap2 in (512, 768, 32768):  # not above the cap, not a power of two, over 16384
        with pytest.raises(ValueError, match="cap2"):
            topk(y, 90, config=TopkConfig(path="fused", cap=512, cap2=cap2))
    with pytest.raises(ValueError, match="path must be"):
        topk(y, 90, config=TopkConfig(path="sort"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        TopkConfig().cap = 4


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
    for n, k in [(1, 1), (7, 7), (4097, 1), (5000, 4999), (32768, 2048), (70000, 8192)]:
        _check(torch.randn(3, n, device="cuda"), k)


@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize("rows", [1, 8, 32])
def test_gpu_adversarial_rows(rows):
    g = torch.Generator(device="cuda").manual_seed(rows)
    n = 131072
    x = torch.randn(rows, n, device="cuda", generator=g)
    x[0] = torch.arange(n, device="cuda", dtype=torch.float32)  # sorted: a strided sample sees it exactly
    if rows > 1:
        x[1] = x[1].sort(descending=True).values
    if rows > 2:
        x[2, ::2] = float("nan")  # 65536 NaNs: more candidates than fit
        x[3, 1000:] = float("-inf")  # -inf padding, k reaches into it
        x[4] = torch.randint(0, 3, (n,), device="cuda", generator=g).float()  # three values
        x[5] = 1.0 + torch.randint(0, 600, (n,), device="cuda", generator=g) * 2.0 ** -23  # low bits decide
    for k in (1, 2048, 8192):
        _check(x, k)
        _check(x.to(torch.bfloat16), k)
    _check(x, 2048, z=-30.0)  # every row streamed again from a lower bound
    _check(x, 2048, z=-30.0, z2=-30.0)  # every row through the from-the-row fallback
    _check(x, 2048, cap=2048)  # every row through the from-the-slices fallback
    for _ in range(20):  # repeated calls: same scratch, same answer (a race would show here)
        assert torch.equal(topk(x, 2048), topk(x, 2048))


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


def test_default_path_rule(monkeypatch):
    monkeypatch.delenv("SPARSEKV_TOPK", raising=False)
    assert default_path() == "fused" and describe_default() == "fused path (radix for k > 8192)"  # any device, length
    monkeypatch.setenv("SPARSEKV_TOPK", "radix")
    assert default_path() == "radix" and describe_default() == "radix path"


# ---------------------------------------------------------------------------------------------------------------
# The plan (kernels/topk/plan.py): plain Python, no launch.

def test_plan_tile_rule():
    """The long-row plan streams 2048-score tiles when its candidates fit 4096 (measured faster on the H100) and
    4096-score tiles above; an explicit tile wins, and no tile exceeds the chunk."""
    p = long_row_plan(131072, 2048, 32, 132)
    assert p.has_bound and p.cap <= 4096 and p.tile == 2048
    p = long_row_plan(131072, 8192, 32, 132)
    assert p.has_bound and p.cap > 4096 and p.tile == 4096
    assert long_row_plan(131072, 2048, 32, 132, tile=4096).tile == 4096
    assert long_row_plan(32768, 100, 32, 132, chunk=1024).tile == 1024
    p = long_row_plan(16384, 100, 1, 4, cap=16384)  # every score a candidate: no bound, 4096-score tiles
    assert not p.has_bound and p.chunk == 4096 and p.tile == 4096
    assert long_row_plan(100000, 9000, 1, 132) is None  # k > 8192: the radix path


def test_plan_sample_rule():
    """Where the strict sample (J at z = 5, 4 deviations below cap) holds >= 4096 scores, the plan takes the smaller
    one that leaves 2 deviations below cap and 5 below cap2 = 2 cap, J at z = 4 (measured faster on the H100); else
    the strict one and no cap2. Every bounded plan's J2 lies above its J_HI (the second bound is lower)."""
    p = long_row_plan(131072, 2048, 32, 132)
    assert (p.s, p.j, p.cap, p.cap2) == (4096, 98, 4096, 8192)
    assert long_row_plan(131072, 4096, 32, 132).s == 2048 and long_row_plan(131072, 4096, 32, 132).cap2 == 16384
    p = long_row_plan(32768, 2048, 32, 132)
    assert (p.s, p.j, p.cap2) == (2048, 187, 0)
    assert long_row_plan(131072, 8192, 32, 132).cap2 == 0  # 2 cap over 16384
    assert long_row_plan(131072, 2048, 32, 132, cap=4096).cap2 == 0  # a forced cap: no second lane count
    for n, k in [(1 << 22, 2048), (1 << 24, 1024), (1 << 24, 64)]:  # no sample fits: a larger cap
        p = long_row_plan(n, k, 32, 132)
        assert p.cap2 == 0 or p.cap2 == 2 * p.cap, (n, k, p)
    for n, k in [(131072, 2048), (131072, 64), (32768, 2048), (524288, 2048), (8192, 128), (16383, 2047)]:
        p = short_row_plan(n, k, 32, 132) if n <= 16384 else long_row_plan(n, k, 32, 132)
        assert p.has_bound and p.j_hi < p.j2 <= p.s, (n, k, p)


def test_loop_rule():
    """Tiles two at a time on fp32 rows past a sampled bound with an even number of tiles per chunk; the candidate
    window for rows of 8 chunks or more (both measured faster there on the H100); knobs win, within what the plan
    allows."""
    main = long_row_plan(131072, 2048, 32, 132)  # 4 chunks of 16 tiles
    assert loop_rule(main, 32) == (True, 0)
    assert loop_rule(main, 16) == (False, 0)  # bf16 / fp16
    assert loop_rule(main, 32, False, True) == (False, main.cap // 4)
    eight = long_row_plan(131072, 2048, 8, 132)  # 16 chunks
    assert eight.p == 16 and loop_rule(eight, 32) == (True, eight.cap // 16)
    one = long_row_plan(131072, 2048, 1, 132)  # 64 chunks of one tile: no pairs
    assert one.chunk == one.tile and loop_rule(one, 32) == (False, one.cap // 64)
    assert loop_rule(one, 32, True) == (False, one.cap // 64)
    whole = long_row_plan(16384, 100, 1, 4, cap=16384)  # every score a candidate: no bound
    assert loop_rule(whole, 32) == (False, 0)
    tiny = long_row_plan(100, 5, 1, 132)  # 50 chunks of 2 scores, 128 lanes: windows of 2
    assert loop_rule(tiny, 32) == (False, 2)


def test_short_row_plan_rule():
    """Rows of at most 16384 scores: the sampled bound when its candidates fit half of next_pow2(n) and the row is
    over 2048 scores (measured faster on the H100), else every score a candidate."""
    for n, k, rows, cap in [(8192, 128, 32, 1024), (8191, 127, 9, 1024), (8188, 2047, 32, 4096),
                            (16383, 2047, 32, 4096), (16384, 512, 1, 2048), (4096, 64, 32, 512)]:
        p = short_row_plan(n, k, rows, 132)
        assert p.has_bound and p.cap == cap and p.p > 1, (n, k, rows)
    for n, k, rows in [(1024, 64, 32), (2048, 64, 32), (4096, 2047, 32), (16384, 8000, 1), (300, 10, 3)]:
        p = short_row_plan(n, k, rows, 132)
        assert not p.has_bound and p.cap == triton.next_power_of_2(n), (n, k, rows)


def test_plan_helpers_match_triton():
    """The plan's own next_pow2 and cdiv (so that it needs no Triton) agree with Triton's."""
    for n in list(range(0, 5000)) + [(1 << e) + d for e in range(12, 31) for d in (-1, 0, 1)]:
        assert next_pow2(n) == triton.next_power_of_2(n), n
    for a in range(0, 300, 7):
        for b in (1, 2, 3, 8, 64, 100):
            assert cdiv(a, b) == triton.cdiv(a, b) == -(-a // b)


def _is_pow2(v):
    return v > 0 and v & (v - 1) == 0


def test_sample_size_bounds_and_monotonic():
    """The sample is a power of two of at least 8 scores and at most min(16384, n / 8); 1 <= J <= J_HI <= S, J above
    the e = k S / n sample keys expected above the k-th largest; when it reports a fit, the expected candidates
    (J_HI n / S) fit the cap with the stated deviations to spare. A larger cap (or cap2) never needs a larger
    sample, and a forced sample keeps J non-decreasing in k and in z."""
    for n in (64, 1000, 4096, 32768, 100003, 131072, 1 << 20, 1 << 24):
        for k in (1, 7, 64, 1000, 2048, 8192):
            if k > n // 2:
                continue
            prev = None
            for cap in (256, 512, 1024, 2048, 4096, 8192, 16384):
                if cap < k:
                    continue
                for cap2 in (0, 2 * cap):
                    s, j, j_hi, worst = sample_size(n, k, cap, cap2, 5.0, None)
                    assert _is_pow2(s) and 8 <= s <= 16384 and 8 * s <= n, (n, k, cap, s)
                    assert 1 <= j <= j_hi <= s and j >= k * s / n, (n, k, cap, s, j, j_hi)
                    mean = j_hi * n / s
                    sd = math.sqrt(mean * n / s)
                    if worst == 0:
                        assert mean + 4 * sd <= cap or (cap2 and mean + 2 * sd <= cap and mean + 5 * sd <= cap2)
                    else:  # no sample fits: the largest one, and by how much it misses
                        assert s == min(16384, next_pow2(n // 8 + 1) // 2) and worst == mean + 4 * sd > cap
                if cap2 == 0 and prev is not None:
                    assert s <= prev, (n, k, cap, s, prev)
                    strict_s = s
                    assert sample_size(n, k, cap, 2 * cap, 5.0, None)[0] <= strict_s
                prev = s
    for n, s in [(131072, 4096), (32768, 512), (1 << 20, 16384)]:
        js = [sample_size(n, k, 16384, 0, 4.0, s)[1] for k in range(1, 8193, 97)]
        assert js == sorted(js) and all(sample_size(n, k, 16384, 0, 4.0, s)[0] == s for k in (1, 100, 8192))
        assert [sample_size(n, 500, 16384, 0, z, s)[1] for z in (-3.0, 0.0, 4.0, 5.0, 10.0)] == sorted(
            sample_size(n, 500, 16384, 0, z, s)[1] for z in (-3.0, 0.0, 4.0, 5.0, 10.0))


@pytest.mark.parametrize("n_sm", [None, 16, 132])
def test_plans_valid_over_shapes(n_sm):
    """Every plan topk can run (n_sm None: the interpreter's), over row lengths, k and row counts: chunks and tiles
    are powers of two that tile the row in at most P_MAX chunks, about one program per multiprocessor; the lanes hold
    k (CAP_MAX at most, cap2 = 2 cap or none); a bounded plan samples inside the row and its second bound's ranks are
    no lower than the first's; an unbounded one holds every score. No plan only where the lanes would exceed CAP_MAX.
    The loop rule's window fits the lanes and paired tiles come in pairs."""
    ns = [1, 2, 16, 100, 255, 256, 300, 1000, 2047, 2048, 2049, 4096, 4999, 8188, 8192, 16383, 16384, 16385, 32768,
          70000, 131071, 131072, 524288, 1 << 20, 1 << 22]
    for n in ns:
        for k in sorted({1, 2, 17, 64, 127, 500, 2047, 2048, 4096, 8192, 8193, n // 3, n}):
            if not 1 <= k <= n:
                continue
            for rows in (1, 3, 8, 32, 200):
                p = fused_plan(rows, n, k, n_sm)
                too_many = next_pow2(max(256, 2 * k)) > CAP_MAX and (n_sm is None or n > CAP_MAX)
                assert (p is None) == too_many, (n, k, rows)
                if p is None:
                    continue
                where = (n, k, rows, p)
                assert _is_pow2(p.chunk) and _is_pow2(p.tile) and p.tile <= p.chunk, where
                assert p.p == cdiv(n, p.chunk) and 1 <= p.p <= P_MAX, where
                if n_sm is not None:  # more chunks than a row's share of the machine only when P_MAX forces them
                    assert p.p <= max(1, n_sm // rows) or p.chunk <= max(16, next_pow2(cdiv(n, P_MAX))), where
                assert _is_pow2(p.cap) and k <= p.cap <= CAP_MAX, where
                assert p.cap2 == 0 or p.cap2 == 2 * p.cap <= CAP_MAX, where
                if p.has_bound:
                    last = (p.s - 1) // 8 * p.stride + 7  # the strided sample's last position
                    assert _is_pow2(p.s) and 8 * p.s <= n and p.stride >= 8 and last < n, where
                    assert 1 <= p.j <= p.j_hi <= p.s and p.j <= p.j2 <= p.j2_hi <= p.s and p.j_hi <= p.j2_hi, where
                else:
                    assert p.cap >= n and p.cap2 == 0, where
                for bits in (32, 16):
                    pairs, win = loop_rule(p, bits)
                    assert win == 0 or (_is_pow2(win) and win * next_pow2(p.p) <= p.cap), where
                    assert not pairs or (p.has_bound and bits == 32 and (p.chunk // p.tile) % 2 == 0), where


def test_config_defaults_are_the_plans():
    """TopkConfig() leaves every choice to the plan: the same plan as no knobs at all; a knob reaches it."""
    cfg = TopkConfig()
    assert all(v is None for v in dataclasses.asdict(cfg).values())
    for n_sm in (None, 132):
        for rows, n, k in [(32, 131072, 2048), (3, 4096, 90), (9, 8191, 127)]:
            base = fused_plan(rows, n, k, n_sm)
            assert base == fused_plan(rows, n, k, n_sm, cfg.chunk, cfg.tile, cfg.cap, cfg.sample, cfg.z, cfg.z2)
            assert fused_plan(rows, n, k, n_sm, sample=64).s == 64


def test_reference_signature():
    x = torch.randn(2, 3, 50, generator=_gen(17))
    out = torch.empty(2, 3, 7, dtype=torch.int64)
    assert topk_reference(x, 7, out=out, config=TopkConfig(path="radix")) is out
    assert torch.equal(out, topk_reference(x, 7)) and torch.equal(out, x.topk(7).indices.sort(-1).values)


@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize("n", [4000, 8191, 16384])
def test_gpu_default_short_rows_with_ties(n, monkeypatch):
    """Rows of at most 16384 scores, with whichever plan `short_row_plan` picks (the sampled bound for the small k
    here, every score a candidate for the large ones): exact on tie-heavy integer rows (where the bound's candidates
    overflow and the fallback selects), fp16 rows and constant rows."""
    monkeypatch.delenv("SPARSEKV_TOPK", raising=False)
    g = torch.Generator(device="cuda").manual_seed(n)
    for x in (torch.randint(0, 40, (3, n), device="cuda", generator=g).float(),
              torch.randn(9, n, device="cuda", generator=g).half(), torch.full((2, n), 1.0, device="cuda")):
        for k in (1, 118, 1000, n):
            _check(x, k)


def test_ties_to_the_higher_index():
    """ops.topk(ties="high"): the same k largest, ties broken toward the higher index, on the kernel and the
    reference path; each row ascending."""
    from sparsekv import ops

    x = torch.randint(0, 6, (3, 200), generator=_gen(23)).float()
    n = x.shape[-1]
    key = x.double() * n + torch.arange(n)  # ties to the higher index, made unique
    want = key.topk(40, -1).indices.sort(-1).values
    assert torch.equal(topk_reference(x, 40, ties="high"), want)
    for on in (False, True):
        with ops.kernels(on):
            assert torch.equal(ops.topk(x.to(DEV), 40, ties="high").cpu(), want)
            assert torch.equal(ops.topk(x.to(DEV), 40).cpu(), topk_reference(x, 40))
    with pytest.raises(ValueError, match="ties must be"):
        topk_reference(x, 4, ties="new")
