"""The runtime reserve of a device: what a training rank holds beyond the tensors the memory model counts.

The memory model (:mod:`autopipe.memory`) adds up tensors: weights, gradients, optimizer state,
activations, buffers. A real rank holds more: on a GPU the CUDA context, NCCL's buffers and the
caching allocator's slack; on a CPU what glibc keeps between the tensors (a heap that never shrinks
fragments) and the runtime's own allocations. That is a property of the device and the runtime
more than of the model, so it is measured once per device by a probe: a small GPT-2-shaped model is
profiled, cut into 2 stages (1 on a GPU: NCCL will not put two ranks on one), trained a few steps by
the real runtime under torchrun, and the reserve is the ranks' mean measured peak
(``autopipe.runtime.peak``) less what the memory model predicts for them. Each profile keeps the
reserve it was made with (``Profile.reserve_bytes``); every plan adds it to each rank.

The figure is cached per device, thread count and torch version in ``$AUTOPIPE_CACHE`` (default
``~/.cache/autopipe/reserve.json``). Known GPUs nobody measured here get ``ASSUMED_CUDA_RESERVE``.

    python -m autopipe.reserve --device cpu      # measure (or read the cache) and print JSON

Example:
    >>> runtime_reserve("cpu")     # bytes; measured the first time (about 20 s), cached after
    75497472
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from .errors import AutopipeError

__all__ = ["ASSUMED_CUDA_RESERVE", "measure_reserve", "reserve_for", "runtime_reserve"]

# CUDA context (~0.5 GiB on Hopper with lazy module loading), NCCL communicators and cuBLAS
# workspaces: a common allowance, used for estimates of GPUs nobody measured here.
ASSUMED_CUDA_RESERVE = 1 << 30

_PROBE = dict(n_layer=4, n_embd=256, n_head=4, vocab_size=4096, n_positions=128)
_ROWS, _SEQ, _MICRO, _STEPS = 4, 128, 4, 6


def _cache_file() -> Path:
    root = os.environ.get("AUTOPIPE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "autopipe")
    return Path(root) / "reserve.json"


def _key(device: str) -> str:
    import torch

    from .devices import ALLOCATOR_SETTINGS, _cpu_name

    if device == "cuda":
        name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cuda"
    else:
        # the allocator's settings change what a CPU rank holds beyond its tensors: measure again
        name = f"{_cpu_name()} x{os.environ.get('OMP_NUM_THREADS', '1')} ({ALLOCATOR_SETTINGS})"
    return f"{device}|{name}|torch {torch.__version__}"


def runtime_reserve(device: str = "cpu", *, refresh: bool = False) -> int:
    """This machine's reserve for ``device`` (cpu or cuda): cached, else measured by the probe."""
    if device not in ("cpu", "cuda"):
        raise AutopipeError(f"the runtime reserve is measured on cpu or cuda, not {device!r}.")
    key = _key(device)
    path = _cache_file()
    cache: dict[str, int] = {}
    if path.is_file():
        try:
            cache = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            cache = {}
    if key in cache and not refresh:
        return int(cache[key])
    value = measure_reserve(device)["reserve_bytes"]
    cache[key] = value
    try:
        from .records import write_text_atomic

        write_text_atomic(path, json.dumps(cache, indent=1) + "\n")
    except OSError:
        pass  # a read-only home: measure again next time
    return value


def reserve_for(device: str, *, estimate: bool, given: str | int | None = None) -> int:
    """The reserve a profile for ``device`` should carry: ``given`` (a size like 80MiB, or 0) if set;
    estimating for a named GPU, the assumed figure; else this machine's, measured once (cpu or cuda)."""
    if given is not None:
        from .units import parse_size

        return 0 if str(given).strip().lower() in ("0", "none") else parse_size(given)
    if estimate and device not in ("cpu", "cuda"):
        return ASSUMED_CUDA_RESERVE
    return runtime_reserve("cuda" if device.startswith("cuda") else "cpu")


def measure_reserve(device: str = "cpu") -> dict[str, int]:
    """Run the probe: profile and cut the probe model here, train it under torchrun in fresh
    processes, and compare each rank's measured peak with the memory model's prediction."""
    import torch
    from transformers import GPT2Config

    import autopipe
    from autopipe.memory import rank_memory
    from autopipe.models import load_model

    ranks = 1 if device == "cuda" else 2
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        GPT2Config(architectures=["GPT2LMHeadModel"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                   use_cache=False, **_PROBE).save_pretrained(root / "model")  # fmt: skip
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as each rank runs
        try:
            spec = load_model(str(root / "model"), device=device, batch_size=_ROWS, seq_len=_SEQ, dropout=0.0)
            seq = autopipe.flatten(spec.model, spec.args, spec.kwargs, validate=False)
            prof = autopipe.profile(seq, spec.args, spec.kwargs, repeats=1, warmup=0, progress=False, reserve=0)
        finally:
            torch.set_num_threads(threads)
        del seq, spec
        plan = autopipe.partition(prof, stages=ranks, microbatches=_MICRO, schedule="1f1b")
        plan.save(root / "plan.json")
        predicted = rank_memory(prof, plan.boundaries, stage_ranks=plan.stage_ranks, inflight=plan.stage_inflight,
                                microbatches=plan.microbatches, reserve=0)  # fmt: skip
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
               "-m", "autopipe.reserve", "--worker", str(root)]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        if done.returncode != 0:
            tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise AutopipeError(f"measuring the runtime reserve on {device} failed: {tail}")
        measured = [int(json.loads((root / f"peak{r}.json").read_text())) for r in range(ranks)]
    gaps = [m - p.total for m, p in zip(measured, predicted)]
    return {"measured_bytes": max(measured), "model_bytes": max(p.total for p in predicted),
            "reserve_bytes": max(0, int(statistics.mean(gaps)))}  # fmt: skip


def _worker(root: Path) -> None:
    """One probe rank: train the planned cut a few steps and write its largest peak after warm-up."""
    import autopipe.runtime as rt

    source = rt.model_factory(str(root / "model"), batch_size=_ROWS, seq_len=_SEQ)
    env = rt.init_dist(dp=1)
    try:
        plan = rt.load_plan(root / "plan.json")
        build = rt.build_stage(source.factory, source.args, source.kwargs, plan, pp_rank=env.pp_rank,
                               pp_size=env.pp_size, schedule="1f1b", device=env.device)  # fmt: skip
        trainer = rt.Trainer(build, env, rt.TrainConfig(steps=_STEPS, microbatches=_MICRO))
        data = rt.TokenData(None, vocab_size=source.vocab_size, seq_len=_SEQ)
        peak = 0
        rows = _ROWS * _MICRO
        for step in range(_STEPS):
            args, kwargs = source.batch(data.batch(step, rows), rows, step=step)
            stats = trainer.step(args, kwargs)
            if step >= 1:  # the first step also infers shapes and allocates what later steps reuse
                peak = max(peak, stats.peak_memory[env.pp_rank])
        (root / f"peak{env.rank}.json").write_text(json.dumps(peak))
    finally:
        env.close()


def main() -> None:
    parser = argparse.ArgumentParser(description="Measure the training runtime's memory reserve on this device.")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--refresh", action="store_true", help="measure again even if cached")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # a probe rank under torchrun
    opts = parser.parse_args()
    if opts.worker:
        _worker(Path(opts.worker))
    else:
        print(json.dumps({"reserve_bytes": runtime_reserve(opts.device, refresh=opts.refresh)}))


if __name__ == "__main__":
    main()
