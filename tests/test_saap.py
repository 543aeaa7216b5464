"""SAAP: pre-RoPE keys, the growing inverted lists and their gather, the offline index (faiss k-means + the query
model's KL), its artifact, and the method against dense attention."""

import functools
import json

import pytest
import torch

import sparsekv.decode as decode
from sparsekv.activations import dump_activations, load_activations
from sparsekv.artifacts import ArtifactError, save_artifact
from sparsekv.decode import generate
from sparsekv.errors import SparseKVError
from sparsekv import ops
from sparsekv.kernels.reference import (PendingAppend, RowBounds, bucket_bases_reference, bucket_gather_reference,
                                       bucket_logits_reference, bucket_rank_keys, bucket_select_reference,
                                       saap_append_reference, slot_bases)
from sparsekv.methods import CacheShape, get_method
from sparsekv.models import tiny_random, wire
from sparsekv.rope import find_rotary, rope_tables, rotate_half
from sparsekv.saap.fit import fit_index, index_keys
from sparsekv.saap.kmeans import clusters_for, spherical_kmeans
from sparsekv.saap.lists import admit, new_lists, record
from sparsekv.saap.model import QueryModel, assign, random_index
from sparsekv.offline.data import DumpExamples
from sparsekv.saap.objective import LongRange, SaapObjective
from sparsekv.selection import BudgetSplit
from sparsekv.step import make_step

pytestmark = pytest.mark.usefixtures("one_thread")

SEQ = 256


@pytest.fixture(scope="module")
def dump(tiny, tmp_path_factory):
    tokens = torch.randint(0, 256, (5 * SEQ,), generator=torch.Generator().manual_seed(2)).tolist()
    out = tmp_path_factory.mktemp("saap") / "d"
    return load_activations(dump_activations(tiny, tokens, out, seq_len=SEQ, queries_per_seq=48, seed=1,
                                             dtype=torch.float32, source="random bytes"))


@pytest.fixture(scope="module")
def artifact(dump, tmp_path_factory):
    root = tmp_path_factory.mktemp("saap-art")
    path, report = fit_index(dump, root, clusters=16, hidden=32, iters=30, lr=1e-3, queries_per_step=48,
                             heldout_queries=96)
    return path, report


# -- pre-RoPE keys ------------------------------------------------------------------------------------------------

def test_dumped_pre_rope_keys_rotate_back_to_the_post_rope_ones(tiny, dump):
    rotary = find_rotary(tiny.model)
    d = dump.layer(1)
    k_pre, k_post = d["k_pre"], d["k_post"]  # [Hkv, T, D]
    pos = d["k_pos"].view(1, -1)
    cos, sin = rope_tables(rotary, k_pre[None], pos)
    again = k_pre * cos + rotate_half(k_pre) * sin  # HF's RoPE of the pre-RoPE keys
    torch.testing.assert_close(again, k_post, atol=1e-5, rtol=1e-5)


def test_the_cache_hands_saap_the_projections_output(tiny, prompt_ids, monkeypatch):
    """The pre-RoPE keys `append` receives (prefill and decode steps) are the k_proj outputs exactly (to fp32
    rounding of the inverse rotation)."""
    method = get_method("saap", budget=64, sink=1, window=8, index=random_index(2, 2, 20, clusters=8, hidden=16))
    got, want = [], []
    real = method.append
    monkeypatch.setattr(method, "append", lambda st, k, v, k_pre, pos: (got.append((st.layer, k_pre)),
                                                                         real(st, k, v, k_pre, pos)))
    hooks = [layer.self_attn.k_proj.register_forward_hook(
        lambda mod, args, out, i=i: want.append((i, out.view(*out.shape[:2], -1, 20).transpose(1, 2))))
        for i, layer in enumerate(tiny.model.model.layers)]
    try:
        generate(tiny, prompt_ids[:, :40], method, 3, stop_on_eos=False)
    finally:
        for h in hooks:
            h.remove()
    assert len(got) == len(want) == 2 * 3  # 2 layers x (prefill + 2 decode steps)
    for (la, a), (lb, b) in zip(got, want):
        assert la == lb
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


# -- the inverted lists -------------------------------------------------------------------------------------------

def _lists_by_hand(buckets: torch.Tensor, first: int, last: int, clusters: int):
    """Each (row, head)'s CSR lists of positions [first, last), by loops: bucket c -> its positions in order."""
    B, H, _ = buckets.shape
    return [[[[p for p in range(first, last) if int(buckets[b, h, p]) == c] for c in range(clusters)]
             for h in range(H)] for b in range(B)]


DEV = "cuda" if torch.cuda.is_available() else "cpu"  # the kernels: the GPU, else the interpreter


@pytest.mark.parametrize("kernel", [False, True], ids=["reference", "kernel"])
@pytest.mark.parametrize("newest_first", [False, True], ids=["oldest first", "newest first"])
def test_appending_key_by_key_equals_a_rebuilt_index(newest_first, kernel):
    """Chunks (prefill), then one key per decode step at device slots (`ops.saap_append`: its bucket, and the key
    leaving the window into its list), give the lists a one-shot build gives: each key's ordinal is its index in its
    bucket's list of the keys that left the window (-1 - index newest first)."""
    B, H, C, n, sink, window = 2, 3, 5, 70, 1, 6
    g = torch.Generator().manual_seed(0)
    new = torch.randint(0, C, (B, H, n), generator=g)
    new[:, 1] = 3  # one huge bucket (and four empty ones) in head 1
    cents = torch.eye(C).expand(H, C, C)  # key 2·e_c is nearest to centroid c
    keys = 2 * torch.nn.functional.one_hot(new, C).float()
    grown = new_lists(B, H, n, C, "cpu")
    pos = 0
    for size in (7, 1, 20):  # prefill chunks, host positions
        record(grown[0], new[:, :, pos : pos + size], pos)
        first = max(sink, pos - window)
        admit(*grown, first, pos + size - window - first, newest_first)
        pos += size
    dev = DEV if kernel else "cpu"
    grown = [t.to(dev) for t in grown]
    with ops.kernels(kernel):
        while pos < n:  # decode steps: device write slots
            ops.saap_append(*grown, cents.to(dev), keys[:, :, pos : pos + 1].to(dev), torch.full((B,), pos, device=dev),
                            sink, window, newest_first)
            pos += 1
    grown = [t.cpu() for t in grown]
    rebuilt = new_lists(B, H, n, C, "cpu")
    record(rebuilt[0], new, 0)
    admit(*rebuilt, sink, n - window - sink, newest_first)
    for a, b in zip(grown, rebuilt):
        assert torch.equal(a, b)
    buckets, ordinals, counts = grown
    for b, heads in enumerate(_lists_by_hand(buckets, sink, n - window, C)):
        for h, lists in enumerate(heads):
            assert counts[b, h, :C].tolist() == [len(x) for x in lists] and counts[b, h, C] == 0
            for lst in lists:
                want = [-1 - i for i in range(len(lst))] if newest_first else list(range(len(lst)))
                assert [int(ordinals[b, h, p]) for p in lst] == want


