"""A stand-in for ``torch.cuda`` on a CPU-only torch, for tests of the runtime's GPU paths.

``StandInCuda(count=1).install(monkeypatch)`` makes ``torch.cuda`` report ``count`` GPUs and records
what the runtime does with them: which device it makes current, synchronizes, reads memory
counters of, and the generator states it reads and writes (each device has its own, a 16-byte
state filled with its index). Memory counters read 0; ``mem_get_info`` an empty 80 GiB device.
Anything that would need a real GPU (a CUDA tensor, a kernel) still fails, as it should: tensors
of ``device="cuda"`` come from ``FakeTensorMode`` in the tests that need them.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

__all__ = ["StandInCuda"]

GIB = 2**30


class StandInCuda:
    """``count`` stand-in GPUs; ``uuids`` their UUIDs (default: distinct)."""

    def __init__(self, count: int = 1, uuids: list[str] | None = None) -> None:
        self.count = count
        self.uuids = uuids or [f"GPU-stand-in-{i}" for i in range(count)]
        self.calls: list[tuple[str, Any]] = []  # (function, device index or value)
        self.current = 0
        self.rng = {i: torch.full((16,), i, dtype=torch.uint8) for i in range(count)}

    def _index(self, device: Any = None) -> int:
        if device is None:
            return self.current
        if isinstance(device, int):
            return device
        d = torch.device(device)
        return self.current if d.index is None else d.index

    # ---- what the runtime calls ----
    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def device_count(self) -> int:
        return self.count

    def set_device(self, device: Any) -> None:
        self.current = self._index(device)
        self.calls.append(("set_device", self.current))

    def current_device(self) -> int:
        return self.current

    def get_device_properties(self, device: Any = None) -> Any:
        i = self._index(device)
        return SimpleNamespace(name="Stand-in GPU", uuid=self.uuids[i], total_memory=80 * GIB, index=i)

    def synchronize(self, device: Any = None) -> None:
        self.calls.append(("synchronize", self._index(device)))

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        self.calls.append(("mem_get_info", self._index(device)))
        return 80 * GIB, 80 * GIB

    def _counter(self, name: str, device: Any = None) -> int:
        self.calls.append((name, self._index(device)))
        return 0

    def memory_allocated(self, device: Any = None) -> int:
        return self._counter("memory_allocated", device)

    def memory_reserved(self, device: Any = None) -> int:
        return self._counter("memory_reserved", device)

    def max_memory_allocated(self, device: Any = None) -> int:
        return self._counter("max_memory_allocated", device)

    def max_memory_reserved(self, device: Any = None) -> int:
        return self._counter("max_memory_reserved", device)

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        self.calls.append(("reset_peak_memory_stats", self._index(device)))

    def memory_stats(self, device: Any = None) -> dict[str, int]:
        self.calls.append(("memory_stats", self._index(device)))
        return {}

    def get_device_name(self, device: Any = None) -> str:
        return "Stand-in GPU"

    def get_rng_state(self, device: Any = "cuda") -> torch.Tensor:
        return self.rng[self._index(device)].clone()

    def set_rng_state(self, state: torch.Tensor, device: Any = "cuda") -> None:
        if state.device.type != "cpu" or state.dtype != torch.uint8:
            raise TypeError(f"RNG state must be a torch.ByteTensor on the CPU, got {state.dtype} on {state.device}")
        self.rng[self._index(device)] = state.clone()
        self.calls.append(("set_rng_state", self._index(device)))

    def install(self, monkeypatch: Any) -> "StandInCuda":
        """Put the stand-in's functions on ``torch.cuda`` for the test (monkeypatch undoes it)."""
        for name in ("is_available", "is_initialized", "device_count", "set_device", "current_device",
                     "get_device_properties", "synchronize", "mem_get_info", "memory_allocated", "memory_reserved",
                     "max_memory_allocated", "max_memory_reserved", "reset_peak_memory_stats", "memory_stats",
                     "get_device_name", "get_rng_state", "set_rng_state"):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))
        return self
