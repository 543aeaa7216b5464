"""Bytes one decode step must read, the numerator of achieved GB/s and of the memory floor.

Three parts, all counted at the cache's dtype:
- `kv`: K and V of every attended key, once per selection head (a KV head serves its whole GQA group);
- `select`: the persistent state `select` reads: the method's index (codes, hashes, segment means, ...) or, for
  exact scoring (oracle), the keys themselves. Measured by running `select` once on the torch path under a
  dispatch mode that records which slices of the state's tensors its ops read (a gather, such as an exact
  re-rank's, counts the elements it takes); a method may instead define `select_bytes(state, sel) -> int`;
- `scores`: the fp32 score row the top-k ranks (one per candidate: token, block or bucket), written once and read
  once.
q, the output and the new token's writes are left out: a few KB against megabytes.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


from .. import ops
from ..selection import Selection

SCORE_BYTES = 4  # scores are ranked in fp32


@dataclass
class Traffic:
    kv: int
    select: int = 0
    scores: int = 0
    attended_total: int = 0  # attended (row, selection head, key) triples: the exact count behind `kv`
    select_source: str = "none"

    @property
    def total(self) -> int:
        return self.kv + self.select + self.scores

    def to_dict(self) -> dict:
        return {**asdict(self), "total": self.total}


def dense_traffic(batch: int, kv_heads: int, length: int, head_dim: int, itemsize: int) -> Traffic:
    n = batch * kv_heads * length
    return Traffic(kv=2 * n * head_dim * itemsize, attended_total=n)


def step_traffic(method, state, sel: Selection, q: torch.Tensor, batch: int, kv_heads: int, head_dim: int,
                 itemsize: int, select_bytes: int, select_source: str) -> Traffic:
    if sel.dense:
        t = dense_traffic(batch, kv_heads, sel.length, head_dim, itemsize)
        return Traffic(t.kv, select_bytes, 0, t.attended_total, select_source)
    heads = sel.heads(kv_heads)
    pos = sel.positions(batch, heads, device=q.device)
    attended = int((pos >= 0).sum())
    return Traffic(kv=2 * attended * head_dim * itemsize, select=select_bytes,
                   scores=2 * SCORE_BYTES * batch * heads * candidates(sel), attended_total=attended,
                   select_source=select_source)


def candidates(sel: Selection) -> int:
    """Entries one selection head's top-k ranks: tokens of the middle region, blocks, or buckets."""
    if sel.indices is not None:
        return sel.length - sel.sink - sel.window
    if sel.blocks is not None:
        return math.ceil(sel.length / max(sel.block_size, 1))
    if sel.buckets is not None:
        return sel.bucket_offsets.shape[-1] - 1
    return 0


def select_read_bytes(method, state, q: torch.Tensor, q_pre: torch.Tensor | None) -> tuple[int, str]:
    """(bytes of persistent state that `select` reads, how that was found)."""
    own = getattr(method, "select_bytes", None)
    if callable(own):
        return int(own(state, method.select(state, q, q_pre))), "method.select_bytes"
    watched = {t.untyped_storage().data_ptr() for t in _tensors((vars(state), vars(method))) if t.numel()}
    probe = _ReadProbe(watched)
    with _torch_path(), probe:
        method.select(state, q, q_pre)
    return sum(probe.seen.values()), "measured: state slices read by select's torch ops"


_GATHERS = (torch.ops.aten.index.Tensor, torch.ops.aten.gather.default, torch.ops.aten.index_select.default)


class _ReadProbe(TorchDispatchMode):
    """Records each distinct slice of a watched storage that a (non-view) op takes as input; a gather from one
    (advanced indexing, gather, index_select: e.g. an exact re-rank reading its candidates' keys) counts the
    elements it takes, not the whole source."""

    def __init__(self, storages: set[int]):
        super().__init__()
        self.storages, self.seen = storages, {}

    def _watched(self, t) -> bool:
        return isinstance(t, torch.Tensor) and t.device.type != "meta" and t.numel() > 0 \
            and t.untyped_storage().data_ptr() in self.storages

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ret = func._schema.returns
        if bool(ret) and ret[0].alias_info is not None and not ret[0].alias_info.is_write:
            return func(*args, **kwargs)  # a view reads nothing
        out = func(*args, **kwargs)
        gathered = func in _GATHERS and self._watched(args[0])
        if gathered:  # no more than the source holds: a lookup table indexed by codes is read once
            self.seen[("gather", len(self.seen))] = min(out.numel() * out.element_size(), _unique_bytes(args[0]))
        for t in tree_leaves((args[1:] if gathered else args, kwargs)):
            if self._watched(t):
                key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
                self.seen[key] = _unique_bytes(t)
        return out


def _unique_bytes(t: torch.Tensor) -> int:
    return math.prod(s for s, st in zip(t.shape, t.stride()) if st != 0) * t.element_size()  # broadcasts read once


def _tensors(obj, depth: int = 0):
    if depth > 4:
        return
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v, depth + 1)
    elif isinstance(obj, torch.nn.Module):
        yield from obj.parameters()
        yield from obj.buffers()


def _torch_path():
    """The torch references for the probe: Triton launches bypass the dispatcher, torch ops do not."""
    return ops.kernels(False)
