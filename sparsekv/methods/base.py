"""The method interface: every method is a small class with the same life cycle (DESIGN.md, "The method interface").

The cache, the attention function, eval and bench only ever call `new_state`, `append` and `select`, so they never
branch on method names. A method implements its own maths and nothing the runtime already does.

What `append` and `select` may do, so that a whole decode step can be captured as one CUDA graph and replayed for
every token (sparsekv/step.py):
- allocate nothing persistent: `new_state` preallocates the state for the cache's capacity;
- never read a device value on the host (no `.item()`, `int(tensor)`, `.tolist()`, data-dependent shapes, Python
  branches on tensor values);
- in a decode step, `append` gets the write slots as a device tensor [B] (`write_at` takes both forms); it may
  leave its work in `state.pending` for the step's `select` to do in the launch that scores the query (`spotlight`
  / `lsh` hash the new key with the queries, `adamas` codes it with them, `saap` files it with the query model's
  logits; `take_pending` hands it over): every decode step of a layer that indexes selects after it appends, and a
  select that reads every key, or the next append, does it alone (`flush`, through the method's `carry_out`);
- decide on the host only what stays fixed while the context grows past the budget: `split` (dense or not, k, sink,
  window) does; the region the sparse part comes from is `BudgetSplit.lo/hi`, exact in an eager step, sized to the
  cache in a captured one, with `BudgetSplit.keep` / `masked` marking on the device the positions of this step;
- build selections with `split.selection(...)` or `state.selection(...)`, which carry the device lengths the kernels
  read;
- run kernels through `sparsekv.ops` (one dispatch point per op: the Triton kernel or its torch reference);
- give every per-row tensor of the state the batch as its first dimension, and shared ones (per layer, per head)
  none: a batch of prompts of different lengths takes each row's state from a one-row cache (`SparseCache.load_row`).
  A row shorter than the region a step selects over may be handed positions outside its own; the kernels read
  nothing there, so the row attends what it would alone.
Tests run every method through the split step in "static" mode (exactly what a graph replays) against the eager
transformers call (tests/test_step.py).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..errors import SparseKVError
from ..patterns import FULL, AttentionPattern
from ..pooling import Pooling
from ..selection import BudgetSplit, Selection, resolve_budget, split_budget


@dataclass(frozen=True)
class CacheShape:
    """What a layer state is allocated for."""

    batch: int
    kv_heads: int
    q_heads: int
    head_dim: int
    max_len: int
    dtype: torch.dtype
    device: torch.device


@dataclass
class LayerState:
    """Per-layer state. The cache fills `keys`/`values` (its preallocated buffers) and keeps `length` current;
    methods subclass this to hold their index (codes, hashes, segment means, ...)."""

    keys: torch.Tensor | None = None  # [B, Hkv, max_len, D], valid up to `length`
    values: torch.Tensor | None = None
    length: int = 0
    pattern: AttentionPattern = FULL  # what the layer may attend (its sliding window, softcapping, scale)
    # The device side of `length` ([B] int32, kept by the cache), and the cache slots a graph-replayed step covers
    # (None: an eager step, whose host `length` is exact). A method's `append`/`select` must never read them back
    # to the host; what they compute from the host `length` is fixed for a captured graph (selection.BudgetSplit).
    lengths: torch.Tensor | None = None
    extent: int | None = None
    # what a fractional budget is a fraction of for a whole generation (the keys the layer saw after the prompt),
    # so k stays fixed while it decodes; None: the keys it sees now
    budget_context: int | None = None
    # a decode step's append a method left for the step's select to carry out in its own launch (`Method.flush`)
    pending: Any = None

    @property
    def start(self) -> int:
        """First key the newest query may attend: methods choose among [start, length) only."""
        return self.pattern.start(self.length)

    def selection(self, **parts) -> Selection:
        """A Selection for this step (sink=, window=, blocks=, dense=, ...) with the layer's span and the step's
        device lengths and extent filled in."""
        return Selection(self.length, span=self.pattern.span, lengths=self.lengths, extent=self.extent, **parts)


class Method:
    """Base of every method. Subclasses set `name`, defaults, and override what they need."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    default_sink: ClassVar[int] = 0
    default_window: ClassVar[int] = 0
    default_pooling: ClassVar[Pooling] = Pooling.GROUP
    needs_pre_rope: ClassVar[bool] = False  # the cache un-rotates keys/queries only for methods that ask
    needs_artifact: ClassVar[bool] = False

    @classmethod
    def pooling_for(cls, pooling: Pooling | str | None) -> Pooling:
        """The pooling the method runs with: `pooling` when given, else its default."""
        return Pooling.parse(cls.default_pooling if pooling is None else pooling)

    def __init__(self, budget: float = 1.0, sink: int | None = None, window: int | None = None,
                 pooling: Pooling | str | None = None, **options: Any):
        if options:
            raise SparseKVError(f"method {self.name!r} has no option(s) {', '.join(sorted(options))}")
        if budget <= 0:
            raise SparseKVError(f"budget must be positive, got {budget}")
        self.pooling = self.pooling_for(pooling)
        self.budget = budget
        self.sink = self.default_sink if sink is None else int(sink)
        self.window = self.default_window if window is None else int(window)
        if self.sink < 0 or self.window < 0:
            raise SparseKVError("sink and window must be >= 0")

    @classmethod
    def option_names(cls) -> frozenset[str]:
        """The options this method takes: its constructor's named parameters, the budget aside."""
        params = inspect.signature(cls.__init__).parameters.values()
        return frozenset(p.name for p in params if p.name not in ("self", "budget") and p.kind is not p.VAR_KEYWORD)

    @classmethod
    def stand_in(cls, budget: float, num_layers: int, kv_heads: int, head_dim: int, **options: Any) -> "Method":
        """The method for a speed run without its artifact (bench on random weights): fitted values do not change
        the work a step does. A method that needs an artifact takes `untrained` values of its fitted state instead,
        or refuses when it has none."""
        if cls.needs_artifact and options.get("artifact") is None:
            fitted = cls.untrained(num_layers, kv_heads, head_dim)
            if fitted is None:
                raise SparseKVError(f"method {cls.name!r} needs a fitted artifact (--artifact)")
            options = {**options, **fitted}
        return cls(budget=budget, **options)

    @classmethod
    def untrained(cls, num_layers: int, kv_heads: int, head_dim: int) -> dict[str, Any] | None:
        """Constructor arguments standing in for the artifact of a method that needs one (`stand_in`): random
        fitted state of its paper's sizes, or None when it cannot stand in."""
        return None

    # -- offline ---------------------------------------------------------------------------------------------
    def fit(self, acts: Any, cfg: Any) -> Any:
        """Offline stage; training-free methods have none."""
        return None

    # -- online ----------------------------------------------------------------------------------------------
    artifact: str | None = None  # the fitted artifact's version folder, for methods that load one
    _bound: Any = None  # the model that artifact was checked against

    def bind(self, lm: Any) -> None:
        """Called by the runtime with the LoadedModel before use: an artifact fitted on another model is refused
        (one line from the artifact store naming what differs), once per model."""
        if self.artifact is None or self._bound is lm:
            return
        from ..artifacts import load_artifact

        load_artifact(self.artifact, method=self.name, model_fingerprint=lm.fingerprint(), verify=False)
        self._bound = lm

    def new_state(self, layer: int, shape: CacheShape) -> LayerState:
        return LayerState()

    def append(self, state: LayerState, k: torch.Tensor, v: torch.Tensor, k_pre_rope: torch.Tensor | None,
               pos: int | torch.Tensor) -> None:
        """Index keys [B, Hkv, n, D] that were just written at positions [pos, pos + n). `pos` is a host int, or in
        a decode step (n = 1) the device tensor [B] of each row's write slot (`write_at` takes both)."""

    def select(self, state: LayerState, q: torch.Tensor, q_pre_rope: torch.Tensor | None) -> Selection:
        raise NotImplementedError

    # -- a decode step's append left pending (module docstring) ------------------------------------------------
    def flush(self, state: LayerState) -> None:
        """Carry out the append left in `state.pending` on its own (one launch): the next append and a select that
        does not take it call this first."""
        pending = self.take_pending(state)
        if pending is not None:
            self.carry_out(state, pending)

    def carry_out(self, state: LayerState, pending: Any) -> None:
        """Do the work of a pending append alone: methods that leave one implement this."""
        raise NotImplementedError(f"{self.name} leaves no append pending")

    @staticmethod
    def is_step_key(k: torch.Tensor, pos) -> bool:
        """Whether `append` got a decode step's key (one a row, at device positions): what a method may leave
        pending."""
        return isinstance(pos, torch.Tensor) and k.shape[2] == 1

    @staticmethod
    def take_pending(state: LayerState) -> Any:
        """The pending append, cleared from the state: for the launch that carries it out with the select's work."""
        pending, state.pending = state.pending, None
        return pending

    # -- shared helpers --------------------------------------------------------------------------------------
    def split(self, state: LayerState) -> BudgetSplit:
        """This step's budget over the keys the layer may see (BudgetSplit.lo/hi bound the sparse part's region)."""
        return split_budget(self.budget, self.sink, self.window, state.length, state.pattern.span, state.lengths,
                            state.extent, state.budget_context, self.name)

    def budget_tokens(self, state: LayerState) -> int:
        """The budget in keys at this step (a fraction resolved against `state.budget_context` when it is set)."""
        return resolve_budget(self.budget, state.budget_context or state.length - state.start)

    def config(self) -> dict[str, Any]:
        """Everything that defines the method's behaviour: recorded in every result and artifact."""
        return {"method": self.name, "budget": self.budget, "sink": self.sink, "window": self.window,
                "pooling": self.pooling.value}


