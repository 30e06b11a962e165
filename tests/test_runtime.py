"""The runtime trains a plan for real: pipelined GPT-2 matches plain single-process training.

Each distributed test launches the generated train.py with torchrun (gloo, CPU, real processes) and
compares its per-step losses and final weights with ReferenceTrainer run here on the whole model.
Tiny model (6 blocks, width 32, 16 tokens) so the file runs in a few minutes on 2 cores.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from _factories import tiny_gpt2_job
from _launch import Launcher

from autopipe.planner.stage_plan import even_boundaries
from autopipe.runtime import (
    TokenData,
    TrainConfig,
    build_reference,
    build_stage,
    model_factory,
)
from autopipe.runtime.checks.reference import ReferenceTrainer

pytestmark = pytest.mark.slow  # every test starts train.py (most on several processes)

STEPS, MICRO, ROWS, SEQ, LR = 4, 4, 2, 16, 1e-3
TOL = 1e-5
RUN_TIMEOUT = 240


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A job folder: a tiny GPT-2 HF folder (config only, tied wte/lm_head, no dropout) + train.py."""
    root = tmp_path_factory.mktemp("job")
    tiny_gpt2_job(root, layers=6, microbatches=MICRO, rows=ROWS, seq=SEQ)
    return root


@pytest.fixture(scope="module")
def num_layers(job: Path) -> int:
    source = model_factory(str(job / "tiny"), batch_size=ROWS, seq_len=SEQ)
    return len(build_stage(source.factory, source.args, source.kwargs, 1, pp_rank=0, pp_size=1).seq.layers)


