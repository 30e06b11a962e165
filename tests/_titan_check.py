"""What torchtitan 0.3 itself makes of an export, for the export tests: its own config parser, its own
model builder and its own splitter, run per pipeline rank on fake process groups (no processes, no
weights: the model is on the meta device). Nothing here re-implements torchtitan; it only calls it.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["parse_config", "build_model", "split_per_rank", "units_of_core_chunk", "units_of_hf_chunk", "parse_module"]


def parse_config(args: Sequence[str]) -> Any:
    """torchtitan's ConfigManager on ``args`` (``--module M --config F ...``)."""
    from torchtitan.config import ConfigManager

    return ConfigManager().parse_args(list(args))


def parse_module(path: Path, function: str = "autopipe_plan") -> Any:
    """The config an exported module gives, read as torchtitan reads it (the file's folder on sys.path)."""
    sys.path.insert(0, str(path.parent))
    try:
        sys.modules.pop(path.stem, None)
        return parse_config(["--module", path.stem, "--config", function])
    finally:
        sys.path.remove(str(path.parent))


def build_model(cfg: Any) -> nn.Module:
    """The model torchtitan's trainer builds from ``cfg``: the config updated from the job, on meta."""
    model_config = cfg.model_spec.model
    model_config.update_from_config(config=cfg)
    folder = getattr(cfg, "hf_model", None)
    if folder and (Path(folder) / "config.json").exists():  # its modeling module loaded before the snapshot
        import json

        import transformers

        for arch in json.loads((Path(folder) / "config.json").read_text()).get("architectures", []):
            getattr(transformers, arch, None)
    with torch.device("meta"), _transformers_restored():
        return model_config.build()


@contextlib.contextmanager
def _transformers_restored() -> Iterator[None]:
    """Undo, on the way out, what torchtitan's HF backend patches into transformers' classes.

    Building an HF-backend model assigns ``PreTrainedModel._init_weights``/``_initialize_weights`` and
    the decoder layer's ``__init__`` for the whole process (torchtitan 0.3.0, its model.py); left in
    place, every HuggingFace model the rest of the test session builds is initialised torchtitan's
    way, and the unpipelined references of other tests no longer match their jobs (CI, 28 failures).
    """
    classes = [c for m in list(sys.modules.values()) if (m.__name__ or "").startswith("transformers")
               for c in vars(m).values() if isinstance(c, type)]  # fmt: skip
    names = ("__init__", "_init_weights", "_initialize_weights")
    saved = [(c, n, c.__dict__[n]) for c in classes for n in names if n in c.__dict__]
    before = {(id(c), n) for c, n, _ in saved}
    try:
        yield
    finally:
        for c, n, v in saved:
            if c.__dict__.get(n) is not v:
                setattr(c, n, v)
        for c in classes:  # an attribute the backend added where the class had none
            for n in names:
                if n in c.__dict__ and (id(c), n) not in before:
                    delattr(c, n)


def split_per_rank(model: nn.Module, cfg: Any) -> dict[int, list[tuple[int, nn.Module]]]:
    """Per pipeline rank, the (stage index, model chunk) pairs torchtitan builds there: its own split
    function (the one the model's pipelining_fn calls), on a fake process group of the pipeline's size."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if cfg.model_spec.pipelining_fn.__name__ == "pipeline_hf_transformers":
        from torchtitan.experiments.transformers_modeling_backend.pipeline import pipeline_module_split as split
    else:
        from torchtitan.distributed.pipeline_parallel import _pipeline_module_split as split
    p = cfg.parallelism
    pp = p.pipeline_parallel_degree
    out = {}
    for rank in range(pp):
        dist.init_process_group("fake", rank=rank, world_size=pp, store=FakeStore())
        try:
            mesh = init_device_mesh("cpu", (pp,), mesh_dim_names=("pp",))
            stages, chunks = split(model, mesh, p.pipeline_parallel_schedule, torch.device("cpu"),
                                   p.module_fqns_per_model_part)  # fmt: skip
            out[rank] = [(s.stage_index, c) for s, c in zip(stages, chunks)]
        finally:
            dist.destroy_process_group()
    return out


def units_of_core_chunk(chunk: nn.Module) -> list[str]:
    """The top-level modules and layer entries a torchtitan model chunk kept (those holding parameters)."""
    units = []
    for name, _ in chunk.named_parameters():
        parts = name.split(".")
        unit = ".".join(parts[:2]) if parts[0] == "layers" else parts[0]
        units += [unit] if unit not in units else []
    return units


def units_of_hf_chunk(chunk: nn.Module) -> list[str]:
    """The same for a chunk of torchtitan's HuggingFace backend, whose split renumbers the kept layers:
    each decoder layer is known by its attention's ``layer_idx``; a dropped module is an Identity."""
    units = ["tok_embeddings"] if not isinstance(chunk.tok_embeddings, nn.Identity) else []
    units += [f"layers.{layer.self_attn.layer_idx}" for layer in chunk.layers]
    units += [n for n in ("norm", "lm_head") if not isinstance(getattr(chunk, n), nn.Identity)]
    return units
