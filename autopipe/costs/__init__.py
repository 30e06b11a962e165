"""What each layer costs: the profile pass and the Profile record it writes.

    layer_costs  Profile, LayerCost, RecomputeCost, DeviceInfo: the record, saved as JSON (torch-free)
    profiler     profile: every layer of a LayerSequence measured (or estimated) on its device
    measure      one layer's time, saved activations and transient memory
    in_model     each layer's time inside the whole model, and the gap to its own figure charged to it
    estimate     a layer's time from FLOPs and bytes on meta tensors (a roofline)
    devices      the device table (known GPUs) and a quick CPU probe
    gpu_memory   the CUDA memory model's per-GPU figures (context, workspaces, NCCL, slack), with sources (torch-free)
    rescale      a profile at another micro-batch size, without profiling again (torch-free)

The names are imported on first use, so the torch-free planner reads Profile without loading torch.
"""

from __future__ import annotations

from ..lazy import lazy_exports

_NAMES = {
    "Profile": "layer_costs",
    "LayerCost": "layer_costs",
    "RecomputeCost": "layer_costs",
    "DeviceInfo": "layer_costs",
    "profile": "profiler",
    "check_signature": "profiler",
    "scale_microbatch": "rescale",
    "device_spec": "devices",
    "KNOWN_DEVICES": "devices",
    "CUDA_MEMORY": "gpu_memory",
    "cuda_memory": "gpu_memory",
}
__getattr__ = lazy_exports(__name__, _NAMES, globals())
__all__ = list(_NAMES)
