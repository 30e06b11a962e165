"""What a training engine adds to a step beyond the layers' own seconds, measured per engine. No torch.

The profile times each layer alone; a job runs them inside an engine (torch.distributed.pipelining's
PipelineStage + schedule, or DeepSpeed's PipelineEngine), which adds its own work:

- ``per_op``: seconds per forward (F) and per backward (B) of a chunk, beyond its layers: the engine's
  bookkeeping per micro-batch (its action loop, shape checks, autograd entry, loss, buffers);
- ``send_latency`` and ``bandwidth``: one P2P send or receive at a cut, latency + bytes / bandwidth;
- ``per_step``: seconds per step outside the schedule beyond ``optimizer_rate``'s work (the
  collectives' latency, the step's host read, zero_grad, the engine's step bookkeeping);
- ``optimizer_rate``: seconds per parameter of the step's work after the schedule that grows with the
  parameters: the whole-gradient norm, the clip and the AdamW step (fp32 state), as a job runs them;
- ``allreduce_latency`` and ``allreduce_bandwidth``: one all-reduce between two ranks, latency + bytes /
  bandwidth: after the schedule each tied tensor held on several ranks (GPT-2's embedding and head)
  has its gradient summed over them, and every holder waits for it (measured: 8 MiB on gloo took
  6.7-7.6 ms here, which a GPT-2 job's step paid and no term counted); tables without it charge none;
- ``host_probe``: seconds of :func:`autopipe.costs.devices.host_probe` on the machine the table was
  fitted on (0 in tables before it). The fixed per-call terms above (``per_op``, ``per_step``, the two
  latencies) are host software work, Python and the dispatcher, and are that machine's seconds; a
  profile records the same probe on its own host, and :meth:`EngineCosts.on_host` scales those terms
  by the ratio. Throughputs (the bandwidths, ``optimizer_rate``) are left as fitted: the arithmetic
  and memory traffic behind them do not follow the interpreter's speed (an AVX2 CPU measured 1.6-2.0x
  another CPU's gloo latency and 0.7-0.9x its AdamW seconds per parameter). Unverified across CPUs:
  no two CPUs have both been measured with the probe;
- ``compute_scale``: how much longer the layers take inside a running job than the profiler timed
  them alone (each rank's forward seconds in the job's step log over the plan's): on a CPU the
  job's ranks share the memory bus and caches, and a stage's micro-batches interleave their forwards
  and backwards (1.13-1.19 measured on this 2-core machine); 1 where it was not measured.

The figures are not constants in code: ``bench/bench_engines.py`` measures them on a machine (a P2P
ping-pong on gloo, an AdamW step, and 2-stage jobs of a small GPT-2 at several micro-batch counts on
each engine, fitted against the plan's own simulation) and writes ``engine_costs.json`` beside this
module with where each figure came from. A device type the table has no entry for (a GPU, which
this machine has none of) gets no engine terms: :func:`engine_costs` returns None and plans stay as
the layers alone predict them.

Example:
    >>> costs = EngineCosts("torch", "cpu", per_op=0.002, send_latency=1e-4, bandwidth=1e9,
    ...                     per_step=0.01, optimizer_rate=1e-8, source="example", compute_scale=1.15,
    ...                     allreduce_latency=2e-4, allreduce_bandwidth=1e9)
    >>> round(costs.send_time(10**6), 6), round(costs.after_schedule(2 * 10**6), 6), costs.compute_scale
    (0.0011, 0.03, 1.15)
    >>> round(costs.allreduce_time(10**6), 6), round(costs.allreduce_time(10**6, ranks=4), 6)  # a ring's 2(n-1)/n
    (0.0012, 0.0017)
    >>> fitted = EngineCosts("torch", "cpu", per_op=0.002, send_latency=1e-4, bandwidth=1e9, per_step=0.01,
    ...                      optimizer_rate=1e-8, source="example", host_probe=0.004)
    >>> slower = fitted.on_host(0.006)  # a host whose probe takes 1.5x as long
    >>> round(slower.per_op, 6), round(slower.per_step, 6), slower.optimizer_rate, slower.host_probe
    (0.003, 0.015, 1e-08, 0.006)
    >>> fitted.on_host(0.0) is fitted  # a profile without the probe: the table as fitted
    True
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from ..choices import ENGINES
from ..errors import AutopipeError

__all__ = ["EngineCosts", "TABLE", "engine_costs", "load_table", "check_engine", "ENGINE_CHOICES"]

TABLE = Path(__file__).with_name("engine_costs.json")
# What --engine accepts: an engine, or auto (the faster of those the model and options can run on).
ENGINE_CHOICES = (*ENGINES, "auto")


@dataclass(frozen=True)
class EngineCosts:
    """One engine's measured overheads on one device type (see the module docstring)."""

    engine: str
    device: str  # the device type measured on: cpu
    per_op: float  # seconds per F and per B of a chunk
    send_latency: float  # seconds per P2P send or receive, beyond bytes / bandwidth
    bandwidth: float | None  # P2P bytes/s between two ranks; None: not measured
    per_step: float  # seconds per step outside the schedule, beyond the optimizer's arithmetic
    optimizer_rate: float  # seconds per parameter of the norm, the clip and the AdamW step
    source: str  # how and when it was measured (the bench, the machine, the load)
    compute_scale: float = 1.0  # a layer's seconds in a job over its profiled seconds (tables before it: 1)
    allreduce_latency: float = 0.0  # seconds per all-reduce between two ranks, beyond bytes / bandwidth
    allreduce_bandwidth: float | None = None  # bytes/s of that all-reduce; None: not measured (charged 0)
    host_probe: float = 0.0  # seconds of devices.host_probe where fitted; 0: not measured (never scaled)

    def send_time(self, nbytes: int) -> float:
        """Seconds of one send (or receive) of ``nbytes`` at a cut."""
        bw = self.bandwidth or float("inf")
        return self.send_latency + nbytes / bw

    def allreduce_time(self, nbytes: int, ranks: int = 2) -> float:
        """Seconds of one all-reduce of ``nbytes`` over ``ranks`` ranks (a ring moves 2(n-1)/n of the
        bytes, which is all of them for the two measured); 0 where the table has no such figure."""
        if not self.allreduce_bandwidth or ranks < 2:
            return 0.0
        return self.allreduce_latency + nbytes * (2 * (ranks - 1) / ranks) / self.allreduce_bandwidth

    def after_schedule(self, params: int) -> float:
        """Seconds a step spends after the schedule on the rank holding ``params`` parameters."""
        return self.per_step + self.optimizer_rate * params

    def on_host(self, probe: float) -> "EngineCosts":
        """These costs on a host whose :func:`~autopipe.costs.devices.host_probe` read ``probe`` seconds:
        the per-call terms scaled by ``probe / self.host_probe``; unchanged where either was not measured."""
        if probe <= 0 or self.host_probe <= 0 or probe == self.host_probe:
            return self
        ratio = probe / self.host_probe
        return replace(self, per_op=self.per_op * ratio, per_step=self.per_step * ratio,
                       send_latency=self.send_latency * ratio, allreduce_latency=self.allreduce_latency * ratio,
                       host_probe=probe)  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_engine(name: str, *, auto: bool = True) -> str:
    """The engine name, lower-cased; one short error for any other.

    >>> check_engine("DeepSpeed")
    'deepspeed'
    >>> check_engine("tensorflow")
    Traceback (most recent call last):
    ...
    autopipe.errors.AutopipeError: unknown engine 'tensorflow'; use one of torch, deepspeed, auto.
    """
    key = str(name).strip().lower()
    valid = ENGINE_CHOICES if auto else ENGINES
    if key not in valid:
        raise AutopipeError(f"unknown engine {name!r}; use one of {', '.join(valid)}.")
    return key


def load_table(path: Path | None = None) -> dict[str, dict[str, EngineCosts]]:
    """device type -> engine -> its costs, from the table the bench wrote ({} when there is none)."""
    p = path or TABLE
    if not p.is_file():
        return {}
    raw = json.loads(p.read_text())
    return {device: {name: EngineCosts(**row) for name, row in engines.items()}
            for device, engines in raw.get("devices", {}).items()}  # fmt: skip


def engine_costs(engine: str | None, device_type: str, *, path: Path | None = None) -> EngineCosts | None:
    """The measured costs of ``engine`` on ``device_type``; None for no engine, or none measured there."""
    if not engine:
        return None
    key = check_engine(engine, auto=False)
    return load_table(path).get(device_type, {}).get(key)
