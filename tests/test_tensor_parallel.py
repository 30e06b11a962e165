"""Tensor parallelism inside pipeline stages (autopipe.runtime.stage.tensor_parallel), against the untouched model.

Each job of tests/tp_models.py (a Llama with HuggingFace's tp_plan, a GPT-2 whose plan is derived
from its Conv1D graph with its embedding tied to its head, a Qwen3-MoE decoder whose experts
run whole on each tp rank beside their sharded attention) is trained one step on tp 2 x 2 stages = 4 gloo processes at the model's own weights.
The reference is the untouched HuggingFace model on the job's rows, micro-batch by micro-batch: the
first-step loss, every parameter's gradient before the update (AdamW would hide a constant scale),
and every weight after one AdamW step must equal it. Also: the (dp, pp, tp) rank layout on fake
process groups of large worlds, the tp plan, and the one-line refusals.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import tp_models
from _launch import Arg, Launcher
from safetensors.torch import save_file

from autopipe.errors import AutopipeError
from autopipe.graph.flattener import flatten
from autopipe.graph.sources import load_model
from autopipe.job.script import write_train_script
from autopipe.job.settings import JobSettings
from autopipe.runtime import JobData, make_loss, model_factory
from autopipe.runtime.data.batches import split_batch
from autopipe.runtime.data.losses import model_loss

MODELS = Path(tp_models.__file__).resolve()
PROBES = Path(__file__).parent / "probes"
MICRO, SEQ, ROWS, LR = 2, tp_models.T, tp_models.B, 1e-3
TOL = 1e-5


def untouched(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return getattr(tp_models, name)(ROWS)[0].train()


def reference(name: str, dp: int = 1) -> tuple[float, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The untouched model's first-step loss, gradients, and weights after one AdamW step as the job
    takes it (lr 1e-3, betas 0.9/0.95, decay 0.1 on matrices, no clip), on the job's rows."""
    spec = f"{MODELS}:{name}"
    source = model_factory(spec, batch_size=ROWS, seq_len=SEQ, loss="auto")
    shapes = load_model(spec, device="meta", batch_size=ROWS, seq_len=SEQ)
    seq = flatten(shapes.model, shapes.args, shapes.kwargs)
    args, kwargs, _ = JobData(source, None, seq_len=SEQ, seed=0, seq=seq).batch(0, ROWS * MICRO * dp)
    model = untouched(name)
    total, parts = 0.0, MICRO * dp
    for a, k in split_batch(args, kwargs, parts):
        value = model_loss(model(*a, **k))
        (value / parts).backward()
        total += float(value.detach()) / parts
    named = dict(model.named_parameters(remove_duplicate=False))
    grads = {n: p.grad for n, p in named.items() if p.grad is not None}  # tied names share one (AdamW leaves .grad)
    unique = dict(model.named_parameters())
    decay = [p for _, p in sorted(unique.items()) if p.dim() >= 2]
    rest = [p for _, p in sorted(unique.items()) if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=LR,
                            betas=(0.9, 0.95), eps=1e-8, foreach=False)
    opt.step()
    weights = {n: p.detach().clone() for n, p in named.items()}
    return total, grads, weights


def make_job(root: Path, name: str, tp: int = 2) -> Path:
    job = root / f"{name}_tp{tp}"
    job.mkdir()
    write_train_script(job, JobSettings(model=f"{MODELS}:{name}", stages=2, microbatches=MICRO, schedule="1f1b",
                                        batch_size=ROWS, seq_len=SEQ, loss="auto"), tp=tp)
    save_file({k: v.detach().clone().contiguous() for k, v in untouched(name).state_dict().items()},
              str(job / "weights.safetensors"))
    return job


def train(torchrun: Launcher, job: Path, nproc: int, *flags: Arg, tag: str = "run", plan: str | Path = "even",
          merge: Callable[[Path, int], tuple[dict, dict]] | None = None) -> tuple[tuple[float, float], dict, dict, str]:
    """One step of ``job`` on ``nproc`` processes: (loss, norm), every gradient and weight after the
    step by name (``merge(run folder, nproc)`` assembles them from the ranks' probe files; default:
    every rank holding a name holds the same whole tensor), and the output."""
    run = job / tag
    run.mkdir()
    proc = torchrun(job / "train.py", "--steps", 1, "--lr", LR, "--grad-clip", 0, "--weights", job / "weights.safetensors",
                    "--plan", plan, "--log-json", run / "log.json", *flags, nproc=nproc, cwd=run,
                    env={"AUTOPIPE_TEST_GRADS": str(run), "AUTOPIPE_TEST_WEIGHTS": str(run)}, pythonpath=[PROBES],
                    timeout=600)
    (step,) = [json.loads(line) for line in (run / "log.json").read_text().splitlines()]
    if merge is not None:
        return (step["loss"], step["grad_norm"]), *merge(run, nproc), proc.stdout
    grads: dict[str, torch.Tensor] = {}
    weights: dict[str, torch.Tensor] = {}
    for rank in range(nproc):
        for n, g in torch.load(run / f"grads_rank{rank}.pt", weights_only=True).items():
            if n in grads:  # every tp rank saves the same whole gradient
                torch.testing.assert_close(g, grads[n], atol=0, rtol=0, msg=f"tp ranks disagree on {n}'s gradient")
            grads[n] = g
        weights.update(torch.load(run / f"weights_rank{rank}_step1.pt", weights_only=True))
    return (step["loss"], step["grad_norm"]), grads, weights, proc.stdout


