"""The first command on a new machine: does the plan's promise hold here? (``autopipe doctor``)

On whatever machine it runs, the doctor lists the devices, profiles a small GPT-2 (4 blocks of
width 256, the reserve probe's size) on the first of them, plans it for 1 or 2 ranks (2 on a CPU
or with two GPUs; one GPU holds one rank: NCCL will not put two on it), trains that plan for a few
steps under torchrun with autopipe's runtime, and sets each figure the plan predicts beside what
the run measured: the step time, and each rank's peak memory, allocated and reserved (on a GPU the
caching allocator's reserved bytes plus the context and NCCL buffers NVML counts for the process;
on a CPU the resident peak, where allocated and reserved are one figure). On a GPU it also prints
the CUDA memory model's figures and their sources (:mod:`autopipe.costs.gpu_memory`): the
measured-over-predicted ratio tells whether the assumed ones hold there.

    autopipe doctor                      # the table on the terminal and in doctor.md
    python -m autopipe.job.doctor        # the same, without the CLI
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..errors import AutopipeError
from ..runtime.process.launch import run_local_workers

__all__ = ["DeviceLine", "DoctorReport", "RankCheck", "run_doctor"]

_ROWS, _SEQ, _MICRO = 4, 128, 4
_SMALL = dict(n_layer=4, n_embd=256, n_head=4, vocab_size=4096, n_positions=_SEQ)


@dataclass(frozen=True)
class DeviceLine:
    """One device this machine has."""

    name: str
    type: str  # cpu | cuda
    memory_bytes: int
    detail: str = ""  # threads, compute capability


@dataclass(frozen=True)
class RankCheck:
    """One rank's peak memory: the plan's prediction and the run's measurement (bytes)."""

    rank: int
    predicted: int
    measured: int  # what the plan's figure is compared with: reserved + outside the allocator
    allocated: int
    reserved: int
    outside: int  # held outside the allocator (CUDA context, NCCL); 0 on a CPU
    outside_known: bool = True  # False: NVML could not see the process, so outside is missing

    @property
    def ratio(self) -> float:
        return self.measured / self.predicted if self.predicted else float("nan")


@dataclass(frozen=True)
class DoctorReport:
    """What the doctor found (``to_markdown`` is the table it writes)."""

    devices: tuple[DeviceLine, ...]
    device: str  # the device profiled and trained on
    software: dict[str, str]
    ranks: int
    steps: int
    predicted_step: float  # seconds, the plan's simulated step
    measured_step: float  # seconds, median over the steps after the first
    memory: tuple[RankCheck, ...]
    memory_model: dict[str, dict[str, Any]] = field(default_factory=dict)  # GPU only: term -> figure, source, why
    notes: tuple[str, ...] = ()

    @property
    def step_ratio(self) -> float:
        return self.measured_step / self.predicted_step if self.predicted_step else float("nan")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "step_ratio": self.step_ratio, "memory_ratios": [r.ratio for r in self.memory]}

    def to_markdown(self) -> str:
        from ..units import format_bytes, format_time

        lines = ["# autopipe doctor", "", "| device | type | memory | detail |", "| --- | --- | --- | --- |"]
        lines += [f"| {d.name} | {d.type} | {format_bytes(d.memory_bytes)} | {d.detail} |" for d in self.devices]
        lines += ["", " · ".join(f"{k} {v}" for k, v in self.software.items()), "",
                  f"A GPT-2 of 4 blocks x 256, {self.ranks} rank(s) on {self.device}, 1F1B, {_MICRO} micro-batches "
                  f"of {_ROWS} x {_SEQ} tokens, {self.steps} steps.", "",
                  "| figure | predicted | measured | measured / predicted |", "| --- | --- | --- | --- |",
                  f"| step time | {format_time(self.predicted_step)} | {format_time(self.measured_step)} "
                  f"| {self.step_ratio:.2f} |"]  # fmt: skip
        for r in self.memory:
            lines.append(f"| rank {r.rank} peak memory (allocated {format_bytes(r.allocated)}, reserved "
                         f"{format_bytes(r.reserved)}, outside the allocator "
                         f"{format_bytes(r.outside) if r.outside_known else 'not visible'}) "
                         f"| {format_bytes(r.predicted)} | {format_bytes(r.measured)} | {r.ratio:.2f} |")  # fmt: skip
        if self.memory_model:
            lines += ["", "The CUDA memory model's figures for this GPU (autopipe/costs/gpu_memory.py):", "",
                      "| term | figure | source | why |", "| --- | --- | --- | --- |"]
            for term, f in self.memory_model.items():
                value = f"{f['ratio']:.0%}" if f["ratio"] else format_bytes(f["bytes"])
                lines.append(f"| {term} | {value} | {f['source']} | {f['why']} |")
        if self.notes:
            lines += [""] + [f"- {n}" for n in self.notes]
        return "\n".join(lines) + "\n"


