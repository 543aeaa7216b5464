"""matplotlib on demand (the optional `plot` extra), headless."""

from __future__ import annotations

from pathlib import Path

from .errors import SparseKVError


def require_matplotlib():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SparseKVError("--plot needs matplotlib: pip install 'sparsekv[plot]'") from None
    return plt


def save_figure(fig, path: Path, plt) -> Path:
    """Lay out, write (folders made as needed) and free a figure."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=150)
    plt.close(fig)
    return path
