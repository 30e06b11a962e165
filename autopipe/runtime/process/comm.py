"""Every collective the runtime makes, on this rank's device, and the one host read per step.

Why one module: NCCL accepts only tensors on the rank's GPU, so a tensor made without ``device=``
(it lands on the CPU) trains fine on the CPU test bed and fails on the first GPU cluster. Routing
the runtime's collectives through :class:`Comm` puts the rule in one place, and its checking mode
makes that class of bug fail on a CPU too:

- every tensor handed to a collective, and every input of a pipeline stage (``check``), must be
  on ``comm.device``; anything else is an :class:`AutopipeError` naming the call and the device;
- inside ``comm.step()`` the default device is ``meta`` when the rank's device is the CPU, so a
  tensor created without a device there is not silently right: it lands on meta and the next
  collective or stage input refuses it;
- inside ``comm.step()`` every device-to-host read (``.item()``, ``float(t)``, ``bool(t)``,
  ``.tolist()``, ``.cpu()``) outside ``comm.host_read()`` is counted, and the step fails if there
  was one: the step loop may wait for the device once, at the per-step logging reduction.

Checking mode is a debugging aid (``train.py --check`` or ``AUTOPIPE_CHECK=1``): it makes each
step slower (every operator goes through a Python mode), never different.

Example:
    >>> comm = Comm(torch.device("cpu"), checking=True)
    >>> comm.all_reduce(torch.ones(2))          # one process: nothing to reduce, still checked
    tensor([1., 1.])
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from ...errors import AutopipeError

__all__ = ["Comm", "DeviceCheckError", "HostSyncError", "checking_requested"]

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
# Tensor methods that make the host wait for the device (on CUDA) to read a value.
_HOST_READS = {"item", "__float__", "__int__", "__bool__", "__index__", "tolist", "cpu", "numpy"}


class DeviceCheckError(AutopipeError):
    """A tensor reached a collective or a pipeline stage on another device than the rank's."""


class HostSyncError(AutopipeError):
    """The step read a device value on the host outside the one logging reduction."""


def checking_requested() -> bool:
    """Whether the environment asks for checking mode (``AUTOPIPE_CHECK=1``)."""
    return os.environ.get("AUTOPIPE_CHECK", "") not in ("", "0")


class _HostReads(TorchFunctionMode):
    """Counts device-to-host reads made by any code but torch's own internals."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []
        self.allowed = 0  # > 0 inside comm.host_read()

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        name = getattr(func, "__name__", "")
        if name in _HOST_READS and not self.allowed:
            where = _caller()
            if where is not None:
                self.reads.append(f"{name} at {where}")
        return func(*args, **(kwargs or {}))


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_DISPATCH = (f"runtime{os.sep}comm.py", f"torch{os.sep}overrides.py", f"torch{os.sep}_tensor.py")


def _caller() -> str | None:
    """file:line of the code that asked for the read; None when torch's own internals did (the
    schedule's one-time shape exchange on its first step, say), which is not ours to change."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        # the modes (ours, the default-device one) and torch's dispatch of Tensor dunders
        if path.endswith(_DISPATCH) or frame.f_code.co_name == "__torch_function__":
            frame = frame.f_back
            continue
        if path.startswith(_TORCH_DIR):
            return None
        return f"{os.path.relpath(path)}:{frame.f_lineno}"
    return None


