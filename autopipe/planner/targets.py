"""The engines a plan exports to, and which cuts, schedules and sharding each one can run. No torch.

torchtitan (and NeMo Automodel), Megatron-Core and DeepSpeed split a model by module, not by
autopipe's flattened layers, so a plan made for one of them may only cut where that engine can:

- between whole modules: a module (a "unit") is a layer name cut after its first numbered part
  (``transformer.h.3.attn`` -> ``transformer.h.3``; ``lm_head`` stays itself), and a cut may not fall
  between two layers holding the same unit (:func:`module_cuts`);
- torchtitan does not tie weights across pipeline stages, so no cut between the users of a tied tensor;
- Megatron-Core's ``--pipeline-model-parallel-layout`` knows an embedding (E), decoder layers (t) and
  the loss with the final norm and output layer (L): cuts only before a decoder layer or before L
  (:func:`decoder_stack`).

Which cuts are left is :func:`allowed_cuts`; ``partition(..., target=...)`` solves over them only
(step_solver: exact for the restricted problem) and records what the restriction costs. What a target
cannot run at all (a schedule, virtual stages, a ZeRO stage) is :func:`check_target`: one line naming
what would work.

Example:
    >>> names = ["wte, wpe", "h.0", "h.1.attn", "h.1.mlp", "ln_f", "lm_head"]
    >>> allowed_cuts(names, "torchtitan").cuts, allowed_cuts(names, "megatron").cuts
    ((1, 2, 4, 5), (1, 2, 4))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from ..costs.layer_costs import Profile
from ..errors import ExportError, InfeasibleMemoryError, PartitionError

__all__ = ["TARGETS", "Target", "target_info", "CutSet", "allowed_cuts", "module_cuts", "layer_units", "unit_of",
           "DecoderStack", "decoder_stack", "check_target", "restricted_cuts", "tied_users", "check_cut_allowed",
           "explain_restricted", "default_cut"]


@dataclass(frozen=True)
class Target:
    """What one engine runs: its name, the schedules it has (autopipe's name -> the engine's spelling),
    virtual stages per rank, the ZeRO stages it shards with, and whether it ties weights across stages."""

    key: str
    name: str
    schedules: Mapping[str, str]
    max_virtual: int | None  # None: any
    zeros: tuple[int, ...]
    ties_across_stages: bool
    what_zero: str  # how the engine shards, for the refusal
    recompute: tuple[str, ...] = ("none", "selective", "full")  # the modes it applies (to every stage alike)
    per_stage_recompute: bool = False  # whether stages may recompute differently
    tensor_parallel: bool = True  # whether it splits each stage's layers over a tensor-parallel group

    def schedule_name(self, schedule: str) -> str:
        return self.schedules[schedule]


TARGETS: dict[str, Target] = {
    "torchtitan": Target(
        "torchtitan", "torchtitan",
        # torch.distributed.pipelining's class names, which torchtitan's pipeline_parallel_schedule takes
        {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved1f1b": "Interleaved1F1B", "zbv": "ZBVZeroBubble"},
        None, (0, 2, 3), False, "replicates (ZeRO 0) or shards with FSDP2 (ZeRO 3; ZeRO 2 without resharding after forward)",
    ),
    "megatron": Target(
        "megatron", "Megatron-Core",
        {"1f1b": "1F1B", "interleaved1f1b": "interleaved 1F1B (virtual stages from the layout)"},
        None, (0, 1, 2), True, "replicates (ZeRO 0) or shards optimizer state and gradients with its distributed optimizer (ZeRO 1/2)",
    ),
    "deepspeed": Target(
        "deepspeed", "DeepSpeed",
        {"1f1b": "TrainSchedule (1F1B)"},
        1, (0, 1), True, "runs ZeRO 0 or 1 with its pipeline engine", ("none", "full"), tensor_parallel=False,
    ),
    "fqns": Target(
        "fqns", "module names (fqns)",
        {"gpipe": "gpipe", "1f1b": "1f1b", "interleaved1f1b": "interleaved1f1b", "zbv": "zbv"},
        None, (0, 1, 2, 3), True, "", per_stage_recompute=True,
    ),
}


def target_info(target: str) -> Target:
    """The Target for a name (torchtitan, megatron, deepspeed, fqns), or one line naming them."""
    key = str(target).strip().lower()
    if key not in TARGETS:
        raise ExportError(f"unknown target {target!r}; use one of {', '.join(TARGETS)}.")
    return TARGETS[key]


def check_target(target: str, *, schedule: str, virtual_stages: int, zero: int = 0, dp: int = 1,
                 recompute: Sequence[str] = (), tp: int = 1) -> None:  # fmt: skip
    """Raise ExportError (one line: what the engine lacks, what would work) when ``target`` cannot run
    this schedule, these virtual stages, this ZeRO stage, these per-chunk recompute modes or tensor
    parallelism of degree ``tp``."""
    t = target_info(target)
    if tp > 1 and not t.tensor_parallel:
        raise ExportError(f"{t.name}'s pipeline engine takes no tensor parallelism, but the plan splits each stage over "
                          f"{tp} GPUs; plan with --tp 1, or export --to torchtitan or megatron.")
    if schedule not in t.schedules:
        have = ", ".join(t.schedules)
        raise ExportError(f"{t.name} has no {schedule} schedule; plan with --schedule {have.replace(', ', ' or ')}.")
    if t.max_virtual is not None and virtual_stages > t.max_virtual:
        raise ExportError(f"{t.name} runs one stage per rank, not {virtual_stages}; plan with --schedule 1f1b.")
    if dp > 1 and zero not in t.zeros:
        zs = " or ".join(map(str, t.zeros))
        raise ExportError(f"{t.name} has no ZeRO {zero}: it {t.what_zero}; plan with --zero {zs}.")
    modes = sorted(set(recompute))
    odd = [m for m in modes if m not in t.recompute]
    if odd:
        raise ExportError(f"{t.name} has no {odd[0]} recompute (it recomputes {', '.join(t.recompute[1:])} layers); "
                          f"plan with --recompute {' or '.join(t.recompute)}.")
    if len(modes) > 1 and not t.per_stage_recompute:
        raise ExportError(f"the plan recomputes {' and '.join(modes)} in different stages, but {t.name} applies one "
                          f"recompute mode to every stage; plan with --recompute {' or '.join(modes)}.")


# ---- which cuts ------------------------------------------------------------------------------------

def unit_of(module: str) -> str:
    """The module an engine moves whole: the name up to its first numbered part, else the name.

    >>> unit_of("model.layers.3.mlp.experts.1"), unit_of("model.norm")
    ('model.layers.3', 'model.norm')
    """
    parts = module.split(".")
    for i, p in enumerate(parts):
        if p.isdigit():
            return ".".join(parts[: i + 1])
    return module


def layer_units(name: str) -> tuple[str, ...]:
    """The units a flattened layer holds, in order, from its name ("a, b, c" lists several modules;
    "h.0..h.3" is a run of blocks; " (call 2)" marks a module's second call).

    >>> layer_units("transformer.h.0..transformer.h.2"), layer_units("wte, wpe +1")
    (('transformer.h.0', 'transformer.h.1', 'transformer.h.2'), ('wte', 'wpe'))
    """
    out: list[str] = []
    for part in name.split(","):
        part = part.split(" (call")[0].split(" +")[0].strip()
        first, dots, last = part.partition("..")
        units = [unit_of(first)] if part else []
        if dots:
            (head, _, a), (head2, _, b) = unit_of(first).rpartition("."), unit_of(last).rpartition(".")
            if head == head2 and a.isdigit() and b.isdigit():
                units = [f"{head}.{i}" for i in range(int(a), int(b) + 1)]
            else:
                units = [unit_of(first), unit_of(last)]
        out += [u for u in units if u not in out]
    return tuple(out)


@dataclass(frozen=True)
class CutSet:
    """The cuts a target allows (layer indices a chunk may start at, 1..L-1) and why others are gone."""

    target: str
    cuts: tuple[int, ...]
    reasons: tuple[str, ...] = ()  # one phrase per rule that removed cuts, for messages

    def most_chunks(self) -> int:
        return len(self.cuts) + 1


def module_cuts(names: Sequence[str]) -> tuple[int, ...]:
    """Cuts between whole modules: none between the first and last layer holding a unit."""
    span: dict[str, tuple[int, int]] = {}
    for i, name in enumerate(names):
        for u in layer_units(name) or (f"#{i}",):  # a layer with no module name is a unit of its own
            first, _ = span.get(u, (i, i))
            span[u] = (first, i)
    blocked = set()
    for first, last in span.values():
        blocked.update(range(first + 1, last + 1))
    return tuple(i for i in range(1, len(names)) if i not in blocked)


@dataclass(frozen=True)
class DecoderStack:
    """A decoder language model as Megatron-Core sees it: layers ``[0, first)`` are the embedding (E),
    ``[first, end)`` the decoder layers (t; ``blocks[i]`` of them in layer i), ``[end, L)`` the loss with
    the final norm and output layer (L)."""

    first: int
    end: int
    blocks: tuple[int, ...]  # decoder layers (units) per flattened layer; 0 outside [first, end)
    prefix: str  # the stack's module path, e.g. "model.layers"


def decoder_stack(names: Sequence[str]) -> DecoderStack:
    """Find E, t, L in the layer names; ExportError when the model is not one stack of numbered decoder
    layers between an embedding and a head (an encoder-decoder, a CNN)."""
    stacks: dict[str, list[int]] = {}
    for i, name in enumerate(names):
        for u in layer_units(name):
            head, _, last = u.rpartition(".")
            if last.isdigit():
                stacks.setdefault(head, []).append(i)
    if not stacks:
        raise ExportError("Megatron-Core's layout describes a decoder language model (embedding, numbered decoder "
                          "layers, loss), and no layer here is a numbered block; export --to torchtitan, deepspeed or fqns.")
    if len(stacks) > 1:
        raise ExportError(f"Megatron-Core's layout describes one decoder stack, and this model has {len(stacks)} "
                          f"({', '.join(stacks)}); export --to torchtitan, deepspeed or fqns.")
    (prefix, where), = stacks.items()
    first, end = where[0], where[-1] + 1
    blocks = []
    for i, name in enumerate(names):
        units = layer_units(name)
        n = sum(1 for u in units if u.rpartition(".")[0] == prefix)
        if first <= i < end and n != len(units):
            odd = next(u for u in units if u.rpartition(".")[0] != prefix)
            raise ExportError(f"layer {i} ({name}) holds {odd} among the decoder layers, which Megatron-Core's layout "
                              "cannot place; export --to torchtitan, deepspeed or fqns.")
        blocks.append(n)
    if first == 0:
        raise ExportError(f"the first layer ({names[0]}) is already a decoder layer, but Megatron-Core's layout starts "
                          "with the embedding (E) on its own; flatten with one block per layer.")
    return DecoderStack(first, end, tuple(blocks), prefix)


def allowed_cuts(names: Sequence[str], target: str, tied: Sequence[Sequence[int]] = ()) -> CutSet:
    """The cuts ``target`` allows in a model whose flattened layers are ``names``; ``tied``: the layer
    indices using each tied tensor (torchtitan keeps them on one stage)."""
    t = target_info(target)
    n = len(names)
    cuts = set(module_cuts(names))
    reasons = []
    if len(cuts) < n - 1:
        reasons.append("cuts only between whole modules")
    if not t.ties_across_stages:
        for users in tied:
            if len(users) > 1:
                lo, hi = min(users), max(users)
                inside = {i for i in cuts if lo < i <= hi}
                if inside:
                    cuts -= inside
                    reasons.append(f"{t.name} does not tie weights across stages, so layers {lo}..{hi} "
                                   "(sharing a tied tensor) stay on one stage: untie them in the model (tie_word_embeddings=false; "
                                   "torchtitan:...,enable_weight_tying=false), or plan for megatron or deepspeed, which "
                                   "tie across stages")
    if t.key == "megatron":
        stack = decoder_stack(names)
        layout = {stack.first, *range(stack.first + 1, stack.end), stack.end} - {n}
        if cuts - layout:
            reasons.append("Megatron-Core cuts only before a decoder layer or before the final norm, output and loss (L)")
        cuts &= layout
    return CutSet(t.key, tuple(sorted(cuts)), tuple(reasons))


def tied_users(profile: Profile) -> list[list[int]]:
    """Per tied tensor, the layers holding a copy (from the profile's per-layer ``tied`` names)."""
    users: dict[str, list[int]] = {}
    for i, layer in enumerate(profile.layers):
        for name in layer.tied:
            users.setdefault(name, []).append(i)
    return [u for u in users.values() if len(u) > 1]


def restricted_cuts(profile: Profile, chunks: int, cuts: Sequence[int] | None, target: str | None) -> CutSet | None:
    """The cuts a partition may use: ``cuts`` (checked), the target's (``allowed_cuts``), or both;
    None when neither restricts. PartitionError when they leave fewer than ``chunks`` chunks."""
    n = len(profile.layers)
    if cuts is None and target is None:
        return None
    given = None
    if cuts is not None:
        bad = [c for c in cuts if isinstance(c, bool) or not isinstance(c, int) or not 0 < c < n]
        if bad:
            raise PartitionError(f"cuts {list(cuts)}: {bad[0]!r} is not a layer index between 1 and {n - 1}.")
        given = CutSet("", tuple(sorted(set(cuts))))
    out = given
    if target is not None:
        names = [layer.name or f"layer{i}" for i, layer in enumerate(profile.layers)]
        engine = allowed_cuts(names, target, tied_users(profile))
        out = engine if given is None else CutSet(engine.target, tuple(c for c in engine.cuts if c in given.cuts),
                                                  engine.reasons + ("the cuts given",))  # fmt: skip
    assert out is not None
    if out.most_chunks() < chunks:
        who = target_info(out.target).name if out.target else "the cuts given"
        why = f" ({'; '.join(out.reasons)})" if out.reasons else ""
        tied = any("tie" in r for r in out.reasons)
        fix = "" if tied else "; use fewer stages (or virtual stages)"
        raise PartitionError(f"{who} allows {len(out.cuts)} cuts in these {n} layers{why}, so at most "
                             f"{out.most_chunks()} chunks, not {chunks}{fix}.")
    return out


def check_cut_allowed(bounds: Sequence[int], cuts: Sequence[int], names: Sequence[str], target: str,
                      method: str) -> None:  # fmt: skip
    """A cut given by hand (or by a baseline) must use allowed cuts only; else one line naming the layer."""
    allowed = set(cuts)
    for b in bounds[1:-1]:
        if b not in allowed:
            who = target_info(target).name if target else "the cuts given"
            mine = "your cut" if method == "manual" else f"the {method} cut"
            inside = [u for u in layer_units(names[b]) if u in layer_units(names[b - 1])]
            where = f"inside {inside[0]}" if inside else "where it cannot"
            raise ExportError(f"{mine} starts a chunk at layer {b} ({names[b]}), {where} for {who}; "
                              f"start chunks at layers {', '.join(map(str, sorted(allowed))) or 'none'}, "
                              "or let autopipe choose (--method autopipe).")


def explain_restricted(error: InfeasibleMemoryError, target: str) -> InfeasibleMemoryError:
    """The memory refusal of a restricted plan, saying the restriction is part of why."""
    who = target_info(target).name if target else "the cuts given"
    return InfeasibleMemoryError(f"no cut {who} allows fits: {error}")


def default_cut(target: str, names: Sequence[str], params: Sequence[float], chunks: int) -> tuple[tuple[int, ...], str]:
    """The cut the engine makes when not told (layer boundaries), and what it is called:

    - torchtitan: ``generate_llm_fqn_per_model_part``: decoder layers shared evenly, the embedding and
      the final norm with the output counting one layer each (``pipeline_parallel_first/last_stage_less_layers = 1``);
    - megatron: decoder layers shared evenly (Megatron needs them to divide; the first stages take
      the remainder here), the embedding on the first stage, the loss on the last;
    - deepspeed, fqns: ``partition_method="parameters"``: balanced parameter counts per layer (here
      the smallest largest count; DeepSpeed's own ``partition_balanced``, the smallest spread, can
      cut differently).
    """
    from .baselines import parameters

    key = target_info(target).key
    if key in ("deepspeed", "fqns"):
        # autopipe's parameters baseline: the smallest largest count; DeepSpeed's own partition_balanced
        # (the smallest spread) agrees on most models, not all (bench/results/export.md)
        return parameters(params, chunks), "parameter counts balanced (DeepSpeed's partition_method='parameters')"
    stack = decoder_stack(names)
    blocks = sum(stack.blocks)
    if key == "torchtitan":
        units = blocks + 2
        base, extra = divmod(units, chunks)
        sizes = [base + (s < extra) for s in range(chunks)]
        sizes[0] -= 1  # the embedding
        sizes[-1] -= 1  # norm + output
        what = "torchtitan's even split (embedding and output weigh one layer each)"
    else:
        base, extra = divmod(blocks, chunks)
        sizes = [base + (s < extra) for s in range(chunks)]
        what = "Megatron-Core's even split of the decoder layers"
    # decoder layers before each boundary -> the first flattened layer after that many
    before = [0]
    for n in stack.blocks[stack.first : stack.end]:
        before.append(before[-1] + n)
    bounds, done = [0], 0
    for size in sizes[:-1]:
        done += max(size, 0)
        i = next((j for j, b in enumerate(before) if b >= done), len(before) - 1)
        bounds.append(stack.first + i)
    bounds.append(len(names))
    for s in range(1, chunks):  # no empty chunk: move each boundary past the one before it
        bounds[s] = min(max(bounds[s], bounds[s - 1] + 1), len(names) - (chunks - s))
    return tuple(bounds), what
