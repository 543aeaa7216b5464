"""One dispatch point per kernel op: the Triton kernel (`sparsekv.kernels`) or its torch reference
(`kernels/reference.py`, same signature), chosen here and nowhere else.

The choice: `with ops.kernels(False):` (or True) for the code inside it; else SPARSEKV_KERNELS=0/1 as the process
default; else the kernels on a CUDA device and the references elsewhere (the kernels also run on the CPU under
TRITON_INTERPRET=1, which the tests use, but far slower). Kernels take plain tensors and import nothing from the
package above them; the one op here that takes a library type is `sparse_decode` (a `Selection`), which it turns
into the kernels' plain arguments.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING

import torch

from sparsekv.kernels import reference as ref

from .errors import SparseKVError

if TYPE_CHECKING:
    from .selection import Selection

_forced: ContextVar[bool | None] = ContextVar("sparsekv_kernels", default=None)


@contextmanager
def kernels(on: bool = True):
    """Run the code inside with the Triton kernels (on=True) or the torch references (False), whatever the device."""
    token = _forced.set(bool(on))
    try:
        yield
    finally:
        _forced.reset(token)


def use_kernels(device: torch.device | str) -> bool:
    forced = _forced.get()
    if forced is None:
        flag = os.environ.get("SPARSEKV_KERNELS", "")
        forced = flag == "1" if flag in ("0", "1") else None
    if forced is None:
        return torch.device(device).type == "cuda"
    if forced and torch.device(device).type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        # Triton has no CPU backend: without its interpreter the launch fails with a message about drivers
        raise SparseKVError("the Triton kernels run on the CPU only under TRITON_INTERPRET=1 (far slower); set it, "
                            "or use the torch references (SPARSEKV_KERNELS=0)")
    return forced


# -- attention --------------------------------------------------------------------------------------------------

def sparse_decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, sel: "Selection", scale: float,
                  softcap: float | None = None, check: bool = False) -> torch.Tensor:
    """q [B, Hq, 1, D] against the keys `sel` names -> [B, Hq, 1, D] (kernels/sparse_decode.py)."""
    args = sel.decode_args()
    if use_kernels(q.device):
        from sparsekv.kernels.sparse_decode import sparse_decode as kernel

        return kernel(q, keys, values, scale, softcap=softcap, check=check, **args)
    if check:
        sel.check(q.shape[0], sel.heads(keys.shape[1]))
    return ref.sparse_decode_reference(q, keys, values, scale, softcap=softcap, **args)


def block_positions(blocks: torch.Tensor, block_size: int, lengths: int | torch.Tensor, span: int = 0,
                    sink: int = 0, window: int = 0, count: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks [B, H, nb] as the padded token positions a step reads of them (-1 outside each row's sparse region),
    and their mean count per (row, head) (fp32, 0-dim, on the device), or with `count` (0-dim) that count added into
    it, which is returned."""
    if use_kernels(blocks.device):
        from sparsekv.kernels.sparse_decode import block_positions as kernel

        return kernel(blocks, block_size, lengths, span, sink, window, count=count)
    return ref.block_positions_reference(blocks, block_size, lengths, span, sink, window, count=count)


def dense_decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: int | torch.Tensor,
                 scale: float, span: int = 0, softcap: float | None = None) -> torch.Tensor:
    """One query per row over every valid key (the last `span` with a sliding window): split-K flash-decoding."""
    if use_kernels(q.device):
        from sparsekv.kernels.sparse_decode import dense_decode as kernel

        return kernel(q, keys, values, lengths, scale, span=span, softcap=softcap)
    return ref.sparse_decode_reference(q, keys, values, scale, lengths, span=span, dense=True, softcap=softcap)


def prefill_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, span: int = 0,
                      softcap: float | None = None) -> torch.Tensor:
    """Causal attention of the last n = q.shape[2] positions over keys [B, Hkv, L, D] (a prefill chunk after
    L - n cached keys), with no mask in memory: kernels/prefill_attention.py."""
    if use_kernels(q.device):
        from sparsekv.kernels.prefill_attention import prefill_attention as kernel

        return kernel(q, keys, values, scale, span=span, softcap=softcap)
    return ref.prefill_attention_reference(q, keys, values, scale, span=span, softcap=softcap)


