"""Data parallelism on torch's engines: dp 2 × pp 2 under each ZeRO stage equals one model on the global batch.

Each run launches the generated train.py on 4 processes (gloo, CPU) and compares with
ReferenceTrainer on the whole model: per-step losses, the logged gradient norm, the final weights,
and every gradient of the first step (1e-5, fp32), taken before clipping and before AdamW.

Why the gradients themselves: AdamW divides each update by the root of the running mean of the
squared gradient, so a gradient multiplied by a constant (a sum over replicas where a mean belongs,
a lost 1/M) gives the same update to within eps; weights after AdamW differed by 2.5e-7 for a
gradient scaled by 8, far inside a 1e-5 tolerance. Clipping hides a scale as well (a clipped
gradient has the clip's norm whatever its scale), so the gradients are taken when the trainer
takes their norm, after the replicas' reduce and the tied sums, before clipping.

The tiny GPT-2 ties wte and lm_head across the two stages, so every mode also syncs a tied
gradient that is sharded (ZeRO 2/3) or replicated (0/1) over the replicas of each stage.

The ZeRO 0 run also proves the overlap: each DDP bucket's all-reduce was launched from inside the
backward (a probe's comm hook records it), not after it as ``replicate`` reduces.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _factories import tiny_gpt2_job
from _held import stray_parameters
from _launch import Launcher, free_port

from autopipe.job.script import write_train_script
from autopipe.job.settings import JobSettings
from autopipe.planner.stage_plan import even_boundaries
from autopipe.runtime import (
    TokenData,
    TrainConfig,
    build_reference,
    build_stage,
    model_factory,
)
from autopipe.runtime.checkpoints.exports import checkpoint_params
from autopipe.runtime.checks.reference import ReferenceTrainer

STEPS, MICRO, ROWS, SEQ, LR = 3, 2, 2, 16, 1e-3
CLIP = 1.0  # active on the first steps (the reference's norms are above it: asserted), so clipping is exercised
TOL = 1e-5
DP = 2
PROBES = Path(__file__).parent / "probes"


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny GPT-2 HF folder (tied wte/lm_head, no dropout) and its train.py (2 stages, 1F1B)."""
    root = tmp_path_factory.mktemp("zero")
    tiny_gpt2_job(root, layers=4, microbatches=MICRO, rows=ROWS, seq=SEQ)
    source = model_factory(str(root / "tiny"), batch_size=ROWS, seq_len=SEQ)
    layers = len(build_stage(source.factory, source.args, source.kwargs, 1, pp_rank=0, pp_size=1).seq.layers)
    (root / "plan.json").write_text(json.dumps({"boundaries": even_boundaries(layers, 2)}))
    # 4 chunks in a V: rank 0 holds the first (wte) and the last (lm_head), so the tie has a local alias
    (root / "plan_v.json").write_text(json.dumps({"boundaries": even_boundaries(layers, 4)}))
    return root


_REF: dict[str, object] = {}


def reference(job: Path) -> tuple[list[float], list[float], dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, int]]:
    """(losses, norms before clipping, first-step gradients before clipping, final weights, tensor of
    each name) of plain training of the whole model on the global batch of DP replicas."""
    if not _REF:
        source = model_factory(str(job / "tiny"), batch_size=ROWS, seq_len=SEQ)
        data = TokenData(None, vocab_size=source.vocab_size, seq_len=SEQ, seed=0)
        model = build_reference(source.factory, seed=0)
        trainer = ReferenceTrainer(model, TrainConfig(steps=STEPS, microbatches=MICRO * DP, lr=LR, grad_clip=CLIP, seed=0))
        rows = ROWS * MICRO * DP
        losses, norms = [], []
        for step in range(STEPS):
            args, kwargs = source.batch(data.batch(step, rows), rows, step=step)
            if step == 0:  # the same backward once more, to keep its gradients before clipping
                trainer.forward_backward(args, kwargs)
                grads = {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)}
                trainer.optimizer.zero_grad(set_to_none=True)
            losses.append(trainer.step(args, kwargs))
            norms.append(trainer.last_grad_norm)
        weights = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
        tensor_of = {n: id(p) for n, p in model.named_parameters(remove_duplicate=False)}
        _REF.update(value=(losses, norms, grads, weights, tensor_of))
    return _REF["value"]  # type: ignore[return-value]


