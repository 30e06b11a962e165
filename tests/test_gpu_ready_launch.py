"""The runtime on several processes the way a GPU cluster runs it (issue 22), on gloo: a checkpoint
folder not every node shares, a failed rank while another waits in a collective, two torchrun
agents started by the job's sbatch script, and a plan whose ranks are numbered replica-inner. Each
test fails on the code before its fix."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from _factories import tiny_gpt2_job
from _launch import Launcher, free_port
from test_zero import DP, STEPS, TOL, job, launch, logged, reference  # noqa: F401 (job: test_zero's fixture)

import autopipe

CHECKOUT = Path(autopipe.__file__).resolve().parent.parent  # the autopipe under test

TINY = """
    import sys, time
    from pathlib import Path
    import torch
    import torch.distributed as dist
    import autopipe.runtime as rt
    from autopipe.errors import AutopipeError

    rt.one_line_errors()
    env = rt.init_dist(dp=1, timeout_s=120)
    make = lambda: torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    x, y = torch.randn(8, 8), torch.randn(8, 1)
"""


def _errors(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error:")]


def _no_traceback_of_ours(proc: subprocess.CompletedProcess) -> bool:
    """No rank printed a traceback (torchrun's own report of the failed processes aside)."""
    out = proc.stdout + proc.stderr
    return "[rank" not in out and "autopipe/" not in out


# ---- defect 3: a checkpoint folder of each node's own ----------------------------------------------
@pytest.mark.slow
@pytest.mark.distributed
def test_a_checkpoint_folder_not_every_rank_sees_is_one_line(torchrun: Launcher, tmp_path: Path) -> None:
    """Two ranks, each with a checkpoint folder of its own (as two nodes with local disks would have
    at one path): the first save says so in one line and writes nothing. (Saving into one folder
    every rank sees is every other checkpoint test's, the rank files listed by test_jobs' Ctrl-C.)"""
    script = tmp_path / "save.py"
    script.write_text(textwrap.dedent(TINY) + textwrap.dedent("""
        build = rt.build_stage(make, (x[:2],), {}, [0, 2, 3], pp_rank=env.pp_rank, pp_size=env.pp_size)
        trainer = rt.Trainer(build, env, rt.TrainConfig(steps=2, microbatches=4), loss_fn=rt.make_loss("mse"))
        trainer.step((x,), {}, y)
        root = Path(sys.argv[1]) / f"node{env.rank}"  # a folder of each rank's own
        rt.save_checkpoint(trainer, root / "ckpt")
        env.close()
    """))
    own = torchrun(script, tmp_path, nproc=2, cwd=tmp_path, env={"PYTHONPATH": str(CHECKOUT)}, check=False)
    assert own.returncode != 0, own.stderr[-3000:]
    (line,) = _errors(own) or [own.stdout[-2000:] + own.stderr[-3000:]]
    assert "is not one folder for every rank: rank(s) 1 do not see" in line and "--ckpt-dir" in line, line
    assert _no_traceback_of_ours(own) and not list(tmp_path.glob("node*/ckpt/step_*")), own.stderr[-3000:]


# ---- defect 14: a failed rank while another waits in a collective ----------------------------------
@pytest.mark.slow
@pytest.mark.distributed
def test_a_failed_rank_does_not_leave_the_others_waiting_in_a_collective(torchrun: Launcher, tmp_path: Path) -> None:
    """Rank 1 fails (one line, then os._exit) while ranks 0 and 2 wait inside collectives that will
    never complete, as NCCL ranks wait for a peer that left: within seconds rank 0 prints rank 1's
    line and every rank exits. Before, nothing could wake them (a signal handler does not run inside
    a collective) until torchrun killed them, without a word."""
    script = tmp_path / "hang.py"
    script.write_text(textwrap.dedent(TINY) + textwrap.dedent("""
        pair = dist.new_group([0, 2])
        if env.rank == 1:
            time.sleep(1)  # the others are inside their collectives by now
            raise AutopipeError("rank 1 could not read its data; check --data")
        if env.rank == 0:
            dist.all_reduce(torch.ones(1), group=pair)  # rank 2 never joins it
        else:
            dist.recv(torch.ones(1), src=0)  # rank 0 never sends
    """))
    # under torchrun itself: its agent's SIGTERM cannot wake a rank inside a collective, and its
    # "forcefully exiting" line below is the sign that a rank had to be killed
    proc = torchrun(script, nproc=3, cwd=tmp_path, env={"PYTHONPATH": str(CHECKOUT)}, timeout=150, check=False,
                    elastic=True)
    assert proc.returncode != 0
    assert _errors(proc) == ["error: rank 1: rank 1 could not read its data; check --data"], proc.stderr[-3000:]
    # torchrun's "Unable to shutdown process ... via 15, forcefully exiting via 9": a rank it had to kill
    assert _no_traceback_of_ours(proc) and "forcefully exiting" not in proc.stderr, proc.stderr[-3000:]


# ---- defect 12: the sbatch script starts one torchrun per node ----------------------------------
SRUN = """#!/bin/bash
# stand-in for SLURM's srun: one task per node of the allocation, all on this machine
pids=()
for ((i = 0; i < SLURM_NNODES; i++)); do SLURM_NODEID=$i SLURM_PROCID=$i "$@" & pids+=($!); done
status=0
for p in "${pids[@]}"; do wait "$p" || status=$?; done
exit $status
"""


@pytest.mark.slow
@pytest.mark.distributed
def test_the_sbatch_script_trains_and_resumes_on_two_nodes(tmp_path: Path) -> None:
    """convert --stages 2 --gpus-per-node 1 makes a two-node job; its train.sbatch, run where srun
    starts each node's task on this machine, brings two torchrun agents together over the c10d
    rendezvous into one 2-rank world that trains, saves, and resumes (flags after the script reach
    train.py)."""
    from autopipe.job.converter import convert

    tiny = tiny_gpt2_job(tmp_path, layers=2, microbatches=2, rows=2, seq=16)
    result = convert(str(tiny), stages=2, gpus_per_node=1, estimate=True, batch_size=2, seq_len=16, reserve=0,
                     out=tmp_path / "job", progress=False)
    assert result.plan.nodes == 2 and result.job.launch.startswith("torchrun --nnodes 2 --nproc-per-node 1 ")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(SRUN)
    (bin_dir / "scontrol").write_text("#!/bin/bash\necho 127.0.0.1\n")  # 'show hostnames': node 0 is here
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}", "SLURM_NNODES": "2",
           "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node[0-1]", "MASTER_PORT": str(free_port()),
           "OMP_NUM_THREADS": "1", "PYTHONPATH": str(CHECKOUT)}
    sbatch = tmp_path / "job" / "train.sbatch"
    ckpt = tmp_path / "ckpt"

    def run(*flags: str) -> subprocess.CompletedProcess:
        proc = subprocess.run(["bash", str(sbatch), "--ckpt-dir", str(ckpt), *flags], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        return proc

    first = run("--steps", "2", "--ckpt-every", "2")  # a run saves only when asked
    assert "on 2 stage(s) x 1 replica(s)" in first.stdout and "step     2" in first.stdout, first.stdout[-2000:]
    (saved,) = ckpt.glob("step_*")
    assert sorted(p.name for p in saved.iterdir()) == ["meta.json", "rank00000.pt", "rank00001.pt", "sharded"]
    again = run("--steps", "3", "--resume")
    assert "at step 2" in again.stdout and "step     3" in again.stdout, again.stdout[-2000:]


# ---- defect 8: a replica-inner plan runs replica-inner -------------------------------------------
@pytest.mark.slow
@pytest.mark.distributed
def test_replica_inner_dp2_x_pp2_equals_one_model_on_the_global_batch(torchrun: Launcher, job: Path) -> None:  # noqa: F811
    """A plan numbering its ranks replica-inner (rank = stage x 2 + replica), dp 2 x pp 2 under ZeRO 2:
    losses, gradient norms, every first-step gradient and the exported weights equal plain training
    on the global batch (1e-5), and the checkpoint's files are numbered that way: rank 1 is stage 0's
    second replica, rank 2 stage 1's first."""
    plan = json.loads((job / "plan.json").read_text())
    (job / "plan_ri.json").write_text(json.dumps({**plan, "placement": "replica-inner"}))
    run, _ = launch(torchrun, job, "replica-inner", 2 * DP, "--dp", str(DP), "--zero", "2", "--ckpt-every", "1",
                    "--ckpt-keep", "0", "--export", str(job / "exported-ri"), plan="plan_ri.json")
    ref_losses, ref_norms, ref_grads, ref_weights, _ = reference(job)
    losses, norms = logged(run, "loss"), logged(run, "grad_norm")
    assert [losses[s + 1] for s in range(STEPS)] == pytest.approx(ref_losses, abs=TOL)
    assert [norms[s + 1] for s in range(STEPS)] == pytest.approx(ref_norms, rel=TOL)
    for rank in range(2 * DP):
        for param, g in torch.load(run / f"grads_rank{rank}.pt", weights_only=True).items():
            torch.testing.assert_close(g, ref_grads[param], atol=TOL, rtol=0, msg=f"rank {rank}: {param}")
    newest = sorted((run / "ckpt").glob("step_*"))[-1]
    assert json.loads((newest / "meta.json").read_text())["placement"] == "replica-inner"
    chunks = [torch.load(newest / f"rank{r:05d}.pt", weights_only=False)["chunks"] for r in range(2 * DP)]
    assert chunks[0] == chunks[1] != chunks[2] == chunks[3]  # ranks 0, 1: stage 0's replicas; 2, 3: stage 1's
    from safetensors.torch import load_file

    exported = load_file(job / "exported-ri" / "model.safetensors")
    for name, value in exported.items():
        torch.testing.assert_close(value, ref_weights[name], atol=TOL, rtol=0, msg=name)
