"""Device facts the kernels' launch plans read, cached per device: plans run at every decode step and layer."""

from __future__ import annotations

import torch

_SMS: dict[torch.device, int] = {}


def num_sms(device: torch.device) -> int:
    """Multiprocessors of a CUDA device."""
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[device]
