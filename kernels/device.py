"""Device facts the kernels' launch plans read, cached per device (plans run at every decode step and layer), and the
programmatic dependent launch of the decode step's kernels."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

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


# -- programmatic dependent launch --------------------------------------------------------------------------------
# A decode step is a few hundred short launches in one CUDA graph; between two of them the GPU idles while the
# second launches. On sm_90 and later a kernel launched as a programmatic dependent may be scheduled before the
# kernel ahead of it in the stream has finished. Each of our kernels so launched starts every program with
# `wait_for_prior`, which waits (griddepcontrol.wait) until the kernel ahead has finished and its writes are visible:
# no program reads a predecessor's output early, and since each kernel waits for the one ahead, none reads an
# earlier kernel's output early either. Kernels that do not wait (torch's, or ours without the option) are launched
# the ordinary way, so the chain holds through them.
#
# When the next kernel may launch: as soon as every program of this one has passed its wait ("early"), or as they
# exit. Launched early, the next kernel's programs settle on whichever SMs have room while this one still runs; a
# kernel whose grid is sized to the SM count (flash-decoding's chunks, the page scores, the select's chunks) then
# finds some SMs still busy and runs slower (on an H200, dense decoding at 131072 tokens lost 0.35 ms a token). So only
# the linear layers launch their successors early: those are the small elementwise kernels (norm, RoPE and the K/V
# write, SiLU) and the greedy pick, which do not care where their programs land (benchmarks/BENCHMARKS.md).

_CAPABLE: dict[torch.device, bool] = {}
_dependent: bool | None = None

WAIT_EARLY, WAIT_EXIT = 1, 2  # the kernels' PDL constexpr (0: an ordinary launch)


def set_dependent_launch(on: bool | None) -> None:
    """Launch the decode kernels as programmatic dependents where the device can (True), never (False), or as
    SPARSEKV_PDL says (None, the default: on unless it is 0). Graphs captured before keep their launches."""
    global _dependent
    _dependent = on


def dependent_launch(device: torch.device, early: bool = False) -> dict:
    """The launch options of a kernel that starts with `wait_for_prior(PDL)`: on a CUDA device of compute capability
    9.0 or later (not under the interpreter), PDL (WAIT_EARLY with `early`, else WAIT_EXIT) and launch_pdl; else
    none (the kernel's PDL=0 default)."""
    on = _dependent if _dependent is not None else os.environ.get("SPARSEKV_PDL", "1") != "0"
    if not on or device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return {}
    if device not in _CAPABLE:
        _CAPABLE[device] = torch.cuda.get_device_capability(device)[0] >= 9
    return {"PDL": WAIT_EARLY if early else WAIT_EXIT, "launch_pdl": True} if _CAPABLE[device] else {}


@triton.jit
def wait_for_prior(PDL: tl.constexpr):
    """A kernel's first statement: with PDL, wait for the kernel ahead (and with WAIT_EARLY let the next launch)."""
    if PDL != 0:
        tl.extra.cuda.gdc_wait()
        if PDL == 1:  # WAIT_EARLY
            tl.extra.cuda.gdc_launch_dependents()