@pytest.mark.parametrize("window", [0, 3])
def test_append_kernel_equals_its_reference(window):
    """The decode step's append kernel (Triton: interpreted on the CPU) = its torch reference over two steps, on
    random keys and centroids in blocks of 16 (combined across programs; a tie between blocks goes to the lower
    bucket), rows at different positions (one still inside its sink + window: no key leaves it), window 0 (the
    leaving key is the new one)."""
    from sparsekv.kernels.saap import saap_append

    B, H, C, D, n, sink = 3, 2, 37, 20, 40, 2
    g = torch.Generator().manual_seed(5)
    cents = torch.nn.functional.normalize(torch.randn(H, C, D, generator=g), dim=-1)
    cents[0, 30] = cents[0, 5]
    pre = torch.randn(B, H, 30, D, generator=g)
    state = new_lists(B, H, n, C, "cpu")
    record(state[0], assign(pre, cents), 0)
    admit(*state, sink, 30 - window - sink, True)
    state[0][2, :, 3:] = C  # row 2 holds 3 keys
    want = [t.clone() for t in state]
    got = [t.clone().to(DEV) for t in state]
    for step in range(2):
        k = torch.randn(B, H, 1, D, generator=g)
        k[1, 0, 0] = 2 * cents[0, 5]  # nearest: buckets 5 and 30, tied
        pos = torch.tensor([30, 31, 3]) + step
        saap_append_reference(*want, cents, k, pos, sink, window, True)
        saap_append(*got, cents.to(DEV), k.to(DEV), pos.to(DEV), sink, window, True, block_c=16)
        for a, b in zip(got, want):
            assert torch.equal(a.cpu(), b)
        assert want[0][1, 0, 31 + step] == 5
    assert not torch.equal(want[2], state[2])  # some key joined a list


def _gather_by_hand(buckets, counts_lists, chosen, cap, lo, hi, row_lo=None, row_hi=None, newest_first=False):
    """The visited lists end to end in the chosen order, each bucket's whole list (positions outside the step's
    region read as -1; newest key first with `newest_first`), cut at cap: the spec of bucket_gather, by loops over
    the lists."""
    B, Hs, _ = chosen.shape
    Hkv = len(counts_lists[0])
    out = torch.full((B, Hs, cap), -1, dtype=torch.int64)
    for b in range(B):
        r_lo = lo if row_lo is None else max(lo, int(row_lo[b]))
        r_hi = hi if row_hi is None else min(hi, int(row_hi[b]))
        for hs in range(Hs):
            lists = counts_lists[b][hs // (Hs // Hkv)]
            flat = [p for c in chosen[b, hs].tolist() for p in (lists[c][::-1] if newest_first else lists[c])]
            for s, p in enumerate(flat[:cap]):
                out[b, hs, s] = p if r_lo <= p < r_hi else -1
    return out


CASES = {"balanced": dict(huge=False, cap=200, group=True), "one huge bucket": dict(huge=True, cap=37, group=True),
         "per query head": dict(huge=False, cap=64, group=False), "cap cuts": dict(huge=False, cap=9, group=True)}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("rows", [False, True], ids=["host region", "row regions"])
@pytest.mark.parametrize("newest_first", [False, True], ids=["oldest first", "newest first"])
def test_bucket_gather_kernel_equals_its_reference_and_the_lists(case, rows, newest_first):
    """Visited lists laid out by the kernel (Triton, interpreted on the CPU) = the torch reference = the lists by
    hand: empty buckets among the chosen, one bucket holding every key, per-query-head choices, a cap that cuts (and
    newest first, the cap keeps the newest keys of the bucket it cuts), each row's region from its device length."""
    from sparsekv.kernels.saap import bucket_gather

    huge, cap, group = CASES[case]["huge"], CASES[case]["cap"], CASES[case]["group"]
    B, Hkv, G, C, n = 2, 2, 3, 8, 300
    g = torch.Generator().manual_seed(1)
    new = torch.randint(0, C - 2, (B, Hkv, n), generator=g)  # buckets C-2, C-1: always empty
    if huge:
        new[:, 0] = 4
    buckets, ordinals, counts = new_lists(B, Hkv, n + 20, C, "cpu")
    record(buckets, new, 0)
    admit(buckets, ordinals, counts, 1, n - 1 - 9, newest_first)  # sink 1, window 9
    Hs = Hkv if group else Hkv * G
    chosen = torch.stack([torch.randperm(C, generator=g)[:4] for _ in range(B * Hs)]).view(B, Hs, 4)
    chosen[0, 0] = torch.tensor([C - 1, 4, C - 2, 0])  # empty buckets first and between
    per_sel = counts if group else counts.repeat_interleave(G, dim=1)
    bases = slot_bases(per_sel, chosen, newest_first)
    lo, hi = 1, n - 9
    # row 0's sliding window starts at 2 (its region [3, n - 9)), row 1 is 159 keys long (region [1, 150))
    bounds = RowBounds(torch.tensor([n, 159]), span=n - 2, sink=1, window=9) if rows else None
    row_lo, row_hi = (torch.tensor([3, 1]), torch.tensor([n - 9, 150])) if rows else (None, None)
    ref, count = bucket_gather_reference(buckets, ordinals, bases, cap, lo, hi, bounds)
    on = [t.to(DEV) for t in (buckets, ordinals, bases)]
    on_bounds = None if bounds is None else RowBounds(bounds.lengths.to(DEV), n - 2, 1, 9)
    for chunk in (2048, 64):  # one program per row, or several that add their counts
        got, got_count = bucket_gather(*on, cap, lo, hi, on_bounds, chunk=chunk)
        assert torch.equal(got.cpu(), ref) and got_count.shape == () and int(got_count) == int(count)
    assert int(count) == int((ref >= 0).sum())
    hand = _gather_by_hand(buckets, _lists_by_hand(buckets, 1, n - 9, C), chosen, cap, lo, hi, row_lo, row_hi,
                           newest_first)
    assert torch.equal(ref, hand)
    assert (ref >= 0).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("model", [True, False], ids=["query model", "centroids"])
@pytest.mark.parametrize("heads", [(6, 2), (2, 2)], ids=["groups of 3", "no GQA"])
@pytest.mark.parametrize("append", [False, True], ids=["", "with the append"])
def test_bucket_logits_kernel_equals_its_reference(dtype, model, heads, append):
    """The queries' bucket logits (both layers of the folded Q-model, or the centroids' inner products; with the
    Q-model, also both at once) = the reference, over a batch and a bucket count that is no power of two; with a
    decode step's append carried out by extra programs of the logits' launch, the lists equal the reference's too."""
    from sparsekv.kernels.saap import bucket_logits

    Hq, Hkv = heads
    B, D, M, C = 3, 20, 48, 37
    g = torch.Generator().manual_seed(6)
    x = torch.randn(B, Hq, 1, D, generator=g).to(dtype)
    cents = torch.nn.functional.normalize(torch.randn(Hkv, C, D, generator=g), dim=-1).to(dtype)
    weights = (torch.randn(Hkv, D, M, generator=g) / 4, torch.randn(Hkv, M, generator=g) / 4,
               torch.randn(Hkv, M, C, generator=g) / 6, torch.randn(Hkv, C, generator=g) / 4)
    w = tuple(t.to(dtype) for t in weights) if model else None
    lists = new_lists(B, Hkv, 40, C, "cpu")
    record(lists[0], assign(torch.randn(B, Hkv, 30, D, generator=g), cents.float()), 0)
    admit(*lists, 1, 30 - 4 - 1, True)
    k, pos = torch.randn(B, Hkv, 1, D, generator=g).to(dtype), torch.tensor([30, 31, 3])[:B]
    want_lists, got_lists = [t.clone() for t in lists], [t.clone().to(DEV) for t in lists]
    pend = (PendingAppend(*want_lists, k, pos, 1, 4, True), PendingAppend(*got_lists, k.to(DEV), pos.to(DEV), 1, 4, True)) \
        if append else (None, None)
    want = bucket_logits_reference(x, cents, w, pend[0])
    got = bucket_logits(x.to(DEV), cents.to(DEV), None if w is None else tuple(t.to(DEV) for t in w), pend[1],
                        block_c=16, block_m=16, block_k=16)  # several blocks of buckets and of the hidden layer
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.cpu(), want, atol=tol, rtol=tol)
    for a, b, before in zip(got_lists, want_lists, lists):
        assert torch.equal(a.cpu(), b) and torch.equal(b, before) != append
    if model:  # the centroids' inner products from the same launch
        want2 = bucket_logits_reference(x, cents, w, centroids_too=True)
        got2 = bucket_logits(x.to(DEV), cents.to(DEV), tuple(t.to(DEV) for t in w), centroids_too=True, block_c=16,
                             block_m=16, block_k=16)
        for a, b in zip(got2, want2):
            torch.testing.assert_close(a.cpu(), b, atol=tol, rtol=tol)
        torch.testing.assert_close(want2[1], bucket_logits_reference(x, cents))