def qk_logits(q: torch.Tensor, keys: torch.Tensor, indices: torch.Tensor | None = None) -> torch.Tensor:
    """Exact q·k (unscaled fp32) of every key, or of those at `indices` (kernels/sparse_decode.py::qk_logits)."""
    if use_kernels(q.device):
        from sparsekv.kernels.sparse_decode import qk_logits as kernel

        return kernel(q, keys, indices)
    return ref.qk_logits_reference(q, keys, indices)


def pooled_log_probs(logits: torch.Tensor, group: int, scale: float, softcap: float | None = None,
                     bounds: ref.RowBounds | None = None) -> torch.Tensor:
    """Log-softmax of the logits per query head over each row's region, summed over each group
    (kernels/exact_scores.py)."""
    if use_kernels(logits.device):
        from sparsekv.kernels.exact_scores import pooled_log_probs as kernel

        return kernel(logits, group, scale, softcap, bounds)
    return ref.pooled_log_probs_reference(logits, group, scale, softcap, bounds)


# -- selection --------------------------------------------------------------------------------------------------

def topk(scores: torch.Tensor, k: int, ties: str = "low") -> torch.Tensor:
    """Indices of the k largest scores along the last dim, each row ascending, ties to the lower index (so a row
    padded with worse scores, as a graph-replayed step's is, chooses the same keys) or with `ties="high"` to the
    higher one (the newer key: code distances, `selection.CODE_TIES`): the select kernels (kernels/topk), exact,
    no sort; the stable-sort reference elsewhere."""
    if use_kernels(scores.device):
        from sparsekv.kernels.topk import topk as kernel

        flat = scores.reshape(-1, scores.shape[-1]).contiguous()
        idx = kernel(flat, k) if ref.check_ties(ties) == "low" else ref.reversed_select(kernel, flat, k)
        return idx.view(*scores.shape[:-1], k)
    return ref.topk_reference(scores, k, ties=ties)


def quantize_pack(x: torch.Tensor, thresholds: torch.Tensor, bits: int = 2, transform: bool = True,
                  append: ref.PendingCodes | None = None) -> torch.Tensor:
    """Codes of x [B, H, n, D] (Hadamard first if `transform`), packed: int16 [B, H, n, W] (kernels/codes.py).
    `append`: a decode step's new keys, coded into their buffer first (in the same launch)."""
    if use_kernels(x.device):
        from sparsekv.kernels.codes import quantize_pack as kernel

        return kernel(x, thresholds, bits=bits, transform=transform, append=append)
    return ref.quantize_pack_reference(x, thresholds, bits, transform, append)


def quantize_pack_into(x: torch.Tensor, thresholds: torch.Tensor, out_words: torch.Tensor,
                       start: int | torch.Tensor, bits: int = 2, transform: bool = True) -> None:
    """quantize_pack written into out_words at [start, start + n) (start: an int or per-row device slots [B])."""
    if use_kernels(x.device):
        from sparsekv.kernels.codes import quantize_pack_into as kernel

        return kernel(x, thresholds, out_words, start, bits=bits, transform=transform)
    return ref.quantize_pack_into_reference(x, thresholds, out_words, start, bits, transform)


def mlp_hash_pack(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor | None = None,
                  w2: torch.Tensor | None = None, append: ref.PendingHash | None = None,
                  margin: float | None = None) -> torch.Tensor:
    """Spotlight's MLP hash sign(SiLU(x @ w1 + b1) @ w2) of x [B, H, n, D], packed as 1-bit codes: int16
    [B, H, n, ceil(nbits / 16)] (kernels/hash_mlp.py). w1 [Hkv, D, M], b1 [Hkv, M], w2 [Hkv, M, nbits]; without
    b1 and w2 the linear hash sign(x @ w1), w1 [Hkv, D, nbits] (LSH). `append`: a decode step's new keys, hashed
    into their code buffer first (in the same launch). `margin`: ternary codes, twice the words (the signs, then
    the bits whose |value| exceeds margin times the row's root mean square), which the code distances read."""
    if use_kernels(x.device):
        from sparsekv.kernels.hash_mlp import mlp_hash_pack as kernel

        return kernel(x, w1, b1, w2, append=append, margin=margin)
    return ref.mlp_hash_pack_reference(x, w1, b1, w2, append, margin)


def mlp_hash_pack_into(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor | None, w2: torch.Tensor | None,
                       out_words: torch.Tensor, start: int | torch.Tensor) -> None:
    """mlp_hash_pack written into out_words at [start, start + n) (start: an int or per-row device slots [B])."""
    if use_kernels(x.device):
        from sparsekv.kernels.hash_mlp import mlp_hash_pack_into as kernel

        return kernel(x, w1, b1, w2, out_words, start)
    return ref.mlp_hash_pack_into_reference(x, w1, b1, w2, out_words, start)