def launch(torchrun: Launcher, job: Path, name: str, nproc: int, *flags: str, ckpt: Path | None = None,
           plan: str = "plan.json", ddp_probe: bool = False) -> tuple[Path, subprocess.CompletedProcess]:
    run = job / name
    run.mkdir(exist_ok=True)
    env = {"AUTOPIPE_TEST_GRADS": str(run), "AUTOPIPE_TEST_GRADS_AT": "norm"}
    if ddp_probe:  # record each DDP bucket's all-reduce (tests/probes): the same all-reduce, through a comm hook
        env["AUTOPIPE_TEST_DDP"] = "1"
    proc = torchrun(job / "train.py", "--steps", STEPS, "--lr", LR, "--grad-clip", CLIP, "--plan", job / plan,
                    "--ckpt-dir", ckpt or run / "ckpt", "--log-json", run / "log.json", *flags,
                    nproc=nproc, cwd=run, env=env, pythonpath=[PROBES])
    return run, proc


def logged(run: Path, key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in map(json.loads, (run / "log.json").read_text().splitlines())}


# ZeRO 0/1 run on DistributedDataParallel under whole-backward schedules (0 on interleaved1f1b: two
# DDP chunks per rank; 1 on 1f1b: DDP + ZeroRedundancyOptimizer) and on replicate under zbv (1:
# replicate + ZeroRedundancyOptimizer over its DTensors); ZeRO 2/3 on FSDP2 (3 on 1f1b, 2 on zbv)
@pytest.mark.slow
@pytest.mark.distributed
# each ZeRO stage once, and each schedule family (ZeRO 1 under zbv was a fifth 4-process launch: zbv's
# replicas are ZeRO 2's case, ZeRO 1's sharded state 1F1B's)
@pytest.mark.parametrize("zero,schedule", [(0, "interleaved1f1b"), (1, "1f1b"), (3, "1f1b"), (2, "zbv")])
def test_dp2_x_pp2_equals_one_model_on_the_global_batch(torchrun: Launcher, job: Path, zero: int, schedule: str) -> None:
    """--dp 2 --zero K on 2 stages: losses, gradient norms, every first-step gradient (before clipping)
    and the final weights equal plain training on the global batch within 1e-5; ZeRO 0 under --check
    (every collective on the rank's device); ZeRO 3 also exports weights from_pretrained loads; the
    zbv runs split the backward, hold two chunks per rank and the tie's alias leaf on rank 0."""
    flags = ["--dp", str(DP), "--zero", str(zero), "--ckpt-every", "1", "--ckpt-keep", "0", "--schedule", schedule]
    if zero == 0:
        flags.append("--check")
    if zero == 3:
        flags += ["--export", str(job / "exported3")]
    name = f"zero{zero}" if schedule == "1f1b" else f"zero{zero}-{schedule}"
    run, proc = launch(torchrun, job, name, 2 * DP, *flags, plan="plan.json" if schedule == "1f1b" else "plan_v.json",
                       ddp_probe=zero == 0)
    assert f"ZeRO {zero}" in proc.stdout
    ref_losses, ref_norms, ref_grads, ref_weights, tensor_of = reference(job)
    assert max(ref_norms) > CLIP  # clipping took part
    losses, norms = logged(run, "loss"), logged(run, "grad_norm")
    assert [losses[s + 1] for s in range(STEPS)] == pytest.approx(ref_losses, abs=TOL)
    assert [norms[s + 1] for s in range(STEPS)] == pytest.approx(ref_norms, rel=TOL)
    covered = set()
    for rank in range(2 * DP):  # every replica's gradients: each equals the global batch's
        grads = torch.load(run / f"grads_rank{rank}.pt", weights_only=True)
        assert len(grads) >= 4
        for param, g in grads.items():
            torch.testing.assert_close(g, ref_grads[param], atol=TOL, rtol=0, msg=f"zero {zero}, rank {rank}: {param}")
            covered.add(tensor_of[param])
    assert covered == set(tensor_of.values())
    newest = sorted((run / "ckpt").glob("step_*"))[-1]
    saved = checkpoint_params(newest)  # the sharded state, read whole in this process: each tensor once
    assert saved and {tensor_of[n] for n in saved} == set(tensor_of.values())
    for name, value in saved.items():
        torch.testing.assert_close(value, ref_weights[name], atol=TOL, rtol=0, msg=f"zero {zero}: {name}")
    if zero == 0:
        _assert_reduced_during_backward(run)
    if zero == 3:
        from transformers import GPT2LMHeadModel

        model = GPT2LMHeadModel.from_pretrained(job / "exported3")
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.detach(), ref_weights[name], atol=TOL, rtol=0, msg=name)


