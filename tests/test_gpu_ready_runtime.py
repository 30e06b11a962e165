"""The runtime's GPU and multi-node paths, checked on a CPU (issue 22): each test fails on the code
before its fix.

The tools: torch's ``fake`` process-group backend lays out any world (16 ranks, 8 per node) in one
process; a stand-in ``torch.cuda`` (tests/_fake_cuda.py) reports GPUs and records what the runtime
makes current and which generator it sets; ``FakeTensorMode`` makes ``device="cuda"`` tensors on a
CPU-only torch; ``map_location="meta"``-like devices expose loads onto the rank's device; a
dispatch mode counts the operators (on a GPU, kernel launches) a function issues.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _fake_cuda import StandInCuda
from torch import nn
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode

import autopipe
from autopipe.errors import AutopipeError, RecordError
from autopipe.runtime import (
    TrainConfig,
    Trainer,
    build_stage,
    init_dist,
    make_loss,
    rank_device,
)

CHECKOUT = Path(autopipe.__file__).resolve().parent.parent  # the autopipe under test, for the processes started here


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))


X, Y = torch.randn(8, 8, generator=torch.Generator().manual_seed(0)), torch.randn(8, 1, generator=torch.Generator().manual_seed(1))


@pytest.fixture
def fake_world():
    """``fake_world(rank, world)`` joins torch's fake process group as ``rank`` of ``world``; left at the end."""

    def join(rank: int, world: int, store=None) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=store or FakeStore(), rank=rank, world_size=world)

    yield join
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def one_rank():
    """A one-process world (gloo) and its DistEnv, closed at the end."""
    env = init_dist(dp=1)
    yield env
    env.close()


def trainer_for(env, **config) -> Trainer:
    build = build_stage(make_model, (X[:2],), {}, [0, 2, 5], pp_rank=env.pp_rank, pp_size=env.pp_size)
    return Trainer(build, env, TrainConfig(steps=10, microbatches=4, **config), loss_fn=make_loss("mse"))


# ---- defect 4: one visible GPU per process -------------------------------------------------------
def test_one_visible_gpu_per_process_is_cuda_0(monkeypatch: pytest.MonkeyPatch) -> None:
    """SLURM --gpus-per-task=1 gives each process one GPU, device 0, whatever its LOCAL_RANK: the rank
    runs on cuda:0 (made current). With several GPUs visible LOCAL_RANK picks one; too few is one line."""
    cuda = StandInCuda(count=1).install(monkeypatch)
    assert rank_device(3) == torch.device("cuda", 0) and cuda.calls == [("set_device", 0)]
    StandInCuda(count=8).install(monkeypatch)
    assert rank_device(3) == torch.device("cuda", 3)
    StandInCuda(count=2).install(monkeypatch)
    with pytest.raises(AutopipeError, match="local rank 3 has no GPU of its own"):
        rank_device(3)


def test_init_dist_on_16_ranks_with_one_gpu_each(monkeypatch: pytest.MonkeyPatch, fake_world) -> None:
    """init_dist of rank 11 of 16 (8 per node, LOCAL_RANK 3), each process seeing one GPU: its
    device is cuda:0 and its groups are the world's (fake backend)."""
    cuda = StandInCuda(count=1).install(monkeypatch)
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    fake_world(11, 16)
    env = init_dist(dp=2)
    assert env.device == torch.device("cuda", 0) and ("set_device", 0) in cuda.calls
    assert (env.dp_rank, env.pp_rank) == (1, 3)
    assert dist.get_process_group_ranks(env.dp_group) == [3, 11]


