"""GQA pooling: how the query heads of a group choose keys, and the kernels' `pool` argument it maps to.

GROUP: one choice per KV head, made on the group's pooled scores (read once for the group). HEAD: one choice per
query head. Kernels take plain strings (they import nothing from the package): `kernel_pool` is the one place
that turns a Pooling into them.
"""

from __future__ import annotations

from enum import Enum

from .errors import SparseKVError


class Pooling(str, Enum):
    GROUP = "group"
    HEAD = "head"

    # the value, as results and option help spell it (a str mixin would print "Pooling.GROUP")
    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @classmethod
    def parse(cls, value: "Pooling | str") -> "Pooling":
        try:
            return cls(value)
        except ValueError:
            raise SparseKVError(f"unknown pooling {value!r}: use 'group' or 'head'") from None

    def kernel_pool(self, reduce: str) -> str | None:
        """A kernel's `pool` argument: the group's rows reduced by `reduce` ("sum", "max") for GROUP, None (one row
        per query head) for HEAD."""
        return reduce if self is Pooling.GROUP else None

    def group_size(self, q_heads: int, kv_heads: int) -> int:
        """Query heads pooled into one selection row."""
        return q_heads // kv_heads if self is Pooling.GROUP else 1