@pytest.mark.parametrize("softmax", [True, False], ids=["softmax", "raw scores"])
@pytest.mark.parametrize("group", [3, 1], ids=["pooled over the group", "per query head"])
@pytest.mark.parametrize("newest_first", [False, True], ids=["oldest first", "newest first"])
@pytest.mark.parametrize("probes", [7, 37])
def test_bucket_bases_kernel_equals_its_reference(softmax, group, newest_first, probes):
    """The visited buckets' first slots in one launch (softmax, the group's sum, the best ℓ by a top-k of 32-bit
    rank keys) = the reference, ties included (to the lower bucket), empty buckets among the chosen, every bucket
    chosen; given the gather's output and counter, the launch fills them (-1, 0)."""
    from sparsekv.kernels.saap import bucket_bases

    B, Hkv, G, C = 2, 2, 3, 37
    g = torch.Generator().manual_seed(7)
    scores = torch.randn(B, Hkv * G, C, generator=g)
    scores[:, :, 20:30] = scores[:, :, 20:21]  # ties: ten buckets with the same logits in every head
    scores[:, :, 20:30] += 5
    counts = torch.randint(0, 9, (B, Hkv, C + 1), generator=g, dtype=torch.int32)
    counts[..., C] = 0
    counts[..., 22] = 0
    want = bucket_bases_reference(scores, counts, probes, group, softmax, newest_first)
    out, count = torch.full((B, Hkv * G // group, 50), 7, device=DEV), torch.ones(1, dtype=torch.int32, device=DEV)
    got = bucket_bases(scores.to(DEV), counts.to(DEV), probes, group, softmax, newest_first, out=out, count=count)
    assert torch.equal(got.cpu(), want) and (out == -1).all() and int(count) == 0
    assert ((want[..., :C] >= 0).sum(-1) == probes).all() and (want[..., C] == -1).all()
    if probes < C:
        assert (want[..., 20:27] >= 0).all() and (want[..., 27:30] == -1).all()  # the tie goes to the lower buckets


@pytest.mark.parametrize("share", [0.5, 0.25, 0.8])
@pytest.mark.parametrize("group,softmax", [(3, True), (1, True), (3, False)], ids=["group", "per head", "raw"])
@pytest.mark.parametrize("probes", [5, 16, 37])
def test_mixed_bucket_bases_kernel_equals_its_reference(share, group, softmax, probes):
    """Two rankings taken in turn inside the bases' launch = the reference's `mixed_order`: the chosen
    buckets and their order (the lists' first slots), with rankings that agree on some buckets, ties within each,
    a bucket count that is no power of two, and every bucket chosen."""
    from sparsekv.kernels.saap import bucket_bases

    B, Hkv, G, C = 2, 2, 3, 37
    g = torch.Generator().manual_seed(11)
    scores = torch.randn(B, Hkv * G, C, generator=g)
    cent = torch.randn(B, Hkv * G, C, generator=g)
    cent[..., :10] = scores[..., :10] + 0.5  # both rankings favour some of the same buckets
    scores[..., 20:26] = scores[..., 20:21] + 3  # ties in the first ranking ...
    cent[..., 12:18] = cent[..., 12:13] + 3  # ... and in the second
    counts = torch.randint(0, 9, (B, Hkv, C + 1), generator=g, dtype=torch.int32)
    counts[..., C] = 0
    want = bucket_bases_reference(scores, counts, probes, group, softmax, True, cent, share)
    got = bucket_bases(scores.to(DEV), counts.to(DEV), probes, group, softmax, True, cent.to(DEV), share)
    assert torch.equal(got.cpu(), want)
    assert ((want[..., :C] >= 0).sum(-1) == probes).all()
    with pytest.raises(ValueError, match="do not fit together"):
        bucket_bases(scores.to(DEV), counts.to(DEV), probes, group, softmax, True, None, share)


def test_mixed_bucket_bases_kernel_equals_its_reference_past_4096_buckets():
    """Past 4096 buckets (where 32-bit rank keys no longer keep every whole-number place apart) the kernel's turns
    and the reference's order still agree."""
    from sparsekv.kernels.saap import bucket_bases

    B, G, C = 1, 4, 5000
    g = torch.Generator().manual_seed(12)
    scores, cent = torch.randn(B, G, C, generator=g), torch.randn(B, G, C, generator=g)
    counts = torch.randint(0, 5, (B, 1, C + 1), generator=g, dtype=torch.int32)
    counts[..., C] = 0
    want = bucket_bases_reference(scores, counts, 48, G, True, True, cent, 0.5)
    got = bucket_bases(scores.to(DEV), counts.to(DEV), 48, G, True, True, cent.to(DEV), 0.5)
    assert torch.equal(got.cpu(), want)


def test_bucket_rank_keys_order_as_the_scores_ties_to_the_lower_bucket():
    """32-bit rank keys: distinct, ordered as the scores (negative, zero, positive), equal scores and scores equal
    to 13 mantissa bits (C = 1024) ranked by bucket."""
    s = torch.tensor([-3.0, -0.5, 0.0, 2.0, 2.0, 2.0 * (1 + 2**-20), 1e-30, 1.5] + [-1.0] * 1016)
    keys = bucket_rank_keys(s)
    assert keys.unique().numel() == 1024
    order = keys.argsort(descending=True).tolist()
    assert order[:7] == [3, 4, 5, 7, 6, 2, 1] and order[-1] == 0 and order[7:-1] == list(range(8, 1024))


def test_bucket_select_kernel_equals_its_reference():
    """bases then gather, the fill and the counter's reset in the bases' launch: = the reference."""
    from sparsekv.kernels.saap import bucket_select

    B, Hkv, G, C, n = 2, 2, 3, 8, 120
    g = torch.Generator().manual_seed(3)
    lists = new_lists(B, Hkv, n, C, "cpu")
    record(lists[0], torch.randint(0, C, (B, Hkv, n), generator=g), 0)
    admit(*lists, 1, n - 1 - 9, True)
    scores = torch.randn(B, Hkv * G, C, generator=g)
    args = (3, G, True, True, 40, 1, n - 9)
    bounds = RowBounds(torch.tensor([n, 70]), sink=1, window=9)
    want, want_count = bucket_select_reference(scores, lists[2], lists[0], lists[1], *args, bounds)
    on = [t.to(DEV) for t in (scores, lists[2], lists[0], lists[1])]
    got, got_count = bucket_select(*on, *args, RowBounds(bounds.lengths.to(DEV), sink=1, window=9))
    assert torch.equal(got.cpu(), want) and int(got_count) == int(want_count) == int((want >= 0).sum()) > 0


# -- the offline stage --------------------------------------------------------------------------------------------

def test_kmeans_heads_side_by_side_equal_each_head_alone():
    """The heads run on worker threads (one OpenMP thread each): each head's centroids = that head fitted alone."""
    keys = torch.randn(2, 3, 800, 16, generator=torch.Generator().manual_seed(4))
    together, _ = spherical_kmeans(keys, 8, iters=5, seed=3)
    for li in range(2):
        for h in range(3):
            alone, _ = spherical_kmeans(keys[li : li + 1, h : h + 1], 8, iters=5, seed=3)
            assert torch.equal(together[li, h], alone[0, 0])


def test_faiss_cpu_kmeans_finds_the_clusters():
    g = torch.Generator().manual_seed(0)
    centers = torch.nn.functional.normalize(torch.randn(6, 16, generator=g), dim=-1)
    which = torch.arange(600) % 6
    keys = (centers[which] * torch.rand(600, 1, generator=g).add(1) + 0.05 * torch.randn(600, 16, generator=g))
    cents, backend = spherical_kmeans(keys.view(1, 1, 600, 16), 12, iters=10, seed=0)
    assert backend == "faiss-cpu" and cents.shape == (1, 1, 12, 16)
    torch.testing.assert_close(cents.norm(dim=-1), torch.ones(1, 1, 12))
    got = assign(keys.view(1, 1, 600, 16), cents)[0, 0]
    for c in range(12):  # no bucket mixes two true clusters (random init: a cluster may take two buckets)
        assert len(set(which[got == c].tolist())) <= 1
    assert clusters_for(1024, 39 * 10) == (10, clusters_for(1024, 390)[1]) and "capped" in clusters_for(1024, 390)[1]
    with pytest.raises(SparseKVError, match="too few"):
        clusters_for(8, 20)


@pytest.mark.parametrize("missing,message", [("faiss", "needs faiss: pip install faiss-cpu"),
                                              ("numpy.core.broken", "faiss is installed but does not import")])
def test_faiss_missing_or_broken_is_one_clear_error(unimportable, missing, message):
    """Not installed: how to install it. Installed but failing to import (a library it loads): that failure, not
    advice to install what is there."""
    from sparsekv.saap.kmeans import faiss_backend

    unimportable("faiss", missing)
    with pytest.raises(SparseKVError, match=message):
        faiss_backend()


def test_folded_query_model_equals_the_batch_normed_one():
    m = QueryModel(2, 3, 8, 16, 5, seed=1)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, 40, 8, generator=g)
    for _ in range(3):  # running statistics away from their initial values
        m(x * 3 + 1, torch.rand(2, 3, 40, generator=g) > 0.3)
    m.eval()
    want = torch.softmax(m(x), -1)
    w = m.folded()
    for layer in range(2):  # a decode step's logits: the 40 queries as batch rows, one per head
        model = tuple(w[n][layer] for n in ("w1", "b1", "w2", "b2"))
        got = bucket_logits_reference(x[layer].transpose(0, 1)[:, :, None], torch.zeros(3, 5, 8), model)
        torch.testing.assert_close(torch.softmax(got, -1), want[layer].transpose(0, 1), atol=1e-5, rtol=1e-5)


def _batch_norm_written_out(m: QueryModel, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The Q-model's training step as the paper's layers: Linear, BatchNorm over the masked rows, ReLU, Linear;
    returns the logits and the running statistics it leaves."""
    h = x @ m.w1 + m.b1[:, :, None]
    w = mask.unsqueeze(-1).to(h.dtype)
    n = w.sum(2, keepdim=True)
    mean = (h * w).sum(2, keepdim=True) / n.clamp(min=1)
    var = ((h - mean).pow(2) * w).sum(2, keepdim=True) / n.clamp(min=1)
    upd = (n > 1).squeeze(-1)
    unbiased = var.squeeze(2) * n.squeeze(2) / (n.squeeze(2) - 1).clamp(min=1)
    rm = torch.where(upd, torch.lerp(m.running_mean, mean.squeeze(2), 0.1), m.running_mean)
    rv = torch.where(upd, torch.lerp(m.running_var, unbiased, 0.1), m.running_var)
    h = (h - mean) / torch.sqrt(var + 1e-5) * m.gamma[:, :, None] + m.beta[:, :, None]
    return torch.relu(h) @ m.w2 + m.b2[:, :, None], rm.detach(), rv.detach()


def test_query_model_training_step_equals_batch_norm_written_out():
    """The training forward takes the batch statistics from the input's covariance and folds them into the first
    layer: the same logits, gradients and running statistics as Linear -> BatchNorm (masked rows) -> ReLU ->
    Linear, also for a head with a single row in its batch (its running statistics stay) and one with none."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 40, 8) * 3 + 1
    mask = torch.rand(2, 3, 40) > 0.3
    mask[0, 1] = False
    mask[0, 1, 7] = True  # one row: statistics from it, running ones unchanged
    empty = mask.clone()
    empty[1, 2] = False  # no row at all (1/sqrt(eps) scales: logits and statistics compared, not gradients)
    for mk, grads in ((mask, True), (empty, False)):
        m = QueryModel(2, 3, 8, 16, 5, seed=1)
        with torch.no_grad():
            m.gamma.uniform_(0.5, 1.5), m.beta.normal_()
        want, rm, rv = _batch_norm_written_out(m, x, mk)
        got = m(x, mk)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(m.running_mean, rm, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(m.running_var, rv, atol=1e-5, rtol=1e-5)
        assert torch.equal(m.running_var[0, 1], torch.ones(16))
        if grads:
            names, params = zip(*m.named_parameters())
            gw = torch.autograd.grad(want.pow(2).sum(), params)
            gg = torch.autograd.grad(got.pow(2).sum(), params)
            for name, a, b in zip(names, gg, gw):
                if name == "b1":  # batch norm subtracts the first bias back out: 0 here, rounding noise there
                    assert torch.equal(a, torch.zeros_like(a)) and b.abs().max() < 1
                else:
                    torch.testing.assert_close(a, b, atol=1e-4 * float(b.abs().max()), rtol=1e-4)


def test_kl_from_target_sums_equals_its_definition():
    from sparsekv.saap.objective import kl_div, target_sums

    torch.manual_seed(1)
    logits = torch.randn(2, 3, 7, 11) * 4
    t = torch.softmax(torch.randn(2, 3, 7, 11) * 3, -1) * (torch.rand(2, 3, 7, 11) > 0.4)
    t = t / t.sum(-1, keepdim=True).clamp(min=1e-30)
    t[0, 0, 0] = 0  # a query with no long-range key: an all-zero target
    want = (torch.xlogy(t, t) - t * torch.log_softmax(logits, -1)).sum(-1)
    torch.testing.assert_close(kl_div(logits, t), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kl_div(logits, t, *target_sums(t)), want, atol=1e-5, rtol=1e-5)
    assert kl_div(logits, t)[0, 0, 0] == 0


def test_query_model_kl_falls_on_a_clustered_problem():
    """Keys around 8 directions, each query after one of them: the Q-model learns which bucket holds its
    attention; the held-out KL falls and the visited bucket holds the heaviest long-range key far more often."""
    from test_train_hash import ClusteredDump

    tensors, config, report = index_keys(ClusteredDump(seqs=8), clusters=8, hidden=32, iters=120, lr=3e-3,
                                         queries_per_step=16, holdout=0.25, eval_every=60, probes=1)
    m = report["metrics"]["mean"]
    assert m["kl"] < 0.5 * m["kl_before"]
    assert m["hit"] > 0.8 and m["hit"] > m["hit_before"] + 0.3
    curve = report["train"]["heldout_curve"]
    assert [s for s, _ in curve] == [60, 120] and curve[-1][1]["kl"] <= curve[0][1]["kl"]
    assert tensors["index"]["centroids"].shape == (2, 1, 8, 16) and tensors["query_model"]["w2"].shape == (2, 1, 32, 8)
    assert config["pairs"] == {"gap": 32, "min_range": 16, "sink": 1, "causal": True, "defaults_from_seq_len": 128}


def test_index_keeps_its_best_evaluation_unless_patience_is_zero():
    """By default the index ends with the weights of its lowest held-out KL (and may stop early); patience 0 runs
    every iteration and keeps the last weights, as the paper."""
    from test_train_hash import ClusteredDump

    opts = dict(clusters=8, hidden=16, iters=8, lr=3e-3, queries_per_step=8, eval_every=1, holdout=0.25, probes=1)
    _, config, report = index_keys(ClusteredDump(seqs=4), **opts)
    kept = report["train"]["kept"]
    assert config["train"]["kept"] == "lowest held-out kl" and kept["by"] == "kl"
    assert kept["value"] == min(m["kl"] for _, m in report["train"]["heldout_curve"])
    assert report["metrics"]["mean"]["kl"] == kept["value"]  # the report measures the weights kept, alike
    _, config, report = index_keys(ClusteredDump(seqs=4), patience=0, **opts)
    assert config["train"]["kept"] == "last" and "kept" not in report["train"] and report["train"]["steps"] == 8


@pytest.mark.parametrize("option, message", [({"clusters": 0}, "--clusters must be >= 1"),
                                             ({"probes": 0}, "--probes must be >= 1"),
                                             ({"hidden": 0}, "--hidden must be >= 1")])
def test_bad_index_options_fail_before_the_dump_loads(option, message, monkeypatch):
    """An option no fit could use fails at once, not after the dump's load (and, for --probes, not after a whole
    fit whose report would score zero buckets)."""
    monkeypatch.setattr("sparsekv.saap.fit.DumpExamples", lambda *a, **k: pytest.fail("the dump was loaded"))
    with pytest.raises(SparseKVError, match=message):
        index_keys(object(), **option)


@pytest.mark.parametrize("option", [{"sink": SEQ}, {"gap": SEQ - 1}, {"min_range": SEQ - 1}])
def test_pairs_farther_than_the_dump_holds_fail_before_the_dump_loads(dump, option, monkeypatch):
    """A gap, long-range threshold or sink that leaves the dump's sequences no pair to train on is one clear error,
    not a fit on nothing (an artifact scored 0) or a torch error."""
    monkeypatch.setattr("sparsekv.saap.fit.DumpExamples", lambda *a, **k: pytest.fail("the dump was loaded"))
    with pytest.raises(SparseKVError, match="hold no pair that far apart"):
        index_keys(dump, **option)


def test_targets_pair_earlier_keys_by_default_and_the_report_scores_causal_pairs(dump):
    """A decode step reads only the keys before its query: by default a query's target pairs it with earlier keys
    only (the paper's two-way pairs with causal=False), and the held-out report scores causal pairs either way."""
    q_pos, j = torch.tensor([10, 50, 90]), torch.arange(100)
    near, far = LongRange(gap=8, min_range=4).masks(q_pos, 100)
    assert not (near & (j > q_pos[:, None])).any() and far[2, 1] and not far[0, 30]
    assert LongRange(gap=8, min_range=4, causal=False).masks(q_pos, 100)[1][0, 30]
    opts = dict(clusters=8, query_model=False, heldout_queries=96)
    _, causal, report = index_keys(dump, **opts)
    _, both, report_both = index_keys(dump, causal=False, **opts)
    assert causal["pairs"]["causal"] and not both["pairs"]["causal"]
    assert report["heldout"]["pairs"] == report_both["heldout"]["pairs"] == "causal"
    assert report_both["metrics"]["mean"] == report["metrics"]["mean"]  # the centroids scored on the same pairs


def test_a_cluster_cap_below_the_probes_says_so(dump):
    """A dump too small for --clusters caps them (faiss wants 39 keys per centroid); when the cap also cuts
    --probes, the note says the report visits every bucket."""
    _, config, report = index_keys(dump, clusters=256, probes=200, query_model=False, heldout_queries=16)
    used = report["clusters"]["used"]
    assert used < 200 and config["probes_reported"] == used
    assert f"visits all {used} buckets, not --probes 200" in report["clusters"]["note"]
    _, _, report = index_keys(dump, clusters=256, probes=2, query_model=False, heldout_queries=16)
    assert "capped" in report["clusters"]["note"] and "--probes" not in report["clusters"]["note"]


def test_cached_targets_equal_the_ones_each_step_computes(dump):
    """A query's target is fixed (frozen attention, fixed buckets): looked up from its sequence's targets computed
    once (kept in bf16), it equals the step's own computation to bf16's rounding, and so does the loss."""
    data = DumpExamples(dump, [0, 1], pre_rope=True, with_post=True, holdout=0.2)
    buckets = torch.randint(0, 8, (2, data.k.shape[1], data.k.shape[2]), generator=torch.Generator().manual_seed(4))
    pats = [dump.patterns()[i] for i in (0, 1)]
    make = lambda cache: SaapObjective(data, pats, buckets, 8, LongRange(8, 4), 16, seed=3, cache_targets=cache)
    cached, fresh = make(True), make(False)
    model = QueryModel(2, data.k.shape[1], data.head_dim, 16, 8)
    for step in range(6):
        ex = cached.sample(step)
        (t1, k1, *s1), (t2, k2, *s2) = cached.step_targets(ex), fresh.step_targets(ex)
        assert t1.dtype == torch.bfloat16  # kept in bf16: within its rounding of the computed ones
        torch.testing.assert_close(t1.float(), t2, atol=1e-6, rtol=2 ** -8)
        torch.testing.assert_close(s1, s2)
        assert torch.equal(k1, k2)
        torch.testing.assert_close(cached.loss(model, step), fresh.loss(model, step), atol=1e-3, rtol=1e-3)
    assert set(cached._cache) <= set(data.fit_seqs) and cached._cache and not fresh._cache


def test_resume_reuses_the_centroids_and_ends_at_the_same_weights(dump, tmp_path):
    opts = dict(clusters=8, hidden=16, iters=12, lr=1e-3, queries_per_step=16, heldout_queries=16,
                checkpoint_every=5, min_delta=0.0)  # every step's small gain counts: the run passes step 7
    whole, _, _ = index_keys(dump, work=tmp_path / "a", **opts)

    def stop(done, total):
        if total == 12 and done == 7:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        index_keys(dump, work=tmp_path / "b", progress=stop, **opts)
    assert (tmp_path / "b" / "kmeans.pt").exists()
    resumed, _, report = index_keys(dump, work=tmp_path / "b", resume=True, **opts)
    assert report["train"]["resumed_from"] == 7 and report["kmeans"]["seconds"] == 0.0
    for part in ("index", "query_model"):
        for k, v in whole[part].items():
            assert torch.equal(v, resumed[part][k]), (part, k)


def test_artifact_round_trip_and_report(artifact, dump):
    path, report = artifact
    m = get_method("saap", budget=100, sink=1, window=16, artifact=str(path))
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["method"] == "saap" and manifest["config"]["space"] == "pre"
    assert m.centroids.shape == (2, 2, 16, 20) and m.probes == 1 and m.model is not None
    assert manifest["config"]["kmeans"]["backend"] == "faiss-cpu"
    assert manifest["config"]["train"]["patience"] == 2 and manifest["config"]["train"]["min_delta"] == 0.02
    assert report["clusters"] == {"asked": 16, "used": 16, "note": None}
    b = report["buckets"]
    assert sum(b["histogram"]["buckets"]) == 2 * 2 * 16 and b["imbalance"]["mean"] >= 1.0
    assert {"kl", "kl_before", "hit", "mass", "hit_centroids"} <= set(report["metrics"]["mean"])
    assert not (path.parent / ".train").exists() and not list(path.parent.glob(".train-*"))  # checkpoints gone


def test_artifact_refusals(artifact, tmp_path, prompt_ids):
    path, _ = artifact
    other = wire(tiny_random(seed=1))
    with pytest.raises(ArtifactError, match="fitted on another model") as e:
        generate(other, prompt_ids, get_method("saap", budget=64, sink=1, window=8, artifact=str(path)), 2)
    assert "\n" not in str(e.value)
    bad = tmp_path / "bad"
    bad.mkdir()
    manifest = json.loads((path / "manifest.json").read_text())
    (bad / "manifest.json").write_text(json.dumps({**manifest, "schema_version": 99}))
    with pytest.raises(ArtifactError, match="schema_version 99"):
        get_method("saap", budget=64, artifact=str(bad))
    wrong = save_artifact(tmp_path, method="saap", model_fingerprint={"name": "m"}, config={},
                          tensors={"index": {"layers": torch.arange(2)}})
    with pytest.raises(SparseKVError, match="has no centroids"):
        get_method("saap", budget=64, artifact=str(wrong))
    with pytest.raises(SparseKVError, match="probes must be"):
        get_method("saap", budget=64, artifact=str(path), probes=17)
    with pytest.raises(SparseKVError, match="needs its index"):
        get_method("saap", budget=64)


# -- the method ---------------------------------------------------------------------------------------------------

def _every_bucket(method):
    """`method` with a cap that holds every key of the sparse region (k = hi - lo) and every bucket visited."""
    method.probes = method.clusters
    split = method.split
    method.split = lambda state: (lambda s: s if s.dense else BudgetSplit(
        s.sink, s.window, s.hi - s.lo, False, s.length, s.span, s.lengths, s.extent))(split(state))
    return method


@pytest.mark.parametrize("mode", ["eager", "static"])
@pytest.mark.parametrize("pooling", ["group", "head"])
def test_saap_visiting_every_bucket_equals_dense(tiny, prompt_ids, mode, pooling, artifact, monkeypatch):
    path, _ = artifact
    dense = generate(tiny, prompt_ids, get_method("dense"), 6, stop_on_eos=False, keep_logits=True)
    if mode == "static":
        monkeypatch.setattr(decode, "make_step", functools.partial(make_step, mode=mode))
    m = _every_bucket(get_method("saap", budget=64, sink=1, window=8, pooling=pooling, artifact=str(path)))
    got = generate(tiny, prompt_ids, m, 6, stop_on_eos=False, keep_logits=True)
    assert got.tokens == dense.tokens and got.stats["selectivity"] == pytest.approx(1.0)
    for a, b in zip(got.logits, dense.logits):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="an interpreter test: on a GPU the graph tests cover it")
def test_saap_through_the_kernels(tiny, prompt_ids, monkeypatch):
    """The Triton path (bucket gather + sparse decode, interpreted) of a replayed step equals dense with every
    bucket visited, and the eager transformers call at ℓ = 2."""
    monkeypatch.setenv("SPARSEKV_KERNELS", "1")
    ids = prompt_ids[:, :72]
    index = random_index(2, 2, 20, clusters=8, hidden=16)
    dense = generate(tiny, ids, get_method("dense"), 3, stop_on_eos=False, keep_logits=True)
    ref = generate(tiny, ids, get_method("saap", budget=40, sink=1, window=8, index=index, probes=2), 3,
                   stop_on_eos=False, keep_logits=True)
    monkeypatch.setattr(decode, "make_step", functools.partial(make_step, mode="static"))
    full = generate(tiny, ids, _every_bucket(get_method("saap", budget=40, sink=1, window=8, index=index)), 3,
                    stop_on_eos=False, keep_logits=True)
    got = generate(tiny, ids, get_method("saap", budget=40, sink=1, window=8, index=index, probes=2), 3,
                   stop_on_eos=False, keep_logits=True)
    for a, b, c, d in zip(full.logits, dense.logits, got.logits, ref.logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(c, d, atol=1e-4, rtol=1e-4)
    assert got.stats["mean_selected"] < 40 - 9


@pytest.mark.parametrize("cap_keep", [None, "newest", "oldest"])
def test_select_reads_only_the_visited_buckets_within_the_cap(tiny, cap_keep):
    """One layer's selection by hand: the positions are those of the top-ℓ buckets of the group's summed Q-model
    distributions, best bucket first, each bucket's keys newest first (by default; oldest first on request), cut at
    the cap: the cap keeps the newest keys of the bucket it cuts."""
    index = random_index(1, 2, 20, clusters=6, hidden=16, seed=3)
    m = get_method("saap", budget=20, sink=1, window=4, index=index, probes=2, cap_keep=cap_keep)
    st = m.new_state(0, CacheShape(1, 2, 6, 20, 80, torch.float32, torch.device("cpu")))
    g = torch.Generator().manual_seed(4)
    k = torch.randn(1, 2, 80, 20, generator=g)
    st.keys, st.values, st.length = k, k, 80
    m.append(st, k, k, k, 0)
    q = torch.randn(1, 6, 1, 20, generator=g)
    sel = m.select(st, q, q)
    w1, b1, w2, b2 = (index[n][0] for n in ("w1", "b1", "w2", "b2"))  # the Q-model written out, per KV head
    logits = torch.relu(q.view(2, 3, 20) @ w1 + b1[:, None]) @ w2 + b2[:, None]
    scores = torch.softmax(logits, -1).sum(1).view(1, 2, 6)
    top = scores.topk(2, dim=-1).indices
    buckets = assign(k, index["centroids"][0])
    keys = range(1, 76) if cap_keep == "oldest" else range(75, 0, -1)
    for h in range(2):
        lists = [[p for p in keys if int(buckets[0, h, p]) == c] for c in top[0, h].tolist()]
        assert len(lists[0]) < 15 < len(lists[0]) + len(lists[1])  # the second bucket straddles the cap
        want = [p for lst in lists for p in lst][:15]
        assert [p for p in sel.indices[0, h].tolist() if p >= 0] == want
    assert (sel.sink, sel.window, sel.indices.shape[-1]) == (1, 4, 15)
    assert m.config()["cap_keep"] == (cap_keep or "newest")


@pytest.mark.parametrize("kernel", [False, True], ids=["reference", "kernel"])
def test_each_decode_steps_key_is_filed_by_its_select_dense_or_sparse(kernel):
    """A decode step's append (device position) is pending until the step's select carries it out: by its own launch
    while the budget still covers the context (a dense select), with the Q-model's logits after; the lists then
    equal a rebuild from every key."""
    index = random_index(1, 2, 20, clusters=6, hidden=16, seed=3)
    m = get_method("saap", budget=40, sink=1, window=4, index=index, probes=2)
    st = m.new_state(0, CacheShape(1, 2, 6, 20, 80, torch.float32, torch.device(DEV)))
    g = torch.Generator().manual_seed(5)
    k = torch.randn(1, 2, 80, 20, generator=g).to(DEV)
    st.keys, st.values, st.length = k, k, 30
    m.append(st, k[:, :, :30], k[:, :, :30], k[:, :, :30], 0)  # the prefill
    dense = []
    with ops.kernels(kernel):
        for p in range(30, 80):
            st.length = p + 1
            one = k[:, :, p : p + 1]
            m.append(st, one, one, one, torch.tensor([p], device=DEV))
            assert st.pending is not None and int(st.buckets[0, 0, p]) == 6  # not filed yet
            q = torch.randn(1, 6, 1, 20, generator=g).to(DEV)
            dense.append(m.select(st, q, q).dense)
            assert st.pending is None and int(st.buckets[0, 0, p]) < 6
    assert any(dense) and not all(dense)
    rebuilt = new_lists(1, 2, 80, 6, "cpu")
    record(rebuilt[0], assign(k.cpu(), index["centroids"][0]), 0)
    admit(*rebuilt, 1, 80 - 4 - 1, True)
    for a, b in zip((st.buckets, st.ordinals, st.counts), rebuilt):
        assert torch.equal(a.cpu(), b)


def test_ragged_batch_equals_each_prompt_alone(tiny):
    from sparsekv.decode import generate_batch

    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (1, n), generator=g) for n in (200, 90, 143)]
    index = random_index(2, 2, 20, clusters=8, hidden=16)
    opts = dict(budget=80, sink=1, window=8, index=index, probes=2)
    alone = [generate(tiny, p, get_method("saap", **opts), 4, stop_on_eos=False, keep_logits=True) for p in prompts]
    together = generate_batch(tiny, prompts, get_method("saap", **opts), 4, stop_on_eos=False, keep_logits=True)
    for a, b in zip(together, alone):
        for x, y in zip(a.logits, b.logits, strict=True):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)


