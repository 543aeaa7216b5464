"""The naive top-k the kernels must match (a stable descending sort, its first k, sorted by index). It lives with
the other kernels' torch references in `kernels/reference.py`; re-exported here so the top-k package is whole."""

from ..reference import topk_reference

__all__ = ["topk_reference"]
