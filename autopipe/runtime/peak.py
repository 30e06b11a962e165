"""A rank's measured peak memory per step, defined as the plan's ``rank_memory`` predicts it.

- CPU: the process's peak resident set (``VmHWM``) during the step, above a baseline: the resident
  set once this rank's stage is built (``rebase``), less the bytes of the tensors the stage holds
  then (its parameters and buffers). So the figure counts every tensor the rank holds, and what
  the allocator holds for them, but not the host-side Python objects of the traced graph, which on
  a GPU would not be in device memory either. The peak is reset at each step start
  (``/proc/self/clear_refs``), so each step reports its own peak. With freed memory kept in the
  process (``keep_freed_memory``, as the runtime does), what the process once held stays resident,
  so this is the high-water mark of the heap: what the OS has to give the rank.
- CUDA: ``torch.cuda.max_memory_allocated`` during the step, plus what the device holds outside
  torch's allocator (CUDA context, NCCL, cuBLAS workspaces), measured at the baseline as the used
  device memory less torch's reserved bytes. Not yet verified on a GPU.

Example:
    >>> peak = PeakMemory(torch.device("cpu"))
    >>> peak.reset(); x = torch.ones(1 << 20); peak.read() >= 0
    True
"""

from __future__ import annotations

import gc
import re
import sys

import torch

from ..costs.devices import release_freed_memory

__all__ = ["PeakMemory", "resident_bytes"]


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            m = re.search(rf"^{field}:\s+(\d+)\s+kB", f.read(), re.M)
    except OSError:
        return None
    return int(m.group(1)) if m else None


def resident_bytes() -> int:
    """The process's resident set now (0 where /proc is missing)."""
    kib = _status_kib("VmRSS")
    return 1024 * kib if kib is not None else 0


class PeakMemory:
    """Per-step peak memory of this rank, in bytes above its baseline (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.outside_allocator = 0
        if self.cuda:
            free, total = torch.cuda.mem_get_info(self.device)
            self.outside_allocator = max(0, total - free - torch.cuda.memory_reserved(self.device))
            self.baseline = 0
        else:
            self.baseline = resident_bytes()
        self.supported = self.cuda or (sys.platform.startswith("linux") and _status_kib("VmHWM") is not None)

    def rebase(self, tensor_bytes: int) -> None:
        """Take the CPU baseline now, with the stage built and holding ``tensor_bytes`` of tensors."""
        if not self.cuda:
            # Free heap left by building the stage (tracing, loading) would be reused by the steps
            # without growing the resident set: return it first, so the steps' growth is counted.
            gc.collect()
            release_freed_memory()
            self.baseline = resident_bytes() - int(tensor_bytes)

    def reset(self) -> None:
        """Start a new measurement window (each step calls it first)."""
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current resident set
        except OSError:
            pass

    def read(self) -> int:
        """The peak since ``reset()``, above the baseline; 0 where it cannot be measured."""
        if self.cuda:
            return int(torch.cuda.max_memory_allocated(self.device)) + self.outside_allocator
        kib = _status_kib("VmHWM")
        return max(0, 1024 * kib - self.baseline) if kib is not None else 0
