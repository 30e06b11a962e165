"""Write a job's train.py: a short nanoGPT-style script over autopipe.runtime.

The script is ``templates/train.py``, a Python file that reads (and runs) as it is. Two parts of it
are the job's: its ``Settings`` dataclass, where each field line ``name: type = value  # help``
gets the job's value (``repr``; its type and comment kept), and the module docstring, whose launch
lines get the job's process counts (``$stages``, ``$stages_x2``) and model (``$model``). Each
setting is declared once, there: the flag of its name defaults to it (``rt.parse_flags``).
Everything else is copied verbatim: building the stage, the engines, checkpoints live in the
runtime, so the script stays readable and a person can edit it (another data loader, another loss)
without touching autopipe.
"""

from __future__ import annotations

import ast
import os
import re
from importlib import resources
from pathlib import Path
from string import Template
from typing import Any

from ..choices import ENGINES
from ..errors import AutopipeError
from ..files import write_text_atomic
from ..planner.plan import Plan
from ..planner.stage_plan import StagePlan
from .settings import JobSettings

__all__ = ["load_settings", "read_settings", "render_train_script", "template_text", "write_train_script"]

_CLASS = "class Settings:"
_FIELD = re.compile(r"^    (?P<name>[a-z][a-z0-9_]*): (?P<type>[^=]+?) = (?P<value>.*?)(?P<comment>  # .*)?$")


def template_text() -> str:
    """The template as shipped (autopipe/job/templates/train.py)."""
    return resources.files(__package__).joinpath("templates", "train.py").read_text(encoding="utf-8")


def render_train_script(settings: dict[str, Any], launch: dict[str, Any], template: str | None = None, *,
                        choices: dict[str, tuple[str, ...]] | None = None) -> str:
    """The template with ``settings`` (field name -> value) in its ``Settings`` class and ``launch``
    (``model``, ``stages``, ``stages_x2``) in its docstring.

    Every name given must be a field of the class and every value one of ``settings`` is written as
    its ``repr``; a field ``settings`` lacks keeps its line as written (``plan``, ``ckpt_dir``).
    ``choices`` (field name -> values) writes that field's type as ``Literal[...]`` of them: the
    flag's choices come from autopipe's own tables, not from a copy in the template.

    Example:
        >>> text = render_train_script({"model": "gpt2", "seed": 7}, {"model": "gpt2", "stages": 4, "stages_x2": 8})
        >>> [line.strip() for line in text.splitlines() if line.startswith(("    model:", "    seed:"))]
        ["model: str = 'gpt2'  # built-in name, HF folder or module:function", "seed: int = 7  # the initial weights' and the synthetic data's"]
        >>> text.splitlines()[3].split("#")[0].strip()
        'torchrun --nproc-per-node 4 train.py'
    """
    text = template_text() if template is None else template
    head, begin, rest = text.partition(_CLASS)
    if not begin:
        raise AutopipeError(f"the train.py template has no {_CLASS!r}.")
    body, _, tail = rest.partition("\n\n\n")  # the class ends at the first two blank lines
    lines = body.split("\n")
    seen: set[str] = set()
    choices = choices or {}
    for i, line in enumerate(lines):
        m = _FIELD.match(line)
        if m and m["name"] in {*settings, *choices}:
            seen.add(m["name"])
            kind = f"Literal[{', '.join(map(repr, choices[m['name']]))}]" if m["name"] in choices else m["type"]
            value = repr(settings[m["name"]]) if m["name"] in settings else m["value"]
            lines[i] = f"    {m['name']}: {kind} = {value}{m['comment'] or ''}"
    missing = sorted({*settings, *choices} - seen)
    if missing:
        raise AutopipeError(f"the train.py template's Settings has no {', '.join(missing)}.")
    doc_end = head.index('"""', 3) if head.startswith('"""') else 0
    docstring = Template(head[:doc_end]).substitute(launch)  # a placeholder left unfilled is a KeyError: a bug here
    return docstring + head[doc_end:] + begin + "\n".join(lines) + "\n\n\n" + tail


