"""DeepSpeed's PipelineModule cut at the parts you give, and those parts from module names per stage.

DeepSpeed 0.19's PipelineModule computes its stage boundaries itself (``partition_method``: uniform,
parameters or type:regex) and takes no explicit list. ``planned_pipeline_module`` is the smallest
change that does: a subclass whose ``_partition_layers`` sets ``parts`` (the first layer index of each
stage, then the layer count) instead of computing them; everything else is DeepSpeed's own
(LayerSpec, TiedLayerSpec, the engine, its schedule). ``parts_for`` turns a plan's module names per
stage (``autopipe export --to deepspeed``) into those indices for your own list of layers.

Everything below the line "the wrapper" imports nothing from autopipe: ``autopipe export --to deepspeed``
copies it into the file it writes, to import or copy into a DeepSpeed project as it is.

Example:
    >>> stages = [["embed", "h.0", "h.1"], ["h.2", "ln_f", "head"]]
    >>> parts_for(stages, ["embed", "h.0", "h.1", None, "h.2", "ln_f", "head"])  # None: a layer with no module
    [0, 4, 7]
"""

from __future__ import annotations

__all__ = ["parts_for", "planned_pipeline_module", "planned_pipeline_module_class"]

# ---- the wrapper -----------------------------------------------------------------------------------

from typing import Any, Sequence, Union  # noqa: E402  (the export copies from the line above down)

LayerModules = Union[str, Sequence[str], None]


def _stage_of(name: str, stage_modules: Sequence[Sequence[str]]) -> set[int]:
    """The stages holding module ``name``, or modules inside it, or the module it is inside."""
    return {s for s, mods in enumerate(stage_modules) for m in mods
            if m == name or m.startswith(name + ".") or name.startswith(m + ".")}


def parts_for(stage_modules: Sequence[Sequence[str]], layer_modules: Sequence[LayerModules]) -> list[int]:
    """PipelineModule parts for your layers: ``layer_modules[i]`` names the module(s) layer i runs (None
    or "" for a layer with no module of its own, e.g. a reshape; it joins the stage before it).

    Raises ValueError naming the layer when a layer's modules sit on two stages, a module is on no
    stage, the stages would run out of order, or a stage would be empty.
    """
    stage_of_layer: list[int] = []
    current = 0
    for i, mods in enumerate(layer_modules):
        names = [mods] if isinstance(mods, str) else list(mods or [])
        names = [n for n in names if n]
        if not names:
            stage_of_layer.append(current)
            continue
        found: set[int] = set()
        for n in names:
            where = _stage_of(n, stage_modules)
            if not where:
                raise ValueError(f"layer {i} runs {n}, which no stage lists; name the model's modules as the plan "
                                 f"does (e.g. {stage_modules[0][0]!r}).")
            found |= where
        if len(found) > 1:
            raise ValueError(f"layer {i} runs {', '.join(names)}, which the plan puts on stages "
                             f"{', '.join(map(str, sorted(found)))}; split that layer in two.")
        (stage,) = found
        if stage < current:
            raise ValueError(f"layer {i} ({', '.join(names)}) belongs to stage {stage}, but an earlier layer is on "
                             f"stage {current}; list the layers in the model's order.")
        current = stage
        stage_of_layer.append(stage)
    parts = [0]
    for s in range(1, len(stage_modules)):
        if s not in stage_of_layer:
            raise ValueError(f"no layer runs a module of stage {s} ({', '.join(stage_modules[s][:3])}, ...).")
        parts.append(stage_of_layer.index(s))
    parts.append(len(layer_modules))
    return parts


_CLASS: Any = None


def planned_pipeline_module_class() -> type:
    """DeepSpeed's PipelineModule with explicit parts (imports DeepSpeed on first use)."""
    global _CLASS
    if _CLASS is None:
        from deepspeed.pipe import PipelineModule

        class PlannedPipelineModule(PipelineModule):
            """PipelineModule whose stage boundaries are given (``parts``), not computed."""

            def __init__(self, layers: Sequence[Any], parts: Sequence[int], **kwargs: Any) -> None:
                self._planned_parts = [int(p) for p in parts]
                kwargs.pop("partition_method", None)
                super().__init__(layers, partition_method="uniform", **kwargs)

            def _partition_layers(self, method: str = "uniform") -> None:
                parts, n = self._planned_parts, len(self._layer_specs)
                if (len(parts) != self.num_stages + 1 or parts[0] != 0 or parts[-1] != n
                        or any(a >= b for a, b in zip(parts, parts[1:]))):
                    raise ValueError(f"parts {parts} must be {self.num_stages + 1} increasing layer indices from 0 "
                                     f"to {n} (one stage each for num_stages={self.num_stages}).")
                self.parts = list(parts)
                stage = self._topo.get_coord(self.global_rank).pipe
                self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])

        _CLASS = PlannedPipelineModule
    return _CLASS


def planned_pipeline_module(layers: Sequence[Any], parts: Sequence[int], **kwargs: Any) -> Any:
    """``PipelineModule(layers, **kwargs)`` cut at ``parts`` (``num_stages``, ``loss_fn``, ... as DeepSpeed's)."""
    return planned_pipeline_module_class()(layers, parts, **kwargs)