def test_selection_is_graph_safe_shapes(tiny):
    """The selection's shape depends on the budget alone, not on how many keys the visited buckets hold."""
    index = random_index(1, 2, 20, clusters=4, hidden=8)
    m = get_method("saap", budget=50, sink=1, window=4, index=index, probes=1)
    shapes = set()
    for n in (60, 90, 120):
        st = m.new_state(0, CacheShape(1, 2, 6, 20, 128, torch.float32, torch.device("cpu")))
        k = torch.randn(1, 2, n, 20, generator=torch.Generator().manual_seed(n))
        st.keys, st.values, st.length = k, k, n
        m.append(st, k, k, k, 0)
        shapes.add(tuple(m.select(st, torch.randn(1, 6, 1, 20), torch.randn(1, 6, 1, 20)).indices.shape))
    assert shapes == {(1, 2, 45)}


# -- two rankings (centroid_share) ----------------------------------------------------------------------------------

def _top(scores: torch.Tensor, n: int) -> list[int]:
    return scores.topk(n).indices.tolist()


@pytest.mark.parametrize("share,from_centroids", [(0.5, 4), (0.25, 2), (0.75, 6)])
def test_mixed_order_takes_each_rankings_best_in_turn(share, from_centroids):
    """With disjoint favourites, the first 8 of the mix are the Q-model's best 8 - n and the centroids' best n, n the
    share of 8, per group; a tie at rank 0 goes to the Q-model; every bucket comes once."""
    from sparsekv.kernels.reference import mixed_order

    C, group = 32, 3
    g = torch.Generator().manual_seed(0)
    qm = torch.randn(1, 2 * group, C, generator=g)
    qm[..., 16:] -= 20  # the Q-model prefers buckets 0..15 in every head, the centroids 16..31
    cent = torch.randn(1, 2 * group, C, generator=g)
    cent[..., :16] -= 20
    order = mixed_order(qm, cent, group, True, share)
    assert order.shape == (1, 2, C)
    for kv in range(2):
        heads = slice(kv * group, (kv + 1) * group)
        q_best = _top(torch.softmax(qm[0, heads], -1).sum(0), 8 - from_centroids)
        c_best = _top(torch.softmax(cent[0, heads], -1).sum(0), from_centroids)
        assert sorted(order[0, kv, :8].tolist()) == sorted(q_best + c_best)
        assert order[0, kv, 0].item() == q_best[0]  # a tie at rank 0 goes to the Q-model
        assert sorted(order[0, kv].tolist()) == list(range(C))


