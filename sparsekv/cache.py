"""The KV cache: preallocated K/V per layer plus the method's index state, updated as keys arrive.

No torch.cat per step (that costs O(t) copies at long context): K/V are written in place into buffers sized for
the whole run, as gpt-fast does. It is a transformers `Cache` so any HF model drives it; each `update` also
tells the attention function (through `active_cache`) which cache and layer state the coming call belongs to,
because transformers passes no cache to attention functions.
"""

from __future__ import annotations

import contextvars
from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from . import ops
from .errors import SparseKVError
from .methods.base import CacheShape, LayerState, Method
from .patterns import FULL, AttentionPattern, window_start
from .rope import rope_tables, unrotate

_ACTIVE: contextvars.ContextVar["SparseCache | None"] = contextvars.ContextVar("sparsekv_cache", default=None)


def active_cache() -> "SparseCache | None":
    return _ACTIVE.get()


# LayerState fields the cache itself keeps (K/V buffers, lengths): load_row copies the method's fields only
_CACHE_FIELDS = frozenset({"keys", "values", "lengths"})
PRE_ROPE = "sparsekv_pre_rope"  # cache_kwargs key of a decode step's keys before RoPE (the split step hands them)
WRITTEN = "sparsekv_written"  # cache_kwargs key: the decode step's K/V are at the slots already (ops.rope_write_kv)


@dataclass(frozen=True)
class StepEntry:
    """What one layer's selection adds to the statistics at any length: a graph replays its selections, so the
    decode loop adds the entries recorded while it was captured at every replayed step (DecodeStats.replay)."""

    span: int
    dense: bool
    selected: int  # host part of the count (0 when it lives on the device)
    sink: int
    window: int


@dataclass
class DecodeStats:
    """Running totals of what sparse decode steps read, for selectivity and the result JSON.

    A selection with padding counts its keys on the device: that count is summed into a device accumulator in place
    (inside a captured graph too) and read once, in `summary`, so the decode loop never waits for the GPU."""

    steps: int = 0  # (layer, step) pairs that went through a method's select
    available: float = 0.0  # keys the layer could see (its sliding window, else the cache), summed over those pairs
    selected: float = 0.0  # sparse-part keys (mean over heads) counted on the host, summed likewise
    sink: float = 0.0
    window: float = 0.0
    decode_path: str = ""  # how the decode steps ran (sparsekv.step.decode_path): "graph", "eager (why)", ...
    on_device: torch.Tensor | None = None  # the device-counted part of `selected`
    captured: list | None = None  # while a graph is captured: the StepEntry of each layer's selection

    def add_selection(self, sel) -> None:
        """One step's `Selection` (a dense one counts every visible key as selected, none as sink or window)."""
        if sel.dense:
            entry = StepEntry(sel.span, True, 0, 0, 0)
        else:
            count = 0
            if sel.counts_on_device():
                if self.on_device is None:  # fp64: exact sums of the counts (multiples of 1 / (rows x heads))
                    self.on_device = torch.zeros((), dtype=torch.float64, device=sel.device)
                sel.add_count(self.on_device)
            else:
                count = sel.selected_count()
            entry = StepEntry(sel.span, False, count, sel.sink, sel.window)
        if self.captured is not None:
            self.captured.append(entry)
        else:
            self.add(entry, sel.length)

    def add(self, e: StepEntry, length: int) -> None:
        visible = length - window_start(length, e.span)
        self.steps += 1
        self.available += visible
        self.selected += visible if e.dense else e.selected
        self.sink += e.sink
        self.window += e.window

    def replay(self, entries: list[StepEntry], length: int) -> None:
        for e in entries:
            self.add(e, length)

    def checkpoint(self) -> tuple:
        """The totals now, to `restore` after steps that turn out not to count (a step the decode loop queued
        ahead for a token it then did not need). The device part is copied behind the queued work, not read."""
        return (self.steps, self.available, self.selected, self.sink, self.window,
                None if self.on_device is None else self.on_device.clone())

    def restore(self, mark: tuple) -> None:
        """Back to a `checkpoint`'s totals. The device accumulator is set in place: captured graphs add into it."""
        self.steps, self.available, self.selected, self.sink, self.window, on_device = mark
        if self.on_device is not None:
            if on_device is None:
                self.on_device.zero_()
            else:
                self.on_device.copy_(on_device)

    def summary(self) -> dict:
        n = max(self.steps, 1)
        selected = self.selected + (float(self.on_device) if self.on_device is not None else 0.0)  # one read
        attended = self.sink + self.window + selected
        return {
            "sparse_steps": self.steps,
            "selectivity": attended / self.available if self.available else 1.0,
            "mean_attended": attended / n,
            "mean_selected": selected / n,
            "mean_sink": self.sink / n,
            "mean_window": self.window / n,
            "mean_context": self.available / n,
            "decode_path": self.decode_path,
        }


