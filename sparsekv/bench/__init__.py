"""`sparsekv bench`: per-layer decode-step latency of every method against dense baselines and the memory floor, and
(`--e2e`) a whole model's decode speed per method."""

from .e2e import run_e2e
from .run import CPU_SEQ_CAP, PROTOCOL, SWEEP_SEQS, run_bench
from .shapes import SHAPES, Shape, from_model, from_name

__all__ = ["CPU_SEQ_CAP", "PROTOCOL", "SHAPES", "SWEEP_SEQS", "Shape", "from_model", "from_name", "run_bench",
           "run_e2e"]