def test_centroid_share_selects_the_union_and_zero_is_the_paper():
    """Per query head (pooling head), ℓ = 4 with share 0.5: the buckets are the Q-model's best two and the centroids'
    best two (or more of one when they share a bucket); share 0 is the Q-model's own selection; bad values refused."""
    index = random_index(1, 2, 20, clusters=12, hidden=16, seed=3)
    shape = CacheShape(1, 2, 6, 20, 80, torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(4)
    k = torch.randn(1, 2, 80, 20, generator=g)
    q = torch.randn(1, 6, 1, 20, generator=g)

    def visited(**opts):
        m = get_method("saap", budget=76, sink=1, window=4, index=index, probes=4, pooling="head", **opts)
        st = m.new_state(0, shape)
        st.keys, st.values, st.length = k, k, 80
        m.append(st, k, k, k, 0)
        sel = m.select(st, q, q)
        b = assign(k, index["centroids"][0])
        return m, [sorted({int(b[0, h // 3, p]) for p in sel.indices[0, h].tolist() if p >= 0}) for h in range(6)]

    w1, b1, w2, b2 = (index[n][0] for n in ("w1", "b1", "w2", "b2"))
    logits = (torch.relu(q.view(2, 3, 20) @ w1 + b1[:, None]) @ w2 + b2[:, None]).reshape(6, 12)
    inner = (q.view(2, 3, 20) @ index["centroids"][0].transpose(-1, -2)).reshape(6, 12)
    m, mixed = visited(centroid_share=0.5)
    _, paper = visited(centroid_share=0.0)
    _, alone = visited()
    assert paper == alone and m.config()["centroid_share"] == 0.5
    for h in range(6):
        assert paper[h] == sorted(_top(logits[h], 4))
        q2, c2 = _top(logits[h], 2), _top(inner[h], 2)
        assert set(q2) | set(c2) <= set(mixed[h]) and len(mixed[h]) == 4
    for bad, msg in [(1.0, "centroid_share must be in"), (-0.1, "centroid_share must be in")]:
        with pytest.raises(SparseKVError, match=msg):
            get_method("saap", budget=76, index=index, centroid_share=bad)
    with pytest.raises(SparseKVError, match="query_model is off"):
        get_method("saap", budget=76, index=index, centroid_share=0.5, query_model=False)
    big = random_index(1, 1, 4, clusters=(1 << 15) + 1, hidden=2)
    with pytest.raises(SparseKVError, match="at most 32768 buckets; the index given has 32769"):
        get_method("saap", budget=76, index=big, centroid_share=0.5)
