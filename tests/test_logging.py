"""The run's log: the progress line (live on a terminal, ETA, MFU or FLOP/s), and the same record in
--log-json, TensorBoard and Weights & Biases; a resumed run has each step once everywhere.

Quick: StepLogger is driven here with StepStats of known figures; the FLOP count is compared with
torch's own counter on the untouched model.
"""

from __future__ import annotations

import io
import json
import re
import sys
import types
from pathlib import Path

import pytest
import torch
from rich.console import Console

from autopipe.errors import AutopipeError
from autopipe.runtime.logs.steps import StepLogger, StepStats, format_eta


def _stats(step: int, loss: float = 2.0, step_time: float = 0.5) -> StepStats:
    return StepStats(step=step, loss=loss, lr=1e-3, grad_norm=1.0, step_time=step_time, tokens_per_s=100.0,
                     stage_times=[step_time], forward_times=[0.1])


def _console(terminal: bool) -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, force_terminal=terminal, width=240, highlight=False, soft_wrap=True), buf


def test_a_message_naming_the_user_s_model_is_printed_verbatim() -> None:
    """A factory ``file.py:llama`` followed by ':' is rich's emoji code :llama:, and '[x]' its markup:
    the header line names the model as given."""
    console, buf = _console(terminal=False)
    StepLogger(0, steps=1, console=console).info("/a/tp_models.py:llama: 5 layers [x] :fire:")
    assert buf.getvalue().strip() == "/a/tp_models.py:llama: 5 layers [x] :fire:"


def test_a_file_gets_every_step_and_a_terminal_a_live_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """Output to a file: one kept line per step, with step/steps, ETA and FLOP/s. On a terminal: the
    line is redrawn in place each step and kept every log_every steps (and at the last)."""
    clock = iter(float(t) for t in range(0, 100, 2))  # every step takes 2 s of wall clock
    monkeypatch.setattr("autopipe.runtime.logs.steps.time.perf_counter", lambda: next(clock))
    console, buf = _console(terminal=False)
    log = StepLogger(0, steps=5, flops_per_step=2e9, console=console)
    for s in range(1, 6):
        log.step(_stats(s))
    lines = buf.getvalue().splitlines()
    assert [line.split()[1] for line in lines] == ["1/5", "2/5", "3/5", "4/5", "5/5"]
    assert "ETA 2s" in lines[0] and "ETA 6s" in lines[1] and "ETA 4s" in lines[2]  # 2 s a step from the first interval on
    assert "4 GFLOP/s" in lines[0] and "MFU" not in lines[0]  # 2e9 FLOPs in 0.5 s; no known peak
    assert "ETA" not in lines[-1]

    console, buf = _console(terminal=True)
    log = StepLogger(0, steps=5, console=console, log_every=2)
    assert log.live
    for s in range(1, 6):
        log.step(_stats(s))
    log.close()
    out = buf.getvalue()
    assert "\x1b[2K" in out  # the live line is drawn in place (its line erased and redrawn)
    kept = [line for line in _screen(out) if line.startswith("step")]
    assert [line.split()[1] for line in kept] == ["2/5", "4/5", "5/5"]  # what stays on the screen
    shown = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out).replace("\r", "\n").splitlines()
    assert list(dict.fromkeys(line.split()[1] for line in shown if line.startswith("step"))) == \
        ["1/5", "2/5", "3/5", "4/5", "5/5"]  # every step was shown, the odd ones live only


def _screen(out: str) -> list[str]:
    """The lines a terminal shows after ``out``: text, \\r, \\n, erase-line and cursor-up (what rich's
    live display sends); styles dropped."""
    lines, row = [""], 0
    for token in re.findall(r"\x1b\[[0-9;?]*[A-Za-z]|\r|\n|[^\x1b\r\n]+", out):
        if token == "\n":
            row += 1
            lines += [""] * (row + 1 - len(lines))
        elif token == "\r":
            pass  # the next text overwrites the line from its start (erase-line comes first here)
        elif token == "\x1b[2K":
            lines[row] = ""
        elif re.fullmatch(r"\x1b\[(\d*)A", token):
            row = max(0, row - int(token[2:-1] or 1))
        elif not token.startswith("\x1b"):
            lines[row] += token
    return [line for line in lines if line]


