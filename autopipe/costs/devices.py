"""Devices a profile is measured on or estimated for: a table of known GPUs and a quick CPU probe.

The estimate mode turns FLOPs and bytes into time with a roofline over these numbers. GPU figures
are the vendors' published dense peaks (no sparsity); the CPU is measured once per process by timing
a matmul, a large copy and a tiny op, so a laptop plans with its own numbers. A GPU's DeviceInfo
also carries the CUDA memory model's per-GPU figures (context, workspaces, NCCL, allocator slack:
:mod:`autopipe.costs.gpu_memory`, which says which are published and which assumed).
"""

from __future__ import annotations

import os
import platform
import time
from dataclasses import dataclass

import torch

from ..errors import AutopipeError
from .gpu_memory import cuda_memory, expandable_segments
from .layer_costs import DeviceInfo

__all__ = ["DeviceSpec", "KNOWN_DEVICES", "device_spec", "describe_device", "probe_cpu", "dtype_name", "heap_kept",
           "slow_16bit_cpu_note", "host_probe"]

_TB = 1e12
_GIB = 1024**3


@dataclass(frozen=True)
class DeviceSpec:
    """Peak numbers of one device, used by the estimate mode's roofline.

    ``flops`` maps a dtype name to peak FLOP/s for matmuls in that dtype. ``compute_efficiency`` and
    ``memory_efficiency`` are the fractions of peak real kernels reach (large matmuls rarely pass
    ~60% of a GPU's peak; streaming kernels reach ~80% of HBM bandwidth); ``op_overhead`` is the
    fixed cost of launching one operator, which dominates small layers.
    """

    name: str
    type: str  # cuda | cpu
    flops: dict[str, float]
    memory_bandwidth: float  # bytes per second
    memory_bytes: int
    compute_efficiency: float = 0.6
    memory_efficiency: float = 0.8
    op_overhead: float = 5e-6  # seconds per operator
    threads: int = 0

    def peak_flops(self, dtype: str) -> float:
        """Peak FLOP/s for ``dtype`` (fp16 shares bf16's figure; unknown dtypes use fp32's)."""
        if dtype in self.flops:
            return self.flops[dtype]
        if dtype == "float16" and "bfloat16" in self.flops:
            return self.flops["bfloat16"]
        return self.flops["float32"]

    def info(self, dtype: str) -> DeviceInfo:
        return DeviceInfo(
            name=self.name,
            type=self.type,
            memory_bytes=self.memory_bytes,
            peak_flops=self.peak_flops(dtype),
            memory_bandwidth=self.memory_bandwidth,
            threads=self.threads,
            **(_cuda_fields(self.name) if self.type == "cuda" else {}),
        )


# Published dense peaks (SXM parts). fp32 is the non-tensor-core figure: PyTorch does not use TF32
# for matmuls unless the user enables it (torch.backends.cuda.matmul.allow_tf32).
KNOWN_DEVICES: dict[str, DeviceSpec] = {
    "a100": DeviceSpec(
        name="NVIDIA A100-SXM4-80GB",
        type="cuda",
        flops={"bfloat16": 312 * _TB, "float32": 19.5 * _TB},
        memory_bandwidth=2.039 * _TB,
        memory_bytes=80 * _GIB,
    ),
    "h100": DeviceSpec(
        name="NVIDIA H100 80GB HBM3",
        type="cuda",
        flops={"bfloat16": 989 * _TB, "float32": 67 * _TB},
        memory_bandwidth=3.35 * _TB,
        memory_bytes=80 * _GIB,
    ),
    "h200": DeviceSpec(
        name="NVIDIA H200",
        type="cuda",
        flops={"bfloat16": 989 * _TB, "float32": 67 * _TB},
        memory_bandwidth=4.8 * _TB,
        memory_bytes=141 * _GIB,
    ),
}

_CPU_PROBES: dict[tuple[str, int], DeviceSpec] = {}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


# the instructions that give a CPU native 16-bit arithmetic, per precision (torch.cpu's feature names)
_NATIVE_16BIT = {"bf16": ("avx512_bf16", "amx_bf16"), "fp16": ("avx512_fp16", "amx_fp16")}


def cpu_features() -> dict[str, bool]:
    """This CPU's instruction-set features as torch sees them ({} where this torch cannot say)."""
    get = getattr(torch.cpu, "get_capabilities", None)
    try:
        return {str(k): bool(v) for k, v in get().items()} if get is not None else {}
    except Exception:  # an older torch's or another platform's probe: no claim either way
        return {}