def _assert_reduced_during_backward(run: Path) -> None:
    """Every stage ran inside DistributedDataParallel, and from step 2 (DDP's first step reduces one
    bucket, then re-buckets in the order gradients came) each stage's buckets were each all-reduced
    once per step from inside the last micro-batch's backward: the overlap. Some stage of each rank
    has several buckets (a chunk of one tensor, the tied lm_head alone, has one)."""
    for rank in range(2 * DP):
        record = json.loads((run / f"ddp_rank{rank}.json").read_text())
        assert record["stages"] == ["DistributedDataParallel"] * 2, record["stages"]
        assert all(launch["in_backward"] for launch in record["launches"]), record["launches"]
        stages = {launch["stage"] for launch in record["launches"]}
        assert len(stages) == 2, record["launches"]
        for step in range(2, STEPS + 1):
            counts = []
            for stage in stages:
                buckets = [launch["bucket"] for launch in record["launches"]
                           if launch["step"] == step and launch["stage"] == stage]
                assert sorted(buckets) == list(range(len(buckets))) and buckets, (rank, step, stage, buckets)
                counts.append(len(buckets))
            assert max(counts) >= 2, (rank, step, counts)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("zero", [1, 3])
def test_sharded_checkpoint_resumes_on_one_replica(torchrun: Launcher, job: Path, zero: int) -> None:
    """A checkpoint of step 1 saved by dp 2 under ZeRO K (sharded AdamW state, and parameters for 3)
    resumes on dp 1 (the same global batch as twice the micro-batches) to steps 2-3 of the uninterrupted run."""
    saved = job / f"zero{zero}" / "ckpt"
    if not saved.is_dir():
        launch(torchrun, job, f"zero{zero}", 2 * DP, "--dp", str(DP), "--zero", str(zero), "--ckpt-every", "1", "--ckpt-keep", "0")
    ckpt = job / f"resume{zero}-ckpt"
    shutil.rmtree(ckpt, ignore_errors=True)
    ckpt.mkdir()
    shutil.copytree(saved / "step_00000001", ckpt / "step_00000001")
    run, proc = launch(torchrun, job, f"resume{zero}", 2, "--dp", "1", "--zero", str(zero), "--microbatches", str(MICRO * DP),
                       "--resume", ckpt=ckpt)
    assert "resumed from" in proc.stdout and "at step 1" in proc.stdout
    ref_losses, ref_norms, *_ = reference(job)
    losses, norms = logged(run, "loss"), logged(run, "grad_norm")
    assert [losses[2], losses[3]] == pytest.approx(ref_losses[1:], abs=TOL)
    assert [norms[2], norms[3]] == pytest.approx(ref_norms[1:], rel=TOL)


def _one_line(proc: subprocess.CompletedProcess, expected: str) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and expected in errors[0], out[-3000:]
    assert "Traceback" not in out, out[-3000:]


@pytest.mark.slow  # two train.py processes
def test_bad_zero_is_one_line(torchrun: Launcher, job: Path, tmp_path: Path) -> None:
    """--zero 5, and --zero 2 on DeepSpeed's pipeline engine: one line each, exit 1."""
    base = [job / "train.py", "--steps", "1", "--plan", job / "plan.json", "--ckpt-dir", tmp_path]
    _one_line(torchrun(*base, "--zero", "5", nproc=1, cwd=tmp_path, timeout=120, check=False), "--zero 5: use 0")
    _one_line(torchrun(*base, "--zero", "2", "--engine", "deepspeed", nproc=1, cwd=tmp_path, timeout=120, check=False),
              "DeepSpeed's pipeline engine runs ZeRO 0 or 1 only")


