"""What a built rank reaches beside the tensors it trains: tests/test_zero.py and
tests/test_expert_parallel.py check that a pass (tp, ep, ZeRO 2/3) leaves no whole weight behind."""

from __future__ import annotations

from typing import Any

import torch

from autopipe.runtime.stage.build import local


def _storage(p: torch.Tensor) -> int:
    return local(p.detach()).untyped_storage().data_ptr()


def stray_parameters(build: Any, trained: Any) -> tuple[int, list[str]]:
    """(how many real parameter tensors ``build``'s model and chunks reach, "name shape" of each whose
    storage is none of ``trained``'s: the rank's own parameters, local parts of DTensors compared)."""
    own = {_storage(p) for p in trained}
    reached = {n: p for mod in (build.model, *build.chunks) for n, p in mod.named_parameters(remove_duplicate=False)
               if p.device.type != "meta"}  # fmt: skip
    return len(reached), sorted(f"{n} {tuple(p.shape)}" for n, p in reached.items() if _storage(p) not in own)
