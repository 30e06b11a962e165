"""Plans exported to torchtitan, Megatron-Core and DeepSpeed against each engine's own default split.

    python bench/bench_export.py               # writes bench/results/export.{json,md}
    python bench/bench_export.py --no-write    # print only

For three models, all priced for an H100 (80 GiB) by autopipe's estimate (FLOPs and bytes on the meta
device, no GPU run): GPT-2 124M (``profiles/gpt2-h100-estimate.json``, its embedding tied to the
output layer), Llama-2-7B shape (``profiles/llama-7b-h100-estimate.json``) and a small MoE decoder
(Qwen2-MoE shape built here from a config: 24 layers of width 2048, the first 3 dense as in
DeepSeek's "first k dense", the other 21 with 16 experts of which 4 are routed, plus a shared expert;
estimated at 2048 tokens), each on a few pipelines (4 and 8 stages on 1F1B, 4 stages × 2 virtual on
interleaved 1F1B where the engine has it), and for each engine:

- autopipe's plan for that engine (``partition(..., target=...)``: only the cuts the engine can make)
  and its simulated step, beside the best unrestricted cut's (what the restriction costs);
- the exported form (Megatron's layout string, torchtitan's modules per part, DeepSpeed's parts), or
  the one-line refusal when the engine cannot run the model split at all;
- the engine's default split of the same model on the same pipeline, priced by the same simulator:
  torchtitan's ``generate_llm_fqn_per_model_part`` (decoder layers even, embedding and norm + output
  weighing one layer each), Megatron-Core's even split of the decoder layers, and DeepSpeed's
  ``partition_method="parameters"`` (DeepSpeed's own ``partition_balanced`` over the layers' parameter
  counts, called here).

Every figure is the simulator's prediction from the estimate (no engine was run): what changes
between rows is only where the cuts are.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

from autopipe import Profile, partition  # noqa: E402
from autopipe.errors import AutopipeError  # noqa: E402
from autopipe.job.export import export_plan  # noqa: E402
from autopipe.job.export.megatron import megatron_args  # noqa: E402
from autopipe.planner.targets import default_cut  # noqa: E402

RESULTS = ROOT / "bench" / "results"
ENGINES = ("torchtitan", "megatron", "deepspeed")
PIPELINES = ((4, "1f1b"), (8, "1f1b"), (4, "interleaved1f1b"))


def moe_profile() -> Profile:
    """The MoE decoder, built from a config on the meta device and estimated for an H100 (bf16 autocast)."""
    from transformers import Qwen2MoeConfig

    import autopipe
    from autopipe.graph.sources import load_model

    with tempfile.TemporaryDirectory() as tmp:
        Qwen2MoeConfig(architectures=["Qwen2MoeForCausalLM"], vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                       num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16, num_experts=16,
                       num_experts_per_tok=4, moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
                       mlp_only_layers=[0, 1, 2], max_position_embeddings=4096, use_cache=False,
                       tie_word_embeddings=False).save_pretrained(tmp)  # fmt: skip
        spec = load_model(tmp, device="meta", batch_size=1, seq_len=2048)
        seq = autopipe.flatten(spec.model, spec.args, spec.kwargs)
        prof = autopipe.profile(seq, spec.args, spec.kwargs, device="h100", estimate=True, autocast="bfloat16")
    return replace(prof, model="qwen2-moe-small (24 layers, 3 dense + 21 MoE: 16 experts, top 4)")


def deepspeed_default(prof: Profile, chunks: int) -> tuple[int, ...]:
    """DeepSpeed's own partition_method='parameters': its partition_balanced over the layers' parameters."""
    from deepspeed.runtime.utils import partition_balanced

    return tuple(int(x) for x in partition_balanced(weights=[layer.params for layer in prof.layers], num_parts=chunks))


def exported_form(engine: str, out) -> str:  # noqa: ANN001
    sm = out.modules
    if engine == "megatron":
        return next(a.split(" ", 1)[1].strip('"') for a in megatron_args(sm) if "layout" in a)
    if engine == "torchtitan":
        return "modules per part " + "/".join(str(len([m for m in part if m not in sm.every_stage])) for part in sm.modules)
    return "parts " + str([a for a, _ in sm.layers] + [sm.layers[-1][1]])


def price(prof: Profile, plan, bounds, engine: str) -> tuple[float, int, bool, list[str]]:  # noqa: ANN001
    """The default cut's simulated step, peak and recompute modes as the engine runs it (one mode on
    every stage, the fastest that fits), under the plan's limit if it fits there, else without."""
    for limit in (plan.memory_limit, None):
        try:
            other = partition(prof, plan.stages, microbatches=plan.microbatches, schedule=plan.schedule,
                              virtual_stages=plan.virtual_stages, memory_limit=limit, boundaries=bounds,
                              target=engine)  # fmt: skip
            return other.step_time, other.peak_memory, limit is None, sorted(set(other.stage_recompute))
        except AutopipeError:
            continue
    raise AssertionError("unreachable: no limit always prices")