def reference(job: Path, dp: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain training of the whole model on the global batches train.py draws."""
    source = model_factory(str(job / "tiny"), batch_size=ROWS, seq_len=SEQ)
    data = TokenData(None, vocab_size=source.vocab_size, seq_len=SEQ, seed=0)
    model = build_reference(source.factory, seed=0)
    trainer = ReferenceTrainer(model, TrainConfig(steps=STEPS, microbatches=MICRO, lr=LR, seed=0))
    rows = ROWS * MICRO * dp
    losses = []
    _NORMS[dp] = []
    for step in range(STEPS):
        args, kwargs = source.batch(data.batch(step, rows), rows, step=step)
        losses.append(trainer.step(args, kwargs, microbatches=MICRO * dp))
        _NORMS[dp].append(trainer.last_grad_norm)
    # every name of every tensor (a tied one under each of its names), cloned once per tensor
    clones = {id(p): p.detach().clone() for p in model.parameters()}
    return losses, {n: clones[id(p)] for n, p in model.named_parameters(remove_duplicate=False)}


_REFS: dict[int, tuple[list[float], dict[str, torch.Tensor]]] = {}
# per dp: the global gradient norm of each reference step, before clipping. Compared with the
# pipelined run's logged norm, it sees what weights after AdamW cannot: a gradient summed instead of
# averaged (over micro-batches or replicas) or a tied gradient counted twice changes the norm.
_NORMS: dict[int, list[float]] = {}


def ref(job: Path, dp: int = 1) -> tuple[list[float], dict[str, torch.Tensor]]:
    if dp not in _REFS:
        _REFS[dp] = reference(job, dp)
    return _REFS[dp]


def launch(torchrun: Launcher, job: Path, name: str, nproc: int, *flags: str, env: dict[str, str] | None = None,
           pythonpath: list[Path] | None = None, plan: list[int] | None = None,
           check: bool = True) -> tuple[Path, subprocess.CompletedProcess]:
    """Run train.py under torchrun (or plain python for one process); returns the run folder."""
    run = job / name
    run.mkdir(exist_ok=True)
    if plan is not None:
        (run / "plan.json").write_text(json.dumps({"boundaries": plan}))
    proc = torchrun(job / "train.py", "--steps", STEPS, "--lr", LR, "--plan",
                    run / "plan.json" if plan is not None else "even",
                    "--ckpt-dir", run / "ckpt", "--log-json", run / "log.json", "--export", run / "exported", *flags,
                    nproc=nproc, cwd=run, env=env, pythonpath=pythonpath or (), timeout=RUN_TIMEOUT, check=check)
    return run, proc


def logged_losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run / "log.json").read_text().splitlines())}


def final_params(run: Path) -> dict[str, torch.Tensor]:
    """The weights the run ended with, as --export wrote them (a tied tensor under each of its names)."""
    from safetensors.torch import load_file

    return load_file(run / "exported" / "model.safetensors")


def assert_matches_reference(run: Path, job: Path, dp: int = 1) -> None:
    ref_losses, ref_params = ref(job, dp)
    losses = logged_losses(run)
    assert [losses[s + 1] for s in range(STEPS)] == pytest.approx(ref_losses, abs=TOL)
    norms = {r["step"]: r["grad_norm"] for r in map(json.loads, (run / "log.json").read_text().splitlines())}
    assert [norms[s + 1] for s in range(STEPS)] == pytest.approx(_NORMS[dp], rel=TOL)
    params = final_params(run)
    assert set(params) == set(ref_params)  # every tensor trained somewhere, under each of its names
    for name, value in params.items():
        torch.testing.assert_close(value, ref_params[name], atol=TOL, rtol=0, msg=name)


# ---- distributed runs ---------------------------------------------------------------------------

@pytest.mark.distributed
# GPipe and the zero-bubble V here; 1F1B on 2 stages is test_jobs' schedule for five models (under --check,
# every first-step gradient) and interleaved 1F1B on 2 ranks x 2 chunks test_zero's ZeRO 0 run (the same
# layout, under --check, every gradient and the final weights): both also run on 4 stages below
@pytest.mark.parametrize("schedule,chunks", [("gpipe", 2), ("zbv", 4)])
def test_two_stage_pipeline_matches_single_process_training(torchrun: Launcher, job: Path, num_layers: int, schedule: str, chunks: int) -> None:
    """2 ranks: per-step losses and final weights equal plain training within 1e-5; with --check, every
    collective and stage input is on the rank's device and each step reads the device once."""
    run, _ = launch(torchrun, job, f"pp2-{schedule}", 2, "--schedule", schedule, "--check", plan=even_boundaries(num_layers, chunks))
    assert_matches_reference(run, job)


@pytest.mark.distributed
# 4 stages under 1F1B and interleaved (GPipe is the 2-stage test's; a third 4-process launch added nothing)
@pytest.mark.parametrize("schedule,chunks", [("1f1b", 4), ("interleaved1f1b", 8)])
def test_four_stage_pipeline_matches_and_tied_copies_stay_equal(torchrun: Launcher, job: Path, num_layers: int, schedule: str, chunks: int) -> None:
    """4 ranks: matches plain training; wte/lm_head copies on the first and last rank are equal after every step
    (each rank's own copy, saved after every update by tests/probes: a checkpoint keeps one)."""
    (job / f"weights-{schedule}").mkdir(exist_ok=True)
    run, _ = launch(torchrun, job, f"pp4-{schedule}", 4, "--schedule", schedule, "--ckpt-every", "1", "--ckpt-keep", "0",
                    plan=even_boundaries(num_layers, chunks), env={"AUTOPIPE_TEST_WEIGHTS": str(job / f"weights-{schedule}")},
                    pythonpath=[Path(__file__).parent / "probes"])
    assert_matches_reference(run, job)
    steps = sorted((run / "ckpt").glob("step_*"))
    assert len(steps) == STEPS
    for step in range(1, STEPS + 1):
        held = [torch.load(job / f"weights-{schedule}" / f"weights_rank{r}_step{step}.pt") for r in range(4)]
        copies = [h[name] for h in held for name in ("transformer.wte.weight", "lm_head.weight") if name in h]
        assert len(copies) >= 2  # held by the embedding's rank and the head's rank
        for c in copies[1:]:
            assert torch.equal(c, copies[0]), step


def test_one_process_runs_all_stages_with_the_same_losses(torchrun: Launcher, job: Path, num_layers: int) -> None:
    """`python train.py` (no torchrun) trains the same plan in one process: same losses; --verify passes."""
    run, proc = launch(torchrun, job, "single", 1, "--verify", plan=even_boundaries(num_layers, 2))
    assert "verify:" in proc.stdout
    assert_matches_reference(run, job)


@pytest.mark.distributed
def test_killed_rank_resumes_exactly(torchrun: Launcher, job: Path, num_layers: int) -> None:
    """SIGKILL rank 1 after step 2's checkpoint; --resume gives steps 3-4 of an uninterrupted run."""
    plan = even_boundaries(num_layers, 2)
    # tests/faults/sitecustomize.py makes rank 1 SIGKILL itself once checkpoint 2 is complete
    faults = {"AUTOPIPE_TEST_KILL_AT": "2:1"}
    run, proc = launch(torchrun, job, "killed", 2, "--ckpt-every", "1", env=faults,
                       pythonpath=[Path(__file__).parent / "faults"], plan=plan, check=False)
    assert proc.returncode != 0
    assert sorted(p.name for p in (run / "ckpt").iterdir() if p.name.startswith("step_")) == ["step_00000001", "step_00000002"]
    assert max(logged_losses(run)) == 2
    run, proc = launch(torchrun, job, "killed", 2, "--ckpt-every", "1", "--resume", "--export", str(job / "exported"), plan=plan)
    assert "resumed from" in proc.stdout
    losses = logged_losses(run)
    ref_losses, ref_params = ref(job, 1)
    assert [losses[3], losses[4]] == pytest.approx(ref_losses[2:], abs=TOL)
    # the exported folder loads with HF from_pretrained and holds the trained weights
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(job / "exported")
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), ref_params[name], atol=TOL, rtol=0, msg=name)


