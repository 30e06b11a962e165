"""A rank's measured peak memory per step, defined as the plan's ``rank_memory`` predicts it.

- CPU: the process's peak resident set (``VmHWM``) during the step, above a baseline: the resident
  set once this rank's stage is built (``rebase``), less the bytes of the tensors the stage holds
  then (its parameters and buffers), and less the file-backed pages mapped since (``RssFile``: the
  library code the first steps run, which the page cache decides the size of, not the model). So
  the figure counts every tensor the rank holds, and what the allocator holds for them, but not the
  host-side Python objects of the traced graph, which on a GPU would not be in device memory
  either. The peak is reset at each step start (``/proc/self/clear_refs``), so each step reports its
  own peak. With freed memory kept in the process (``keep_freed_memory``, as the runtime does when
  asked to measure memory:
  ``init_dist(exact_memory=True)``), what the process once held stays resident, so this is the
  high-water mark of the heap: what the OS has to give the rank, and what the plan predicts. Under
  glibc's own settings (a job's default: they are faster) the heap's free blocks stay resident
  too and its peak reads well above the tensors' (1.2-1.7x on a GPT-2 pipeline's ranks):
  ``PeakMemory.exact`` is False then, and the step log sets no plan beside it.
- CUDA: what the process holds on its GPU at the step's peak: torch's caching allocator's peak
  *reserved* bytes (the tensors, the allocator's cached-but-free slack, cuBLAS workspaces), plus
  what the process holds outside the allocator (CUDA context, NCCL's buffers), read for this
  process alone from NVML (``process_device_bytes``: its usage less torch's reserved bytes), never
  device-wide: another process on the GPU (the one that profiled, say) is not this rank's. Where
  NVML cannot see the process (no ``pynvml``, a container's PID namespace), the outside part is 0
  and ``outside_known`` is False. The peak allocated bytes are kept too (``PeakMemory.detail``).

The step's peak includes its optimizer step. The trainer reads the peak once per step, with the
loss, before the optimizer steps (whether to step depends on that read); so each ``reset`` (at the
next step's start) keeps what was held after that read, the previous step's optimizer step, and
``read`` reports the larger of it and the step so far. A read after ``Trainer.step`` returns (the
reserve probe, the doctor) covers the whole step. The first step reports no optimizer step (none
ran before it): compare steps after the first.

Example:
    >>> peak = PeakMemory(torch.device("cpu"))
    >>> peak.reset(); x = torch.ones(1 << 20); peak.read() >= 0
    True
"""

from __future__ import annotations

import gc
import os
import re
import sys
from dataclasses import dataclass

import torch

from ...costs.devices import heap_kept, release_freed_memory

__all__ = ["PeakMemory", "PeakDetail", "process_device_bytes", "resident_bytes"]


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


def file_resident_bytes() -> int:
    """The file-backed part of the resident set now: mapped library code and files (0 where unknown)."""
    kib = _status_kib("RssFile")
    return 1024 * kib if kib is not None else 0


def process_device_bytes(device: torch.device) -> int | None:
    """Bytes this process holds on GPU ``device`` as the driver counts them (NVML's per-process
    figure: context, allocator segments, NCCL), or None where NVML is missing or does not list this
    process (a container's PID namespace hides it)."""
    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid == os.getpid() and proc.usedGpuMemory:
                return int(proc.usedGpuMemory)
    except (pynvml.NVMLError, AttributeError, RuntimeError):
        return None
    return None


@dataclass(frozen=True)
class PeakDetail:
    """The CUDA counters behind a peak (bytes): torch's allocated and reserved peaks, and what the
    process held outside the allocator; on a CPU allocated = reserved = the resident peak."""

    allocated: int = 0
    reserved: int = 0
    outside: int = 0


class PeakMemory:
    """Per-step peak memory of this rank, in bytes above its baseline (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        # whether the peak counts what the plan counts: a GPU's allocator does; a CPU heap only when kept
        self.exact = self.cuda or heap_kept()
        self.outside_allocator = 0
        self.outside_known = not self.cuda
        self.baseline = 0 if self.cuda else resident_bytes()
        self.file_baseline = 0 if self.cuda else file_resident_bytes()
        self.supported = self.cuda or (sys.platform.startswith("linux") and _status_kib("VmHWM") is not None)
        self.detail = PeakDetail()
        self._tail = PeakDetail()  # held after the last read: the optimizer step of the step read
        self._seen = PeakDetail()  # this step's window up to its last read
        self._read_once = False

    def rebase(self, tensor_bytes: int) -> None:
        """Take the CPU baseline now, with the stage built and holding ``tensor_bytes`` of tensors."""
        if not self.cuda:
            # Free heap left by building the stage (tracing, loading) would be reused by the steps
            # without growing the resident set: return it first, so the steps' growth is counted.
            gc.collect()
            release_freed_memory()
            self.baseline = resident_bytes() - int(tensor_bytes)
            self.file_baseline = file_resident_bytes()

    def reset(self) -> None:
        """Start a new step's window (each step calls it first), keeping what the last step held
        after its read (its optimizer step) to report with this one."""
        self._tail = self._window() if self._read_once else PeakDetail()
        self._seen = PeakDetail()
        self._restart()

    def read(self) -> int:
        """The step's peak so far above the baseline, its optimizer step included (the last step's
        where the read comes before this one's); 0 where it cannot be measured."""
        self._seen = _larger(self._seen, self._window())
        self._restart()
        self._read_once = True
        self.detail = _larger(self._seen, self._tail)
        return self.detail.reserved + self.detail.outside

    # --- one measurement window -------------------------------------------------------------
    def _restart(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current resident set
        except OSError:
            pass

    def _window(self) -> PeakDetail:
        """The peak since the last restart."""
        if self.cuda:
            reserved = int(torch.cuda.max_memory_reserved(self.device))
            used = process_device_bytes(self.device)
            if used is not None:
                # context and NCCL only grow (communicators appear at first use): keep the largest
                self.outside_allocator = max(self.outside_allocator, used - int(torch.cuda.memory_reserved(self.device)))
                self.outside_known = True
            return PeakDetail(int(torch.cuda.max_memory_allocated(self.device)), reserved, self.outside_allocator)
        kib = _status_kib("VmHWM")
        # File-backed pages mapped since the baseline are the library code the steps first run (torch's
        # backward kernels, say), not the rank's data: 5-11 MB on a GPT-2 stage here, more where the page
        # cache maps more around each fault. Not a tensor, so not what the plan predicts: left out.
        code = max(0, file_resident_bytes() - self.file_baseline)
        rss = max(0, 1024 * kib - self.baseline - code) if kib is not None else 0
        return PeakDetail(rss, rss, 0)


def _larger(a: PeakDetail, b: PeakDetail) -> PeakDetail:
    return PeakDetail(max(a.allocated, b.allocated), max(a.reserved, b.reserved), max(a.outside, b.outside))