def row(name: str, prof: Profile, stages: int, schedule: str, engine: str) -> dict:
    out: dict = {"model": name, "stages": stages, "schedule": schedule, "engine": engine}
    try:
        plan = partition(prof, stages, schedule=schedule, target=engine)
    except AutopipeError as e:
        out["refused"] = str(e)
        return out
    exp = export_plan(plan, prof, engine)
    names = [layer.name for layer in prof.layers]
    if engine == "deepspeed":
        bounds, what = deepspeed_default(prof, plan.num_chunks), "DeepSpeed parameters (partition_balanced)"
        ours, _ = default_cut("deepspeed", names, [layer.params for layer in prof.layers], plan.num_chunks)
        out["autopipe_parameters_baseline_agrees"] = tuple(ours) == bounds
    else:
        bounds, what = default_cut(engine, names, [layer.params for layer in prof.layers], plan.num_chunks)
    step, peak, over, modes = price(prof, plan, bounds, engine)
    out.update(step=plan.step_time, unrestricted=plan.unrestricted_step_time, cut=list(plan.boundaries),
               form=exported_form(engine, exp), default=what, default_cut=list(bounds), default_step=step,
               default_peak=peak, default_over_limit=over, default_recompute=modes, peak=plan.peak_memory,
               limit=plan.memory_limit, recompute=sorted(set(plan.stage_recompute)),
               microbatches=plan.microbatches)  # fmt: skip
    return out


def ms(x: float) -> str:
    return f"{x * 1e3:.1f}"


def render(rows: list[dict]) -> str:
    lines = [
        "# Plans exported to torchtitan, Megatron-Core and DeepSpeed, against each engine's default split",
        "",
        "`python bench/bench_export.py`: every figure is autopipe's simulated step (1F1B or interleaved 1F1B, "
        "2 × stages micro-batches of 1 sequence) from an H100 estimate (no engine was run; GPT-2 at 1024 tokens, "
        "Llama-7B and the MoE at 2048), under an 80 GiB limit. *plan*: autopipe's plan for that engine, cut only "
        "where it can and with one recompute mode on every stage, as the engine runs it (in brackets: its cost "
        "against autopipe's own plan, any cut and each stage its own recompute mode); *default*: the engine's own split of "
        "the same model on the same pipeline, priced the same way (one recompute mode, the fastest that fits; over the limit: priced without one, and marked); "
        "*gain*: default step / plan step - 1.",
        "",
        "| model | pipeline | engine | plan (restriction) | default split | gain | exported form |",
        "| --- | --- | --- | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        pipe = f"{r['stages']} × {r['schedule']}"
        if "refused" in r:
            lines.append(f"| {r['model']} | {pipe} | {r['engine']} | refused | | | {r['refused']} |")
            continue
        cost = r["step"] / r["unrestricted"] - 1 if r["unrestricted"] else 0.0
        over = " (over limit)" if r["default_over_limit"] else ""
        gain = r["default_step"] / r["step"] - 1
        lines.append(f"| {r['model']} | {pipe} | {r['engine']} | {ms(r['step'])} ms (+{cost:.2%}) | "
                     f"{ms(r['default_step'])} ms{over} | {gain:+.1%} | `{r['form']}` |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    gpt2 = Profile.load(ROOT / "profiles" / "gpt2-h100-estimate.json")
    untied = replace(gpt2, layers=tuple(replace(layer, tied=()) for layer in gpt2.layers))
    models = [("GPT-2", gpt2), ("GPT-2 untied", untied),
              ("Llama-7B", Profile.load(ROOT / "profiles" / "llama-7b-h100-estimate.json")), ("MoE", moe_profile())]
    rows = []
    for name, prof in models:
        for stages, schedule in PIPELINES:
            for engine in ENGINES:
                if name == "GPT-2 untied" and engine != "torchtitan":
                    continue
                if engine == "deepspeed" and schedule != "1f1b":
                    continue
                rows.append(row(name, prof, stages, schedule, engine))
                print(json.dumps(rows[-1]))
    text = render(rows)
    print(text)
    if not args.no_write:
        (RESULTS / "export.json").write_text(json.dumps(rows, indent=1) + "\n")
        md = RESULTS / "export.md"
        notes = md.read_text().split("\n## Reading", 1)[1] if md.exists() and "\n## Reading" in md.read_text() else ""
        md.write_text(text + ("\n## Reading" + notes if notes else ""))


if __name__ == "__main__":
    main()
