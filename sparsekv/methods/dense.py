"""Dense attention: every key, every step. The exact reference every table compares against."""

from ..pooling import Pooling
from ..selection import Selection
from .base import LayerState, Method, register


@register
class Dense(Method):
    name = "dense"
    summary = "exact attention over the whole cache"

    def __init__(self, budget: float = 1.0, sink: int | None = None, window: int | None = None,
                 pooling: Pooling | str | None = None, **options):
        # dense ignores the budget: it always reads everything
        super().__init__(budget=1.0, sink=0, window=0, pooling=pooling, **options)

    @classmethod
    def option_names(cls) -> frozenset[str]:
        return frozenset()  # every key, whatever the sink, window or pooling

    def select(self, state: LayerState, q, q_pre_rope) -> Selection:
        return state.selection(dense=True)

    def config(self):
        return {"method": self.name}