def code_scores(q_words: torch.Tensor, k_words: torch.Tensor, length: int, d: int, bits: int = 2,
                metric: str = "l1", pool: str | None = None) -> torch.Tensor:
    """-distance of the query codes to the first `length` key codes, higher = closer (kernels/codes.py)."""
    if use_kernels(q_words.device):
        from sparsekv.kernels.codes import code_scores as kernel

        return kernel(q_words, k_words, length, d, bits=bits, metric=metric, pool=pool)
    return ref.code_scores_reference(q_words, k_words, length, d, bits, metric, pool=pool)


def code_ip_scores(q: torch.Tensor, k_words: torch.Tensor, centers: torch.Tensor, length: int, d: int,
                   bits: int = 2, pool: str | None = None) -> torch.Tensor:
    """q · (each key's codes read as their buckets' centers) for the first `length` keys (kernels/codes.py)."""
    if use_kernels(q.device):
        from sparsekv.kernels.codes import code_ip_scores as kernel

        return kernel(q, k_words, centers, length, d, bits, pool=pool)
    return ref.code_ip_scores_reference(q, k_words, centers, length, d, bits, pool=pool)


def code_topk(q_words: torch.Tensor, k_words: torch.Tensor, length: int, d: int, k: int, bits: int, metric: str,
              pool: str | None, offset: int = 0, keep: torch.Tensor | None = None,
              bounds: ref.RowBounds | None = None, ties: str = "low", head_top: int = 0) -> torch.Tensor | None:
    """The k nearest keys by code distance, counted in one fused pass (kernels/codes.py::code_topk), or None where
    that kernel does not run (the references, or distances too wide for its counting): rank `code_scores` with
    `topk` then (with `head_top`, its keys forced first: `selection.code_selection`), which chooses the same keys."""
    if not use_kernels(q_words.device):
        return None
    from sparsekv.kernels.codes import code_topk as kernel
    from sparsekv.kernels.codes import code_topk_supported

    group = q_words.shape[1] // k_words.shape[1] if pool else 1
    if not code_topk_supported(d, bits, metric, group, head_top):
        return None
    return kernel(q_words, k_words, length, d, k, bits=bits, metric=metric, pool=pool, offset=offset, keep=keep,
                  bounds=bounds, ties=ties, head_top=head_top)


def page_scores(q: torch.Tensor, bounds: torch.Tensor, n_pages: int, pool: str | None = "max",
                region: ref.PageRegion | None = None) -> torch.Tensor:
    """Quest's page upper bounds of the first `n_pages` pages, -inf outside `region` (kernels/quest.py)."""
    if use_kernels(q.device):
        from sparsekv.kernels.quest import page_scores as kernel

        return kernel(q, bounds, n_pages, pool, region=region)
    return ref.quest_region_scores_reference(q, bounds, n_pages, pool, region)


def page_blocks(scores: torch.Tensor, pick: torch.Tensor, region: ref.PageRegion) -> torch.Tensor:
    """The pages a Quest step attends: the top-k's picks as pages (-1 for -inf ones), then each row's newest."""
    if use_kernels(scores.device):
        from sparsekv.kernels.quest import page_blocks as kernel

        return kernel(scores, pick, region)
    return ref.quest_blocks_reference(scores, pick, region)


def quest_append(bounds: torch.Tensor, k: torch.Tensor, pos: int | torch.Tensor, page_size: int) -> None:
    """A decode step's new key [B, Hkv, 1, D] folded into its page's bounds in place."""
    if use_kernels(k.device):
        from sparsekv.kernels.quest import append_one as kernel

        return kernel(bounds, k, pos, page_size)
    return ref.quest_append_reference(bounds, k, pos, page_size)


# -- the decode step's layer (kernels/layer_ops.py) ---------------------------------------------------------------