def compare(name: str, got: tuple[float, dict, dict], ref: tuple[float, dict, dict]) -> dict[str, float]:
    (loss, norm), grads, weights = got
    ref_loss, ref_grads, ref_weights = ref
    assert loss == pytest.approx(ref_loss, abs=TOL, rel=TOL), f"{name}: loss {loss} vs the untouched model's {ref_loss}"
    # the logged global norm counts each shard once, each replicated (and tied) tensor once
    unique = {id(g): g for g in ref_grads.values()}.values()
    ref_norm = float(torch.sqrt(sum(g.double().square().sum() for g in unique)))
    assert norm == pytest.approx(ref_norm, rel=1e-5), f"{name}: grad norm {norm} vs the untouched model's {ref_norm}"
    covered = {n for n in ref_grads if n in grads}
    # a tied tensor is saved by one of its names: every other name of it shares the reference's grad
    missing = [n for n in ref_grads if n not in grads and not any(ref_grads[n] is ref_grads[m] for m in covered)]
    assert covered and not missing, f"{name}: gradients missing for {missing}"
    worst_g = worst_w = 0.0
    for n in covered:
        torch.testing.assert_close(grads[n], ref_grads[n], atol=TOL, rtol=TOL, msg=f"{name}: gradient of {n}")
        worst_g = max(worst_g, float((grads[n] - ref_grads[n]).abs().max()))
    for n, w in weights.items():
        torch.testing.assert_close(w, ref_weights[n], atol=TOL, rtol=TOL, msg=f"{name}: weight {n} after one step")
        worst_w = max(worst_w, float((w - ref_weights[n]).abs().max()))
    assert set(weights) <= set(ref_weights) and weights, f"{name}: weights {set(weights) - set(ref_weights)}"
    return {"loss_diff": abs(loss - ref_loss), "max_grad_diff": worst_g, "max_weight_diff": worst_w,
            "norm_rel_diff": abs(norm - ref_norm) / ref_norm}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tp")


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("name", ["llama", "gpt2", "qwen3_moe"])
def test_tp2_x_pp2_trains_as_the_untouched_model(torchrun: Launcher, root: Path, name: str) -> None:
    """tp 2 x 2 stages on 4 processes: loss, every gradient and every weight after one AdamW step
    equal the untouched HuggingFace model's (1e-5); the log names the layers that run replicated."""
    job = make_job(root, name)
    ref = reference(name)
    t0 = time.perf_counter()
    loss, grads, weights, out = train(torchrun, job, 4)
    figures = compare(name, (loss, grads, weights), ref)
    assert "x tp 2" in out, out[-2000:]
    (said,) = [line for line in out.splitlines() if line.startswith("tp 2: ")]  # once, from rank 0
    # Qwen3-MoE: its decoder blocks' experts (a grouped matmul DTensor has no rule for) run whole on each
    # tp rank's local tensors, the rest of the blocks on DTensors
    assert "every layer runs on DTensors" in said, said
    assert ("the MoE experts of 2 layer(s) run whole on every tp rank" in said) == (name == "qwen3_moe"), said
    assert ("HF tp_plan" in said) == (name != "gpt2"), said
    figures["seconds"] = time.perf_counter() - t0
    print(f"\n{name} tp2 x pp2: {figures}", file=sys.stderr)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("name", ["llama", "gpt2", "qwen3_moe"])
def test_sequence_parallel_tp2_x_pp2_trains_as_the_untouched_model(torchrun: Launcher, root: Path, name: str) -> None:
    """--sequence-parallel on tp 2 x 2 stages: the activations between layers (and across the cut)
    travel as half sequences, the norms' weights get their gradients summed over the tp ranks, and the
    loss, every gradient and every weight after one AdamW step still equal the untouched model's (GPT-2:
    its head, tied to the embedding, replicated; Qwen3-MoE: its decoder blocks gather their sequence inputs
    whole, run as without SP, their experts whole on each tp rank, and keep their part of the outputs)."""
    job = root / f"{name}_tp2" if (root / f"{name}_tp2").exists() else make_job(root, name)
    loss, grads, weights, out = train(torchrun, job, 4, "--sequence-parallel", tag="sp")
    figures = compare(f"{name} sp", (loss, grads, weights), reference(name))
    (said,) = [line for line in out.splitlines() if line.startswith("tp 2: ")]
    # gpt2: embedding, 2 blocks and ln_f each send their hidden states on (the head's logits go to the loss whole)
    assert "sequence parallel: 4 activations sent sharded on the sequence" in said, said
    print(f"\n{name} tp2 x pp2 sequence parallel: {figures}", file=sys.stderr)


