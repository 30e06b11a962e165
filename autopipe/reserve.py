"""The runtime reserve of a device: what a training rank holds beyond the tensors the memory model counts.

The memory model (:mod:`autopipe.memory`) adds up tensors: weights, gradients, optimizer state,
activations, buffers. A real rank holds more: on a GPU the CUDA context, NCCL's buffers and the
caching allocator's slack; on a CPU what glibc keeps between the tensors (fragmentation of a heap
that never shrinks) and the runtime's own allocations. That is a property of the device and the
runtime more than of the model, so it is measured once per device, by a probe: a small GPT-2-shaped
model is profiled and trained for a few steps by the real runtime (``autopipe.runtime``) in a
fresh process, and the reserve is its measured peak (``autopipe.runtime.peak``) less what the memory
model predicts for it. Each profile keeps the reserve it was measured with (``Profile.reserve_bytes``)
and every plan adds it to each rank. The figure is cached per device, thread count and torch
version in ``$AUTOPIPE_CACHE`` (default ``~/.cache/autopipe``).

Known GPUs that were never measured get an assumed reserve (``ASSUMED_CUDA_RESERVE``), said so
wherever it is used.

    python -m autopipe.reserve --device cpu      # measure (or read the cache) and print JSON

Example:
    >>> runtime_reserve("cpu")     # bytes; measured the first time (about 15 s), cached after
    83886080
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from .errors import AutopipeError

__all__ = ["ASSUMED_CUDA_RESERVE", "runtime_reserve", "probe_reserve"]

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

    from .devices import _cpu_name

    if device == "cuda":
        name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cuda"
    else:
        name = f"{_cpu_name()} x{torch.get_num_threads()}"
    return f"{device}|{name}|torch {torch.__version__}"


def runtime_reserve(device: str = "cpu", *, refresh: bool = False) -> int:
    """This machine's reserve for ``device`` (cpu or cuda): cached, else measured by a probe process."""
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
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "TRANSFORMERS_VERBOSITY": "error"}
    env.pop("WORLD_SIZE", None)
    done = subprocess.run([sys.executable, "-m", "autopipe.reserve", "--device", device, "--probe"],
                          capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    if done.returncode != 0:
        raise AutopipeError(f"measuring the runtime reserve on {device} failed: {done.stderr.strip().splitlines()[-1:]}")
    value = int(json.loads(done.stdout.strip().splitlines()[-1])["reserve_bytes"])
    cache[key] = value
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        from .records import write_text_atomic

        write_text_atomic(path, json.dumps(cache, indent=1) + "\n")
    except OSError:
        pass  # a read-only home: measure again next time
    return value


def probe_reserve(device: str = "cpu") -> dict[str, int]:
    """Run the probe in this process (it starts a one-rank process group): measured peak, the memory
    model's prediction, and their difference, the reserve. ``runtime_reserve`` runs it in a fresh
    process so nothing of the caller's state is counted."""
    import tempfile

    import torch
    from transformers import GPT2Config

    import autopipe
    import autopipe.runtime as rt
    from autopipe.memory import rank_memory
    from autopipe.models import load_model
    from autopipe.schedule import inflight_counts

    with tempfile.TemporaryDirectory() as tmp:
        GPT2Config(architectures=["GPT2LMHeadModel"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                   use_cache=False, **_PROBE).save_pretrained(tmp)  # fmt: skip
        source = rt.model_factory(tmp, batch_size=_ROWS, seq_len=_SEQ)
        spec = load_model(tmp, device=device, batch_size=_ROWS, seq_len=_SEQ, dropout=0.0)
        seq = autopipe.flatten(spec.model, spec.args, spec.kwargs, validate=False)
        prof = autopipe.profile(seq, spec.args, spec.kwargs, repeats=1, warmup=0, progress=False)
        del seq, spec
        n = len(prof.layers)
        (model,) = rank_memory(prof, (0, n), stage_ranks=(0,), inflight=inflight_counts("gpipe", 1, 1, _MICRO),
                               microbatches=_MICRO, reserve=0)  # fmt: skip
        env = rt.init_dist(dp=1)
        try:
            build = rt.build_stage(source.factory, source.args, source.kwargs, 1, pp_rank=0, pp_size=1,
                                   schedule="gpipe", device=env.device)  # fmt: skip
            trainer = rt.Trainer(build, env, rt.TrainConfig(steps=_STEPS, microbatches=_MICRO))
            data = rt.TokenData(None, vocab_size=source.vocab_size, seq_len=_SEQ)
            peak = 0
            for step in range(_STEPS):
                args, kwargs = source.batch(data.batch(step, _ROWS * _MICRO), _ROWS * _MICRO, step=step)
                stats = trainer.step(args, kwargs)
                if step >= 1:  # the first step allocates the optimizer state after its peak
                    peak = max(peak, stats.peak_memory[0])
        finally:
            env.close()
    del torch
    return {"measured_bytes": int(peak), "model_bytes": int(model.total), "reserve_bytes": max(0, int(peak - model.total))}


def main() -> None:
    parser = argparse.ArgumentParser(description="Measure the training runtime's memory reserve on this device.")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--probe", action="store_true", help="run the probe in this process (no cache)")
    parser.add_argument("--refresh", action="store_true", help="measure again even if cached")
    opts = parser.parse_args()
    if opts.probe:
        print(json.dumps(probe_reserve(opts.device)))
    else:
        print(json.dumps({"reserve_bytes": runtime_reserve(opts.device, refresh=opts.refresh)}))


if __name__ == "__main__":
    main()
