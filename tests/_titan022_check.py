"""What torchtitan 0.2 itself makes of an exported TOML: run with torchtitan 0.2 first on PYTHONPATH.

Its own ConfigManager reads ``--job.config_file TOML`` (plus any overrides after it), its own train
spec builds the model the TOML names on the meta device, and its own ``pipeline_module_split`` builds
each pipeline rank's parts on a fake process group. Prints what it read and built as JSON; it imports
nothing from autopipe and re-implements nothing of torchtitan.

usage: python _titan022_check.py CONFIG.toml [OVERRIDE ...]
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
import torchtitan
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore
from torchtitan.config import ConfigManager
from torchtitan.distributed.pipeline_parallel import pipeline_module_split
from torchtitan.protocols.train_spec import get_train_spec


def main() -> None:
    cfg = ConfigManager().parse_args(["--job.config_file", sys.argv[1], *sys.argv[2:]])
    p = cfg.parallelism
    spec = get_train_spec(cfg.model.name)
    with torch.device("meta"):
        model = spec.model_cls(spec.model_args[cfg.model.flavor])
    ranks = {}
    for rank in range(p.pipeline_parallel_degree):
        dist.init_process_group("fake", rank=rank, world_size=p.pipeline_parallel_degree, store=FakeStore())
        mesh = init_device_mesh("cpu", (p.pipeline_parallel_degree,), mesh_dim_names=("pp",))
        stages, chunks = pipeline_module_split(model, mesh, p.pipeline_parallel_schedule, torch.device("cpu"),
                                               p.module_fqns_per_model_part)  # fmt: skip
        ranks[rank] = [[s.stage_index, [n for n, _ in c.named_parameters()]] for s, c in zip(stages, chunks)]
        dist.destroy_process_group()
    print(json.dumps({
        "version": torchtitan.__version__,
        "model": [cfg.model.name, cfg.model.flavor],
        "parallelism": {k: getattr(p, k) for k in ("pipeline_parallel_degree", "pipeline_parallel_schedule",
                                                   "pipeline_parallel_microbatch_size", "module_fqns_per_model_part",
                                                   "data_parallel_replicate_degree", "data_parallel_shard_degree",
                                                   "fsdp_reshard_after_forward")},
        "training": {"local_batch_size": cfg.training.local_batch_size, "seq_len": cfg.training.seq_len},
        "activation_checkpoint": cfg.activation_checkpoint.mode,
        "params": [n for n, _ in model.named_parameters()],
        "ranks": ranks,
    }))


if __name__ == "__main__":
    main()