@pytest.mark.distributed
@pytest.mark.deepspeed
def test_deepspeed_pipeline_module_matches_single_process_training(torchrun: Launcher, job: Path, num_layers: int) -> None:
    """--engine deepspeed: PipelineModule with TiedLayerSpec, cut at the plan's boundaries, matches too."""
    from autopipe.runtime.deepspeed_engine.trainer import ds_config

    # the job's ds_config.json as emit writes it, given with --deepspeed_config (the flags' batch sizes win)
    (job / "ds_config.json").write_text(json.dumps(ds_config(TrainConfig(microbatches=1), rows=1, dp=1)))
    run, _proc = launch(torchrun, job, "deepspeed", 2, "--engine", "deepspeed", "--check", "--deepspeed_config",
                        str(job / "ds_config.json"), plan=even_boundaries(num_layers, 2))
    assert_matches_reference(run, job)


@pytest.mark.parametrize("dtype,nproc", [pytest.param("bf16", 2, marks=pytest.mark.distributed), ("fp16", 1)])
def test_mixed_precision_trains_close_to_fp32_with_fp32_master_weights(torchrun: Launcher, job: Path, num_layers: int, dtype: str, nproc: int) -> None:
    """--dtype bf16|fp16: --verify passes against the reference under the same autocast; losses stay
    near fp32 training; master weights (checkpointed) stay fp32."""
    run, proc = launch(torchrun, job, f"amp-{dtype}", nproc, "--dtype", dtype, "--verify", plan=even_boundaries(num_layers, 2))
    assert "verify:" in proc.stdout
    losses = logged_losses(run)
    ref_losses, _ = ref(job)
    assert [losses[s + 1] for s in range(STEPS)] == pytest.approx(ref_losses, abs=3e-2)
    assert all(v.dtype == torch.float32 for copies in final_params(run).values() for v in copies)
