"""Write a job's train.py: a short nanoGPT-style script over autopipe.runtime.

The script is ``templates/train.py``, a Python file that reads (and runs) as it is. Two parts of it
are the job's: the settings block between the ``# ---- settings`` and ``# ---- end of settings``
lines, where each ``NAME = value`` line gets ``NAME = repr(the job's value)`` (its comment kept),
and the module docstring, whose launch lines get the job's process counts (``$stages``,
``$stages_x2``) and model (``$model``). Everything else is copied verbatim: building the stage, the
engines, checkpoints live in the runtime, so the script stays readable and a person can edit it
(another data loader, another loss) without touching autopipe.
"""

from __future__ import annotations

import os
import re
from importlib import resources
from pathlib import Path
from string import Template
from typing import Any

from ..choices import ENGINES, PRECISIONS, precision
from ..errors import AutopipeError
from ..files import write_text_atomic

__all__ = ["render_train_script", "template_text", "write_train_script"]

_BEGIN = "# ---- settings"
_END = "# ---- end of settings"
_SETTING = re.compile(r"^(?P<name>[A-Z][A-Z0-9_]*) = (?P<value>.*?)(?P<comment>  # .*)?$")


def template_text() -> str:
    """The template as shipped (autopipe/job/templates/train.py)."""
    return resources.files(__package__).joinpath("templates", "train.py").read_text(encoding="utf-8")


def render_train_script(settings: dict[str, Any], launch: dict[str, Any], template: str | None = None) -> str:
    """The template with ``settings`` (NAME -> value) in its settings block and ``launch``
    (``model``, ``stages``, ``stages_x2``) in its docstring.

    Every settings-block name given must be in the block and every value one of ``settings`` is
    written as its ``repr``; a line the block has and ``settings`` lacks is kept as written (``PLAN``).

    Example:
        >>> text = render_train_script({"MODEL": "gpt2", "SEED": 7}, {"model": "gpt2", "stages": 4, "stages_x2": 8})
        >>> [line for line in text.splitlines() if line.startswith(("MODEL =", "SEED ="))]
        ["MODEL = 'gpt2'  # built-in name, HF folder or module:function", 'SEED = 7']
        >>> text.splitlines()[3].split("#")[0].strip()
        'torchrun --nproc-per-node 4 train.py'
    """
    text = template_text() if template is None else template
    head, begin, rest = text.partition(_BEGIN)
    block, end, tail = rest.partition(_END)
    if not begin or not end:
        raise AutopipeError(f"the train.py template has no settings block ({_BEGIN!r} ... {_END!r}).")
    lines = block.split("\n")
    seen: set[str] = set()
    for i, line in enumerate(lines[1:], start=1):  # lines[0] is the rest of the marker line
        m = _SETTING.match(line)
        if m and m["name"] in settings:
            seen.add(m["name"])
            lines[i] = f"{m['name']} = {settings[m['name']]!r}{m['comment'] or ''}"
    missing = sorted(set(settings) - seen)
    if missing:
        raise AutopipeError(f"the train.py template's settings block has no {', '.join(missing)}.")
    doc_end = head.index('"""', 3) if head.startswith('"""') else 0
    docstring = Template(head[:doc_end]).substitute(launch)  # a placeholder left unfilled is a KeyError: a bug here
    return docstring + head[doc_end:] + begin + "\n".join(lines) + end + tail


def write_train_script(
    path: str | os.PathLike[str],
    *,
    model: str,
    stages: int,
    microbatches: int,
    schedule: str,
    plan: Any = None,
    batch_size: int = 1,
    seq_len: int = 128,
    dtype: str = "fp32",
    engine: str = "torch",
    seed: int = 0,
    loss: str = "auto",
    data: str | None = None,
    dp: int | None = None,
    zero: int | None = None,
    optimizer: str = "adamw",
    lr: float = 3e-4,
    weight_decay: float = 0.1,
    betas: tuple[float, float] = (0.9, 0.95),
    momentum: float = 0.9,
    warmup: int = 0,
    lr_schedule: str = "cosine",
    grad_clip: float = 1.0,
    eval_data: str | None = None,
    **unknown: Any,
) -> Path:
    """Write train.py at ``path`` (a file, or a folder to put train.py in).

    ``plan`` is not embedded: the script reads plan.json beside it; its ``dp`` and ``zero`` (when it
    has them) become the script's defaults unless ``dp`` / ``zero`` are given. A setting this function
    does not know is refused (naming the one it was probably meant to be), not dropped.

    Example:
        >>> import tempfile
        >>> path = write_train_script(tempfile.mkdtemp(), model="gpt2", stages=4, microbatches=8, schedule="1f1b")
        >>> path.name, "MICROBATCHES = 8" in path.read_text()
        ('train.py', True)
    """
    from ..planner.stage_plan import schedule_name
    from ..runtime.training.optim import LR_SCHEDULES, OPTIMIZERS, TrainConfig
    from ..runtime.training.optim import check_zero
    from .settings import refuse_unknown

    known = ("model", "stages", "microbatches", "schedule", "plan", "batch_size", "seq_len", "dtype", "engine",
             "seed", "loss", "data", "dp", "zero", "optimizer", "lr", "weight_decay", "betas", "momentum", "warmup",
             "lr_schedule", "grad_clip", "eval_data")  # fmt: skip
    refuse_unknown("train.py setting", unknown, known)
    # the optimizer's settings are checked now (a bad --lr in convert is refused before any work)
    TrainConfig(optimizer=optimizer, lr=lr, weight_decay=weight_decay, betas=tuple(betas), momentum=momentum,
                warmup=warmup, lr_schedule=lr_schedule, grad_clip=grad_clip)
    target = Path(path)
    if target.is_dir():
        target = target / "train.py"
    if engine not in ENGINES:
        raise AutopipeError(f"engine must be one of {', '.join(map(repr, ENGINES))}, got {engine!r}.")
    schedule_name(schedule)  # refuse an unknown schedule now, not at launch
    dp = int(dp if dp is not None else (getattr(plan, "dp", None) or 1))
    zero = check_zero(zero if zero is not None else (getattr(plan, "zero", None) or 0))
    settings = {
        "MODEL": model, "SCHEDULE": schedule, "MICROBATCHES": microbatches, "BATCH_SIZE": batch_size,
        "SEQ_LEN": seq_len, "DTYPE": precision(dtype), "DTYPES": tuple(PRECISIONS), "ENGINE": engine,
        "ENGINES": tuple(ENGINES), "LOSS": loss, "DATA": data, "SEED": seed, "DP": dp, "ZERO": zero,
        "OPTIMIZER": str(optimizer).lower(), "OPTIMIZERS": tuple(OPTIMIZERS), "LR": float(lr),
        "WEIGHT_DECAY": float(weight_decay), "BETAS": tuple(float(b) for b in betas), "MOMENTUM": float(momentum),
        "WARMUP": int(warmup), "LR_SCHEDULE": lr_schedule, "LR_SCHEDULES": tuple(LR_SCHEDULES),
        "GRAD_CLIP": float(grad_clip), "EVAL_DATA": eval_data,
    }  # fmt: skip
    text = render_train_script(settings, {"model": model, "stages": stages, "stages_x2": 2 * stages})
    compile(text, str(target), "exec")  # a template bug must fail here, not on the cluster
    write_text_atomic(target, text)
    return target