def slow_16bit_cpu_note(dtype: str) -> str | None:
    """A warning when training ``dtype`` (bf16 or fp16, any spelling ``choices.precision`` reads:
    ``bfloat16`` too) on this CPU would be emulated: without its instructions torch converts each
    value to fp32 and back, and a step runs many times slower than in fp32. None where the CPU has
    them, ``dtype`` is not 16-bit, or torch cannot tell."""
    from ..choices import precision

    try:
        dtype = precision(dtype)
    except AutopipeError:  # float64 and kin: not a precision this warns of
        return None
    wanted = _NATIVE_16BIT.get(dtype)
    features = cpu_features()
    if wanted is None or not features or any(features.get(f, False) for f in wanted):
        return None
    level = torch.backends.cpu.get_cpu_capability()
    return (f"this CPU ({cpu_name()}, {level}) has no {dtype} instructions ({' or '.join(f.upper() for f in wanted)}): "
            f"torch emulates {dtype} here, many times slower than fp32 (a GPT-2 6x256 bf16 step took 17 s against "
            f"0.45 s in fp32 on an AVX2 EPYC), and the profile and the job run at that speed. Use --dtype fp32 on "
            f"this machine, or plan for a GPU with --estimate --device h100.")


def _cpu_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def _best_time(fn, repeats: int) -> float:
    fn()  # warm-up: first calls pay for allocation and thread-pool start
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def host_probe() -> float:
    """Seconds of a fixed piece of host work shaped like a pipeline engine's own per-micro-batch work:
    Python calls, tiny tensor ops through the dispatcher and an autograd backward each, on tensors far
    too small for their arithmetic to count. The least of 7 runs (another process only slows one).

    An engine's measured overheads (:mod:`autopipe.costs.engines`: the runtime's seconds per forward and
    backward of a chunk, per step, per send) are this kind of work, fitted on one machine in that
    machine's seconds; a profile records this probe so a plan made on another CPU can scale them by the
    ratio instead of charging the fitting machine's seconds. About 35 ms (8 runs of 4 ms on a 2026 EPYC).
    """
    # the same work whatever mode the caller is in (a profile asked for under no_grad or inference_mode)
    with torch.inference_mode(False), torch.enable_grad():
        x = torch.ones(8, requires_grad=True)
        w = torch.ones(8, requires_grad=True)
        state: dict[str, float] = {}

        def work() -> None:
            for i in range(40):
                y = torch.relu(x * w + 1.0).sum()
                y.backward()
                state[f"op{i % 4}"] = state.get(f"op{i % 4}", 0.0) + 1.0  # an engine's dict and attribute traffic
            x.grad = None
            w.grad = None

        return _best_time(work, 7)


