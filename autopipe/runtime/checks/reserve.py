"""The runtime reserve of a device: what a training rank holds beyond everything the memory model counts.

The memory model (:mod:`autopipe.planner.memory`) adds up tensors: weights, gradients, optimizer state
and its step's temporaries, activations, buffers; on a GPU also the CUDA memory model's per-GPU terms
(context, cuBLAS workspaces, NCCL's buffers, the caching allocator's slack:
:mod:`autopipe.costs.gpu_memory`). A real rank holds more: on a CPU what glibc keeps between the
tensors (a heap that never shrinks fragments) and the runtime's own allocations; on a GPU whatever
the assumed figures miss. That depends on the device and the runtime, and also on the precision and
on the architecture's pattern of allocations, so it is measured once per device, precision and
architecture by a probe: a small model of the user's architecture (their HuggingFace causal-LM
config shrunk by ``probe_config`` to 4 layers of width 256 and a vocabulary of 4096; a GPT-2 of that
size for anything else) is profiled in the mode training runs in (autocast for bf16/fp16), cut into
2 stages (1 on a GPU: NCCL will not put two ranks on one), trained 10 steps by the real runtime
under torchrun, and the reserve is the ranks' mean measured peak (``autopipe.runtime.logs.peak``, read
after each step's optimizer step, from the 5th step on) less what the memory model predicts for
them, at least 0. Each profile keeps the reserve it was made with (``Profile.reserve_bytes``); every
plan adds it to each rank.

On a GPU the probe's ranks measure their own process (NVML's per-process figure), never the whole
device: the process that asks (which may hold the user's model on the GPU already) is not theirs. A
measurement is cached only when it is clean: on a GPU, NVML saw the probe's processes and the
asking process held no GPU memory while it ran; otherwise the figure serves this run and the next
run measures again.

Measured on this CPU, three probes each (MiB): GPT-2-shaped fp32 28.0-29.3, bf16 36.3-37.5;
Llama-shaped fp32 35.2-38.0, bf16 45.1-51.5. The GPT-2 fp32 probe alone under-charged every rank of a
Llama plan by 7-10 MiB and of a bf16 plan by 8-23: hence the precision and the architecture in the key.
Those counted the library code pages a rank maps after its baseline; without them (the peak since
2026-11-28, ``runtime.peak``) an AVX2 EPYC measured 15.4 MiB (GPT-2 fp32) and 24.7 MiB (Llama fp32).
Nearly all of that was glibc's heap: under a 1 MiB mmap threshold it held the sub-MiB tensors, and
its holes put the resident peak 20-37 MiB over the live tensors, climbing for ~8 steps. With the
exact-memory threshold at 64 KiB (``devices.MMAP_THRESHOLD``, 2026-11-29) the same CPU measures
0.2 MiB (GPT-2 fp32) and 3.6 MiB (Llama fp32): the reserve is now what a CPU rank holds outside its
tensors, and may be 0.

The reserve is a mean, and its ranks fall either side of it: on this CPU the GPT-2 probe's first
rank held 4.5 MB under its predicted tensors and its second 4.7 MB over (a reserve of 0.1 MB), and a
6-layer MLP's ranks of 0.2 MiB of tensors peaked at 2-3.6 MiB. Memory advice (``--memory-limit X
fits``) must name a limit every rank fits, so the probe also keeps the most any of its ranks held
beyond its prediction (``rank_excess``, cached beside the reserve): the advice sets that beside the
tensors on a CPU (autopipe.planner.refusals). Neither figure counts the free blocks glibc's heap
keeps under a job's default settings (``devices.steady_heap``; the probe measures as ``train.py
--exact-memory`` does): the advice says so.

The figures are cached per device, thread count, torch version, precision and architecture in
``$AUTOPIPE_CACHE`` (default ``~/.cache/autopipe/reserve.json``), with the probe's largest rank
measured and predicted beside them; one process measures at a time (a lock file beside the cache),
and another that needs the same figure meanwhile waits and reads it. An estimate for a named GPU
(``--estimate --device h100``) carries no reserve: the device table's terms stand for the GPU.

    python -m autopipe.runtime.checks.reserve --device cpu                        # GPT-2 probe, fp32 (or the cache)
    python -m autopipe.runtime.checks.reserve --device cpu --model llama-7b --dtype bf16

Example:
    >>> reserve = runtime_reserve("cpu")  # bytes; measured the first time (about 20 s), cached after
    >>> 0 <= reserve < 64 << 20    # a few MiB on a CPU (the figures above), this machine's own
    True
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ...choices import PRECISIONS
from ...errors import AutopipeError
from ...progress import Phase, Progress, progress_for
from ..process.launch import run_local_workers

__all__ = ["excess_for", "holds_gpu_memory", "measure_reserve", "probe_config", "rank_excess", "reserve_for",
           "runtime_reserve"]

_ROWS, _SEQ, _MICRO, _STEPS = 4, 128, 4, 10
# the probe reads each rank's peak from this step on, as a long run holds it: under a 1 MiB mmap
# threshold a CPU rank's heap took ~8 steps to settle (the GPT-2 probe's rank 0 read 19 MiB over its
# tensors by step 5, 26-30 from step 8 to 48); under 64 KiB (devices.MMAP_THRESHOLD) the 2nd step's
# peak is the 12th's to 0.1 MiB, and the later steps are the margin
_SETTLED = 4
_LAYERS, _WIDTH, _HEADS, _VOCAB = 4, 256, 4, 4096  # the probe's size, GPT-2 or the user's architecture
# token ids inside the probe's vocabulary: GPT2Config's defaults (50256) made transformers warn, on
# the user's terminal, about a model the user never asked for
_PROBE = dict(n_layer=_LAYERS, n_embd=_WIDTH, n_head=_HEADS, vocab_size=_VOCAB, n_positions=_SEQ,
              bos_token_id=0, eos_token_id=0)


def _cache_file() -> Path:
    root = os.environ.get("AUTOPIPE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "autopipe")
    return Path(root) / "reserve.json"


def _key(device: str, dtype: str = "fp32", arch: str = "gpt2") -> str:
    import torch

    from ...costs.devices import ALLOCATOR_SETTINGS, cpu_name

    if device == "cuda":
        # "model 2": measured per process after the optimizer step, beside the CUDA memory model's
        # terms; figures cached before (device-wide, with the asking process's model in them) are not reused
        name = (torch.cuda.get_device_name() if torch.cuda.is_available() else "cuda") + " (model 2)"
    else:
        # the allocator's settings change what a CPU rank holds beyond its tensors: measure again
        # "anon": measured without the library code pages the steps map (runtime.peak); earlier figures had them
        # "settled": read from the probe's 5th step on (_SETTLED); earlier figures read steps 2-6
        name = f"{cpu_name()} x{os.environ.get('OMP_NUM_THREADS', '1')} ({ALLOCATOR_SETTINGS}, anon, settled)"
    mode = "" if dtype == "fp32" else f"|autocast {dtype}"
    shape = "" if arch == "gpt2" else f"|{arch}"  # fp32 GPT-2 keeps the key caches made before either
    return f"{device}|{name}|torch {torch.__version__}{mode}{shape}"


def probe_config(config: Any) -> Any | None:
    """A small config of ``config``'s architecture for the probe: 4 layers of width 256 and 4 heads
    (the grouped-query ratio and the MLP's width ratio kept), a vocabulary of 4096, no dropout.
    None where the GPT-2 probe stands in: not a HuggingFace decoder-only language model, GPT-2 itself,
    or a config whose size fields are not the usual ones.

    >>> from transformers import LlamaConfig
    >>> small = probe_config(LlamaConfig(architectures=["LlamaForCausalLM"], hidden_size=4096,
    ...                                  intermediate_size=11008, num_attention_heads=32, num_key_value_heads=8))
    >>> small.hidden_size, small.intermediate_size, small.num_key_value_heads, small.num_hidden_layers
    (256, 688, 1, 4)
    """
    archs = list(getattr(config, "architectures", None) or [])
    if not archs or not all(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
        return None
    if getattr(config, "is_encoder_decoder", False) or getattr(config, "model_type", "gpt2") in ("", "gpt2"):
        return None
    try:
        hidden, heads = int(config.hidden_size), int(config.num_attention_heads)
        kv = int(getattr(config, "num_key_value_heads", None) or heads)
        inter = getattr(config, "intermediate_size", None)
        small = copy.deepcopy(config)
        small.num_hidden_layers, small.hidden_size, small.num_attention_heads = _LAYERS, _WIDTH, _HEADS
        if hasattr(config, "num_key_value_heads"):
            small.num_key_value_heads = max(1, _HEADS * kv // heads)
        if getattr(config, "head_dim", None):
            small.head_dim = _WIDTH // _HEADS
        if inter:
            small.intermediate_size = max(8, round(_WIDTH * int(inter) / hidden))
        small.vocab_size = _VOCAB
        small.max_position_embeddings = max(_SEQ, 128)
        for key in ("layer_types",):  # per-layer lists sized for the old depth
            if isinstance(getattr(small, key, None), list):
                setattr(small, key, list(getattr(small, key))[:_LAYERS])
        for key in ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop", "dropout"):
            if isinstance(getattr(small, key, None), float):
                setattr(small, key, 0.0)
        for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
            if isinstance(getattr(small, key, None), int) and getattr(small, key) >= _VOCAB:
                setattr(small, key, 0)
        small.use_cache = False
        return small
    except (AttributeError, TypeError, ValueError):
        return None


def _arch(config: Any) -> str:
    """The architecture a reserve is cached under: the config's model type where the probe takes its
    shape, else ``gpt2`` (the stand-in)."""
    return str(config.model_type) if config is not None and probe_config(config) is not None else "gpt2"


def runtime_reserve(device: str = "cpu", *, dtype: str = "fp32", config: Any = None, refresh: bool = False,
                    progress: bool | Progress = False) -> int:
    """This machine's reserve for ``device`` (cpu or cuda) when training ``dtype`` (fp32, or bf16/fp16
    under autocast with fp32 master weights) a model of ``config``'s architecture (a HuggingFace
    config; None for the GPT-2 probe): cached, else measured by the probe (its phases shown as
    ``progress`` says: autopipe.progress)."""
    if device not in ("cpu", "cuda"):
        raise AutopipeError(f"the runtime reserve is measured on cpu or cuda, not {device!r}.")
    if dtype not in PRECISIONS:
        raise AutopipeError(f"the runtime reserve is measured for fp32, bf16 or fp16 training, not {dtype!r}.")
    arch = _arch(config)
    key = _key(device, dtype, arch)
    path = _cache_file()
    # a CPU figure cached before the probe kept its ranks' excess is measured again, once: the memory
    # advice needs both (module docstring)
    cached = _cached(path, key, device)
    if cached is not None and not refresh:
        return cached
    with _one_probe_at_a_time(path):
        cached = _cached(path, key, device)  # measured by another process while this one waited
        if cached is not None and not refresh:
            return cached
        measured = measure_reserve(device, dtype=dtype, config=config if arch != "gpt2" else None, progress=progress)
        value = int(measured["reserve_bytes"])
        _EXCESS[(str(path), key)] = int(measured.get("excess_bytes", 0))  # this process's, cached or not; a GPU's: 0
        if not measured.get("clean", True):
            return value  # polluted (module docstring): good for this run, measured again next time
        cache = _read_cache(path)
        cache[key] = value
        cache[_excess_key(key)] = int(measured.get("excess_bytes", 0))
        # what the probe measured and predicted of its largest rank, kept so the figure can be checked later
        for part in ("measured_bytes", "model_bytes"):
            if part in measured:
                cache[f"{key}|{part}"] = int(measured[part])
        try:
            from ...files import write_text_atomic

            write_text_atomic(path, json.dumps(cache, indent=1) + "\n")
        except OSError:
            pass  # a read-only home: measure again next time
        return value


def _read_cache(path: Path) -> dict[str, int]:
    try:
        cache = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, json.JSONDecodeError):
        return {}
    return cache if isinstance(cache, dict) else {}


def _cached(path: Path, key: str, device: str) -> int | None:
    """The cached reserve under ``key``, or None where it must be measured (absent; on a CPU, cached
    without its ranks' excess)."""
    cache = _read_cache(path)
    if key in cache and (device != "cpu" or _excess_key(key) in cache):
        return int(cache[key])
    return None


@contextmanager
def _one_probe_at_a_time(path: Path) -> Iterator[None]:
    """Hold the cache's lock file while measuring: a second process needing the same figure (two
    converts at once, the test suite's workers) waits for the first's and reads it, instead of
    running a probe of its own beside it, twice the time on the same cores. Where no lock can be
    taken (no fcntl, a read-only cache folder), each process measures as before."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_name(path.name + ".lock"), "a")
    except OSError:
        yield
        return
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        except OSError:
            pass  # a filesystem without locks: measure as before
        yield


# figures the probe measured in this process, cached or not: (cache file, key) -> excess bytes; the
# file is part of the key so that a process switching caches (AUTOPIPE_CACHE) never reads another's
_EXCESS: dict[tuple[str, str], int] = {}


def _excess_key(key: str) -> str:
    return f"{key}|excess"


def rank_excess(device: str = "cpu", *, dtype: str = "fp32", config: Any = None) -> int | None:
    """The most a rank of this machine's reserve probe held beyond the memory model's prediction for
    it (bytes, the module docstring), as measured with the reserve; None where it never was (a cache
    from before the figure: ``python -m autopipe.runtime.checks.reserve --device cpu --refresh``).
    Measures nothing itself."""
    key = _key(device, dtype, _arch(config))
    slot = (str(_cache_file()), key)
    if slot in _EXCESS:
        return _EXCESS[slot]
    try:
        cache = json.loads(_cache_file().read_text())
    except (OSError, json.JSONDecodeError):
        return None
    value = cache.get(_excess_key(key)) if isinstance(cache, dict) else None
    return int(value) if isinstance(value, int) else None


def excess_for(device: str, *, estimate: bool, given: str | int | None = None, dtype: str = "fp32",
               config: Any = None) -> int | None:
    """What a CPU profile's memory advice sets beside the tensors (``Profile.rank_excess_bytes``):
    ``rank_excess`` where the reserve was measured on this CPU (call after ``reserve_for``: an
    estimate for ``cpu`` trains here too); None where it was given, or for a GPU (whose CUDA memory
    model has its own terms)."""
    if given is not None or device != "cpu":
        return None
    return rank_excess("cpu", dtype=dtype, config=config)


def reserve_for(device: str, *, estimate: bool, given: str | int | None = None, dtype: str = "fp32",
                config: Any = None, progress: bool | Progress = False) -> int:
    """The reserve a profile for ``device`` should carry: ``given`` (a size like 80MiB, or 0) if set;
    estimating for a named GPU, none (the device table's CUDA memory model stands for it); else this
    machine's for training ``dtype`` a model of ``config``'s architecture, measured once (cpu or
    cuda). Call it before the model is moved to the GPU: a measurement taken beside it is not cached."""
    if given is not None:
        from ...units import parse_size

        return 0 if str(given).strip().lower() in ("0", "none") else parse_size(given)
    if estimate and device not in ("cpu", "cuda"):
        return 0
    return runtime_reserve("cuda" if device.startswith("cuda") else "cpu", dtype=dtype, config=config, progress=progress)


def holds_gpu_memory() -> bool:
    """Whether this process holds GPU memory (the user's model moved there already): a probe run
    beside it competes for the device, so its figure is not cached."""
    import torch

    return bool(torch.cuda.is_initialized() and torch.cuda.memory_reserved() > 0)


def measure_reserve(device: str = "cpu", *, dtype: str = "fp32", config: Any = None,
                    progress: bool | Progress = False) -> dict[str, int]:
    """Run the probe: profile and cut the probe model (``config``'s architecture shrunk by
    ``probe_config``, else a small GPT-2) here, in the mode ``dtype`` trains in; train it under
    torchrun in fresh processes; compare each rank's measured peak with the memory model's prediction.
    ``clean`` (0 or 1) says whether the figure may be cached (module docstring). ``progress``: how its
    two phases (profiling the probe, training it) are shown (autopipe.progress)."""
    import torch
    from transformers import GPT2Config

    from ...costs.profiler import profile
    from ...graph.flattener import flatten
    from ...graph.sources import load_model
    from ...planner.memory import rank_memory
    from ...planner.partitioner import partition
    from ..torch_engine.pipeline import receives_integers

    # two ranks on a CPU (gloo's buffers are in the reserve); one where the probe's cut, which
    # carries the labels, would not run (torch < 2.13)
    ranks = 1 if device == "cuda" or not receives_integers() else 2
    beside = holds_gpu_memory() if device == "cuda" else False
    small = probe_config(config) if config is not None else None
    shown = progress_for(progress)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        with shown.phase(f"reserve: profile a probe model for {device}"):
            if small is not None:
                small.save_pretrained(root / "model")
            else:
                GPT2Config(architectures=["GPT2LMHeadModel"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                           use_cache=False, **_PROBE).save_pretrained(root / "model")  # fmt: skip
            threads = torch.get_num_threads()
            torch.set_num_threads(1)  # as each rank runs
            try:
                spec = load_model(str(root / "model"), device=device, batch_size=_ROWS, seq_len=_SEQ, dropout=0.0)
                autocast = None if dtype == "fp32" else PRECISIONS[dtype]  # fp32: no autocast
                seq = flatten(spec.model, spec.args, spec.kwargs, validate=False, autocast=autocast)
                prof = profile(seq, spec.args, spec.kwargs, repeats=1, warmup=0, progress=False, reserve=0,
                               autocast=autocast)  # fmt: skip
            finally:
                torch.set_num_threads(threads)
            del seq, spec
            plan = partition(prof, stages=ranks, microbatches=_MICRO, schedule="1f1b")
            plan.save(root / "plan.json")
            predicted = rank_memory(prof, plan.boundaries, stage_ranks=plan.stage_ranks, inflight=plan.stage_inflight,
                                    microbatches=plan.microbatches, reserve=0)  # fmt: skip
        with shown.phase(f"reserve: train the probe on {ranks} rank(s)", total=_STEPS, unit="steps") as steps, \
                _watching(root, ranks, steps):
            run_local_workers("autopipe.runtime.checks.reserve", ranks, [str(root), "--dtype", dtype], timeout=600,
                              failure=f"measuring the runtime reserve on {device} failed")
        readings = [json.loads((root / f"peak{r}.json").read_text()) for r in range(ranks)]
    measured = [int(r["peak"]) for r in readings]
    gaps = [m - p.total for m, p in zip(measured, predicted)]
    clean = all(r["outside_known"] for r in readings) and not beside
    return {"measured_bytes": max(measured), "model_bytes": max(p.total for p in predicted),
            "reserve_bytes": max(0, int(statistics.mean(gaps))), "excess_bytes": max(0, max(gaps)),
            "clean": int(clean)}  # fmt: skip


@contextmanager
def _watching(root: Path, ranks: int, phase: Phase) -> Iterator[None]:
    """While the probe's ranks train: their slowest rank's step count, read every half second from the
    files each writes after a step, set on ``phase`` (the ranks run in processes of their own)."""
    def steps() -> int:
        done = []
        for r in range(ranks):
            try:
                done.append(int((root / f"step{r}").read_text() or 0))
            except (OSError, ValueError):
                done.append(0)
        return min(done)

    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(0.5):
            phase.set(steps())

    thread = threading.Thread(target=watch, name="reserve-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        phase.set(steps())


def _worker(root: Path, dtype: str) -> None:
    """One probe rank: train the planned cut ``_STEPS`` steps and write its largest peak once the heap
    has settled (``_SETTLED``), each read after the step's optimizer step."""
    from ...planner.plan import load_plan
    from ..data.factory import model_factory
    from ..data.sources import TokenData
    from ..process.distenv import init_dist
    from ..stage.build import build_stage
    from ..torch_engine.trainer import Trainer
    from ..training.optim import TrainConfig

    source = model_factory(str(root / "model"), batch_size=_ROWS, seq_len=_SEQ)
    env = init_dist(dp=1, exact_memory=True)  # the peak then counts tensors, as the memory model does
    try:
        plan = load_plan(root / "plan.json")
        config = TrainConfig(steps=_STEPS, microbatches=_MICRO, dtype=dtype)
        build = build_stage(source.factory, source.args, source.kwargs, plan, pp_rank=env.pp_rank,
                            pp_size=env.pp_size, schedule="1f1b", device=env.device,
                            autocast=config.autocast_dtype)  # fmt: skip
        trainer = Trainer(build, env, config)
        data = TokenData(None, vocab_size=source.vocab_size, seq_len=_SEQ)
        peak = 0
        rows = _ROWS * _MICRO
        for step in range(_STEPS):
            args, kwargs = source.batch(data.batch(step, rows), rows, step=step)
            trainer.step(args, kwargs)
            whole = env.peak.read()  # after the step returned: its optimizer step included
            if step >= _SETTLED:  # not the first steps': shapes inferred, allocations still finding their places
                peak = max(peak, whole)
            (root / f"step{env.rank}").write_text(str(step + 1))  # for the asking process's progress (_watching)
        reading = {"peak": peak, "outside_known": env.peak.outside_known}
        (root / f"peak{env.rank}.json").write_text(json.dumps(reading))
    finally:
        env.close()


def main() -> None:

    parser = argparse.ArgumentParser(description="Measure the training runtime's memory reserve on this device.")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="fp32", choices=list(PRECISIONS), help="the precision training runs in")
    parser.add_argument("--model", default=None, help="a built-in name or folder whose architecture the probe takes")
    parser.add_argument("--refresh", action="store_true", help="measure again even if cached")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # a probe rank under torchrun
    opts = parser.parse_args()
    if opts.worker:
        _worker(Path(opts.worker), opts.dtype)
        return
    config = None
    if opts.model:
        from ...graph.sources import load_model

        config = getattr(load_model(opts.model, device="meta", batch_size=1, seq_len=_SEQ).model, "config", None)
    # progress on stderr; the figures on stdout, as JSON
    reserve = runtime_reserve(opts.device, dtype=opts.dtype, config=config, refresh=opts.refresh, progress=True)
    print(json.dumps({"reserve_bytes": reserve,
                      "rank_excess_bytes": rank_excess(opts.device, dtype=opts.dtype, config=config)}))


if __name__ == "__main__":
    main()
