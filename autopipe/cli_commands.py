"""CLI commands. Each one: parse, call the library, render. Keep them thin."""

from __future__ import annotations

from .cli import app, console, handle_errors  # noqa: F401


# ---- profile (issue 3) -------------------------------------------------------------------------
from pathlib import Path  # noqa: E402
from typing import Annotated, Optional  # noqa: E402

import typer  # noqa: E402

@app.command("profile")
@handle_errors
def profile_command(
    model: Annotated[str, typer.Argument(help="A built-in name (gpt2), a HuggingFace folder, or module:function.")],
    device: Annotated[str, typer.Option(help="Measure on cpu or cuda; with --estimate: cpu, cuda, a100, h100, h200.")] = "cpu",
    estimate: Annotated[bool, typer.Option("--estimate", help="Run nothing: FLOPs and bytes on meta tensors, priced by a roofline.")] = False,
    batch_size: Annotated[int, typer.Option(help="Micro-batch size.")] = 1,
    seq_len: Annotated[int, typer.Option(help="Sequence length of the example input.")] = 128,
    dtype: Annotated[Optional[str], typer.Option(help="Profile in this dtype (default: the model's).")] = None,
    mixed_precision: Annotated[bool, typer.Option("--mixed-precision", help="16-bit params/grads, fp32 master weights and optimizer state.")] = False,
    optimizer: Annotated[str, typer.Option(help="adamw, adam, sgd-momentum, sgd or none: sizes optimizer state.")] = "adamw",
    repeats: Annotated[int, typer.Option(help="Timed runs per measured layer.")] = 10,
    warmup: Annotated[int, typer.Option(help="Untimed runs before timing.")] = 3,
    out: Annotated[Path, typer.Option(help="Where to save the profile JSON.")] = Path("profile.json"),
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing --out.")] = False,
    json_output: Annotated[bool, typer.Option("--json", help="Print the profile as JSON instead of a table.")] = False,
) -> None:
    """Measure (or estimate) what each layer costs; print a table and save the profile JSON."""
    import dataclasses
    import json

    import torch
    from torch.utils._pytree import tree_map

    from .flatten import flatten
    from .models import load_model
    from .profile import profile, profile_table

    if out.exists() and not force:
        raise FileExistsError(f"{out} already exists; pass --force to overwrite it, or choose another --out.")
    m, args, kwargs = load_model(model, device="meta" if estimate else "cpu", batch_size=batch_size, seq_len=seq_len)
    if not estimate and device != "cpu":
        # Trace where it will be measured: traced graphs keep their device.
        m = m.to(device)
        args, kwargs = tree_map(lambda v: v.to(device) if isinstance(v, torch.Tensor) else v, (args, kwargs))
    seq = flatten(m, args, kwargs)
    prof = profile(seq, args, kwargs, device=device, estimate=estimate, dtype=dtype,
                   mixed_precision=mixed_precision, optimizer=optimizer, repeats=repeats, warmup=warmup,
                   progress=not json_output)
    prof = dataclasses.replace(prof, model=model)
    prof.save(out)
    if json_output:
        typer.echo(json.dumps(prof.to_dict(), indent=1))
    else:
        console.print(profile_table(prof))
        console.print(f"saved {out}")
