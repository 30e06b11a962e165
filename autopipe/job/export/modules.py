"""A plan as module names per stage: what every engine that splits by module reads, checked against the model.

A flattened layer is named after the modules it runs ("transformer.wte, transformer.wpe, ..." for a
glue layer, "model.layers.3" for a block); a chunk's modules are the units of its layers
(autopipe.planner.targets.unit_of). With the model at hand (built on the meta device: no weights) the
names are checked to be its modules, the units a glue layer's shortened name leaves out (" +2") are
found among the model's parameters, and parameter-free modules outside the decoder stack that every
stage calls (a rotary embedding: NeMo Automodel lists ``model.rotary_emb`` in every part) are named
for every stage. What an engine cannot express is refused here, one line each: a cut inside a module,
a tied tensor split across stages where the engine does not tie, a schedule or sharding it lacks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from ...costs.layer_costs import Profile
from ...costs.rescale import profiled_microbatch, tokens_per_sample
from ...errors import ExportError, StaleProfileError
from ...planner.plan import Plan
from ...planner.targets import (
    allowed_cuts,
    check_target,
    decoder_stack,
    layer_units,
    module_cuts,
    target_info,
    tied_users,
    unit_of,
)

__all__ = ["StageModules", "stage_modules", "model_units"]


@dataclass(frozen=True)
class StageModules:
    """The plan, per chunk (model order), as the modules an engine keeps there, with what it runs."""

    target: str
    model: str
    stages: int
    virtual_stages: int
    schedule: str
    microbatches: int
    microbatch_size: int
    dp: int
    zero: int
    recompute: str  # the one mode every chunk runs ("none", "selective", "full")
    chunk_ranks: tuple[int, ...]
    layers: tuple[tuple[int, int], ...]  # per chunk: its layers [a, b) in the flattened sequence
    modules: tuple[tuple[str, ...], ...]  # per chunk: module FQNs, in model order
    every_stage: tuple[str, ...] = ()  # parameter-free modules each stage calls (already in ``modules``)
    tied: tuple[tuple[tuple[str, ...], tuple[int, ...]], ...] = ()  # (tensor names, chunks holding one)
    names: tuple[str, ...] = ()  # the flattened layers' names
    units: tuple[tuple[str, ...], ...] = ()  # per flattened layer: the modules it runs
    step_time: float = 0.0
    notes: tuple[str, ...] = field(default_factory=tuple)
    seq_len: int = 0  # tokens per sample the profile was taken at (0: not a token model)
    tp: int = 1  # tensor-parallel degree inside each stage (Plan.tp)
    sequence_parallel: bool = False  # norms and dropouts sequence-parallel between the tp regions
    ep: int = 1  # expert-parallel degree over the dp replicas (Plan.ep)
    experts: int = 0  # routed experts per MoE layer (the profile's MoeShape; 0: none recorded)
    top_k: int = 0  # experts per token


def model_units(model: Any) -> tuple[dict[str, bool], dict[str, list[str]]]:
    """From a model: every module path -> whether it holds parameters (its own or below), and for each
    name of a tied tensor (one object under several names) all its names. Torch only through the
    model's own methods."""
    has_params: dict[str, bool] = {}
    for name, mod in model.named_modules():
        has_params[name] = any(True for _ in mod.parameters())
    tied: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        tied.setdefault(id(p), []).append(name)
    groups = {name: names for names in tied.values() if len(names) > 1 for name in names}
    return has_params, groups


def _stale(plan: Plan, profile: Profile) -> None:
    if plan.signature and profile.signature and plan.signature != profile.signature:
        raise StaleProfileError("the plan was made from another profile (their signatures differ); give the profile "
                                "it was planned from (--profile), or plan again.")  # fmt: skip
    if plan.num_layers != len(profile.layers):
        raise StaleProfileError(f"the plan cuts {plan.num_layers} layers but the profile has {len(profile.layers)}; "
                                "give the profile it was planned from (--profile).")


