"""Device facts the kernels' launch plans read, cached per device: plans run at every decode step and layer."""

from __future__ import annotations

import torch

_SMS: dict[torch.device, int] = {}


def num_sms(device: torch.device) -> int:
    """Multiprocessors of a CUDA device."""
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[device]


_SMEM: dict[torch.device, int] = {}


def max_shared_mem(device: torch.device) -> int:
    """Shared memory one program may hold on a CUDA device, in bytes (the opt-in maximum: 227 KB on an H100 or H200,
    163 KB on an A100, 99 KB on consumer Ada and Ampere cards)."""
    if device not in _SMEM:
        import triton

        index = device.index if device.index is not None else torch.cuda.current_device()
        try:
            _SMEM[device] = int(triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"])
        except Exception:  # a driver that does not say: 0, which sends the plans to their smallest tiles
            _SMEM[device] = 0
    return _SMEM[device]
