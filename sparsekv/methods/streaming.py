"""StreamingLLM (Xiao et al., ICLR 2024): attention sinks + a recent window, nothing else.

Defaults follow the paper: 4 sink tokens; the window takes the rest of the budget.
"""

from ..errors import SparseKVError
from ..pooling import Pooling
from ..selection import Selection
from .base import LayerState, Method, register


@register
class Streaming(Method):
    name = "streaming"
    summary = "sink tokens + recent window (StreamingLLM)"
    default_sink = 4

    def __init__(self, budget: float = 1.0, sink: int | None = None, window: int | None = None,
                 pooling: Pooling | str | None = None, **options):
        super().__init__(budget=budget, sink=sink, window=window, pooling=pooling, **options)
        self.auto_window = window is None  # the window fills whatever the sink leaves of the budget
        if self.sink == 0 and window == 0:
            raise SparseKVError("streaming: --sink 0 with --window 0 attends no key; give one of them (or leave "
                                "--window out: it fills the budget)")

    def select(self, state: LayerState, q, q_pre_rope) -> Selection:
        """The first `sink` keys the layer may see and the newest ones (its whole window if that fits the budget)."""
        visible = state.length - state.start
        b = self.budget_tokens(state)
        if b >= visible:
            return state.selection(dense=True)
        window = b - self.sink if self.auto_window else self.window
        if window < 0 or self.sink + window > b:
            raise SparseKVError(f"sink ({self.sink}) + window ({window}) exceed the budget ({b} tokens)")
        return state.selection(sink=self.sink, window=window)

    def config(self):
        cfg = super().config()
        cfg["window"] = "budget - sink" if self.auto_window else self.window
        return cfg
