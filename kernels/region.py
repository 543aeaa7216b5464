"""The one device-side rule every kernel uses for the keys a row may see (references: sparsekv.patterns.window_start,
kernels/reference.py::window_start)."""

import triton
import triton.language as tl


@triton.jit
def window_first(length, span):
    """First key the newest of `length` keys may see under a sliding window of `span` keys (0: every key)."""
    return tl.where(span > 0, tl.maximum(length - span, 0), 0)


@triton.jit
def in_sparse_region(length, pos, span, sink, window):
    """Whether positions `pos` lie in a row's sparse region [start + sink, length - window), start its sliding
    window's first key (reference: kernels/reference.py::RowBounds.mask)."""
    return (pos >= window_first(length, span) + sink) & (pos < length - window)
