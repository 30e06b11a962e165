"""Expert parallelism (autopipe.runtime.stage.expert_parallel), against the untouched model.

A tiny Mixtral and a tiny Qwen3-MoE (4 experts, top-2; their loss includes the load-balancing loss,
``output_router_logits``) train one step on ep 2 x 2 stages: 2 stages x dp 2 = 4 gloo processes,
each replica holding half of every MoE layer's experts, tokens dispatched and combined by
all-to-all. The reference is the untouched HuggingFace model on the global batch, micro-batch by
micro-batch (tests/test_tensor_parallel.py's harness): the first-step loss, every gradient before
the update (each expert tensor assembled from the ranks' slices) and every weight after one AdamW
step. Also: each rank holds only its experts, the test batch routes tokens across the ep ranks,
and the one-line refusals.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch
import tp_models
from _held import stray_parameters
from _launch import Launcher
from test_tensor_parallel import MICRO, MODELS, ROWS, SEQ, compare, make_job, reference, train, untouched

from autopipe.choices import world_rank
from autopipe.errors import AutopipeError

DP, PP, EP, EXPERTS = 2, 2, 2, 4
CUT = [0, 2, 5]  # 5 layers: embedding, 2 decoder blocks, norm, head


def _ep_rank_of(rank: int, dp: int = DP, tp: int = 1) -> tuple[int, int]:
    """(stage, ep rank) of world ``rank`` (placement pipeline-inner, the 'even' plan's)."""
    for d in range(dp):
        for p in range(PP):
            for t in range(tp):
                if world_rank(d, p, dp=dp, pp=PP, placement="pipeline-inner", tp=tp, tp_rank=t) == rank:
                    return p, d % EP
    raise AssertionError(rank)


def _assembled(run: Path, nproc: int, name: str, held: dict[int, dict[str, tuple]], dp: int = DP,
               tp: int = 1) -> tuple[dict, dict]:
    """Every gradient and weight by name: an expert tensor (its dim 0 smaller on a rank than in the
    model) concatenated from its ep ranks' slices in ep-rank order; any other the same on every rank
    (a tp shard saved whole by the probes)."""
    full = {n: tuple(p.shape) for n, p in untouched(name).named_parameters()}
    out = []
    for kind in ("grads_rank{}.pt", "weights_rank{}_step1.pt"):
        slices: dict[str, dict[int, torch.Tensor]] = {}
        whole: dict[str, torch.Tensor] = {}
        for rank in range(nproc):
            _, e = _ep_rank_of(rank, dp, tp)
            saved = torch.load(run / kind.format(rank), weights_only=True)
            held.setdefault(rank, {}).update({n: tuple(t.shape) for n, t in saved.items()})
            for n, t in saved.items():
                if tuple(t.shape) != full[n]:
                    if e in slices.get(n, {}):  # the same slice in another ep group: equal after the step
                        torch.testing.assert_close(t, slices[n][e], atol=0, rtol=0, msg=f"ep groups disagree on {n}")
                    slices.setdefault(n, {})[e] = t
                elif n in whole:
                    torch.testing.assert_close(t, whole[n], atol=0, rtol=0, msg=f"ranks disagree on {n} ({kind})")
                else:
                    whole[n] = t
        for n, parts in slices.items():
            assert sorted(parts) == list(range(EP)), f"{n}: slices from ep ranks {sorted(parts)}"
            whole[n] = torch.cat([parts[e] for e in range(EP)])
        out.append(whole)
    return out[0], out[1]


def _routes_across(name: str) -> int:
    """The least, over the micro-batches of the test batch and the MoE layers, of (slots routed to ep
    rank 0's experts) x (slots routed to ep rank 1's): above 0 when every replica's every micro-batch
    sends some slots to the other rank's experts in every layer (the routing is the job's: its loss
    and gradients equal the untouched model's)."""
    from autopipe.runtime.data.batches import split_batch

    model = untouched(name)
    seen: list[torch.Tensor] = []
    hooks = [m.register_forward_hook(lambda mod, args, out: seen.append(args[1].detach()))
             for n, m in model.named_modules() if n.endswith("mlp.experts")]
    ids = tp_models._ids(ROWS * MICRO * DP)
    crossing = []
    for a, k in split_batch((ids,), {"labels": ids}, MICRO * DP):
        seen.clear()
        with torch.no_grad():
            model(*a, **k)
        # every layer, every micro-batch: some slots go to each half of the experts
        crossing += [int((idx < EXPERTS // EP).sum()) * int((idx >= EXPERTS // EP).sum()) for idx in seen]
    for h in hooks:
        h.remove()
    return min(crossing)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ep")


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe_aux"])
def job(request: pytest.FixtureRequest, torchrun: Launcher, root: Path) -> dict:
    """One ep 2 x pp 2 step of the model (1F1B, ZeRO 0; --verify first), and the untouched model's reference."""
    name = request.param
    path = make_job(root, name, tp=1)
    plan = path / "cut.json"  # one MoE block on each stage: embedding + layer 0 | layer 1 + norm + head
    plan.write_text(json.dumps({"boundaries": CUT}))
    held: dict[int, dict[str, tuple]] = {}
    t0 = time.perf_counter()
    loss, grads, weights, out = train(torchrun, path, DP * PP, "--dp", DP, "--ep", EP, "--verify", plan=plan,
                                      merge=lambda run, n: _assembled(run, n, name, held))
    seconds = time.perf_counter() - t0
    return {"name": name, "got": (loss, grads, weights), "out": out, "held": held, "seconds": seconds,
            "ref": reference(name, dp=DP)}


@pytest.mark.slow
@pytest.mark.distributed
def test_ep2_x_pp2_trains_as_the_untouched_model(job: dict) -> None:
    """Loss (load-balancing loss included), every gradient and every weight after one AdamW step
    equal the untouched model's on the global batch (1e-5); --verify, run first, said so too (each
    expert slice's gradient gathered over its ep group, the untouched model on the global batch), and
    left the step as it was."""
    figures = compare(job["name"], job["got"], job["ref"])
    _verified(job["out"])
    said = [line for line in job["out"].splitlines() if line.startswith("ep 2: ")]
    assert len(said) == 1 and "2 MoE layer(s), each rank of an ep group of 2 replicas holds 2 of 4 experts" in said[0], job["out"][-2000:]
    figures["seconds"] = job["seconds"]
    print(f"\n{job['name']} ep2 x pp2 (dp 2): {figures}", file=sys.stderr)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(("name", "zero"), [("mixtral", 2), ("qwen3_moe_aux", 3)])
def test_ep2_x_pp2_on_fsdp2_replicas_trains_as_the_untouched_model(torchrun: Launcher, root: Path, name: str,
                                                                   zero: int) -> None:  # fmt: skip
    """ZeRO 2 and 3 (FSDP2 over the replicas, the expert slices left out of it: ``ignored_params``): the
    non-expert weights sharded and their gradients reduce-scattered, each expert slice's gradient summed
    over its expert data-parallel group by autopipe, the norm summed over the world with each slice
    counted once. The same step as the untouched model's, as on ZeRO 0; --verify gathers the shards
    and the slices and says so."""
    path = root / f"{name}_tp1" if (root / f"{name}_tp1").exists() else make_job(root, name, tp=1)
    plan = path / "cut.json"
    plan.write_text(json.dumps({"boundaries": CUT}))
    held: dict[int, dict[str, tuple]] = {}
    loss, grads, weights, out = train(torchrun, path, DP * PP, "--dp", DP, "--ep", EP, "--zero", zero, "--verify",
                                      plan=plan, tag=f"zero{zero}", merge=lambda run, n: _assembled(run, n, name, held))  # fmt: skip
    figures = compare(f"{name} zero {zero}", (loss, grads, weights), reference(name, dp=DP))
    _verified(out)
    assert f"ZeRO {zero}" in out, out[-2000:]
    print(f"\n{name} ep2 x pp2 (dp 2) ZeRO {zero}: {figures}", file=sys.stderr)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(("zero", "sp"), [(0, False), (1, True), (3, False)])
def test_ep2_x_tp2_x_pp2_trains_as_the_untouched_model(torchrun: Launcher, root: Path, zero: int, sp: bool) -> None:
    """ep 2 with tp 2: 2 stages x tp 2 x dp 2 = 8 processes, each stage's attention split over its tp
    ranks and each MoE layer's experts shared out over the 2 replicas at the same tp rank (the layer
    runs replicated over tp: its experts call dispatches plain tensors, as each tp rank holds the same
    tokens). Qwen3-MoE with its load-balancing loss, on ZeRO 0, 1 (the tp shards stepped through their
    local tensors, the expert slices by the expert optimizer) and 3: the same step as the untouched
    model's on the global batch (the norm counting each tp shard on its rank, each expert slice once);
    --verify says so first. ZeRO 1 runs under sequence parallelism too (a MoE layer gathers its sequence
    inputs whole; the norms' replicated DTensors step as local tensors beside the tp shards)."""
    name = "qwen3_moe_aux"
    path = root / f"{name}_tp2" if (root / f"{name}_tp2").exists() else make_job(root, name, tp=2)
    plan = path / "cut.json"
    plan.write_text(json.dumps({"boundaries": CUT}))
    held: dict[int, dict[str, tuple]] = {}
    loss, grads, weights, out = train(torchrun, path, DP * PP * 2, "--dp", DP, "--ep", EP, "--zero", zero, "--verify",
                                      *(["--sequence-parallel"] if sp else []), plan=plan, tag=f"tp2_zero{zero}_sp{sp:d}",
                                      merge=lambda run, n: _assembled(run, n, name, held, tp=2))  # fmt: skip
    figures = compare(f"{name} tp 2 zero {zero}", (loss, grads, weights), reference(name, dp=DP))
    (said,) = [line for line in out.splitlines() if line.startswith("tp 2: ")]
    assert "its MoE experts run by expert parallelism" in said and ("sequence parallel: " in said) == sp, said
    assert "holds 2 of 4 experts" in out and "x tp 2" in out, out[-2000:]
    assert all(held[r]["model.layers.1.mlp.experts.gate_up_proj"][0] == EXPERTS // EP for r in held if
               "model.layers.1.mlp.experts.gate_up_proj" in held[r]) and len(held) == DP * PP * 2, held.keys()
    _verified(out)
    print(f"\n{name} ep2 x tp2 x pp2 (dp 2) ZeRO {zero}{' SP' if sp else ''}: {figures}", file=sys.stderr)


def _verified(out: str) -> None:
    """train.py's --verify line says ok, within 1e-5 of the untouched model's gradients."""
    (line,) = [line for line in out.splitlines() if "verify: loss" in line]
    assert line.endswith(": ok") and float(line.split("max grad diff ")[1].split(":")[0]) < 1e-5, line


@pytest.mark.slow
@pytest.mark.distributed
def test_verify_under_ep_names_an_expert_gradient_the_job_gets_wrong(torchrun: Launcher, root: Path) -> None:
    """With each expert slice's gradient left dp times the untouched model's (tests/faults: the
    division by the replica count dropped), --verify on ep 2 x 2 stages x dp 2 stops the job in one
    line naming an expert tensor, before any update; a check comparing a replica with its own batch
    or autopipe with itself would not see it."""
    name = "mixtral"
    path = root / f"{name}_tp1" if (root / f"{name}_tp1").exists() else make_job(root, name, tp=1)
    plan = path / "cut_fault.json"
    plan.write_text(json.dumps({"boundaries": CUT}))
    proc = torchrun(path / "train.py", "--steps", 1, "--plan", plan, "--weights", path / "weights.safetensors",
                    "--dp", DP, "--ep", EP, "--verify", nproc=DP * PP, cwd=path, timeout=600, check=False,
                    env={"AUTOPIPE_TEST_EXPERT_GRAD_UNSCALED": "1"}, pythonpath=[Path(__file__).parent / "faults"])
    said = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "differs from the untouched model" in said, said[-3000:]
    (line,) = {line for line in said.splitlines() if "differs from the untouched model" in line}
    assert "experts" in line.split("worst: ")[1] and "Traceback" not in said, said[-3000:]


@pytest.mark.slow
@pytest.mark.distributed
def test_each_rank_holds_only_its_experts_and_tokens_cross(job: dict) -> None:
    """Every rank's expert tensors hold E/ep experts (its parameter bytes shrink by that much),
    and the test batch routes slots of every micro-batch to both halves of the experts in every
    MoE layer, so the dispatch really sends tokens to the other rank."""
    full = {n: p for n, p in untouched(job["name"]).named_parameters()}
    for rank, shapes in job["held"].items():
        experts = [n for n in shapes if ".experts." in n]
        assert experts, f"rank {rank} holds no expert tensor: {sorted(shapes)}"
        for n in experts:
            assert shapes[n][0] == EXPERTS // EP and shapes[n][1:] == tuple(full[n].shape[1:]), (n, shapes[n])
        held = sum(torch.Size(s).numel() for s in shapes.values())
        whole = sum(full[n].numel() for n in shapes)
        saved = sum(full[n].numel() for n in experts) // EP
        assert held == whole - saved, (rank, held, whole, saved)
    assert _routes_across(job["name"]) > 0


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe_aux"])
def test_an_ep_rank_keeps_no_whole_expert_tensor_once_built(name: str) -> None:
    """Once a stage is built under ep 2, every tensor its model and chunks reach is one of the stage's
    own parameters, so the rank holds its experts' slices and not the whole stacked tensors besides.
    The traced experts calls' modules kept the whole tensors until their first forward swapped the
    slices in: through the memory baseline and the first step each rank held every expert (the tiny
    Mixtral's ep 2 rank 9 MiB over its share, measured 0.85x its plan). Each stage of a 2-stage
    build, on a fake process group of 2."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from autopipe.runtime import build_stage, model_factory

    source = model_factory(f"{MODELS}:{name}", batch_size=ROWS, seq_len=SEQ)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        for pp_rank in (0, 1):
            build = build_stage(source.factory, source.args, source.kwargs, CUT, pp_rank=pp_rank, pp_size=2,
                                ep_group=dist.group.WORLD)
            _, stray = stray_parameters(build, build.params.values())
            assert build.ep_layout.calls and not stray, (pp_rank, stray)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_the_load_balancing_loss_is_in_the_reference() -> None:
    """The untouched models' loss changes with their load-balancing term: the equality covers it."""
    for name in ("mixtral", "qwen3_moe_aux"):
        model, args, kwargs = getattr(tp_models, name)(ROWS)
        with torch.no_grad():
            with_aux = float(model(*args, **kwargs).loss)
            model.config.output_router_logits = False
            without = float(model(*args, **kwargs).loss)
        assert abs(with_aux - without) > 1e-2, (name, with_aux, without)


# ---- no processes: the refusals ------------------------------------------------------------------


def test_what_ep_does_not_compose_with_is_one_line() -> None:
    from autopipe.runtime.stage.expert_parallel import plan_expert_parallel

    with pytest.raises(AutopipeError, match="--ep 2: the model has no MoE experts module"):
        plan_expert_parallel({}, 2, None)
    from types import SimpleNamespace

    with pytest.raises(AutopipeError, match="--ep 3 does not divide the 4 experts of model.layers.0.mlp.experts"):
        plan_expert_parallel({"model.layers.0.mlp.experts": SimpleNamespace(num_experts=4)}, 3, None)


def test_zero_1_shards_expert_state_over_the_expert_data_parallel_group_only() -> None:
    """ZeRO 1 with ep on a fake world of 4 (rank 0; ep 2, so its expert data-parallel group is ranks
    0 and 2): the dense tensors' AdamW state shared out over all 4 replicas, the expert slices' over
    their 2, so rank 0 owns the larger of each (ZeroRedundancyOptimizer fills the emptiest rank,
    largest first); with dp = ep (no such group) the slices' state is all held. The experts step at
    the scheduled LR."""
    import torch.distributed as dist
    from torch import nn
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from autopipe.runtime.torch_engine.zero import make_dp_optimizer, optimizer_state
    from autopipe.runtime.training.optim import TrainConfig

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        sizes = {"a": (16, 16), "b": (16,), "e.w": (2, 16, 16), "e.v": (2, 16, 4)}
        for group, owned in ((dist.new_group([0, 2]), {"a", "e.w"}), (None, {"a", "e.w", "e.v"})):
            params = {n: nn.Parameter(torch.randn(*shape)) for n, shape in sizes.items()}
            opt = make_dp_optimizer(params, TrainConfig(zero=1), zero=1, dp_size=4, group=dist.group.WORLD,
                                    experts=["e.v", "e.w"], expert_group=group)  # fmt: skip
            for p in params.values():
                p.grad = torch.ones_like(p)
            opt.preallocate_()
            assert set(optimizer_state(opt, params)) == owned, group
            opt.param_groups[0]["lr"] = 0.25
            before = params["e.w"].detach().clone()
            opt.step()
            assert {g["lr"] for g in opt.expert_param_groups()} == {0.25}
            assert not torch.equal(params["e.w"], before)  # stepped by the expert optimizer, here
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("schedule", ["gpipe", "interleaved1f1b", "zbv"])
def test_ep_composes_with_every_schedule(torchrun: Launcher, root: Path, schedule: str) -> None:
    """ep 2 x 2 stages (Qwen3-MoE) under GPipe, Interleaved1F1B and ZBV (2 chunks per rank, the
    experts' all-to-alls inside the split input/weight backward; ``replicate`` for ZBV's replicas):
    the first step and the weights after it equal the untouched model's."""
    name = "qwen3_moe_aux"
    path = root / f"{name}_tp1" if (root / f"{name}_tp1").exists() else make_job(root, name, tp=1)
    plan = path / f"cut_{schedule}.json"
    plan.write_text(json.dumps({"boundaries": CUT if schedule == "gpipe" else [0, 1, 2, 3, 5]}))
    got = train(torchrun, path, DP * PP, "--dp", DP, "--ep", EP, "--schedule", schedule, tag=f"sched_{schedule}",
                plan=plan, merge=lambda run, n: _assembled(run, n, name, {}))
    figures = compare(f"{name} {schedule}", got[:3], reference(name, dp=DP))
    print(f"\n{name} ep2 x pp2 {schedule}: {figures}", file=sys.stderr)


def test_preflight_refuses_what_ep_does_not_run_in_one_line(tmp_path: Path) -> None:
    """Before any model is built: ep not dividing dp, and DeepSpeed; tp, every ZeRO stage, checkpoints,
    --export and --verify pass."""
    from types import SimpleNamespace

    from autopipe.runtime.training.preflight import preflight

    def settings(**changes: object) -> SimpleNamespace:
        base = dict(ckpt_dir=str(tmp_path / "ckpt"), ckpt_every=0, resume=None, data=None, eval_data=None, plan="even",
                    dp=2, tp=1, ep=2, engine="torch", zero=0, verify=False, export=None)
        return SimpleNamespace(**{**base, **changes})

    assert preflight(settings(), world=4) is None
    for changes, says in [({"ep": 3, "dp": 3}, None), ({"dp": 3}, "--ep 2 must divide --dp 3"),
                          ({"engine": "deepspeed"}, "--ep 2 on DeepSpeed"),
                          ({"tp": 2}, None),
                          ({"zero": 1}, None), ({"zero": 2}, None), ({"zero": 3}, None),
                          ({"ckpt_every": 1, "export": "out"}, None),
                          ({"verify": True}, None)]:
        world = 3 * 2 if changes.get("dp") == 3 else 8 if changes.get("tp") else 4
        if says is None:
            preflight(settings(**changes), world=world)
            continue
        with pytest.raises(AutopipeError, match=says):
            preflight(settings(**changes), world=world)


@pytest.mark.slow
@pytest.mark.distributed
def test_ep_on_a_model_without_experts_is_one_line(torchrun: Launcher, root: Path) -> None:
    """--ep 2 on a dense Llama: one line from rank 0 naming what is missing, no traceback."""
    path = make_job(root, "llama", tp=1)
    run = path / "dense"
    run.mkdir()
    proc = torchrun(path / "train.py", "--steps", 1, "--plan", "even", "--dp", DP, "--ep", EP, nproc=DP * PP, cwd=run,
                    check=False)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "--ep 2: the model has no MoE experts module" in text, text[-2000:]
    assert "Traceback" not in text, text[-2000:]


@pytest.mark.slow
@pytest.mark.distributed
def test_convert_with_ep_writes_a_job_that_runs_it(tmp_path: Path) -> None:
    """``convert --stages 2 --dp 2 --ep 2``: plan.ep 2, train.py's default --ep 2, and ``autopipe run``
    starts 4 processes whose log says how the experts are shared out; --ep 3 is refused at convert."""
    import os
    import subprocess

    from autopipe.job.converter import convert
    from autopipe.job.settings import ConvertSettings

    with pytest.raises(AutopipeError, match="--ep 3 must divide --dp 2"):
        ConvertSettings(stages=2, dp=2, ep=3)
    job = tmp_path / "job"
    convert(f"{tp_models.__file__}:mixtral", stages=2, dp=2, ep=2, microbatches=MICRO, batch_size=ROWS, seq_len=SEQ,
            out=job, repeats=1, warmup=0, progress=False, reserve="0", schedule="1f1b")
    assert json.loads((job / "plan.json").read_text())["ep"] == 2
    # the cut was solved for what one ep rank computes (autopipe.costs.ep: its busiest experts at the
    # profile's counted skew and four all-to-alls), which is never less than the model at ep 1
    import autopipe
    from autopipe import Profile
    from autopipe.planner.plan import Plan

    plan, prof = Plan.load(job / "plan.json"), Profile.load(job / "profile.json")
    assert all(l.moe is not None for l in prof.layers if "mlp" in l.name or "layers" in l.name)
    # what the runner's own ops cost a rank at ep > 1, timed at convert (autopipe.runtime.checks.ep_timing)
    assert all(l.moe.local_forward > 0 and l.moe.local_backward > 0 for l in prof.layers if l.moe is not None)
    ep1 = autopipe.partition(prof, 2, microbatches=plan.microbatches, schedule=plan.schedule, boundaries=plan.boundaries)
    assert sum(plan.stage_forward) > sum(ep1.stage_forward) * 1.001, (plan.stage_forward, ep1.stage_forward)
    assert "    ep: int = 2" in (job / "train.py").read_text()
    done = subprocess.run([sys.executable, "-m", "autopipe", "run", str(job), "--steps", "1"], cwd=job, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert "2 stage(s) x 2 replica(s)" in done.stdout and "ep 2: 2 MoE layer(s)" in done.stdout, done.stdout[-3000:]
    assert "step     1/1" in done.stdout, done.stdout[-3000:]


def test_ep_groups_of_a_large_world_on_fake_process_groups() -> None:
    """dp 4 x pp 2 with ep 2, both placements: a stage's ep group is ep consecutive dp ranks, its
    expert data-parallel group the same ep rank in the other ep groups, its norm group the
    pipelines of its ep group."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from autopipe.runtime.process.distenv import init_dist

    dp, pp, ep = 4, 2, 2
    for placement in ("pipeline-inner", "replica-inner"):
        def rank_of(d: int, p: int) -> int:
            return world_rank(d, p, dp=dp, pp=pp, placement=placement)

        for rank in range(dp * pp):
            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=dp * pp)
            try:
                env = init_dist(dp=dp, ep=ep, placement=placement)
                d, p, g = env.dp_rank, env.pp_rank, env.dp_rank // ep
                assert env.ep_rank == d % ep and env.ep_size == ep
                assert dist.get_process_group_ranks(env.ep_group) == [rank_of(g * ep + j, p) for j in range(ep)]
                assert dist.get_rank(env.ep_group) == env.ep_rank
                assert sorted(dist.get_process_group_ranks(env.expert_dp_group)) == sorted(
                    rank_of(h * ep + env.ep_rank, p) for h in range(dp // ep))
                assert sorted(dist.get_process_group_ranks(env.pp_ep_group)) == sorted(
                    rank_of(g * ep + j, q) for j in range(ep) for q in range(pp))
            finally:
                dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.distributed
def test_ep2_over_dp4_on_zero_1_sums_each_expert_and_shards_its_state(torchrun: Launcher, root: Path) -> None:
    """dp 4 x 2 stages with ep 2 on ZeRO 1 (8 processes, two ep groups): an expert slice's gradient is
    summed over the expert data-parallel group (the same slice in the other ep group) before the step,
    and its AdamW state is sharded over that group by an optimizer of its own
    (ZeroOneAdamW.experts), the rest over all 4 replicas. The first step equals the untouched model's
    on the global batch (--verify says so first), and both ep groups agree. Then, on one stage x dp 4
    (4 processes), 2 steps checkpointing each: step 2 resumed from step 1's checkpoint (each expert
    state saved by the ep group that owns it) logs the same loss and norm on ZeRO 1 and on ZeRO 0."""
    import shutil

    name = "qwen3_moe_aux"
    path = root / f"{name}_tp1" if (root / f"{name}_tp1").exists() else make_job(root, name, tp=1)
    plan = path / "cut_dp4.json"
    plan.write_text(json.dumps({"boundaries": CUT}))
    got = train(torchrun, path, 4 * PP, "--dp", 4, "--ep", EP, "--zero", 1, "--verify", tag="dp4", plan=plan,
                merge=lambda run, n: _assembled(run, n, name, {}, dp=4))
    figures = compare(f"{name} dp4 ep2 zero 1", got[:3], reference(name, dp=4))
    _verified(got[3])
    assert "ZeRO 1" in got[3], got[3][-2000:]
    print(f"\n{name} ep2 x dp4 x pp2 ZeRO 1: {figures}", file=sys.stderr)

    whole = path / "cut_dp4_one_stage.json"
    whole.write_text(json.dumps({"boundaries": [CUT[0], CUT[-1]]}))

    def steps(log: Path, *flags: object) -> list[dict]:
        torchrun(path / "train.py", "--steps", 2, "--plan", whole, "--weights", path / "weights.safetensors", "--dp", 4,
                 "--ep", EP, "--log-json", log, *flags, nproc=4, cwd=path, timeout=600)
        return [json.loads(line) for line in log.read_text().splitlines()]

    ran = steps(path / "z1_dp4.json", "--zero", 1, "--ckpt-dir", path / "z1_ckpt", "--ckpt-every", 1)
    assert ran[1]["loss"] != ran[0]["loss"]
    for zero in (1, 0):
        ckpt = path / f"z1_resume_zero{zero}"
        shutil.copytree(path / "z1_ckpt", ckpt)
        shutil.rmtree(ckpt / "step_00000002")
        (second,) = steps(path / f"z1_resumed_zero{zero}.json", "--zero", zero, "--ckpt-dir", ckpt, "--resume")[-1:]
        assert second["step"] == 2 and second["loss"] == pytest.approx(ran[1]["loss"], abs=1e-5), zero
        assert second["grad_norm"] == pytest.approx(ran[1]["grad_norm"], rel=1e-5), zero


@pytest.mark.slow
@pytest.mark.distributed
def test_three_steps_under_ep_follow_the_same_steps_without_it_and_resume_on_either(torchrun: Launcher,
                                                                                     root: Path) -> None:
    """Qwen3-MoE, dp 2 x 2 stages: three steps with --ep 2 log the losses, gradient norms and
    held-out losses (--eval-data: forward only, the all-to-alls without backward) of the same three
    steps with --ep 1 (every replica holding every expert), so the expert slices, their optimizer
    state and the zeroed gradients carry over from step to step. The ep 2 run checkpoints each step
    (each expert tensor by its global offsets) and exports its weights: the export equals the ep 1
    run's, and step 3 resumed from its step 2 checkpoint, on ep 2 and on ep 1, logs the same loss."""
    import shutil

    import numpy as np
    from safetensors.torch import load_file

    name = "qwen3_moe_aux"
    path = root / f"{name}_tp1" if (root / f"{name}_tp1").exists() else make_job(root, name, tp=1)
    plan = path / "cut_steps.json"
    plan.write_text(json.dumps({"boundaries": CUT}))
    val = path / "val.bin"
    np.random.default_rng(0).integers(0, tp_models.V, 400, dtype=np.uint16).tofile(val)

    def steps(ep: int, log: Path, *flags: object) -> list[dict]:
        torchrun(path / "train.py", "--steps", 3, "--plan", plan, "--weights", path / "weights.safetensors", "--dp", DP,
                 "--ep", ep, "--log-json", log, "--eval-data", val, "--eval-every", 3, *flags, nproc=DP * PP, cwd=path,
                 timeout=600)
        return [json.loads(line) for line in log.read_text().splitlines()]

    logs = {ep: steps(ep, path / f"steps_ep{ep}.json", "--export", path / f"out_ep{ep}",
                      *(["--ckpt-dir", path / "ckpt", "--ckpt-every", 1] if ep == EP else []))
            for ep in (1, EP)}
    assert len(logs[EP]) == 3 and "eval_loss" in logs[EP][2]
    for a, b in zip(logs[1], logs[EP]):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-5) and b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
    assert logs[EP][2]["eval_loss"] == pytest.approx(logs[1][2]["eval_loss"], abs=1e-5)
    assert logs[EP][2]["loss"] != logs[EP][0]["loss"]

    whole, sliced = (load_file(path / f"out_ep{ep}" / "model.safetensors") for ep in (1, EP))
    assert sliced.keys() == whole.keys()
    experts = [k for k in whole if "experts" in k]
    assert experts and all(sliced[k].shape[0] == EXPERTS for k in experts)
    for k in whole:
        torch.testing.assert_close(sliced[k], whole[k], atol=1e-5, rtol=0, msg=k)
    assert max((sliced[k] - whole[k]).abs().max().item() for k in experts) < 1e-5

    for ep in (EP, 1):  # step 3 again, from the ep 2 run's step 2 checkpoint
        ckpt = path / f"ckpt_resume_ep{ep}"
        shutil.copytree(path / "ckpt", ckpt)
        shutil.rmtree(ckpt / "step_00000003")
        (third,) = steps(ep, path / f"resumed_ep{ep}.json", "--ckpt-dir", ckpt, "--resume")[-1:]
        assert third["step"] == 3 and third["loss"] == pytest.approx(logs[EP][2]["loss"], abs=1e-5), ep
        assert third["grad_norm"] == pytest.approx(logs[EP][2]["grad_norm"], rel=1e-5), ep


@pytest.mark.slow
@pytest.mark.distributed
def test_a_rank_that_receives_no_tokens_still_meets_the_others(torchrun: Launcher, tmp_path: Path) -> None:
    """Every token routed to ep rank 0's experts (tests/_ep_one_sided.py, 2 processes): rank 1 sends
    all and receives none, both finish forward and backward, and every output and gradient equals the
    untouched experts module's."""
    proc = torchrun(Path(__file__).parent / "_ep_one_sided.py", nproc=2, cwd=tmp_path, timeout=300)
    assert "ok 0" in proc.stdout and "ok 1" in proc.stdout, proc.stdout[-2000:]


@pytest.mark.parametrize("name", ["qwen3_moe_aux", "mixtral"])
def test_the_step_log_s_flops_count_the_experts_with_and_without_ep(name: str) -> None:
    """The step log's MFU divides a step's FLOPs, counted without data. transformers runs the experts
    by torch._grouped_mm (on CPU its opaque grouped_mm_fallback), which torch's FlopCounterMode counts
    as nothing, and under --ep an experts call returns no rows without data: the ep 2 count was 56 %
    of this Qwen3-MoE's, and at ep 1 another stage's MoE layer failed to run data-free, so the step
    log had no MFU at all. Each stage of a 2-stage build, at ep 1 and at ep 2 (fake process groups, one
    process), now counts 3x torch's own count of the untouched model's forward, run for real on
    random tokens with transformers' eager experts (a matmul per expert, which torch counts), per
    micro-batch and replica."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.utils.flop_counter import FlopCounterMode

    from autopipe.runtime import build_stage, model_factory, step_flops

    source = model_factory(f"{MODELS}:{name}", batch_size=ROWS, seq_len=SEQ)
    model = untouched(name)
    model.set_experts_implementation("eager")
    ids = torch.randint(0, model.config.vocab_size, tuple(source.args[0].shape), generator=torch.Generator().manual_seed(0))
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(ids, labels=ids, use_cache=False)
    forward = counter.get_total_flops()
    want = 3 * forward * 4 * 2
    for pp_rank in (0, 1):  # ep 1: the experts run transformers' default (grouped_mm) on fake tensors
        build = build_stage(source.factory, source.args, source.kwargs, CUT, pp_rank=pp_rank, pp_size=2)
        assert step_flops(build.seq, source, microbatches=4, replicas=2) == want
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        for pp_rank in (0, 1):
            build = build_stage(source.factory, source.args, source.kwargs, CUT, pp_rank=pp_rank, pp_size=2,
                                ep_group=dist.group.WORLD)
            assert build.ep_layout is not None and build.ep_layout.ep == 2
            assert step_flops(build.seq, source, microbatches=4, replicas=2) == want
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.distributed
def test_ep_on_zero_3_checkpoints_resumes_and_exports_as_without_ep(torchrun: Launcher, root: Path) -> None:
    """Mixtral, dp 2 x 2 stages on ZeRO 3 (FSDP2, expert slices left out of it): two steps with --ep 2
    log the losses and norms of the same two steps with --ep 1; the ep 2 run's export equals the ep 1
    run's; step 2 resumed from its step 1 checkpoint (FSDP2 shards and expert slices, each tensor by its
    global offsets) logs the same loss, on ep 2 and on ep 1."""
    import shutil

    from safetensors.torch import load_file

    name = "mixtral"
    path = root / f"{name}_tp1" if (root / f"{name}_tp1").exists() else make_job(root, name, tp=1)
    plan = path / "cut_z3.json"
    plan.write_text(json.dumps({"boundaries": CUT}))

    def steps(ep: int, log: Path, *flags: object) -> list[dict]:
        torchrun(path / "train.py", "--steps", 2, "--plan", plan, "--weights", path / "weights.safetensors", "--dp", DP,
                 "--ep", ep, "--zero", 3, "--log-json", log, *flags, nproc=DP * PP, cwd=path, timeout=600)
        return [json.loads(line) for line in log.read_text().splitlines()]

    logs = {ep: steps(ep, path / f"z3_ep{ep}.json", "--export", path / f"z3_out_ep{ep}",
                      *(["--ckpt-dir", path / "z3_ckpt", "--ckpt-every", 1] if ep == EP else []))
            for ep in (1, EP)}  # fmt: skip
    for a, b in zip(logs[1], logs[EP]):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-5) and b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
    assert logs[EP][1]["loss"] != logs[EP][0]["loss"]
    whole, sliced = (load_file(path / f"z3_out_ep{ep}" / "model.safetensors") for ep in (1, EP))
    assert sliced.keys() == whole.keys() and any("experts" in k for k in whole)
    for k in whole:
        torch.testing.assert_close(sliced[k], whole[k], atol=1e-5, rtol=0, msg=k)
    for ep in (EP, 1):
        ckpt = path / f"z3_resume_ep{ep}"
        shutil.copytree(path / "z3_ckpt", ckpt)
        shutil.rmtree(ckpt / "step_00000002")
        (second,) = steps(ep, path / f"z3_resumed_ep{ep}.json", "--ckpt-dir", ckpt, "--resume")[-1:]
        assert second["step"] == 2 and second["loss"] == pytest.approx(logs[EP][1]["loss"], abs=1e-5), ep