class Comm:
    """This rank's device and the collectives over it.

    Args:
        device: the rank's device (``DistEnv.device``).
        checking: refuse tensors on other devices and count host reads in ``step()``.
    """

    def __init__(self, device: torch.device, *, checking: bool = False) -> None:
        self.device = torch.device(device)
        self.checking = checking
        self._reads: _HostReads | None = None

    # ---- the rule --------------------------------------------------------------------------
    def check(self, where: str, tree: Any) -> None:
        """In checking mode, refuse any tensor in ``tree`` that is not on this rank's device."""
        if not self.checking:
            return
        for i, t in enumerate(x for x in pytree.tree_leaves(tree) if isinstance(x, torch.Tensor)):
            if not _same_device(t.device, self.device):
                raise DeviceCheckError(
                    f"{where}: tensor {i} ({tuple(t.shape)}, {t.dtype}) is on {t.device}, not on this rank's "
                    f"device {self.device}; create it with device= the rank's device (DistEnv.device)."
                )

    # ---- collectives -----------------------------------------------------------------------
    def _world(self, group: Any) -> int:
        return dist.get_world_size(group) if dist.is_initialized() else 1

    def all_reduce(self, t: torch.Tensor, *, op: str = "sum", group: Any = None, where: str = "all_reduce") -> torch.Tensor:
        """Reduce ``t`` in place over ``group`` (the whole world by default); returns ``t``."""
        self.check(where, t)
        if self._world(group) > 1:
            dist.all_reduce(t, op=_OPS[op], group=group)
        return t

    def all_gather(self, t: torch.Tensor, *, group: Any = None, where: str = "all_gather") -> torch.Tensor:
        """Every rank's ``t``, stacked along a new first dimension in rank order."""
        self.check(where, t)
        n = self._world(group)
        if n == 1:
            return t.unsqueeze(0)
        # a flat output: gloo accepts only the concatenated form (NCCL both)
        out = torch.empty(n * t.numel(), dtype=t.dtype, device=t.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch 2.13 deprecates the old name
        gather(out, t.contiguous().view(-1), group=group)
        return out.view(n, *t.shape)

    def send(self, tensors: list[torch.Tensor], dst: int, *, where: str = "send") -> None:
        """Send ``tensors`` to global rank ``dst`` (their shapes and dtypes first, so the receiver
        needs to know nothing); for ``--verify``'s unpipelined run, not for the step."""
        self.check(where, tensors)
        dist.send_object_list([[(tuple(t.shape), t.dtype) for t in tensors]], dst=dst)
        for t in tensors:
            dist.send(t.contiguous(), dst=dst)

    def recv(self, src: int, *, where: str = "recv") -> list[torch.Tensor]:
        """Receive what ``send`` sent from global rank ``src``, on this rank's device."""
        metas: list[Any] = [None]
        dist.recv_object_list(metas, src=src)
        out = [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in metas[0]]
        for t in out:
            dist.recv(t, src=src)
        self.check(where, out)
        return out

    def barrier(self) -> None:
        if self._world(None) > 1:
            if self.device.type == "cuda":
                dist.barrier(device_ids=[self.device.index or 0])
            else:
                dist.barrier()

    def new_group(self, ranks: list[int]) -> Any:
        """A process group over ``ranks`` (collective: every rank calls it, in the same order)."""
        return dist.new_group(ranks)

    # ---- the step ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Wrap one training step: in checking mode, catch tensors created without a device and
        host reads outside ``host_read()``."""
        if not self.checking:
            yield
            return
        reads = _HostReads()
        # On a CPU rank a tensor created without device= is on the right device by luck; make it
        # land on meta instead, so checking mode sees on the CPU what NCCL would refuse on a GPU.
        default = torch.device("meta") if self.device.type == "cpu" else contextlib.nullcontext()
        self._reads = reads
        try:
            with reads, default:
                yield
        finally:
            self._reads = None
        if reads.reads:
            raise HostSyncError(
                f"the step read device values on the host {len(reads.reads)} time(s) outside the logging "
                f"reduction ({'; '.join(reads.reads[:3])}); keep the value on the device (each read waits for the GPU)."
            )

    @contextlib.contextmanager
    def host_read(self) -> Iterator[None]:
        """The one place per step where the host waits for the device: the logging reduction."""
        if self._reads is None:
            yield
            return
        self._reads.allowed += 1
        try:
            yield
        finally:
            self._reads.allowed -= 1

    def synchronize(self) -> None:
        """Wait for this rank's device (only inside ``host_read``: it is a host sync)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    # cuda vs cuda:0 are the same device when the rank's device is the current one
    return a.index is None or b.index is None or a.index == b.index

