"""Result JSON files, written whole or not at all (a stopped job never leaves half a file)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch


def write_json(path: str | Path, payload: Any) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    tmp.replace(path)
    return path


def device_label(device: str | torch.device) -> str:
    """What a result records as its device: "cpu", or the GPU's name (NVIDIA H100 80GB HBM3, ...): figures from
    different cards are compared only within one card."""
    device = torch.device(device)
    return str(device) if device.type != "cuda" else torch.cuda.get_device_name(device)