def probe_cpu(dtype: str = "float32") -> DeviceSpec:
    """Measure this CPU's matmul FLOP/s, copy bandwidth and per-op overhead (once per process).

    Takes well under a second. The best of a few runs is kept, since other processes only ever make
    a run slower.
    """
    threads = torch.get_num_threads()
    key = (dtype, threads)
    if key in _CPU_PROBES:
        return _CPU_PROBES[key]
    tdtype = getattr(torch, dtype)
    n = 512
    a = torch.randn(n, n).to(tdtype)
    b = torch.randn(n, n).to(tdtype)
    t_mm = _best_time(lambda: torch.mm(a, b), 5)
    big = torch.empty(16 * 1024 * 1024 // 4, dtype=torch.float32)  # 16 MiB: past the caches
    dst = torch.empty_like(big)
    t_copy = _best_time(lambda: dst.copy_(big), 5)
    one = torch.ones(1)
    t_op = _best_time(lambda: [one.add(one) for _ in range(100)], 3) / 100
    flops = 2.0 * n**3 / t_mm
    spec = DeviceSpec(
        name=cpu_name(),
        type="cpu",
        flops={dtype: flops, "float32": flops} if dtype != "float32" else {"float32": flops},
        memory_bandwidth=2.0 * big.numel() * 4 / t_copy,  # read + write
        memory_bytes=_cpu_memory(),
        # Measured figures are already what kernels reach, so no further discount.
        compute_efficiency=1.0,
        memory_efficiency=1.0,
        op_overhead=t_op,
        threads=threads,
    )
    _CPU_PROBES[key] = spec
    return spec


def device_spec(target: str, dtype: str = "float32") -> DeviceSpec:
    """Resolve an estimate target: ``cpu`` (probed), ``a100``/``h100``/``h200``, or ``cuda`` (this GPU)."""
    t = target.lower().strip()
    if t == "cpu":
        return probe_cpu(dtype)
    if t in ("cuda", "gpu") or t.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise AutopipeError(
                f"estimate target {target!r} means this machine's GPU, but CUDA is not available; "
                f"name the GPU instead ({', '.join(KNOWN_DEVICES)})."
            )
        gpu = torch.cuda.get_device_name(t if ":" in t else None).lower()
        for key, spec in KNOWN_DEVICES.items():
            if key in gpu:
                return spec
        raise AutopipeError(
            f"no peak figures for GPU {gpu!r}; estimate for one of {', '.join(KNOWN_DEVICES)} or measure it."
        )
    for key, spec in KNOWN_DEVICES.items():
        if t == key or t.startswith(key):
            return spec
    raise AutopipeError(
        f"unknown device {target!r} for an estimate; use cpu, cuda or one of {', '.join(KNOWN_DEVICES)}."
    )


def rank_threads() -> int:
    """The torch threads each rank of a CPU job runs with: ``OMP_NUM_THREADS`` where the shell sets it,
    else 1 (``autopipe run`` sets 1 where it is unset, as torchrun does for its workers). A CPU profile
    times its layers at this count, so its seconds are a rank's, not a whole-machine process's."""
    try:
        return max(int(os.environ.get("OMP_NUM_THREADS") or 1), 1)
    except ValueError:  # "4,2" (nested OpenMP levels) or junk: torch's workers take the first level
        head = os.environ["OMP_NUM_THREADS"].split(",")[0].strip()
        return max(int(head), 1) if head.isdigit() else 1


def describe_device(device: torch.device) -> DeviceInfo:
    """Name, type, memory and thread count of the device a profile is measured on (the threads in
    use when it is called: the profiler calls it while its timing threads are set)."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return DeviceInfo(name=props.name, type="cuda", memory_bytes=int(props.total_memory),
                          **_cuda_fields(props.name, hopper=props.major == 9))  # fmt: skip
    if device.type == "cpu":
        return DeviceInfo(name=cpu_name(), type="cpu", memory_bytes=_cpu_memory(), threads=torch.get_num_threads(),
                          cores=_cpu_cores(), host_probe=host_probe())
    return DeviceInfo(name=device.type, type=device.type)


def _cpu_cores() -> int:
    """The cores this process may run on (its affinity: a container's or taskset's share, not the host's)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # macOS and Windows have no affinity call
        return os.cpu_count() or 0


def _cuda_fields(name: str, hopper: bool | None = None) -> dict[str, float]:
    """The CUDA memory model's figures for GPU ``name`` under this process's allocator settings
    (``PYTORCH_CUDA_ALLOC_CONF``: train with the same), as a profile's DeviceInfo carries them."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") or os.environ.get("PYTORCH_ALLOC_CONF", "")
    return cuda_memory(name, expandable_segments=expandable_segments(conf), hopper=hopper).device_fields()


# Allocations at least this large get their own mapping (returned to the OS on free); smaller ones
# come from the heap, which keeps what it frees. Why not keep everything (M_MMAP_MAX = 0, as before):
# a step's large tensors then interleave with small ones in one heap, and the holes they leave do not
# fit the next step's pattern, so resident memory outgrew the bytes ever live: the LM-head rank of a
# GPT-2 pipeline peaked 1.3-1.5x above the plan (its live tensor bytes were within 7%), GPT-2 under
# full recompute 1.23-1.28x. Measured against the plan (bench/results/accuracy.md): with 8 MiB those
# were 1.12 and 1.15-1.17, with 1 MiB 0.89 and 1.02-1.03, and the runtime reserve a probe measures fell
# from 67 to 28 MiB. The price, GPT-2 (6 x 256) fp32 steps on one thread, 3 interleaved rounds under
# load 2-5: 1 MiB 1.08-1.11x the old setting's step, 8 MiB 1.01-1.11x.
# 64 KiB (2026-11-29): under 1 MiB the heap still held a step's sub-MiB tensors (a GPT-2 or Llama
# block's hidden states, 512 KiB at 4 x 128 x 256), and its holes grew the resident peak by 20-37 MiB
# over the live tensors (the profiler's memory timeline: the plan's tensors within 1-8 MiB of it),
# climbing for ~8 steps and moving +-5 MiB from step to step, which the runtime reserve, one figure
# per machine, could not follow: Llama 1F1B's rank 1 read 1.09-1.11x its plan, GPT-2's rank 0 1.07.
# At 64 KiB the same ranks read 0.99-1.05x their tensors, the same to 0.1 MiB from the 2nd step on,
# and the reserve fell from 20 to 0.2 MiB (GPT-2) and 27 to 3.6 (Llama). The price: an exact-memory
# GPT-2 1F1B step 1.30-1.32 s against 0.91-0.94 at 1 MiB (2 rounds, interleaved, load 1.3-1.5);
# it is the measuring mode's alone (a job's default is ``steady_heap``).
MMAP_THRESHOLD = 64 << 10
ALLOCATOR_SETTINGS = f"glibc mmap>={MMAP_THRESHOLD >> 10}KiB, no trim"  # part of the reserve's cache key


_HEAP_KEPT = False  # whether keep_freed_memory took effect in this process (it cannot be undone)


def keep_freed_memory() -> bool:
    """Make glibc keep freed heap memory for reuse instead of returning it to the OS (Linux only),
    with blocks of ``MMAP_THRESHOLD`` bytes or more in mappings of their own (see there): a CPU
    process's resident peak then counts its tensors, as the plan's memory model does.

    It costs time: every such block is page-faulted in afresh each time it is allocated. A GPT-2
    pipeline's LM-head rank (16 MiB of logits per micro-batch, several times over) spent 1.86 s of
    CPU per step under it against 1.45 s under glibc's own settings (bench/results/peers.md), so the
    runtime calls it only when asked to measure memory (``init_dist(exact_memory=True)``,
    ``train.py --exact-memory``) and the profiler not at all (both run ``steady_heap``). Returns
    whether it took effect (``heap_kept`` says it later).
    """
    global _HEAP_KEPT
    _HEAP_KEPT = _fix_thresholds(MMAP_THRESHOLD)
    return _HEAP_KEPT


def _fix_thresholds(mmap_threshold: int) -> bool:
    """glibc's mmap threshold set to ``mmap_threshold`` and its trim threshold to the most; whether both took."""
    mallopt = getattr(_libc(), "mallopt", None)  # musl and others have no mallopt
    if mallopt is None:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # a fixed threshold also stops glibc adapting it
    return bool(mallopt(m_mmap_threshold, mmap_threshold)) and bool(mallopt(m_trim_threshold, 2**31 - 1))


# glibc's largest mmap threshold on a 64-bit system (HEAP_MAX_SIZE / 2): blocks under it come from the heap
STEADY_MMAP_THRESHOLD = 32 << 20
_HEAP_STEADY = False


def steady_heap() -> bool:
    """Fix glibc's allocator thresholds for a loop of same-shaped steps (Linux only): blocks under
    ``STEADY_MMAP_THRESHOLD`` come from the heap, and the heap keeps what it frees, so each step
    reuses the pages the previous one touched instead of page-faulting fresh ones.

    Why: under glibc's own settings the thresholds adapt to what was freed last, and the heap's top
    is handed back whenever it outgrows twice the mmap threshold, so when a run's large tensors come
    and go they are mapped and page-faulted again: the profiler's whole-model runs of a 6-block
    Llama met 2,000-13,000 minor faults each (bf16 autocast), while a job's steps met few once their
    pattern settled, and the profile read 3-7% slower than the job (docs/profile.md). The
    profiler and every CPU rank call this, so both time one allocator state, the job's steady one.
    The price: a process keeps its heap's high-water mark resident, as a training loop reaches it
    every step anyway. ``keep_freed_memory`` (exact memory) takes precedence and is left as it set
    things. Returns whether the thresholds are fixed (by this call or before).
    """
    global _HEAP_STEADY
    if not (_HEAP_KEPT or _HEAP_STEADY):
        _HEAP_STEADY = _fix_thresholds(STEADY_MMAP_THRESHOLD)
    return _HEAP_KEPT or _HEAP_STEADY


def heap_kept() -> bool:
    """Whether this process runs under ``keep_freed_memory`` (its resident peak then counts tensors)."""
    return _HEAP_KEPT


def release_freed_memory() -> bool:
    """Hand the heap's free pages back to the OS now (glibc ``malloc_trim(0)``; Linux only).

    With ``keep_freed_memory`` on, pages a process freed stay resident and are reused silently; a
    peak measured as resident-set growth then misses whatever reuses them. The runtime calls this
    once, just before it takes its CPU memory baseline, so the baseline holds what is live.
    Returns whether anything could be called.
    """
    malloc_trim = getattr(_libc(), "malloc_trim", None)
    if malloc_trim is None:
        return False
    malloc_trim(0)
    return True


def _libc():  # noqa: ANN202
    """The C library on Linux (for glibc's allocator knobs), or None elsewhere or when it cannot load."""
    import ctypes
    import ctypes.util
    import sys

    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