def _why_not(plan: Plan, names: Sequence[str], target: str, tied: list[list[int]], chunk_of: list[int]) -> None:
    """One line for the first cut ``target`` cannot make: inside a module, a tie split, Megatron's E/L."""
    t = target_info(target)
    allowed = set(allowed_cuts(names, target, tied).cuts)
    inside = set(range(1, len(names))) - set(module_cuts(names))
    for c, b in enumerate(plan.boundaries[1:-1], start=1):
        if b in allowed:
            continue
        if b in inside:
            shared = [u for u in layer_units(names[b]) if any(u in layer_units(n) for n in names[:b])]
            what = shared[0] if shared else layer_units(names[b])[0]
            raise ExportError(f"chunk {c} starts at layer {b} ({names[b]}), inside module {what}, and {t.name} moves "
                              f"whole modules; plan with --for {t.key} (cuts between whole modules only).")
        for users in tied if not t.ties_across_stages else ():
            if min(users) < b <= max(users):
                chunks = sorted({chunk_of[u] for u in users})
                raise ExportError(f"layers {', '.join(names[u] for u in users)} share a tied tensor but sit on chunks "
                                  f"{', '.join(map(str, chunks))}, and {t.name} does not tie weights across stages; untie "
                                  "them in the model (tie_word_embeddings=false; torchtitan:...,enable_weight_tying=false), or "
                                  "export --to megatron or deepspeed.")
        part = "embedding (E)" if b < decoder_stack(names).first else "final norm, output layer and loss (L)"
        raise ExportError(f"chunk {c} starts at layer {b} ({names[b]}), inside Megatron-Core's {part}; plan with "
                          "--for megatron (cuts before a decoder layer or before L only).")


def stage_modules(plan: Plan, profile: Profile, target: str, model: Any = None) -> StageModules:
    """The plan's chunks as module FQNs for ``target`` (torchtitan, megatron, deepspeed, fqns).

    ``model`` (optional, any device, meta is enough) checks the names against the model's modules and
    fills in what the names leave out; without it the names are taken as they are.
    Raises ExportError (one line) when the plan cannot be expressed in ``target``.
    """
    t = target_info(target)
    _stale(plan, profile)
    names = [layer.name or f"layer{i}" for i, layer in enumerate(profile.layers)]
    modes = plan.stage_recompute or ("none",) * plan.num_chunks
    check_target(t.key, schedule=plan.schedule, virtual_stages=plan.virtual_stages, zero=plan.zero, dp=plan.dp,
                 recompute=modes, tp=plan.tp)  # fmt: skip
    experts, top_k = _check_ep(plan, profile, t.key, t.name)
    chunk_of = [c for c in range(plan.num_chunks) for _ in plan.layers_of(c)]
    tied = tied_users(profile)
    _why_not(plan, names, t.key, tied, chunk_of)
    units = [list(layer_units(n)) for n in names]
    notes: list[str] = []
    every: list[str] = []
    tied_names: dict[str, list[str]] = {}
    if model is not None:
        has_params, tied_names = model_units(model)
        _complete(units, names, has_params)
        stack = _stack_prefix(names)
        seen = {u for us in units for u in us}
        # modules no stage would keep that the stages call: parameter-free, beside the decoder stack
        every = [u for u in seen if u in has_params and not has_params[u] and not u.startswith(stack + ".")
                 and _called_by_stack(u, stack) and not _is_dropout(model, u)]  # fmt: skip
        every.sort(key=lambda u: min(i for i, us in enumerate(units) if u in us))
    else:
        notes.append("no model given: the module names are the profile's layer names, unchecked")
    modules = []
    for c in range(plan.num_chunks):
        found: list[str] = []
        for i in plan.layers_of(c):
            found += [u for u in units[i] if u not in found]
        if t.key in ("torchtitan", "fqns"):
            found += [u for u in every if u not in found]
        modules.append(tuple(found))
    groups = []
    for users in tied:
        tensors = sorted({n for i in users for n in profile.layers[i].tied})
        full = sorted({n for x in tensors for n in tied_names.get(x, [x])} | set(tensors))
        groups.append((tuple(full), tuple(sorted({chunk_of[u] for u in users}))))
    if t.key == "megatron":
        _megatron_ties(groups, names, tied)
    return StageModules(
        target=t.key, model=profile.model, stages=plan.stages, virtual_stages=plan.virtual_stages,
        schedule=plan.schedule, microbatches=plan.microbatches, microbatch_size=profiled_microbatch(profile),
        dp=plan.dp, zero=plan.zero, recompute=modes[0], chunk_ranks=plan.stage_ranks,
        layers=tuple((a, b) for a, b in zip(plan.boundaries, plan.boundaries[1:])), modules=tuple(modules),
        every_stage=tuple(every), tied=tuple(groups), names=tuple(names), units=tuple(tuple(u) for u in units),
        step_time=plan.step_time, notes=tuple(notes), seq_len=tokens_per_sample(profile) or 0,
        tp=plan.tp, sequence_parallel=plan.sequence_parallel, ep=plan.ep, experts=experts, top_k=top_k,
    )  # fmt: skip