@pytest.mark.slow
@pytest.mark.distributed
def test_verify_under_tp_compares_whole_gradients(torchrun: Launcher, root: Path) -> None:
    """--verify on tp 2 x 2 stages gathers each sharded gradient before comparing: it says ok."""
    job = make_job(root, "llama", tp=2) if not (root / "llama_tp2").exists() else root / "llama_tp2"
    *_, out = train(torchrun, job, 4, "--verify", tag="verify")
    line = next(line for line in out.splitlines() if "verify:" in line)
    assert line.endswith(": ok"), line


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(("zero", "sp"), [(0, True), (1, True), (2, True), (3, False)])
def test_tp2_x_pp2_x_dp2_on_8_processes_trains_as_the_untouched_model(torchrun: Launcher, root: Path, zero: int,
                                                                       sp: bool) -> None:  # fmt: skip
    """tp 2 x 2 stages x 2 replicas over the dp mesh (ZeRO 0: ``replicate``; ZeRO 1: the same with each
    replica stepping its share of the tp shards' state and broadcasting them; ZeRO 2/3: FSDP2, 2-D with
    the tp placements, as torchtitan lays it out): the first step equals the untouched model's on the
    global batch, and --verify, run first, gathers each gradient over the tp and dp meshes and says ok.
    Under --sequence-parallel (ZeRO 0-2: the norms' weights are DTensors replicated over tp, and each
    replica's partial norm gradients are averaged over the replicas, then summed over the tp ranks) and
    without it (ZeRO 3: FSDP2 shards plain norm weights over dp alone beside the 2-D tp shards)."""
    job = make_job(root, "llama", tp=2) if not (root / "llama_tp2").exists() else root / "llama_tp2"
    loss, grads, weights, out = train(torchrun, job, 8, "--dp", 2, "--zero", zero, "--verify",
                                      *(["--sequence-parallel"] if sp else []), tag=f"dp2_zero{zero}_sp{sp:d}")
    figures = compare(f"llama dp2 zero {zero}", (loss, grads, weights), reference("llama", dp=2))
    (line,) = [line for line in out.splitlines() if "verify: loss" in line]
    assert line.endswith(": ok"), line
    assert ("sequence parallel:" in out) == sp, out[-2000:]
    print(f"\nllama tp2 x pp2 x dp2 zero {zero}{' sequence parallel' if sp else ''}: {figures}", file=sys.stderr)