def test_two_local_ranks_on_one_gpu_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two local ranks that each see a single GPU, the same one: one line before any collective
    (NCCL's own refusal comes at the first collective, a traceback on every rank)."""
    StandInCuda(count=1, uuids=["GPU-1234"]).install(monkeypatch)
    store = dist.HashStore()
    real_init = dist.init_process_group

    def joined(*args, **kwargs) -> None:  # the world as torchrun would make it, on the fake backend
        real_init("fake", store=store, rank=0, world_size=2)
        dist.distributed_c10d._get_default_store().set("autopipe/gpu/0/1", "GPU-1234")  # local rank 1's

    monkeypatch.setattr(dist, "init_process_group", joined)
    for name, value in {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
                        "GROUP_RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    try:
        with pytest.raises(AutopipeError, match="local ranks 0 and 1 both see only GPU GPU-1234"):
            init_dist(dp=1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# ---- defect 8: the plan's placement numbers the ranks ---------------------------------------------
@pytest.mark.parametrize("placement", ["pipeline-inner", "replica-inner"])
def test_placement_builds_the_process_groups(fake_world, placement: str) -> None:
    """8 stages x 2 replicas on 2 nodes of 8 (16 ranks, fake backend): under replica-inner the replicas
    of a stage are neighbours (their reduction stays inside a node, as the search priced it), under
    pipeline-inner a pipeline is; every rank makes the same groups, tied groups included."""
    from autopipe.choices import world_rank
    from autopipe.cluster.topology import cluster_for, place
    from autopipe.runtime.stage.build import TiedSpec

    link = place(cluster_for("h100", 16, 8), stages=8, dp=2, order=placement).dp_link
    for rank in range(16):
        fake_world(rank, 16)
        env = init_dist(dp=2, placement=placement)
        assert env.global_rank(env.dp_rank, env.pp_rank) == rank
        pipeline = dist.get_process_group_ranks(env.pp_group)
        replicas = dist.get_process_group_ranks(env.dp_group)
        assert pipeline == [world_rank(env.dp_rank, p, dp=2, pp=8, placement=placement) for p in range(8)]
        assert replicas == [world_rank(d, env.pp_rank, dp=2, pp=8, placement=placement) for d in range(2)]
        assert ({r // 8 for r in replicas} == {rank // 8}) == (link == "intra")  # the search's link, run
        env.make_tied_groups([TiedSpec("wte.weight", ("wte.weight", "lm_head.weight"), (0, 7))])
        if env.pp_rank in (0, 7):
            assert dist.get_process_group_ranks(env.tied_groups["wte.weight"]) == [env.global_rank(env.dp_rank, 0),
                                                                                  env.global_rank(env.dp_rank, 7)]


def test_plan_carries_its_placement() -> None:
    """The search's layout puts its placement (and node size) in the plan; plan.json files made before
    the field load as pipeline-inner; a placement autopipe does not know is one line."""
    from dataclasses import replace

    from autopipe.cluster.evaluate import evaluate
    from autopipe.cluster.layouts import Layout
    from autopipe.cluster.topology import cluster_for
    from autopipe.costs.layer_costs import Profile
    from autopipe.planner.plan import Plan

    prof = Profile.from_costs([1.0] * 4, param_bytes=[100] * 4, activation_bytes=[10] * 4)
    cluster = cluster_for("h100", 16, 8)
    _, plan = evaluate(prof, cluster, Layout(2, 8, 1, 4, "1f1b", 1, 0, "replica-inner"), memory_limit=None)
    assert (plan.placement, plan.gpus_per_node, plan.nodes) == ("replica-inner", 8, 2)
    again = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again.placement == "replica-inner"
    old = plan.to_dict()
    del old["placement"], old["gpus_per_node"]
    assert Plan.from_dict(old).placement == "pipeline-inner" and Plan.from_dict(old).nodes == 1
    with pytest.raises(RecordError, match="placement is 'stage-inner'"):
        Plan.from_dict(replace(plan, placement="stage-inner").to_dict())


# ---- defect 2: resume on a GPU ---------------------------------------------------------------------
def test_resume_loads_rng_on_the_host_and_no_weights_onto_the_device(one_rank, tmp_path: Path, monkeypatch) -> None:
    """load_checkpoint on a rank whose device is not the host (meta stands in for a GPU): the saved RNG
    states stay host tensors (torch.set_rng_state takes nothing else), and replica 0's whole stage
    weights, kept for export, are not loaded at all (they would sit on every GPU beside the model)."""
    from autopipe.runtime.checkpoints.store import load_checkpoint, save_checkpoint

    trainer = trainer_for(one_rank)
    trainer.step((X,), {}, Y)
    saved = save_checkpoint(trainer, tmp_path)
    trainer.env.device = torch.device("meta")
    loaded = []
    real = trainer.load_state_dict
    monkeypatch.setattr(trainer, "load_state_dict", lambda state: (loaded.append(state), real(state)))
    assert load_checkpoint(trainer, saved) == 1
    (state,) = loaded
    assert "params" not in state
    tensors = [v for v in state.values() if isinstance(v, torch.Tensor)]
    assert tensors and all(t.device.type == "cpu" for t in tensors)


def test_each_rank_restores_its_own_gpu_generator(one_rank, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank on cuda:1 saves cuda:1's generator and restores it there, as a host tensor; no other
    device's generator is read or set (with one GPU per process there is only one)."""
    trainer = trainer_for(one_rank)
    cuda = StandInCuda(count=2).install(monkeypatch)
    trainer.env.device = torch.device("cuda", 1)
    state = trainer.state_dict()
    cuda.rng[1] = torch.full((16,), 7, dtype=torch.uint8)  # moved on since the save
    trainer.load_state_dict(state)
    assert [c for c in cuda.calls if c[0] == "set_rng_state"] == [("set_rng_state", 1)]
    assert torch.equal(cuda.rng[1], torch.full((16,), 1, dtype=torch.uint8)) and torch.equal(cuda.rng[0], torch.zeros(16, dtype=torch.uint8))


# ---- defect 11: no copy of the stage's weights on the GPU at a checkpoint --------------------------
class _Made(TorchDispatchMode):
    """Records the device of every tensor an operator makes (views, which make none, aside)."""

    def __init__(self) -> None:
        super().__init__()
        self.devices: list[tuple[str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor) and not func.is_view:
                self.devices.append((str(func), t.device.type))
        return out


def test_checkpoint_weights_go_to_the_host_without_a_copy_on_the_gpu() -> None:
    """The weights a checkpoint keeps (replica 0's) are copied straight to host memory: no operator
    makes a CUDA tensor on the way (the old clone held all stage weights twice on every replica's
    GPU). A replica that keeps nothing touches nothing of its whole tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from autopipe.runtime.torch_engine.zero import full_values

    with FakeTensorMode(allow_non_fake_inputs=True):
        params = [(f"w{i}", nn.Parameter(torch.empty(64, 64, device="cuda"))) for i in range(3)]
        with _Made() as made:
            kept = full_values(params)
        assert sorted(kept) == ["w0", "w1", "w2"] and all(t.device.type == "cpu" for t in kept.values())
        assert all(device == "cpu" for _, device in made.devices), made.devices
        with _Made() as made:
            assert full_values(params, keep=False) == {}
        assert made.devices == []


# ---- defect 13: few kernels for the gradient norm and the clip; FSDP2 gathers bf16 ----------------
class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def test_grad_norm_and_clip_issue_a_few_kernels_whatever_the_tensor_count() -> None:
    """The global norm and the clip issue the same few operators (on a GPU, kernel launches) for 10
    gradients as for 40: multi-tensor kernels, not three or four per tensor and slice."""
    from autopipe.runtime.process.comm import Comm
    from autopipe.runtime.training.grads import clip_grads_, global_grad_norm

    def ops(n: int) -> int:
        params = {f"p{i}": nn.Parameter(torch.randn(300)) for i in range(n)}
        for p in params.values():
            p.grad = torch.randn(300)
        with _Count() as count:
            norm = global_grad_norm(params, set(), None, Comm(torch.device("cpu")))
            clip_grads_(params.values(), norm, 0.5)
        return count.ops

    assert ops(10) == ops(40) <= 16


def test_fsdp2_gathers_bf16_weights_under_bf16(fake_world) -> None:
    """dp 2 under ZeRO 2 with bf16: the layers compute on bf16 weights gathered by FSDP2 (its
    MixedPrecisionPolicy), not on fp32 ones autocast casts down again; the AdamW shards stay fp32."""
    fake_world(0, 2)
    env = init_dist(dp=2)
    build = build_stage(make_model, (X[:2],), {}, [0, 5], pp_rank=0, pp_size=1)
    trainer = Trainer(build, env, TrainConfig(steps=2, microbatches=2, dtype="bf16", zero=2), loss_fn=make_loss("mse"))
    seen = []
    module = trainer.engine.stages[0].submod
    for layer in module.layers:
        if any(True for _ in layer.parameters()):
            layer.register_forward_pre_hook(lambda m, a: seen.extend(p.dtype for p in m.parameters(recurse=True)))
    module(X[:2])
    assert seen and set(seen) == {torch.bfloat16}
    assert {p.dtype for p in trainer.params.values()} == {torch.float32}


# ---- defect 16: fp16's LR schedule ------------------------------------------------------------------
def test_fp16_steps_skipped_for_overflow_do_not_advance_the_lr_schedule(one_rank) -> None:
    """A loss scale so large that every step overflows: every step is skipped, and the learning rate
    stays at the first step's (warmup) value, in the trainer and in the unpipelined reference."""
    from autopipe.runtime import build_reference
    from autopipe.runtime.checks.reference import ReferenceTrainer
    from autopipe.runtime.training.optim import lr_factor

    config = dict(dtype="fp16", loss_scale=1e30, warmup=4)
    trainer = trainer_for(one_rank, **config)
    stats = [trainer.step((X,), {}, Y) for _ in range(3)]
    first = 3e-4 * lr_factor(0, TrainConfig(steps=10, microbatches=4, **config))
    assert all(s.skipped for s in stats) and [s.lr for s in stats] == pytest.approx([first] * 3)
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(first)
    ref = ReferenceTrainer(build_reference(make_model, seed=0), TrainConfig(steps=10, microbatches=4, **config),
                           loss_fn=make_loss("mse"))
    for _ in range(3):
        ref.step((X,), {}, Y)
    assert ref.optimizer.param_groups[0]["lr"] == pytest.approx(first)


# ---- defect 14: an NCCL timeout is a lost peer, said once ------------------------------------------
NCCL_TIMEOUT = ("[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, OpType=ALLREDUCE, "
                "NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600046 milliseconds before timing out.")


@pytest.mark.parametrize("rank", [0, 1])
def test_an_nccl_timeout_is_one_line_from_rank_0_and_silence_elsewhere(tmp_path: Path, rank: int) -> None:
    """NCCL's watchdog timeout reaching train.py's excepthook: rank 0 prints one line saying a
    collective timed out because another rank stopped answering; the others exit 1 without a word
    (before: a traceback from every rank)."""
    script = tmp_path / "timeout.py"
    script.write_text(textwrap.dedent(f"""
        import autopipe.runtime as rt
        rt.one_line_errors()
        raise RuntimeError({NCCL_TIMEOUT!r})
    """))
    env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "PYTHONPATH": str(CHECKOUT)}
    env.pop("AUTOPIPE_DEBUG", None)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    if rank == 0:
        assert len(lines) == 1 and lines[0].startswith("error: a collective timed out (") and "another rank" in lines[0]
    else:
        assert lines == []


# ---- defect 12: multi-node launch lines, the sbatch script, the resume hint -----------------------
def _torchrun_env(monkeypatch: pytest.MonkeyPatch, **values: str) -> None:
    for name in ("GROUP_WORLD_SIZE", "LOCAL_WORLD_SIZE", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in values.items():
        monkeypatch.setenv(name, value)


def test_resume_hint_keeps_the_nodes_and_the_rendezvous(monkeypatch: pytest.MonkeyPatch) -> None:
    """The command rank 0 prints for resuming a 2-node run keeps torchrun's --nnodes and rendezvous
    options as given (read from torchrun's own command line), with the node rank left to each node;
    where that line cannot be read it is rebuilt from torchrun's environment."""
    from autopipe.runtime.process import launch

    _torchrun_env(monkeypatch, WORLD_SIZE="16", LOCAL_WORLD_SIZE="8", GROUP_WORLD_SIZE="2", TORCHELASTIC_RUN_ID="42",
                  MASTER_ADDR="node0", MASTER_PORT="29500")
    monkeypatch.setattr(sys, "argv", ["jobs/gpt2/train.py", "--steps", "9"])
    given = ["/venv/bin/python3", "/venv/bin/torchrun", "--nnodes", "2", "--nproc-per-node", "8", "--rdzv-backend", "c10d",
             "--rdzv-endpoint", "node0:29500", "--rdzv-id", "42", "jobs/gpt2/train.py", "--steps", "9"]
    monkeypatch.setattr(launch, "_parent_argv", lambda: given)
    assert launch.launch_command(("--resume",)) == ("torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d "
                                                    "--rdzv-endpoint node0:29500 --rdzv-id 42 jobs/gpt2/train.py --steps 9 --resume")
    static = ["python", "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=8", "--node-rank=0",
              "--master-addr=node0", "jobs/gpt2/train.py", "--steps", "9"]
    monkeypatch.setattr(launch, "_parent_argv", lambda: static)
    assert launch.launch_command(("--resume",)) == ("torchrun --nnodes=2 --nproc-per-node=8 --node-rank $NODE_RANK "
                                                    "--master-addr=node0 jobs/gpt2/train.py --steps 9 --resume")
    monkeypatch.setattr(launch, "_parent_argv", lambda: None)
    assert launch.launch_command(("--resume",)) == ("torchrun --nnodes 2 --nproc-per-node 8 --node-rank $NODE_RANK "
                                                    "--master-addr node0 --master-port 29500 jobs/gpt2/train.py --steps 9 --resume")


def test_a_plan_on_two_nodes_gets_multi_node_launch_lines_and_an_sbatch_script(tmp_path: Path) -> None:
    """A plan of 8 stages x 2 replicas on nodes of 8: the README's line runs torchrun on each of 2
    nodes (node rank, rendezvous), and train.sbatch (valid bash) asks SLURM for 2 nodes of 8 GPUs
    and starts one torchrun per node; a plan that fits one node gets neither."""
    from dataclasses import replace

    from autopipe.costs.layer_costs import Profile
    from autopipe.job.folder import JobSettings, emit
    from autopipe.planner.partitioner import partition

    prof = Profile.from_costs([1.0] * 16, param_bytes=[100] * 16, activation_bytes=[10] * 16)
    plan = replace(partition(prof, stages=8, dp=2), gpus_per_node=8, placement="replica-inner")
    settings = JobSettings(model="gpt2", stages=8, microbatches=plan.microbatches, schedule=plan.schedule, device="cuda")
    job = emit(tmp_path / "two", settings=settings, profile=prof, plan=plan)
    assert job.launch.startswith("torchrun --nnodes 2 --nproc-per-node 8 --node-rank $NODE_RANK --master-addr $MASTER_ADDR ")
    assert job.launch in (job.job_dir / "README.md").read_text() and "sbatch train.sbatch" in (job.job_dir / "README.md").read_text()
    sbatch = job.job_dir / "train.sbatch"
    assert sbatch in job.files
    text = sbatch.read_text()
    assert "#SBATCH --nodes=2" in text and "#SBATCH --gpus-per-node=8" in text and "ranks replica-inner" in text
    assert 'srun torchrun --nnodes "$SLURM_NNODES" --nproc-per-node 8 --rdzv-backend c10d' in text
    subprocess.run(["bash", "-n", str(sbatch)], check=True)
    one = emit(tmp_path / "one", settings=settings, profile=prof, plan=replace(plan, gpus_per_node=16))
    assert one.launch.startswith("torchrun --nproc-per-node 16 ") and not (one.job_dir / "train.sbatch").exists()


def test_the_wrong_process_count_on_a_multi_node_plan_says_the_nodes() -> None:
    """A 2-node plan (8 stages x 2 replicas, 8 per node) launched with 4 processes per replica: the
    line names the torchrun counts that fit, nodes included."""
    from types import SimpleNamespace

    from autopipe.runtime import check_launch

    plan = SimpleNamespace(stages=8, gpus_per_node=8)
    with pytest.raises(AutopipeError, match="launch with --nnodes 2 --nproc-per-node 8 with --dp 2"):
        check_launch(plan, 4, 2)


def test_convert_settings_check_the_node_size() -> None:
    """--gpus-per-node with --stages sets the job's nodes: a world that is no whole number of nodes is one line."""
    from autopipe.job.settings import ConvertSettings

    assert ConvertSettings(stages=8, dp=2, gpus_per_node=8).gpus_per_node == 8
    with pytest.raises(AutopipeError, match="12 processes is not a whole number of nodes of 8"):
        ConvertSettings(stages=6, dp=2, gpus_per_node=8)


# ---- defect 14: the startup race of tests/test_jobs.py's 3-process launch error --------------------
def test_every_rank_has_joined_before_any_can_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torchrun, init_dist waits for every rank right after init_process_group, before making
    the mesh (or anything else that can raise): a rank that fails and leaves can no longer catch
    another still inside init_process_group, where its failure was a raw 'Connection closed by peer'."""
    calls: list[str] = []
    real_init, real_barrier, real_new_group = dist.init_process_group, dist.barrier, dist.new_group

    def joined(*args, **kwargs) -> None:
        real_init("fake", store=FakeStore(), rank=0, world_size=3)
        calls.append("init_process_group")

    monkeypatch.setattr(dist, "init_process_group", joined)
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: (calls.append("barrier"), real_barrier(*a, **k))[1])
    monkeypatch.setattr(dist, "new_group", lambda *a, **k: (calls.append("new_group"), real_new_group(*a, **k))[1])
    for name, value in {"WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "3"}.items():
        monkeypatch.setenv(name, value)
    try:
        env = init_dist(dp=1)
        assert calls[:2] == ["init_process_group", "barrier"], calls
        assert env.watch is not None  # the peer watch runs from here on
        env.watch.set()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class _GeneratorOnItsDevice(torch.overrides.TorchFunctionMode):
    """torch's rule on a GPU, on a CPU: a tensor drawn with a generator is made on that generator's
    device. Under ``torch.device("cuda")`` a CPU generator without ``device="cpu"`` raised there
    ("Expected a 'cuda' device type for generator but found 'cpu'"); on a CPU-only torch the meta
    device stands in for the GPU, where torch itself does not check."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        g = kwargs.get("generator")
        if isinstance(g, torch.Generator) and isinstance(out, torch.Tensor) and out.device.type != g.device.type:
            raise RuntimeError(f"{func.__name__}: a {g.device.type} generator drew a {out.device.type} tensor")
        return out


def test_the_untouched_model_builds_on_a_gpu_with_its_example_batch_drawn_on_the_host() -> None:
    """--verify builds the untouched model under the job's device (H200, torch 2.11: every --verify
    run failed before its first step, in the built-in GPT-2's example batch)."""
    from autopipe.graph.sources import load_model

    with torch.device("meta"), _GeneratorOnItsDevice():
        spec = load_model("gpt2", device="meta", batch_size=2, seq_len=8)
    assert spec.args[0].device.type == "meta" and spec.args[0].shape == (2, 8)