def _check_ep(plan: Plan, profile: Profile, key: str, name: str) -> tuple[int, int]:
    """(experts, top-k) of the profile's MoE layers; one line where ``key`` cannot run the plan's ep:
    DeepSpeed's pipeline engine has none; torchtitan's EP borrows its ranks from FSDP's dp_shard (and
    from tp, which the plan keeps apart), so it needs the replicas sharded (ZeRO 2/3) and tp 1."""
    shapes = [l.moe for l in profile.layers if l.moe is not None]
    experts, top_k = (shapes[0].experts, shapes[0].top_k) if shapes else (0, 0)
    if plan.ep == 1:
        return experts, top_k
    if key == "deepspeed":
        raise ExportError(f"{name}'s pipeline engine takes no expert parallelism, but the plan shards the experts over "
                          f"{plan.ep} replicas; plan with --ep 1, or export --to torchtitan or megatron.")
    if not shapes:
        raise ExportError(f"the plan has ep {plan.ep} but its profile records no mixture-of-experts layer; give the "
                          "profile the plan was made from.")
    if key == "torchtitan" and (plan.zero not in (2, 3) or plan.tp > 1):
        raise ExportError(f"torchtitan's expert parallelism borrows its {plan.ep} ranks from FSDP's data_parallel_shard "
                          f"(and from tp, which the plan keeps whole), but the plan has ZeRO {plan.zero} and tp {plan.tp}; "
                          "plan with --zero 2 or 3 and --tp 1, or export --to megatron.")
    return experts, top_k


def _complete(units: list[list[str]], names: Sequence[str], has_params: dict[str, bool]) -> None:
    """Check each unit is a module of the model; give a shortened glue name (" +N") the units with
    parameters that no layer names, placed by the order the model registers its modules."""
    order = {m: i for i, m in enumerate(has_params)}
    for i, us in enumerate(units):
        for u in us:
            if u not in has_params:
                raise ExportError(f"layer {i} ({names[i]}) names {u}, which is not a module of the model; export with "
                                  "the model the plan was made for (--model).")
    short = [i for i, n in enumerate(names) if "+" in n.rsplit(",", 1)[-1]]
    if not short:
        return
    named = {u for us in units for u in us}
    missing = sorted({unit_of(m) for m, p in has_params.items() if p and m and unit_of(m) not in named
                      and not any(unit_of(m).startswith(n + ".") for n in named)}, key=lambda m: order.get(m, 0))  # fmt: skip
    for m in missing:  # the shortened layer whose named modules the model registers nearest before it
        before = [i for i in short if min(order.get(u, 0) for u in units[i]) <= order.get(m, 0)]
        units[(before or short)[-1]].append(m)


def _stack_prefix(names: Sequence[str]) -> str:
    try:
        return decoder_stack(names).prefix
    except ExportError:
        return "\0"  # no single stack: no module is "beside" it


def _called_by_stack(unit: str, stack: str) -> bool:
    """Beside the stack: in the same parent as the stack's container (model.rotary_emb next to model.layers)."""
    parent = stack.rpartition(".")[0]
    return unit.rpartition(".")[0] == parent


def _is_dropout(model: Any, unit: str) -> bool:
    """Dropout runs once after the embedding; a later stage calling it again would drop twice."""
    mod = model.get_submodule(unit)
    return "Dropout" in type(mod).__name__ or type(mod).__name__ == "Identity"


def _megatron_ties(groups: list[tuple[tuple[str, ...], tuple[int, ...]]], names: Sequence[str],
                   tied: list[list[int]]) -> None:  # fmt: skip
    """Megatron-Core ties the embedding to the output layer (and nothing else) across stages."""
    stack = decoder_stack(names)
    for (tensors, _chunks), users in zip(groups, tied):
        ends = {("E" if u < stack.first else "L" if u >= stack.end else "t") for u in users}
        if ends != {"E", "L"}:
            raise ExportError(f"{' = '.join(tensors)} is tied between layers {', '.join(names[u] for u in users)}; "
                              "Megatron-Core ties only the embedding to the output layer; export --to deepspeed or fqns.")