def write_train_script(path: str | os.PathLike[str], job: JobSettings, plan: Plan | StagePlan | None = None, *,
                       dp: int | None = None, zero: int | None = None, tp: int | None = None,
                       ep: int | None = None, sequence_parallel: bool | None = None) -> Path:
    """Write train.py for ``job`` at ``path`` (a file, or a folder to put train.py in).

    ``plan`` is not embedded: the script reads plan.json beside it; its ``dp``, ``zero``, ``tp``,
    ``ep`` and ``sequence_parallel`` become the script's defaults unless given here. The settings are checked now (an
    unknown schedule, engine or optimizer setting is refused here, not at launch).

    Example:
        >>> import tempfile
        >>> job = JobSettings(model="gpt2", stages=4, microbatches=8, schedule="1f1b")
        >>> path = write_train_script(tempfile.mkdtemp(), job)
        >>> path.name, "    microbatches: int = 8  # per step; the gradients are their mean" in path.read_text()
        ('train.py', True)
    """
    from ..choices import PRECISIONS, precision
    from ..planner.stage_plan import schedule_name
    from ..runtime.training.optim import LR_SCHEDULES, OPTIMIZERS, TrainConfig, check_zero

    # the optimizer's settings are checked now (a bad --lr in convert is refused before any work)
    TrainConfig(optimizer=job.optimizer, lr=job.lr, weight_decay=job.weight_decay, betas=tuple(job.betas),
                momentum=job.momentum, warmup=job.warmup, lr_schedule=job.lr_schedule, grad_clip=job.grad_clip)
    target = Path(path)
    if target.is_dir():
        target = target / "train.py"
    if job.engine not in ENGINES:
        raise AutopipeError(f"engine must be one of {', '.join(map(repr, ENGINES))}, got {job.engine!r}.")
    schedule_name(job.schedule)  # refuse an unknown schedule now, not at launch
    settings = {
        "model": job.model, "schedule": job.schedule, "microbatches": job.microbatches, "batch_size": job.batch_size,
        "seq_len": job.seq_len, "dtype": precision(job.dtype), "engine": job.engine, "loss": job.loss,
        "data": job.data, "seed": job.seed, "dp": int(dp if dp is not None else plan.dp if plan is not None else 1),
        "zero": check_zero(zero if zero is not None else plan.zero if plan is not None else 0),
        "tp": int(tp if tp is not None else getattr(plan, "tp", 1) if plan is not None else 1),
        "ep": int(ep if ep is not None else getattr(plan, "ep", 1) if plan is not None else 1),
        "sequence_parallel": bool(sequence_parallel if sequence_parallel is not None
                                  else getattr(plan, "sequence_parallel", False) if plan is not None else False),
        "optimizer": str(job.optimizer).lower(), "lr": float(job.lr), "weight_decay": float(job.weight_decay),
        "betas": tuple(float(b) for b in job.betas), "momentum": float(job.momentum), "warmup": int(job.warmup),
        "lr_schedule": job.lr_schedule, "grad_clip": float(job.grad_clip), "eval_data": job.eval_data,
    }  # fmt: skip
    tables = {"dtype": tuple(PRECISIONS), "engine": tuple(ENGINES), "optimizer": tuple(OPTIMIZERS),
              "lr_schedule": tuple(LR_SCHEDULES)}
    per_stage = settings["tp"]  # processes per stage of one replica (its tp ranks)
    text = render_train_script(settings, {"model": job.model, "stages": job.stages * per_stage,
                                          "stages_x2": 2 * job.stages * per_stage},
                               choices=tables)
    compile(text, str(target), "exec")  # a template bug must fail here, not on the cluster
    write_text_atomic(target, text)
    return target


def read_settings(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The values a train.py's ``Settings`` class declares (those written as literals: not ``plan``
    or ``ckpt_dir``, which are paths beside the script), read from its text, nothing run.

    Example:
        >>> import tempfile
        >>> job = JobSettings(model="gpt2", stages=2, microbatches=4, schedule="zbv")
        >>> settings = read_settings(write_train_script(tempfile.mkdtemp(), job))
        >>> settings["schedule"], settings["microbatches"], settings["dp"]
        ('zbv', 4, 1)
    """
    tree = ast.parse(Path(path).read_text())
    body = next((node.body for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Settings"), None)
    if body is None:
        raise AutopipeError(f"{path} has no Settings class; it is not a train.py autopipe wrote (or one from before it).")
    out: dict[str, Any] = {}
    for node in body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            try:
                out[node.target.id] = ast.literal_eval(node.value)
            except ValueError:
                continue
    return out


def load_settings(path: str | os.PathLike[str]) -> type | None:
    """The ``Settings`` dataclass of the train.py at ``path``, made by running only its imports, its
    top-level assignments before the class (``HERE``) and the class itself: nothing of the job runs.
    None for a train.py without one (written before it)."""
    import sys
    import types

    path = Path(path)
    tree = ast.parse(path.read_text(), filename=str(path))
    at = next((i for i, node in enumerate(tree.body) if isinstance(node, ast.ClassDef) and node.name == "Settings"), None)
    if at is None:
        return None
    kept = [node for node in tree.body[:at] if isinstance(node, (ast.Import, ast.ImportFrom, ast.Assign))]
    module = types.ModuleType(f"_autopipe_settings_of_{abs(hash(str(path.resolve())))}")
    module.__file__ = str(path)
    sys.modules[module.__name__] = module  # dataclasses and typing read the class's module
    code = compile(ast.Module(body=[*kept, tree.body[at]], type_ignores=[]), str(path), "exec", dont_inherit=True)
    exec(code, module.__dict__)
    return module.Settings
