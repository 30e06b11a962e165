"""`autopipe doctor`: parse, call autopipe.job.doctor, render the table and write it to a file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from .app import app, console, handle_errors

__all__ = ["doctor_command"]


@app.command("doctor")
@handle_errors
def doctor_command(
    device: Annotated[str, typer.Option(help="auto (the first GPU, else the CPU), cpu or cuda.")] = "auto",
    ranks: Annotated[Optional[int], typer.Option(help="Ranks to train: 1 or 2 (default: 2 on a CPU or with two GPUs).")] = None,
    steps: Annotated[int, typer.Option(help="Training steps (the first is warm-up and left out).")] = 6,
    reserve: Annotated[Optional[str], typer.Option(help="Memory the runtime holds per rank beyond the tensors, like 80MiB (default: measured once per device).")] = None,
    out: Annotated[Path, typer.Option(help="Where to write the table (markdown).")] = Path("doctor.md"),
    force: Annotated[bool, typer.Option("--force", help="Overwrite --out if it exists.")] = False,
    json_output: Annotated[bool, typer.Option("--json", help="Print the findings as JSON instead of the table.")] = False,
) -> None:
    """What to run first on a new machine: profile, plan and train a small GPT-2 here, and set the
    plan's step time and per-rank peak memory beside what the run measured (allocated and reserved)."""
    from ..files import write_text_atomic
    from ..job.doctor import run_doctor
    from ..units import format_bytes, format_time

    if out.exists() and not force:
        raise FileExistsError(f"{out} already exists; pass --force to overwrite it, or choose another --out.")
    report = run_doctor(device=device, ranks=ranks, steps=steps, reserve=reserve, progress=not json_output)
    write_text_atomic(out, report.to_markdown())
    if json_output:
        typer.echo(json.dumps(report.to_dict(), indent=1))
        return
    devices = Table(title="devices")
    for column in ("device", "type", "memory", "detail"):
        devices.add_column(column)
    for d in report.devices:
        devices.add_row(d.name, d.type, format_bytes(d.memory_bytes), d.detail)
    console.print(devices)
    checks = Table(title=f"{report.ranks} rank(s) on {report.device}: the plan against the run")
    for column in ("figure", "predicted", "measured", "allocated", "reserved", "measured / predicted"):
        checks.add_column(column, justify="left" if column == "figure" else "right")
    checks.add_row("step time", format_time(report.predicted_step), format_time(report.measured_step), "", "",
                   f"{report.step_ratio:.2f}")
    for r in report.memory:
        checks.add_row(f"rank {r.rank} peak memory", format_bytes(r.predicted), format_bytes(r.measured),
                       format_bytes(r.allocated), format_bytes(r.reserved), f"{r.ratio:.2f}")
    console.print(checks)
    for note in report.notes:
        console.print(f"[yellow]note:[/] {note}", highlight=False, soft_wrap=True)
    console.print(f"saved {out}")
