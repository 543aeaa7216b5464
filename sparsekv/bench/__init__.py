"""`sparsekv bench`: per-layer decode-step latency of every method against dense baselines and the memory floor."""

from .run import CPU_SEQ_CAP, PROTOCOL, SWEEP_SEQS, run_bench
from .shapes import SHAPES, Shape, from_model, from_name

__all__ = ["CPU_SEQ_CAP", "PROTOCOL", "SHAPES", "SWEEP_SEQS", "Shape", "from_model", "from_name", "run_bench"]