class SparseLayer(CacheLayerMixin):
    """One layer: K/V buffers [B, Hkv, max_len, D] and the method's state for this layer."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, cache: "SparseCache", layer_idx: int):
        super().__init__()
        self.cache, self.layer_idx = cache, layer_idx
        self.length = 0
        self.state: LayerState | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, H, _, D = key_states.shape
        c = self.cache
        self.dtype, self.device = key_states.dtype, key_states.device
        if c.kv is not None:  # buffers given (a shared prefill's): decode in them
            self.keys, self.values = c.kv[self.layer_idx]
        else:
            self.keys = torch.zeros(B, H, c.max_len, D, dtype=key_states.dtype, device=key_states.device)
            self.values = torch.zeros(B, H, c.max_len, value_states.shape[-1], dtype=value_states.dtype,
                                      device=value_states.device)
        shape = CacheShape(B, H, c.q_heads, D, c.max_len, key_states.dtype, key_states.device)
        if c.lengths is None:
            c.lengths = torch.zeros(B, dtype=torch.int32, device=key_states.device)
            c.slots = torch.zeros(B, dtype=torch.int32, device=key_states.device)
        self.state = c.method.new_state(self.layer_idx, shape)
        self.state.keys, self.state.values, self.state.length = self.keys, self.values, 0
        self.state.pattern = c.pattern(self.layer_idx)
        self.state.lengths, self.state.extent = c.lengths, c.extent
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, cache_kwargs: dict | None = None, *args,
               **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        c = self.cache
        n = key_states.shape[2]
        if n == 1 and c.step_pos is not None:  # a decode step: the write slot comes from the device
            if not (cache_kwargs or {}).get(WRITTEN):
                ops.write_kv(self.keys, self.values, c.slots, key_states, value_states)
            self._index(key_states, value_states, c.slots, (cache_kwargs or {}).get(PRE_ROPE))
            return self.keys, self.values
        start = self.length
        if start + n > c.max_len:
            raise SparseKVError(f"KV cache is full: {start} + {n} tokens exceed its {c.max_len} slots (raise max_len)")
        dst_k, dst_v = self.keys[:, :, start : start + n], self.values[:, :, start : start + n]
        if key_states.data_ptr() != dst_k.data_ptr():  # a shared prefill's keys are in place already
            dst_k.copy_(key_states)
        if value_states.data_ptr() != dst_v.data_ptr():
            dst_v.copy_(value_states)
        self.length = self.state.length = start + n
        c.lengths.fill_(self.length)
        self._index(key_states, value_states, start)
        return self.keys[:, :, : self.length], self.values[:, :, : self.length]

    def _index(self, k: torch.Tensor, v: torch.Tensor, pos: int | torch.Tensor,
               k_pre: torch.Tensor | None = None) -> None:
        """The method's append of keys k at pos; `k_pre`: the keys before RoPE where the caller has them (the split
        step), else they are rotated back when the method needs them."""
        c = self.cache
        if c.indexes(self.layer_idx):
            if not c.method.needs_pre_rope:
                k_pre = None
            elif k_pre is None:
                k_pre = c.pre_rope(k, pos, self.layer_idx)
            c.method.append(self.state, k, v, k_pre, pos)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if self.cache.step_pos is not None and query_length == 1:  # begin_step has counted the token already
            return self.length, 0
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.cache.max_len

    def reset(self) -> None:
        self.length = 0
        self.is_initialized = False
        self.keys = self.values = self.state = None


class SparseCache(Cache):
    """A cache whose layers hold preallocated K/V and the method state; pass it as the model's `cache` (or
    `past_key_values` before transformers 5.24; `models.cache_kwarg` picks).

    `dense_layers` are attended densely at every step (and not indexed); `rotary` (the model's rotary module) is
    needed only by methods that index pre-RoPE keys or queries; `patterns` (one per layer,
    `patterns.model_patterns(model)`) say what each layer may attend: every key when not given. `kv`: per layer
    (keys, values) buffers [B, Hkv, max_len, D] to use instead of allocating them (a shared prefill's).
    """

    def __init__(self, method: Method, num_layers: int, q_heads: int, max_len: int,
                 dense_layers: tuple[int, ...] | list[int] = (), rotary: torch.nn.Module | None = None,
                 patterns: list[AttentionPattern] | None = None,
                 kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None):
        if max_len <= 0:
            raise SparseKVError(f"max_len must be positive, got {max_len}")
        bad = [i for i in dense_layers if not 0 <= i < num_layers]
        if bad:
            raise SparseKVError(f"dense layer(s) {bad} out of range: the model has {num_layers} layers (0..{num_layers - 1})")
        if method.needs_pre_rope and rotary is None:
            raise SparseKVError(f"method {method.name!r} needs the model's rotary module to recover pre-RoPE keys")
        if patterns is not None and len(patterns) != num_layers:
            raise SparseKVError(f"{len(patterns)} attention patterns for {num_layers} layers")
        self.patterns = list(patterns) if patterns is not None else [FULL] * num_layers
        if kv is not None and (len(kv) != num_layers or any(k.shape[2] != max_len for k, _ in kv)):
            raise SparseKVError(f"given K/V buffers must be {num_layers} layers of {max_len} slots")
        self.kv = kv
        self.method, self.q_heads, self.max_len = method, q_heads, max_len
        self.lengths: torch.Tensor | None = None  # [B] int32 on the device: valid keys per row (all layers alike)
        self.slots: torch.Tensor | None = None  # [B] int32 on the device: where a decode step writes (lengths - 1)
        self.step_pos: int | None = None  # set by begin_step: the position the next one-token updates write
        self.extent: int | None = None  # set_extent
        self.dense_layers = frozenset(dense_layers)
        self.rotary = rotary
        self.stats = DecodeStats()
        # optional callable(layer_idx, query, keys, values, cache) run on every attention call (used by `dump`)
        self.recorder = None
        super().__init__(layers=[SparseLayer(self, i) for i in range(num_layers)])

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        _ACTIVE.set(self)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def begin_step(self, pos: int | Sequence[int]) -> None:
        """Before a decode step of one token per row at `pos` (an int for every row, or one per row): host lengths
        become the longest row's, pos + 1, and the device lengths are filled once, so each layer's write slot, its
        index update and its selection read them on the device, as a replayed CUDA graph does. Outside begin_step a
        one-token update writes at the host length."""
        last = pos if isinstance(pos, int) else max(pos)
        if last + 1 > self.max_len:
            raise SparseKVError(f"KV cache is full: position {last} is past its {self.max_len} slots (raise max_len)")
        self.step_pos = last
        for layer in self.layers:
            if layer.is_initialized:
                layer.length = layer.state.length = last + 1
        if self.lengths is None:
            return
        if isinstance(pos, int):
            self.lengths.fill_(pos + 1)
            self.slots.fill_(pos)
        else:
            if len(pos) != self.lengths.shape[0]:
                raise SparseKVError(f"{len(pos)} positions for a batch of {self.lengths.shape[0]} rows")
            self.slots.copy_(torch.tensor(pos, dtype=torch.int32), non_blocking=True)
            torch.add(self.slots, 1, out=self.lengths)

    def load_row(self, row: int, batch: int, src: "SparseCache") -> None:
        """Take a one-row cache's prompt (its K/V and the method's index of it, e.g. a prefill) as row `row` of this
        batch of `batch` rows: prompts of different lengths are prefilled and indexed alone, then decode together,
        each row at its own length. The method state's per-row tensors are those whose first dimension is the batch
        (`batch` here, 1 in `src`); they are copied over the part both cover. Host lengths become the longest
        row's; rows decode in regions sized to the cache (`set_extent`), masked per row on the device."""
        if batch < 2 or not 0 <= row < batch:
            raise SparseKVError(f"row {row} of a batch of {batch}: load_row builds batches of 2 or more rows")
        for layer, one in zip(self.layers, src.layers):
            if not one.is_initialized:
                raise SparseKVError("load_row: the one-row cache holds no prompt")
            n = one.length
            if n > self.max_len:
                raise SparseKVError(f"a prompt of {n} tokens does not fit the batch cache's {self.max_len} slots")
            if not layer.is_initialized:
                H, D = one.keys.shape[1], one.keys.shape[3]
                layer.lazy_initialization(one.keys.new_empty(batch, H, 0, D), one.values.new_empty(batch, H, 0, D))
            layer.keys[row, :, :n] = one.keys[0, :, :n]
            layer.values[row, :, :n] = one.values[0, :, :n]
            for f in fields(layer.state):
                dst, part = getattr(layer.state, f.name), getattr(one.state, f.name)
                if f.name in _CACHE_FIELDS or not isinstance(dst, torch.Tensor) or not isinstance(part, torch.Tensor):
                    continue
                if dst.dim() == part.dim() and dst.shape[0] == batch and part.shape[0] == 1:
                    common = tuple(slice(0, min(a, b)) for a, b in zip(dst.shape[1:], part.shape[1:]))
                    dst[row][common] = part[0][common]
            layer.length = layer.state.length = max(layer.length, n)
        self.lengths[row] = src.layers[0].length
        self.slots[row] = src.layers[0].length - 1
        self.set_extent(self.max_len)

    def release(self) -> None:
        """Free the K/V buffers and method states now (a finished generation), not when the garbage collector
        breaks the cache's reference cycles."""
        for layer in self.layers:
            layer.reset()
        self.lengths = self.slots = self.kv = None
        if _ACTIVE.get() is self:  # the attention function's pointer would keep the buffers alive
            _ACTIVE.set(None)

    def fix_budget(self) -> None:
        """Hold a fractional budget at its share of what each layer sees now (after the prompt) for the rest of the
        generation: k stays fixed, so a captured step stays valid."""
        for layer in self.layers:
            if layer.is_initialized:
                layer.state.budget_context = layer.state.length - layer.state.start

    def regime(self) -> tuple:
        """What the host decides for a step at the current length, and a captured graph holds fixed: for each layer
        that runs the method, whether its budget is below the keys it sees (else the step reads them all)."""
        out = []
        for i, layer in enumerate(self.layers):
            if layer.is_initialized and self.runs_method(i):
                st = layer.state
                out.append(self.method.budget_tokens(st) < st.length - st.start)
        return tuple(out)

    def set_extent(self, extent: int | None) -> None:
        """Size every layer's selection region to `extent` cache slots (a step about to be captured as a CUDA graph,
        replayed at lengths up to it), or back to each step's exact length (None). Layers initialised later take it
        too."""
        self.extent = extent
        for layer in self.layers:
            if layer.is_initialized:
                layer.state.extent = extent

    def indexes(self, layer_idx: int) -> bool:
        """Whether this layer keeps the method's index (dense layers do not)."""
        return layer_idx not in self.dense_layers

    def runs_method(self, layer_idx: int) -> bool:
        """Whether a decode step of this layer goes through the method's select (not for dense layers, nor for the
        dense method, whose steps are not counted in the statistics)."""
        return self.indexes(layer_idx) and self.method.name != "dense"

    def pattern(self, layer_idx: int) -> AttentionPattern:
        return self.patterns[layer_idx]

    def layer_state(self, layer_idx: int) -> LayerState:
        return self.layers[layer_idx].state

    def pre_rope(self, x: torch.Tensor, start: int | torch.Tensor, layer_idx: int) -> torch.Tensor:
        """Rotate layer `layer_idx`'s post-RoPE x [B, H, n, D] at positions [start, start + n) back to pre-RoPE
        (`start` an int, or a device tensor [B] of each row's first position)."""
        B, n = x.shape[0], x.shape[2]
        if isinstance(start, int):
            pos = torch.arange(start, start + n, device=x.device).unsqueeze(0).expand(B, n)
        else:
            pos = start.long().view(B, 1) + torch.arange(n, device=x.device)
        cos, sin = rope_tables(self.rotary, x, pos, self.pattern(layer_idx).rope)
        return unrotate(x, cos, sin)