def test_the_record_has_eta_and_mfu_and_goes_to_json_lines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every sink gets the same record: StepStats, the plan's predictions, eta_s, model_flops_per_s and
    mfu (when the peak is known: flops / step time / peak), and what the loop adds (eval, epoch)."""
    clock = iter([0.0, 3.0])
    monkeypatch.setattr("autopipe.runtime.logs.steps.time.perf_counter", lambda: next(clock))
    console, buf = _console(terminal=False)
    log = StepLogger(0, json_path=tmp_path / "log.json", steps=10, flops_per_step=1e12, peak_flops=1e13, console=console)
    log.step(_stats(1, step_time=0.5))
    log.step(_stats(2, step_time=0.5), eval_loss=1.5, eval_perplexity=4.48, epoch=0.25)
    records = [json.loads(line) for line in (tmp_path / "log.json").read_text().splitlines()]
    assert records[0]["mfu"] == pytest.approx(0.2) and records[0]["model_flops_per_s"] == pytest.approx(2e12)
    assert records[0]["eta_s"] == pytest.approx(9 * 0.5) and records[1]["eta_s"] == pytest.approx(8 * 3.0)
    assert records[1]["eval_loss"] == 1.5 and records[1]["epoch"] == 0.25
    assert "MFU 20.0%" in buf.getvalue() and "eval loss 1.5000 ppl 4.48" in buf.getvalue() and "epoch 0.25" in buf.getvalue()


def test_a_resumed_run_drops_the_lines_it_trains_again(tmp_path: Path) -> None:
    """A run that stopped after step 5 with its checkpoint at 3 logged 4 and 5: resumed at 3, the log
    keeps 1-3 (and a line it cannot read, as it was) and gets 4 and 5 once, from the new run."""
    path = tmp_path / "log.json"
    path.write_text("".join(json.dumps({"step": s, "loss": 9.0}) + "\n" for s in range(1, 6)) + "not json\n")
    log = StepLogger(0, json_path=path, quiet=True)
    log.resumed(3)
    for s in (4, 5):
        log.step(_stats(s, loss=1.0))
    lines = path.read_text().splitlines()
    steps = [json.loads(line)["step"] for line in lines if line.startswith("{")]
    assert steps == [1, 2, 3, 4, 5] and "not json" in lines
    assert [json.loads(line)["loss"] for line in lines if line.startswith("{")][3:] == [1.0, 1.0]


def test_tensorboard_gets_the_record_and_a_resume_purges_what_is_trained_again(tmp_path: Path) -> None:
    """Event files readable by TensorBoard: each number of the record a scalar (lists per item); after
    a resume at step 1, step 2 is there once, with the resumed run's value."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = StepLogger(0, tensorboard=tmp_path / "tb", quiet=True)
    for s in (1, 2):
        first.step(_stats(s, loss=float(s)))
    first.close()
    again = StepLogger(0, tensorboard=tmp_path / "tb", quiet=True)
    again.open()  # as train.py does: the sinks open before the checkpoint is loaded
    again.resumed(1)
    again.step(_stats(2, loss=7.0))
    again.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert {"loss", "lr", "grad_norm", "step_time", "tokens_per_s", "stage_times/0"} <= set(events.Tags()["scalars"])
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 1.0), (2, 7.0)]


def test_weights_and_biases_when_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """--wandb PROJECT: wandb.init with the run's flags, each record's numbers logged at its step; without
    the package, one line saying how to get it."""
    calls: list[tuple] = []

    class Run:
        def log(self, data: dict, step: int) -> None:
            calls.append(("log", step, data))

        def finish(self) -> None:
            calls.append(("finish",))

    fake = types.ModuleType("wandb")
    fake.init = lambda project, config: calls.append(("init", project, config)) or Run()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wandb", fake)
    log = StepLogger(0, wandb="autopipe-tests", run_config={"lr": 1e-3}, quiet=True, peak_flops=1e13, flops_per_step=1e12)
    log.step(_stats(3))
    log.close()
    assert calls[0] == ("init", "autopipe-tests", {"lr": 1e-3})
    _, step, data = calls[1]
    assert step == 3 and data["loss"] == 2.0 and data["mfu"] == pytest.approx(0.2) and data["stage_times/0"] == 0.5
    assert calls[-1] == ("finish",)

    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed
    with pytest.raises(AutopipeError, match="--wandb p needs Weights & Biases: pip install wandb"):
        StepLogger(0, wandb="p", quiet=True).open()


def test_eta_reads_as_time() -> None:
    assert [format_eta(s) for s in (0, 59, 61, 3599, 3600, 90061)] == ["0s", "59s", "1m01s", "59m59s", "1h00m", "25h01m"]


def test_step_flops_equal_torch_s_count_of_the_untouched_model(tmp_path: Path) -> None:
    """The FLOPs of a step counted without data through the flattened layers (on a rank that holds
    only some of them for real) equal 3x torch's own count of the untouched model's forward, run for
    real, times the micro-batches and replicas."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import GPT2Config

    from autopipe.runtime import build_reference, build_stage, model_factory, step_flops

    GPT2Config(architectures=["GPT2LMHeadModel"], n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=16,
               bos_token_id=0, eos_token_id=0).save_pretrained(tmp_path / "tiny")
    source = model_factory(str(tmp_path / "tiny"), batch_size=2, seq_len=16)
    model = build_reference(source.factory, seed=0)
    args = tuple(torch.zeros(a.shape, dtype=a.dtype) if isinstance(a, torch.Tensor) else a for a in source.args)
    kwargs = {k: torch.zeros(v.shape, dtype=v.dtype) if isinstance(v, torch.Tensor) else v for k, v in source.kwargs.items()}
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(*args, **kwargs)
    forward = counter.get_total_flops()
    assert forward > 0
    for pp_rank in (0, 1):
        build = build_stage(source.factory, source.args, source.kwargs, 2, pp_rank=pp_rank, pp_size=2)
        assert step_flops(build.seq, source, microbatches=4, replicas=2) == 3 * forward * 4 * 2