@pytest.mark.slow
@pytest.mark.distributed
def test_tp_refusals_are_one_line(torchrun: Launcher, root: Path) -> None:
    """DeepSpeed with --tp 2, and a tp that does not divide the heads: one line each, from rank 0."""
    job = make_job(root, "llama_bad_heads", tp=2)
    run = job / "bad"
    run.mkdir()
    proc = torchrun(job / "train.py", "--steps", 1, "--plan", "even", nproc=4, cwd=run, check=False)
    assert proc.returncode != 0
    assert "3 attention heads (num_attention_heads) do not divide over tp 2" in proc.stdout + proc.stderr, \
        (proc.stdout + proc.stderr)[-2000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    proc = torchrun(job / "train.py", "--steps", 1, "--plan", "even", "--engine", "deepspeed", nproc=2, cwd=run,
                    check=False)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "--tp 2 on DeepSpeed" in text and "Traceback" not in text, text[-2000:]


# ---- no processes: the layout, the plan, the refusals ---------------------------------------------


def test_rank_layout_of_a_large_world_on_fake_process_groups() -> None:
    """(dp, pp, tp) with tp innermost, both placements, 64 ranks: every rank's coordinates and groups
    match autopipe.choices.world_rank."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from autopipe.choices import world_rank
    from autopipe.runtime.process.distenv import init_dist

    dp, pp, tp = 2, 8, 4
    for placement in ("pipeline-inner", "replica-inner"):
        for rank in (0, 5, 37, 63):
            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=dp * pp * tp)
            try:
                env = init_dist(dp=dp, tp=tp, placement=placement)
                d, p, t = env.dp_rank, env.pp_rank, env.tp_rank
                assert world_rank(d, p, dp=dp, pp=pp, placement=placement, tp=tp, tp_rank=t) == rank
                assert dist.get_process_group_ranks(env.tp_group) == [rank - t + i for i in range(tp)]
                assert dist.get_process_group_ranks(env.pp_group) == [
                    world_rank(d, q, dp=dp, pp=pp, placement=placement, tp=tp, tp_rank=t) for q in range(pp)]
                assert sorted(dist.get_process_group_ranks(env.dp_group)) == sorted(
                    world_rank(e, p, dp=dp, pp=pp, placement=placement, tp=tp, tp_rank=t) for e in range(dp))
                assert sorted(dist.get_process_group_ranks(env.pp_tp_group)) == sorted(
                    world_rank(d, q, dp=dp, pp=pp, placement=placement, tp=tp, tp_rank=u)
                    for q in range(pp) for u in range(tp))
                assert env.pipeline_ranks(d) == [env.global_rank(d, q) for q in range(pp)]
            finally:
                dist.destroy_process_group()


def test_launch_lines_count_stages_x_dp_x_tp() -> None:
    from autopipe.job.launch import launch_command, sbatch_script

    job = JobSettings(model="gpt2", stages=4, microbatches=8, schedule="1f1b", device="cuda")
    assert launch_command("jobs/g", job, dp=2, nodes=2, tp=2).startswith("torchrun --nnodes 2 --nproc-per-node 8 ")
    text = sbatch_script("/jobs/g", job, dp=2, nodes=2, tp=2)
    assert "4 stages x 2 replicas x tp 2 = 16 processes, 8 on each of 2 nodes" in text
    assert "#SBATCH --gpus-per-node=8" in text


def test_bad_tp_layouts_are_one_line() -> None:
    from autopipe.runtime.process.distenv import check_tp

    with pytest.raises(AutopipeError, match="tp 3 does not divide the world of 8 ranks"):
        check_tp(3, 8, local_world=8)
    with pytest.raises(AutopipeError, match="tp 8 does not fit the 4 processes"):
        check_tp(8, 16, local_world=4)
    check_tp(4, 16, local_world=8)


def test_the_tp_plan_of_llama_gpt2_and_moe() -> None:
    """Llama's own HF plan; GPT-2's derived from its Conv1D (addmm) graph, with the [in, out] weight
    layout's shard dims; the MoE experts' stacked tensors replicated."""
    from autopipe.graph.tp_plan import shard_dims, tp_plan

    def plans(name: str) -> tuple[dict, dict]:
        s = load_model(f"{MODELS}:{name}", device="meta", batch_size=ROWS, seq_len=SEQ)
        seq = flatten(s.model, s.args, s.kwargs)
        hf = getattr(s.model, "_tp_plan", None) or None
        kinds, dims = {}, {}
        for layer in seq.layers:
            k = tp_plan(layer, hf)
            kinds.update(k)
            dims.update(shard_dims(layer, k, 2))
        return kinds, dims

    kinds, dims = plans("llama")
    assert kinds["model.layers.0.self_attn.k_proj.weight"] == "colwise" and dims["model.layers.0.self_attn.k_proj.weight"] == 0
    assert kinds["model.layers.1.mlp.down_proj.weight"] == "rowwise" and dims["model.layers.1.mlp.down_proj.weight"] == 1
    assert kinds["model.embed_tokens.weight"] == "vocab" and kinds["model.norm.weight"] == "replicate"
    kinds, dims = plans("gpt2")
    assert (kinds["transformer.h.0.attn.c_attn.weight"], dims["transformer.h.0.attn.c_attn.weight"]) == ("colwise", 1)
    assert (kinds["transformer.h.0.attn.c_attn.bias"], dims["transformer.h.0.attn.c_attn.bias"]) == ("colwise", 0)
    assert (kinds["transformer.h.1.mlp.c_proj.weight"], dims["transformer.h.1.mlp.c_proj.weight"]) == ("rowwise", 0)
    assert kinds["transformer.h.1.mlp.c_proj.bias"] == "replicate" and kinds["transformer.wte.weight"] == "vocab"
    kinds, dims = plans("qwen3_moe")
    assert dims["model.layers.0.mlp.experts.gate_up_proj"] is None  # 3-D expert stacks stay whole


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(("name", "schedule"), [("llama", "gpipe"), ("llama", "interleaved1f1b"), ("gpt2", "zbv")])
def test_tp_composes_with_every_schedule(torchrun: Launcher, root: Path, name: str, schedule: str) -> None:
    """tp 2 x 2 stages under GPipe, Interleaved1F1B (2 chunks per rank) and ZBV (GPT-2: its tied
    embedding and head then both sit on rank 0, as two leaves over one storage): the first step and
    the weights after it equal the untouched model's."""
    job = root / f"{name}_tp2" if (root / f"{name}_tp2").exists() else make_job(root, name)
    cut = [0, 3, 5] if schedule == "gpipe" else [0, 1, 2, 3, 5]  # 5 layers: embedding, 2 blocks, norm, head
    plan = job / f"cut_{schedule}.json"
    plan.write_text(json.dumps({"boundaries": cut}))
    got = train(torchrun, job, 4, "--schedule", schedule, tag=f"sched_{schedule}", plan=plan)
    figures = compare(f"{name} {schedule}", got[:3], reference(name))
    print(f"\n{name} tp2 x pp2 {schedule}: {figures}", file=sys.stderr)


@pytest.mark.slow
@pytest.mark.distributed
def test_convert_with_tp_writes_a_job_that_autopipe_run_launches_on_stages_x_tp(tmp_path: Path) -> None:
    """``convert --stages 2 --tp 2 --sequence-parallel``: plan.tp 2 with sequence parallelism, train.py's
    defaults --tp 2 and --sequence-parallel, the launch lines and README count 4 processes, and
    ``autopipe run`` starts 4 (its step logs tp 2, and the activations it sends sharded)."""
    import subprocess

    from autopipe.job.converter import convert

    job = tmp_path / "job"
    convert(f"{MODELS}:llama", stages=2, tp=2, sequence_parallel=True, microbatches=MICRO, batch_size=ROWS, seq_len=SEQ,
            out=job, repeats=1, warmup=0, progress=False, reserve="0", schedule="1f1b")
    plan = json.loads((job / "plan.json").read_text())
    assert plan["tp"] == 2 and plan["sequence_parallel"] is True
    # each layer timed at tp 2 with sequence parallelism as the runtime runs it (runtime/checks/tp_timing)
    shapes = [l["tp"] for l in json.loads((job / "profile.json").read_text())["layers"] if l.get("tp")]
    assert shapes and all(len(s["timed"]) == 1 and s["timed"][0][:2] == [2, True] and min(s["timed"][0][2:]) > 0
                          for s in shapes), shapes
    script, readme = (job / "train.py").read_text(), (job / "README.md").read_text()
    assert "    tp: int = 2" in script and "torchrun --nproc-per-node 4 train.py" in script
    assert "    sequence_parallel: bool = True" in script
    assert f"torchrun --nproc-per-node 4 {job / 'train.py'}" in readme and "= 4 processes (nproc = stages x dp x tp)" in readme
    done = subprocess.run([sys.executable, "-m", "autopipe", "run", str(job), "--steps", "1"], cwd=job, capture_output=True,
                          text=True, timeout=600, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert "2 stage(s) x 1 replica(s) x tp 2" in done.stdout and "step     1/1" in done.stdout, done.stdout[-3000:]
    assert "sequence parallel: 4 activations sent sharded on the sequence" in done.stdout, done.stdout[-3000:]


@pytest.mark.slow
@pytest.mark.distributed
def test_tp_checkpoint_resumes_exactly_on_the_same_and_on_another_tp_degree(torchrun: Launcher, root: Path) -> None:
    """A tp 2 x 2 stages run saves each step (torch.distributed.checkpoint, each tp shard by its global
    offsets); resumed from step 1 on tp 2, and on tp 1 (2 processes: DCP reshards), step 2's loss and
    gradient norm equal the uninterrupted run's."""
    import shutil

    job = root / "llama_tp2" if (root / "llama_tp2").exists() else make_job(root, "llama")
    run = job / "ckpt_runs"
    run.mkdir()

    def steps(nproc: int, ckpt: Path, *flags: Arg) -> list[dict]:
        log = run / f"{ckpt.name}_{nproc}.json"
        torchrun(job / "train.py", "--steps", 2, "--plan", "even", "--weights", job / "weights.safetensors",
                 "--ckpt-dir", ckpt, "--log-json", log, *flags, nproc=nproc, cwd=run, timeout=600)
        return [json.loads(line) for line in log.read_text().splitlines()]

    whole = steps(4, run / "a", "--ckpt-every", 1)
    for name in ("same", "tp1"):
        shutil.copytree(run / "a", run / name)
        shutil.rmtree(run / name / "step_00000002")
    (same,) = steps(4, run / "same", "--resume")
    (tp1,) = steps(2, run / "tp1", "--resume", "--tp", 1)
    assert same["loss"] == whole[1]["loss"] and same["grad_norm"] == pytest.approx(whole[1]["grad_norm"], rel=1e-12)
    assert tp1["loss"] == pytest.approx(whole[1]["loss"], abs=1e-6)
    assert tp1["grad_norm"] == pytest.approx(whole[1]["grad_norm"], rel=1e-6)


@pytest.mark.slow
@pytest.mark.distributed
def test_tp_on_zero_1_checkpoints_its_state_by_shard_and_resumes_on_zero_0(torchrun: Launcher, root: Path) -> None:
    """tp 2 x 2 stages x dp 2 on ZeRO 1: each replica saves the AdamW state it owns of its tp shards as
    DTensors (global offsets), so resumed from step 1 on ZeRO 0 (each replica holding all of it) step 3,
    whose update reads the state step 2 left, logs the uninterrupted run's loss."""
    import shutil

    job = root / "llama_tp2" if (root / "llama_tp2").exists() else make_job(root, "llama")
    run = job / "zero1_ckpt"
    run.mkdir()

    def steps(ckpt: Path, *flags: Arg) -> list[dict]:
        log = run / f"{ckpt.name}.json"
        torchrun(job / "train.py", "--steps", 3, "--plan", "even", "--weights", job / "weights.safetensors", "--dp", 2,
                 "--lr", 1e-2, "--ckpt-dir", ckpt, "--log-json", log, *flags, nproc=8, cwd=run, timeout=600)
        return [json.loads(line) for line in log.read_text().splitlines()]

    whole = steps(run / "a", "--zero", 1, "--ckpt-every", 1, "--ckpt-keep", 0)
    shutil.copytree(run / "a", run / "z0")
    for later in ("step_00000002", "step_00000003"):
        shutil.rmtree(run / "z0" / later)
    resumed = steps(run / "z0", "--zero", 0, "--resume")
    assert [r["step"] for r in resumed] == [2, 3] and whole[2]["loss"] != whole[1]["loss"]
    assert resumed[1]["loss"] == pytest.approx(whole[2]["loss"], abs=1e-6), (resumed, whole)


def test_what_tp_does_not_compose_with_is_one_line() -> None:
    """A launch of the wrong size (the count to launch is stages x dp x tp), DeepSpeed at convert time;
    every ZeRO stage with replicas passes."""
    from types import SimpleNamespace

    from autopipe.job.settings import ConvertSettings
    from autopipe.planner.stage_plan import StagePlan
    from autopipe.runtime.process.lifecycle import check_launch
    from autopipe.runtime.torch_engine.trainer import check_tp_composes
    from autopipe.runtime.training.optim import TrainConfig

    for zero in range(4):
        check_tp_composes(TrainConfig(zero=zero), 2, SimpleNamespace())
    plan = StagePlan((0, 2, 4, 6, 8), stages=4, chunk_ranks=(0, 1, 2, 3), tp=2)
    with pytest.raises(AutopipeError, match=r"launch with --nproc-per-node 16 with --dp 2 and --tp 2\."):
        check_launch(plan, 2, 2, tp=2)
    with pytest.raises(AutopipeError, match="--tp 2 on DeepSpeed"):
        ConvertSettings(stages=2, tp=2, engine="deepspeed")
    assert ConvertSettings(stages=2, tp=2, engine="auto").engine == "torch"
    with pytest.raises(AutopipeError, match="--tp 16 does not fit nodes of 8"):
        ConvertSettings(stages=1, tp=16, gpus_per_node=8)


def test_what_sequence_parallelism_refuses_is_one_line(tmp_path: Path) -> None:
    """--sequence-parallel without tp, on a sequence tp does not divide, on a model with no token ids:
    one line each, before any model is built (or, for the last two, from the trace). Replicas on any
    ZeRO but 1 (which tp refuses) are accepted."""
    from types import SimpleNamespace

    from autopipe.graph.sequence import TensorSig
    from autopipe.runtime.stage.tensor_parallel import sequence_positions
    from autopipe.runtime.training.preflight import preflight

    def settings(**kw: object) -> SimpleNamespace:
        base = dict(ckpt_dir=str(tmp_path / "ckpt"), resume=None, ckpt_every=0, plan="even", dp=1, tp=2, ep=1, zero=0,
                    engine="torch", data=None, eval_data=None, sequence_parallel=True)
        return SimpleNamespace(**{**base, **kw})

    assert preflight(settings(), world=4) is None  # tp 2 x 2 stages: accepted
    with pytest.raises(AutopipeError, match="--sequence-parallel shards the activations over the tp ranks"):
        preflight(settings(tp=1), world=2)
    for zero in (0, 2, 3):  # replicas: accepted (ZeRO 1 is tp's refusal, at the build)
        preflight(settings(dp=2, zero=zero), world=8)
    preflight(settings(tp=1), world=1)  # one process runs the plan whole: nothing to shard, nothing refused
    from autopipe.job.settings import ConvertSettings

    with pytest.raises(AutopipeError, match="give --tp 2 or more with it"):
        ConvertSettings(stages=2, sequence_parallel=True)
    assert ConvertSettings(stages=2, tp=2, dp=2, zero=2, sequence_parallel=True).sequence_parallel
    assert ConvertSettings(stages=2, tp=2, dp=2, sequence_parallel=True).sequence_parallel
    h = TensorSig("h", (2, 15, 8), "float32")
    odd = SimpleNamespace(infos=[SimpleNamespace(inputs=(TensorSig("ids", (2, 15), "int64"),), outputs=(h,))])
    with pytest.raises(AutopipeError, match="the sequence of 15 tokens does not split over tp 2"):
        sequence_positions(odd, 2)
    images = SimpleNamespace(infos=[SimpleNamespace(inputs=(TensorSig("x", (2, 3, 8, 8), "float32"),), outputs=(h,))])
    with pytest.raises(AutopipeError, match="needs token inputs"):
        sequence_positions(images, 2)


def test_a_run_at_another_tp_layout_than_its_plan_is_warned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A plan priced with sequence parallelism, run without it (or at another tp), still runs its cut, but
    its predictions were for the other layout: train.py's rank 0 says so in one line; matching runs, one
    process, the other ranks and ``autopipe run``'s own check (given ``world``) say nothing."""
    import warnings
    from dataclasses import replace
    from types import SimpleNamespace

    import autopipe
    from autopipe.costs.layer_costs import Profile
    from autopipe.runtime.training.preflight import preflight

    prof = Profile.from_costs([1.0] * 4, param_bytes=[100] * 4, activation_bytes=[10] * 4)
    plan = replace(autopipe.partition(prof, 2, microbatches=4), tp=2, sequence_parallel=True)
    plan.save(tmp_path / "plan.json")

    def said(world: int, rank: int = 0, given: bool = False, **kw: object) -> list[str]:
        base = dict(ckpt_dir=str(tmp_path / "ckpt"), resume=None, ckpt_every=0, plan=str(tmp_path / "plan.json"),
                    dp=1, tp=2, ep=1, zero=0, engine="torch", data=None, eval_data=None, sequence_parallel=True)
        monkeypatch.setenv("WORLD_SIZE", str(world))
        monkeypatch.setenv("RANK", str(rank))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            preflight(SimpleNamespace(**{**base, **kw}), world=world if given else None)
        return [str(w.message) for w in caught]

    assert said(4) == []  # as planned
    (line,) = said(4, sequence_parallel=False)
    assert "was priced for tp 2 with --sequence-parallel, this run has tp 2:" in line
    assert "launch with --tp 2 --sequence-parallel, or re-plan" in line
    assert said(4, rank=1, sequence_parallel=False) == []  # rank 0 alone
    assert said(4, given=True, sequence_parallel=False) == []  # autopipe run's check: the job says it
    assert said(1, tp=1, sequence_parallel=False) == []  # one process runs the plan whole


def test_moe_blocks_are_priced_at_tp_as_the_runtime_runs_them() -> None:
    """At tp 2 the runtime runs Qwen3-MoE's decoder blocks on DTensors around their experts, which run
    whole on each tp rank's local tensors (plan_tensor_parallel on a fake process group of 2 over the
    model traced as a job traces it: each experts call one op); the plan prices them so: the attention's
    all-reduce each way, the parameters divided by the attention's share only. Under expert parallelism
    the runtime runs those blocks replicated, and the plan prices exactly those whole (their seconds and
    parameter bytes as at tp 1, no collectives); the embedding all-reduces either way."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import autopipe
    from autopipe.costs.moe_shape import moe_shapes, with_moe_shapes
    from autopipe.costs.tp import tp_terms
    from autopipe.graph.expert_calls import experts_as_calls
    from autopipe.runtime.stage.tensor_parallel import plan_tensor_parallel

    shapes = load_model(f"{MODELS}:qwen3_moe", device="meta", batch_size=ROWS, seq_len=SEQ)
    with experts_as_calls(shapes.model):
        traced = flatten(shapes.model, shapes.args, shapes.kwargs)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        runs = plan_tensor_parallel(traced, shapes.model, 2, mesh)
        under_ep = plan_tensor_parallel(traced, shapes.model, 2, mesh, expert_parallel=True)
    finally:
        dist.destroy_process_group()
    model, args, kwargs = tp_models.qwen3_moe(ROWS)
    seq = flatten(model, args, kwargs)
    prof = autopipe.profile(seq, args, kwargs, estimate=True, device="h100", reserve=0)
    prof = with_moe_shapes(prof, moe_shapes(model, seq, [(args, kwargs)]))
    moe = {i for i, l in enumerate(prof.layers) if l.moe is not None}
    assert moe and moe == set(runs.local_experts) and not runs.replicated, (moe, runs.local_experts, runs.replicated)
    assert moe == set(under_ep.replicated), (moe, under_ep.replicated)
    plain, at2 = (tp_terms(prof, t, bandwidth=450e9) for t in (1, 2))
    whole = tp_terms(prof, 2, bandwidth=450e9, expert_parallel=True)
    for i in moe:
        assert (at2[i].forward_collectives, at2[i].backward_collectives) == (1, 1), at2[i]
        # the attention's weights halved, the experts' whole: between half and all of tp 1's
        assert plain[i].param_bytes / 2 < at2[i].param_bytes < plain[i].param_bytes, (at2[i], plain[i])
        assert at2[i].forward_compute < plain[i].forward_compute
        assert (whole[i].forward_collectives, whole[i].backward_collectives) == (0, 0), whole[i]
        assert (whole[i].forward_compute, whole[i].param_bytes) == (plain[i].forward_compute, plain[i].param_bytes)
    assert at2[0].forward_collectives == whole[0].forward_collectives == 1  # the vocab-sharded embedding's all-reduce


@pytest.mark.parametrize(("name", "sp"), [("llama", False), ("llama", True), ("qwen3_moe", False), ("qwen3_moe", True),
                                        ("gpt2", False)])
def test_each_layer_issues_the_collectives_its_price_counts(name: str, sp: bool) -> None:
    """Each layer run as one tp 2 rank runs it (shard_layer_ on a fake process group, under sequence
    parallelism on its sequence piece), forward then backward: the collectives it issues, counted by
    torch's CommDebugMode (which sees those DTensor issues inside an op's dispatch too), are the ones
    tp_terms prices for it. Under SP the price used to put each all-reduce's reduce-scatter and
    all-gather both in the pass it came from (the embedding: 2 forward, 0 backward, where it issues 1
    and 1) and nothing for a MoE block run replicated (it issues 1 and 1). GPT-2 (no HF tp_plan): its
    head, kept whole by the derived plan, and its embedding table tied to it issue nothing, and are
    priced so (they were priced as a gathered colwise head and a vocab-sharded table).

    A gathered head (Llama's and Qwen3-MoE's colwise_gather_output, the loss beside it in the last
    layer) issued 2 all-gathers of the logits forward (the loss's op gathered them, then the layer's
    output), 1 priced: it gathers them once now, right after its matmul (settle_partials_). Not yet
    priced as run, and held here to what it does: GPT-2's fused-qkv blocks issue 3 forward and 4
    backward where 2 and 2 are priced."""
    import copy

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import autopipe
    from autopipe.costs.moe_shape import moe_shapes, with_moe_shapes
    from autopipe.costs.tp import tp_terms
    from autopipe.runtime.checks.tp_timing import _inputs, _on_meta, _piece
    from autopipe.runtime.stage.tensor_parallel import plan_tensor_parallel, shard_layer_, swap_parameters_

    from autopipe.graph.expert_calls import experts_as_calls

    model, args, kwargs = getattr(tp_models, name)(2)
    seq = flatten(model, args, kwargs)
    prof = autopipe.profile(seq, args, kwargs, estimate=True, device="h100", reserve=0)
    prof = with_moe_shapes(prof, moe_shapes(model, seq, [(args, kwargs)]))
    priced = tp_terms(prof, 2, sequence_parallel=sp, bandwidth=450e9)
    with experts_as_calls(model):  # as a tp job traces it (build_stage): each experts call one op
        seq = flatten(model, args, kwargs)
    last = len(seq.layers) - 1
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        layout = plan_tensor_parallel(_on_meta(seq), model, 2, mesh, sequence_parallel=sp)
        x = _inputs(seq.pack_inputs(tuple(args), dict(kwargs)))
        issued = []
        for i, layer in enumerate(seq.layers):
            work, made = copy.deepcopy(layer), {}
            shard_layer_(work, i, layout, mesh, made)
            swap_parameters_(work, made)
            with CommDebugMode() as forward:
                out = work(_piece(x, layout.seq_in.get(i, ()), 2))
            leaves = [o for o in (out if isinstance(out, tuple) else (out,)) if isinstance(o, torch.Tensor)
                      and o.requires_grad]  # fmt: skip
            with CommDebugMode() as backward:
                torch.autograd.backward(leaves, [torch.ones_like(o) for o in leaves])
            issued.append((forward.get_total_counts(), backward.get_total_counts()))
            with torch.no_grad():
                x = _inputs(layer(x))
    finally:
        dist.destroy_process_group()
    expected = [(p.forward_collectives, p.backward_collectives) for p in priced]
    if name == "gpt2":  # its fused-qkv blocks (docstring)
        expected = [(3, 4) if 0 < i < last - 1 else e for i, e in enumerate(expected)]
    assert issued == expected, (issued, [(p.forward_collectives, p.backward_collectives) for p in priced])
    if name == "llama":  # a decoder block: Megatron's two all-reduces each way (SP: a reduce-scatter and an all-gather each)
        assert issued[1] == issued[2] == ((4, 4) if sp else (2, 2)), issued


@pytest.mark.parametrize("sp", [False, True])
def test_identical_layers_are_tried_on_dtensors_once(monkeypatch: pytest.MonkeyPatch, sp: bool) -> None:
    """plan_tensor_parallel tries each layer on meta DTensors before any step (a layer DTensor cannot
    run is run replicated). Identical layers (one structure key) placed alike are tried once: a
    4-block Llama makes 4 trials (embedding, a block, norm, head), not 7, and the layout (placements,
    replicated layers and why) is the one trying every layer gives. The same for a 4-block Qwen3-MoE
    traced as a tp job traces it (each experts call one op, numbered per call: the number is no part
    of the structure, or every block was tried again)."""
    from autopipe.graph.expert_calls import experts_as_calls
    from autopipe.runtime.stage.build import to_meta

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from autopipe.runtime.stage import tensor_parallel as tpmod

    calls: list[int] = []
    real = tpmod._meta_trial
    monkeypatch.setattr(tpmod, "_meta_trial", lambda *a, **k: calls.append(1) or real(*a, **k))
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        for name, blocks, distinct in (("llama", 4, 4), ("qwen3_moe", 4, 4)):
            model, args, kwargs = getattr(tp_models, name)(ROWS)
            config = model.config
            config.num_hidden_layers = blocks  # the same tiny model, 4 decoder blocks
            with torch.device("meta"):  # as a job plans: on the meta model
                model = type(model)(config)
            args, kwargs = to_meta(args), to_meta(kwargs)
            with experts_as_calls(model):
                seq = flatten(model, args, kwargs)
            calls.clear()
            once = tpmod.plan_tensor_parallel(seq, model, 2, mesh, sequence_parallel=sp)
            tried = len(calls)
            for info in seq.infos:  # no two layers alike: every layer tried
                object.__setattr__(info, "structure", "")
            calls.clear()
            each = tpmod.plan_tensor_parallel(seq, model, 2, mesh, sequence_parallel=sp)
            assert (tried, len(calls)) == (distinct, len(seq.layers)), (name, tried, len(calls))
            assert (once.dims, once.replicated, once.kinds) == (each.dims, each.replicated, each.kinds), name
            assert (once.local_experts, once.gather_in) == (each.local_experts, each.gather_in), name
            assert len(once.local_experts) == (blocks if name == "qwen3_moe" else 0), once.local_experts
    finally:
        dist.destroy_process_group()


def test_a_moe_block_that_fails_its_trial_runs_replicated_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """A MoE block whose trial fails on meta DTensors runs replicated, and is then neither counted as a
    block with local experts (the log line, the price) nor gathered on entry as one under SP."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from autopipe.graph.expert_calls import experts_as_calls
    from autopipe.runtime.stage import tensor_parallel as tpmod

    shapes = load_model(f"{MODELS}:qwen3_moe", device="meta", batch_size=ROWS, seq_len=SEQ)
    with experts_as_calls(shapes.model):
        seq = flatten(shapes.model, shapes.args, shapes.kwargs)
    real = tpmod._meta_trial
    monkeypatch.setattr(tpmod, "_meta_trial", lambda layer, *a, **k: "a fault" if tpmod._holds_experts_call(layer)
                        else real(layer, *a, **k))  # fmt: skip
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        layout = tpmod.plan_tensor_parallel(seq, shapes.model, 2, mesh, sequence_parallel=True)
    finally:
        dist.destroy_process_group()
    assert set(layout.replicated) == {1, 2} and layout.local_experts == () and layout.gather_in == (len(seq.layers) - 1,)
    assert "run whole on every tp rank" not in layout.describe(seq) and "a fault" in layout.describe(seq)