def _layer_ops(device: torch.device):
    if use_kernels(device):
        from sparsekv.kernels import layer_ops

        return layer_ops
    return None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """A decode step's linear layer x [..., K] @ weight [N, K]ᵀ + bias: the GEMV kernel (kernels/gemv.py) for up
    to its 16 rows of 16-bit floats, else torch (cuBLAS on a GPU)."""
    if use_kernels(x.device) and x.dtype in (torch.float16, torch.bfloat16) and x.dtype == weight.dtype:
        from sparsekv.kernels import gemv

        if x.numel() <= gemv.MAX_ROWS * x.shape[-1] and weight.stride(-1) == 1:
            return gemv.linear(x, weight, bias)
    return ref.linear_reference(x, weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual) * weight, x + residual)."""
    k = _layer_ops(x.device)
    return (k.rms_norm if k else ref.rms_norm_reference)(x, weight, eps, residual)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, 1, D] rotated by cos/sin [B, 1, R]."""
    k = _layer_ops(x.device)
    return (k.rope if k else ref.rope_reference)(x, cos, sin)


def rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  keys: torch.Tensor, values: torch.Tensor, slot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step's q and k [B, H, 1, D] rotated by cos/sin [B, 1, R], and the rotated k with v written into the
    cache keys/values [B, Hkv, L, D] at device slots [B]: (q, k) rotated."""
    kern = _layer_ops(q.device)
    return (kern.rope_write_kv if kern else ref.rope_write_kv_reference)(q, k, v, cos, sin, keys, values, slot)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    k = _layer_ops(gate.device)
    return (k.silu_mul if k else ref.silu_mul_reference)(gate, up)


def write_kv(keys: torch.Tensor, values: torch.Tensor, slot: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Write one token's k/v [B, H, 1, D] into the cache keys/values [B, H, L, D] at device slots [B]."""
    kern = _layer_ops(k.device)
    (kern.write_kv if kern else ref.write_kv_reference)(keys, values, slot, k, v)


# -- SAAP's decode step (kernels/saap.py) -------------------------------------------------------------------------

def saap_append(buckets: torch.Tensor, ordinals: torch.Tensor, counts: torch.Tensor, centroids: torch.Tensor,
                k: torch.Tensor, pos: torch.Tensor, sink: int, window: int, newest_first: bool = False) -> None:
    """A decode step's keys k [B, Hkv, 1, D] at device positions pos [B]: each one's bucket recorded, and the key
    leaving the dense window appended to its bucket's list (sparsekv/saap/lists.py), in place."""
    if use_kernels(k.device):
        from sparsekv.kernels.saap import saap_append as kernel

        return kernel(buckets, ordinals, counts, centroids, k, pos, sink, window, newest_first)
    return ref.saap_append_reference(buckets, ordinals, counts, centroids, k, pos, sink, window, newest_first)


def bucket_logits(x: torch.Tensor, centroids: torch.Tensor, model: tuple | None = None,
                  append: ref.PendingAppend | None = None,
                  centroids_too: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """fp32 [B, Hq, C]: queries x [B, Hq, 1, D] scored against their KV head's buckets by the folded Q-model
    (w1, b1, w2, b2), else by the centroids' inner products. `append`: a decode step's `saap_append` with these
    centroids, carried out first (by the kernel, in the same launch). `centroids_too` (with a Q-model): the pair
    (its logits, the centroids' inner products), from the same launch."""
    if use_kernels(x.device):
        from sparsekv.kernels.saap import bucket_logits as kernel

        return kernel(x, centroids, model, append, centroids_too)
    return ref.bucket_logits_reference(x, centroids, model, append, centroids_too)


def bucket_select(scores: torch.Tensor, counts: torch.Tensor, buckets: torch.Tensor, ordinals: torch.Tensor,
                  probes: int, group: int, softmax: bool, newest_first: bool, cap: int, lo: int, hi: int,
                  bounds: ref.RowBounds | None = None, centroid_scores: torch.Tensor | None = None,
                  centroid_share: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """SAAP's selection from the bucket logits: the `probes` best buckets of each selection head (scores summed over
    its `group` query heads, each softmaxed first with `softmax`; with `centroid_scores` and a `centroid_share`,
    the first of `mixed_order`), their lists laid end to end best first, and the positions [B, Hs, cap]
    (-1 pads) of the keys in [lo, hi) (and each row's region from `bounds`) that land in them: the key at p goes to
    slot base[bucket[p]] + ordinals[p]. Also how many landed, summed over rows and heads (0-dim int32, on the
    device)."""
    if use_kernels(scores.device):
        from sparsekv.kernels.saap import bucket_select as kernel

        return kernel(scores, counts, buckets, ordinals, probes, group, softmax, newest_first, cap, lo, hi, bounds,
                      centroid_scores, centroid_share)
    return ref.bucket_select_reference(scores, counts, buckets, ordinals, probes, group, softmax, newest_first, cap,
                                       lo, hi, bounds, centroid_scores, centroid_share)