def list_devices() -> tuple[DeviceLine, ...]:
    """This machine's CPU and every GPU torch sees."""
    import torch

    from ..costs.devices import cpu_name, describe_device

    cpu = describe_device(torch.device("cpu"))
    lines = [DeviceLine(cpu_name(), "cpu", cpu.memory_bytes, f"{os.cpu_count()} cores, torch uses {cpu.threads} threads")]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            lines.append(DeviceLine(p.name, "cuda", int(p.total_memory),
                                    f"cuda:{i}, sm{p.major}{p.minor}, {p.multi_processor_count} SMs"))  # fmt: skip
    return tuple(lines)


def _software() -> dict[str, str]:
    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__}
    if torch.cuda.is_available():
        out["CUDA"] = str(torch.version.cuda)
        nccl = torch.cuda.nccl.version() if hasattr(torch.cuda, "nccl") else None
        out["NCCL"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
        out["PYTORCH_CUDA_ALLOC_CONF"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") or "(unset)"
        try:
            import pynvml  # type: ignore[import-not-found]  # noqa: F401

            out["pynvml"] = "yes"
        except ImportError:
            out["pynvml"] = "no (pip install nvidia-ml-py: the context and NCCL buffers cannot be measured)"
    return out


def run_doctor(*, device: str = "auto", ranks: int | None = None, steps: int = 6, reserve: str | int | None = None,
               progress: bool = False) -> DoctorReport:
    """Profile, plan and train the small GPT-2 here; compare the plan's step time and per-rank peak
    memory with the run's. ``device``: auto (the first GPU, else the CPU), cpu or cuda; ``ranks``:
    1 or 2 (default: 2 on a CPU or with two GPUs, else 1); ``reserve`` as ``profile --reserve``
    (default: this machine's, measured once per device)."""
    import torch
    from transformers import GPT2Config

    from ..costs.profiler import profile
    from ..graph.flattener import flatten
    from ..graph.sources import load_model
    from ..planner.partitioner import partition
    from ..runtime.checks.reserve import reserve_for

    cuda = torch.cuda.is_available()
    if device == "auto":
        device = "cuda" if cuda else "cpu"
    if device not in ("cpu", "cuda"):
        raise AutopipeError(f"doctor --device {device!r}: use auto, cpu or cuda.")
    if device == "cuda" and not cuda:
        raise AutopipeError("doctor --device cuda, but torch sees no CUDA device; run it with --device cpu.")
    from ..runtime.torch_engine.pipeline import receives_integers

    most = 2 if device == "cpu" else min(2, torch.cuda.device_count())
    # the small GPT-2's cut carries its labels, which torch < 2.13's stages cannot receive
    ranks = (most if receives_integers() else 1) if ranks is None else ranks
    if ranks not in (1, 2) or ranks > most:
        raise AutopipeError(f"doctor --ranks {ranks}: use 1{' or 2' if most == 2 else ''} on this machine "
                            "(one rank per GPU).")  # fmt: skip
    if steps < 3:
        raise AutopipeError(f"doctor --steps {steps}: use 3 or more (the first step warms up and is left out).")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        GPT2Config(architectures=["GPT2LMHeadModel"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                   **_SMALL).save_pretrained(root / "model")  # fmt: skip
        held = reserve_for(device, estimate=False, given=reserve)  # before any model is on the GPU
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as each rank runs
        try:
            spec = load_model(str(root / "model"), device=device, batch_size=_ROWS, seq_len=_SEQ, dropout=0.0)
            seq = flatten(spec.model, spec.args, spec.kwargs, validate=False)
            prof = profile(seq, spec.args, spec.kwargs, repeats=5, warmup=2, progress=progress, reserve=held)
        finally:
            torch.set_num_threads(threads)
        del seq, spec
        plan = partition(prof, stages=ranks, microbatches=_MICRO, schedule="1f1b", memory_limit=None)
        plan.save(root / "plan.json")
        run_local_workers("autopipe.job.doctor", ranks, [str(root), "--steps", str(steps)], timeout=900,
                          failure=f"the doctor's {ranks}-rank training run failed")
        runs = [json.loads((root / f"rank{r}.json").read_text()) for r in range(ranks)]
    memory = tuple(RankCheck(rank=r, predicted=int(plan.rank_memory[r]), **runs[r]["peak"]) for r in range(ranks))
    model = _memory_model(prof.device.name) if device == "cuda" else {}
    notes = [] if device == "cuda" else ["no GPU here: the CUDA memory model's figures are not exercised; run the "
                                         "doctor on a GPU machine to check them."]  # fmt: skip
    if any(not r.outside_known for r in memory):
        notes.append("NVML could not see the ranks' processes: the context and NCCL buffers are missing from the "
                     "measured peaks (install nvidia-ml-py; in a container, share the host's PID namespace).")  # fmt: skip
    return DoctorReport(devices=list_devices(), device=prof.device.name, software=_software(), ranks=ranks,
                        steps=steps, predicted_step=plan.step_time, measured_step=statistics.median(runs[0]["step_times"]),
                        memory=memory, memory_model=model, notes=tuple(notes))  # fmt: skip


def _memory_model(gpu: str) -> dict[str, dict[str, Any]]:
    from ..costs.gpu_memory import cuda_memory, expandable_segments

    row = cuda_memory(gpu, expandable_segments=expandable_segments(os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")))
    return {term: asdict(f) for term, f in row.figures().items()}


def _worker(root: Path, steps: int) -> None:
    """One rank: train the plan, then write its step times and its largest peak after the first step
    (each read after the step, its optimizer step included)."""
    from ..runtime.stage.build import build_stage
    from ..runtime.data.sources import TokenData
    from ..runtime.process.distenv import init_dist
    from ..runtime.data.factory import model_factory
    from ..planner.plan import load_plan
    from ..runtime.training.optim import TrainConfig
    from ..runtime.torch_engine.trainer import Trainer

    source = model_factory(str(root / "model"), batch_size=_ROWS, seq_len=_SEQ)
    env = init_dist(dp=1, exact_memory=True)  # a CPU rank's peak then counts the tensors the plan counts
    try:
        plan = load_plan(root / "plan.json")
        build = build_stage(source.factory, source.args, source.kwargs, plan, pp_rank=env.pp_rank,
                            pp_size=env.pp_size, schedule="1f1b", device=env.device)  # fmt: skip
        trainer = Trainer(build, env, TrainConfig(steps=steps, microbatches=_MICRO))
        data = TokenData(None, vocab_size=source.vocab_size, seq_len=_SEQ)
        rows, times, peak = _ROWS * _MICRO, [], None
        for step in range(steps):
            args, kwargs = source.batch(data.batch(step, rows), rows, step=step)
            stats = trainer.step(args, kwargs)
            env.peak.read()  # after the step returned: its optimizer step included
            if step >= 1:  # the first step also infers shapes and allocates what later steps reuse
                times.append(stats.step_time)
                d = env.peak.detail
                mine = dict(measured=d.reserved + d.outside, allocated=d.allocated, reserved=d.reserved,
                            outside=d.outside, outside_known=env.peak.outside_known)  # fmt: skip
                peak = mine if peak is None or mine["measured"] > peak["measured"] else peak
        (root / f"rank{env.rank}.json").write_text(json.dumps({"step_times": times, "peak": peak}))
    finally:
        env.close()


def main() -> None:
    parser = argparse.ArgumentParser(description="Check the plan's step time and memory on this machine.")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--ranks", type=int, default=None)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # one rank under torchrun
    opts = parser.parse_args()
    if opts.worker:
        _worker(Path(opts.worker), opts.steps)
        return
    print(run_doctor(device=opts.device, ranks=opts.ranks, steps=opts.steps).to_markdown(), end="")


if __name__ == "__main__":
    main()
