"""matplotlib on demand (the optional `plot` extra), headless."""

from __future__ import annotations

from .errors import SparseKVError


def require_matplotlib():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SparseKVError("--plot needs matplotlib: pip install 'sparsekv[plot]'") from None
    return plt