def flag_of(what: str) -> str:
    """" (--name)": the command-line flag of the option a message names at its end ("lsh: head_top"), so that it
    reads for library callers (the keyword) and CLI users (the flag) alike; "" when `what` is a flag already."""
    name = what.rsplit(": ", 1)[-1]
    return "" if name.startswith("--") else f" (--{name.replace('_', '-')})"


def whole_option(value: Any, least: int, what: str) -> int:
    """A method's integer option `value`, checked: a whole number >= `least` (its off value), else SparseKVError."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise SparseKVError(f"{what} must be a whole number >= {least} ({least} = off), got {value!r}{flag_of(what)}")
    return value


def margin_option(value: Any, what: str) -> float:
    """A method's non-negative number option `value` (a margin; 0 = off), checked: a finite number >= 0, else
    SparseKVError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
        raise SparseKVError(f"{what} must be a number >= 0 (0 = off), got {value!r}{flag_of(what)}")
    return float(value)


def write_at(buf: torch.Tensor, pos: int | torch.Tensor, x: torch.Tensor) -> None:
    """Write x [B, H, n, ...] into buf [B, H, L, ...] at positions [pos, pos + n): `pos` an int (every row), or for
    one token (n = 1) a device tensor [B] of per-row positions (a graph-replayed step's write slots)."""
    if isinstance(pos, int):
        buf[:, :, pos : pos + x.shape[2]] = x
        return
    if x.shape[2] != 1:
        raise SparseKVError(f"device positions write one token per row, got {x.shape[2]}")
    buf[torch.arange(buf.shape[0], device=buf.device), :, pos.long()] = x[:, :, 0]


REGISTRY: dict[str, type[Method]] = {}


def register(cls: type[Method]) -> type[Method]:
    REGISTRY[cls.name] = cls
    return cls


def method_names() -> list[str]:
    from . import _load_all  # noqa: F401  (import side effect: every method registers itself)

    return sorted(REGISTRY)


def get_method(name: str, **cfg: Any) -> Method:
    names = method_names()
    if name not in REGISTRY:
        raise SparseKVError(f"unknown method {name!r}; available: {', '.join(names)}")
    return REGISTRY[name](**cfg)
