"""Matrix-product precision while fitting: the models' products may run on TF32 tensor cores (CUDA), the attention
targets and held-out metrics may not (TF32 keeps 10 mantissa bits of each input: enough for a model's gradient
steps, not for the exact attention a target is defined by, whose near-tied logits it can reorder)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch


@contextmanager
def tf32_matmul(on: bool) -> Iterator[None]:
    """fp32 matrix products on TF32 tensor cores (on) or in full fp32 (off) inside the block, restored after. No
    effect on the CPU."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = on
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
