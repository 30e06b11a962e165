"""`autopipe export`: a plan as what torchtitan, Megatron-Core or DeepSpeed reads (autopipe.job.export)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from .app import app, console, err_console, handle_errors

__all__ = ["export_command"]


@app.command("export")
@handle_errors
def export_command(
    plan: Annotated[Path, typer.Argument(help="A plan.json (from `autopipe plan --for ...`), or a job folder holding one.")],
    to: Annotated[str, typer.Option("--to", help="torchtitan (the installed release's form, else 0.3's config function; torchtitan@0.2 for 0.2's TOML), megatron (layout flags), deepspeed (a PipelineModule file) or fqns (module names per stage, JSON).")],
    out: Annotated[Optional[Path], typer.Option(help="Write the file here (default: print it).")] = None,
    profile: Annotated[Optional[Path], typer.Option(help="The profile the plan was made from (default: profile.json beside the plan).")] = None,
    model: Annotated[Optional[str], typer.Option(help="The model, to check the module names (default: the profile's model, built on the meta device).")] = None,
    no_model: Annotated[bool, typer.Option("--no-model", help="Trust the profile's layer names; build no model.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing --out.")] = False,
) -> None:
    """Write PLAN for the engine you run: the cuts, schedule and micro-batches in its own settings."""
    from ..costs.layer_costs import Profile
    from ..errors import AutopipeError
    from ..files import write_text_atomic
    from ..job.export import export_plan
    from ..job.export.exporter import split_target
    from ..planner.plan import Plan

    split_target(to)  # an unknown engine or a stray version fails before any file is read
    plan_path = plan / "plan.json" if plan.is_dir() else plan
    if out is not None and out.exists() and not force:
        raise FileExistsError(f"{out} exists; pass --force to overwrite it, or choose another --out.")
    prof_path = profile or plan_path.with_name("profile.json")
    if not prof_path.is_file():
        raise AutopipeError(f"no profile beside {plan_path}; give the one it was planned from with --profile.")
    the_plan, prof = Plan.load(plan_path), Profile.load(prof_path)
    built = None if no_model else _build(model or prof.model, prof, given=model is not None)
    result = export_plan(the_plan, prof, to, model=built, path=out)
    if out is not None:
        write_text_atomic(out, result.text)
    else:
        typer.echo(result.text, nl=False)
    say = err_console if out is None else console  # the file on stdout stays clean to pipe
    if result.overrides:
        say.print(f"torchtitan {result.version} command-line overrides (the same plan on top of your own config):\n"
                  f"{result.overrides}", highlight=False, soft_wrap=True)  # fmt: skip
    if result.command:
        say.print(f"run it:\n{result.command}", highlight=False, soft_wrap=True)
    for step in result.todo:
        say.print(f"[yellow]to do:[/] {step}", highlight=False, soft_wrap=True)
    line = f"predicted step {result.step_time * 1e3:.3f} ms"
    if result.default_step_time is not None:
        diff = result.default_step_time / result.step_time - 1 if result.step_time > 0 else 0.0
        line += (f"; {result.default_name}: {result.default_step_time * 1e3:.3f} ms "
                 f"({diff:+.1%} against this plan" + (", and over the memory limit)" if result.default_over_limit else ")"))
    for note in result.modules.notes:
        say.print(f"[yellow]note:[/] {note}", highlight=False, soft_wrap=True)
    say.print(line + (f"; saved {out}" if out is not None else ""), highlight=False, soft_wrap=True)


def _build(spec: str, prof: object, *, given: bool) -> object:
    """The model on the meta device (no weights), to check the plan's module names against."""
    from ..costs.rescale import profiled_microbatch, tokens_per_sample
    from ..errors import AutopipeError
    from ..graph.sources import load_model

    if not spec:
        raise AutopipeError("the profile does not say which model it is; give --model, or --no-model to trust its names.")
    try:
        return load_model(spec, device="meta", batch_size=profiled_microbatch(prof),  # type: ignore[arg-type]
                          seq_len=tokens_per_sample(prof) or 16, weights=False).model  # type: ignore[arg-type]
    except AutopipeError as e:
        if given:
            raise
        raise AutopipeError(f"cannot build the profile's model {spec!r} to check the module names ({e}); "
                            "give --model, or --no-model to trust the profile's names.") from None