def test_the_job_takes_dp_and_zero_from_the_plan(tmp_path: Path) -> None:
    """convert's train.py defaults to the plan's replicas and ZeRO stage; explicit values win; a bad one is refused."""
    from types import SimpleNamespace

    from autopipe.errors import AutopipeError

    plan = SimpleNamespace(dp=2, zero=3)
    text = write_train_script(tmp_path / "a.py", JobSettings(model="gpt2", stages=4, microbatches=8, schedule="1f1b"), plan).read_text()
    assert "    dp: int = 2  #" in text and "    zero: int = 3  #" in text
    text = write_train_script(tmp_path / "b.py", JobSettings(model="gpt2", stages=4, microbatches=8, schedule="1f1b"), plan, zero=1).read_text()
    assert "    zero: int = 1  #" in text
    text = write_train_script(tmp_path / "c.py", JobSettings(model="gpt2", stages=4, microbatches=8, schedule="1f1b")).read_text()
    assert "    dp: int = 1  #" in text and "    zero: int = 0  #" in text
    with pytest.raises(AutopipeError, match="--zero 4"):
        write_train_script(tmp_path / "d.py", JobSettings(model="gpt2", stages=4, microbatches=8, schedule="1f1b"), zero=4)


_UNUSED = """
import os, torch, torch.distributed as dist
from torch import nn
from autopipe.runtime.torch_engine.zero import explain_ddp_error
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
dist.init_process_group("gloo", rank=0, world_size=1)
class Chunk(nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.unused = nn.Linear(4, 4), nn.Linear(4, 4)
    def forward(self, x):
        return self.used(x)
ddp = nn.parallel.DistributedDataParallel(Chunk())
try:
    for _ in range(2):
        ddp(torch.randn(2, 4)).sum().backward()
except RuntimeError as e:
    print(explain_ddp_error(e, 0))
dist.destroy_process_group()
"""


@pytest.mark.slow  # a process of its own with a real DDP
def test_a_parameter_no_forward_uses_is_one_line_under_ddp(tmp_path: Path) -> None:
    """DDP runs without find_unused_parameters (it breaks non-reentrant recompute), so a chunk holding
    a parameter its forward never reads fails at the next forward with DDP's paragraph; the trainer
    turns exactly that error into one line saying what to do (torch's real error, from a real DDP)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PORT": str(free_port())}
    done = subprocess.run([sys.executable, "-c", _UNUSED], capture_output=True, text=True, timeout=120, env=env,
                          cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1 and "never uses" in lines[0] and "--zero 2" in lines[0], done.stdout
    from autopipe.runtime.torch_engine.zero import explain_ddp_error

    other = RuntimeError("something else")
    assert explain_ddp_error(other, 0) is other


@pytest.mark.parametrize(("zero", "tp"), [(2, 1), (3, 1), (0, 2), (3, 2)])
def test_a_sharded_rank_keeps_no_whole_weight_beside_its_shards(zero: int, tp: int) -> None:
    """Once a rank's trainer is made under ZeRO 2/3 or tp (Llama-shaped, dp 2, on a fake process group
    of dp x tp), every parameter tensor its model and chunks reach is one the rank trains: its shard or
    its tp part. The layers are graphs over module objects of their own, so FSDP2 and tp replaced the
    parameters there and the model's modules kept the whole weights: every such rank held its whole
    stage's weights beside its shards for the whole run (a GPU's memory too), and a CPU rank's memory
    baseline counted them, so no measured peak showed it."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from autopipe.runtime import Trainer, init_dist, make_loss

    source = model_factory(str(Path(__file__).parent / "tp_models.py") + ":llama", batch_size=ROWS, seq_len=SEQ)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=DP * tp)
    try:
        env = init_dist(dp=DP, tp=tp)
        build = build_stage(source.factory, source.args, source.kwargs, 1, pp_rank=0, pp_size=1, tp_mesh=env.tp_mesh)
        trainer = Trainer(build, env, TrainConfig(steps=1, microbatches=MICRO, zero=zero), loss_fn=make_loss(source.loss))
        reached, stray = stray_parameters(build, trainer.params.values())
        assert reached > 10 and not stray, stray
    finally:
        dist.destroy_process_group()
