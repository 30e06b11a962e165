"""Runtime pieces on their own: layouts, identical weights on every layout, memory per rank,
checkpoint folders, the script writer, mixed precision. No process group except where stated."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import autopipe
from autopipe.errors import AutopipeError, PartitionError
from autopipe.job.script import read_settings, write_train_script
from autopipe.job.settings import JobSettings
from autopipe.planner.plan import load_plan
from autopipe.planner.stage_plan import StagePlan, even_boundaries, schedule_name
from autopipe.runtime import build_reference, build_stage
from autopipe.runtime.checkpoints.folders import latest_checkpoint
from autopipe.runtime.data.sources import TokenData
from autopipe.runtime.stage.weights import init_weights_, materialize_


def tiny_gpt2(n_layer: int = 4, n_embd: int = 32, vocab: int = 128) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(
        n_layer=n_layer, n_embd=n_embd, n_head=2, vocab_size=vocab, n_positions=16, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, use_cache=False))


IDS = torch.zeros(2, 16, dtype=torch.long)


def test_layout_owners_loop_and_v() -> None:
    """Looped schedules deal chunks round-robin; V schedules go down and back up."""
    loop = StagePlan((0, 1, 2, 3, 4, 5, 6, 7, 8), schedule="interleaved1f1b").placed(4)
    assert [loop.owner(c) for c in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    v = StagePlan((0, 1, 2, 3, 4, 5, 6, 7, 8), schedule="zbv").placed(4)
    assert [v.owner(c) for c in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert v.chunks_of(0) == [0, 7]
    assert loop.ranks_holding([0, 7]) == [0, 3]


def test_layout_one_process_holds_every_chunk_of_a_v_plan() -> None:
    """`python train.py` runs a 2-rank zbv plan in one process: every chunk, and so both ends of
    GPT-2's tied embedding, is rank 0's (the V's way back once numbered it -1 and -2, and the tied
    group over ranks [0, -2] failed in new_group before the first step)."""
    one = StagePlan((0, 3, 7, 13, 15), schedule="zbv").placed(1)
    assert [one.owner(c) for c in range(4)] == [0, 0, 0, 0]
    assert one.chunks_of(0) == [0, 1, 2, 3]
    assert one.ranks_holding([0, 14]) == [0]


def test_layout_refuses_mismatched_plans() -> None:
    """Wrong chunk counts for a schedule fail with the fix in the message."""
    with pytest.raises(PartitionError, match="Interleaved1F1B"):
        StagePlan((0, 1, 2, 3, 4), schedule="1f1b").placed(2)
    with pytest.raises(PartitionError, match="virtual_stages=2"):
        StagePlan((0, 1, 2, 3), schedule="zbv").placed(3)
    with pytest.raises(PartitionError, match="evenly"):
        StagePlan((0, 1, 2, 3), schedule="interleaved1f1b").placed(2)


def test_the_runtime_places_every_chunk_where_the_plan_did() -> None:
    """One rule for chunk ownership: for every schedule, stage count and virtual stages the planner
    plans, the StagePlan a rank reads (from the Plan, and from its plan.json) places each chunk on
    the rank the plan charged it to, and a hand-written cut is placed the same way."""
    from autopipe import Profile, partition

    prof = Profile.from_costs([1.0] * 12)
    for schedule, stages, v in (("1f1b", 2, 1), ("gpipe", 3, 1), ("interleaved1f1b", 2, 2), ("interleaved1f1b", 3, 2),
                                ("zbv", 2, 2), ("zbv", 3, 2)):
        plan = partition(prof, stages, schedule=schedule, virtual_stages=v, microbatches=6, bandwidth=None)
        record = plan.stage_plan()
        assert record.chunk_ranks == plan.stage_ranks and record.stages == stages
        assert record.placed(stages).chunk_ranks == plan.stage_ranks, (schedule, stages, v)
        by_hand = StagePlan(plan.boundaries, schedule=schedule).placed(stages)
        assert by_hand.chunk_ranks == plan.stage_ranks, (schedule, stages, v)
        assert [record.placed(stages).chunks_of(r) for r in range(stages)] == [plan.chunks_of(r) for r in range(stages)]


def test_load_plan_reads_a_full_and_a_hand_written_plan_as_one_record(tmp_path) -> None:
    """plan.json written by partition and a hand-written {"boundaries": ...} both load as a StagePlan;
    the full one keeps what the runtime reads (ranks, schedule, placement, dp/zero, promises)."""
    import json

    from autopipe import Profile, partition

    plan = partition(Profile.from_costs([1.0] * 8), 2, schedule="zbv", virtual_stages=2, microbatches=4, bandwidth=None)
    plan.save(tmp_path / "plan.json")
    full = load_plan(tmp_path / "plan.json")
    assert full == plan.stage_plan()
    assert (full.schedule, full.chunk_ranks, full.microbatches, full.step_time) == \
        ("ZBVZeroBubble", plan.stage_ranks, 4, plan.step_time)
    (tmp_path / "hand.json").write_text(json.dumps({"boundaries": [0, 3, 8], "placement": "replica-inner"}))
    hand = load_plan(tmp_path / "hand.json")
    assert (hand.boundaries, hand.stages, hand.chunk_ranks, hand.placement) == ((0, 3, 8), 0, (), "replica-inner")
    assert hand.placed(2).chunk_ranks == (0, 1) and hand.step_time is None
    with pytest.raises(PartitionError, match="not placed"):
        hand.owner(0)


def test_even_boundaries_and_schedule_names() -> None:
    """Even cuts put the longer chunks first; schedule names accept the partitioner's spellings."""
    assert even_boundaries(7, 3) == [0, 3, 5, 7]
    assert even_boundaries(4, 4) == [0, 1, 2, 3, 4]
    assert schedule_name("zbv") == "ZBVZeroBubble"
    assert schedule_name("Interleaved-1F1B") == "Interleaved1F1B"
    with pytest.raises(PartitionError, match="unknown schedule"):
        schedule_name("pipedream")


@pytest.mark.parametrize("chunks", [2, 3])
def test_every_rank_builds_exactly_the_reference_weights(chunks: int) -> None:
    """Per-module seeded init: each rank's tensors equal the whole model's, whatever the layout."""
    reference = dict(build_reference(tiny_gpt2, seed=7).named_parameters(remove_duplicate=False))
    seen: set[str] = set()
    for rank in range(chunks):
        build = build_stage(tiny_gpt2, (IDS,), {"labels": IDS}, chunks, pp_rank=rank, pp_size=chunks, seed=7)
        for name, p in build.params.items():
            assert torch.equal(p, reference[name]), name
            seen.add(name)
        real = {n for n, p in build.model.named_parameters() if p.device.type != "meta"}
        assert real < set(dict(build.model.named_parameters()))  # the rest stays on meta
    assert len(seen) == len(dict(build_reference(tiny_gpt2, seed=7).named_parameters()))


def test_gpt2_init_follows_the_model_s_own_scheme() -> None:
    """HF's _init_weights runs per module: residual projections get GPT-2's 1/sqrt(2·n_layer) std."""
    model = build_reference(lambda: tiny_gpt2(n_layer=8, n_embd=256), seed=0)
    std_proj = float(model.transformer.h[0].mlp.c_proj.weight.detach().std())
    std_fc = float(model.transformer.h[0].mlp.c_fc.weight.detach().std())
    assert std_fc == pytest.approx(0.02, rel=0.05)
    assert std_proj == pytest.approx(0.02 / 4, rel=0.05)
    assert model.lm_head.weight is model.transformer.wte.weight


def test_tensors_without_an_init_function_are_reported() -> None:
    """A raw nn.Parameter no init writes stays NaN and is named, so the caller can fill it."""

    class Raw(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(3))
            self.lin = nn.Linear(3, 3)

    with torch.device("meta"):
        model = Raw()
    new = materialize_(model, ["scale", "lin.weight", "lin.bias"])
    assert init_weights_(model, new, seed=0) == ["scale"]
    assert torch.isfinite(model.lin.weight).all()


def test_constructor_fallback_gives_the_same_values_on_every_layout() -> None:
    """A model whose parameter has no init function still starts identically pipelined or not."""
    from autopipe.runtime import build_reference as ref_build

    def make() -> nn.Module:
        return nn.Sequential(nn.Linear(4, 4), _Scale(), nn.Linear(4, 2))

    x = torch.randn(2, 4)
    with pytest.warns(UserWarning, match="no init function"):
        reference = dict(ref_build(make, seed=3).named_parameters())
    with pytest.warns(UserWarning, match="no init function"):
        build = build_stage(make, (x,), None, [0, 2, 3], pp_rank=0, pp_size=2, seed=3)
    for name, p in build.params.items():
        assert torch.equal(p, reference[name]), name


def test_multihead_attention_takes_its_own_init_without_a_warning() -> None:
    """nn.MultiheadAttention names its init _reset_parameters: it is used (no "no init function" warning
    blaming the user's code, no whole-model build), gives what the constructor gives for the same
    seed, and writes only the tensors asked for (a loaded out_proj.weight is kept)."""
    import warnings

    def make() -> nn.Module:
        return nn.Sequential(nn.MultiheadAttention(8, 2, batch_first=True))

    with torch.device("meta"):
        model = make()
    model[0].out_proj.weight = nn.Parameter(torch.full((8, 8), 0.5))  # as if loaded
    new = materialize_(model, ["0.in_proj_weight", "0.in_proj_bias", "0.out_proj.bias"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert init_weights_(model, new, seed=0) == []
    mha = model[0]
    assert mha.out_proj.weight.eq(0.5).all()
    assert mha.in_proj_bias.eq(0).all() and mha.out_proj.bias.eq(0).all()
    bound = (6 / (8 + 24)) ** 0.5  # xavier_uniform_ of the (24, 8) in_proj_weight
    assert mha.in_proj_weight.abs().max() <= bound and mha.in_proj_weight.std() > bound / 3


class _Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.g = nn.Parameter(torch.randn(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.g


MEMORY_PROBE = textwrap.dedent('''
    import sys, torch
    from transformers import GPT2Config, GPT2LMHeadModel
    from autopipe.runtime import build_stage, build_reference
    def make():
        return GPT2LMHeadModel(GPT2Config(n_layer=8, n_embd=768, n_head=8, vocab_size=4096, n_positions=16,
                                          bos_token_id=0, eos_token_id=0, use_cache=False))
    ids = torch.zeros(1, 16, dtype=torch.long)
    # warm up: load the tracing machinery so its own allocations are in the baseline
    build_stage(lambda: torch.nn.Sequential(torch.nn.Linear(2, 2)), (torch.zeros(1, 2),), None, 1, pp_rank=0, pp_size=1)
    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current RSS
    before = status("VmRSS")
    if sys.argv[1] == "whole":
        share = sum(4 * p.numel() for p in build_reference(make).parameters())
    else:
        build = build_stage(make, (ids,), {"labels": ids}, 4, pp_rank=int(sys.argv[1]), pp_size=4)
        share = sum(4 * p.numel() for p in build.params.values())
    print(status("VmHWM") - before, share)
''')


def _peak_growth(which: str) -> tuple[int, int]:
    """(peak RSS growth while building, bytes of the parameters built) in a fresh process."""
    out = subprocess.run([sys.executable, "-c", MEMORY_PROBE, which], check=False, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    growth, share = out.stdout.strip().splitlines()[-1].split()
    return int(growth), int(share)


@pytest.mark.slow  # two fresh processes
def test_peak_memory_per_rank_is_its_share_not_the_whole_model() -> None:
    """Building rank 1 of 4 peaks at its own parameters plus tracing overhead, not the whole model."""
    whole, model_bytes = _peak_growth("whole")
    stage, share = _peak_growth("1")
    assert whole > 0.9 * model_bytes  # the probe does see the weights
    assert share < 0.4 * model_bytes  # rank 1 holds 3 of 11 layers
    # its share, plus what tracing the graph costs (~16 MB here), and far below the whole model
    assert stage < share + 0.15 * model_bytes, (stage, share, model_bytes)
    assert stage < 0.5 * whole, (stage, whole)


def test_latest_checkpoint_ignores_half_written_folders(tmp_path: Path) -> None:
    """Only complete step folders (renamed, with meta.json) count; a crash's .tmp does not."""
    for name, meta in [("step_00000001", True), ("step_00000002", True), ("step_00000003.tmp", True), ("step_00000004", False)]:
        (tmp_path / name).mkdir()
        if meta:
            (tmp_path / name / "meta.json").write_text(json.dumps({"step": int(name[5:13])}))
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000002"
    assert latest_checkpoint(tmp_path / "missing") is None


def test_token_data_is_a_function_of_seed_and_step(tmp_path: Path) -> None:
    """Same (seed, step) -> same batch; replicas split the global batch; text files are bytes."""
    data = TokenData(None, vocab_size=100, seq_len=8, seed=1)
    full = data.batch(5, 4)
    assert torch.equal(full, data.batch(5, 4))
    assert torch.equal(torch.cat([data.batch(5, 4, replica=r, replicas=2) for r in range(2)]), full)
    assert not torch.equal(full, data.batch(6, 4))
    text = tmp_path / "corpus.txt"
    text.write_text("hello pipeline " * 20)
    batch = TokenData(text, vocab_size=256, seq_len=8, seed=0).batch(0, 2)
    assert batch.shape == (2, 8) and int(batch.max()) < 256
    with pytest.raises(AutopipeError, match="vocabulary"):
        TokenData(text, vocab_size=50, seq_len=8)


@pytest.mark.slow  # runs train.py --help in a process
def test_write_train_script_fills_settings_and_refuses_bad_ones(tmp_path: Path) -> None:
    """The script compiles, carries the job's settings at the top, and bad settings fail early."""
    path = write_train_script(tmp_path, JobSettings(model="gpt2", stages=4, microbatches=8, schedule="1f1b", batch_size=2, seq_len=64, dtype="bf16", seed=3))
    text = path.read_text()
    assert path.name == "train.py"
    settings = read_settings(path)
    assert {k: settings[k] for k in ("model", "schedule", "microbatches", "seq_len", "dtype", "seed")} == \
        {"model": "gpt2", "schedule": "1f1b", "microbatches": 8, "seq_len": 64, "dtype": "bf16", "seed": 3}
    assert "    microbatches: int = 8  # per step" in text  # its line, with its help
    help_out = subprocess.run([sys.executable, str(path), "--help"], check=False, capture_output=True, text=True, timeout=120)
    assert help_out.returncode == 0 and "--resume" in help_out.stdout and "--verify" in help_out.stdout
    with pytest.raises(PartitionError):
        write_train_script(tmp_path, JobSettings(model="gpt2", stages=2, microbatches=4, schedule="nope"))
    with pytest.raises(AutopipeError, match="engine"):
        write_train_script(tmp_path, JobSettings(model="gpt2", stages=2, microbatches=4, schedule="1f1b", engine="megatron"))


def test_stages_load_their_own_keys_from_safetensors(tmp_path: Path) -> None:
    """--weights: each rank reads only its tensors; a tied tensor saved once (as HF does) fills both names."""
    from safetensors.torch import save_file

    source = build_reference(tiny_gpt2, seed=11)
    state = {n: p.detach().clone() for n, p in source.named_parameters()}  # wte saved, lm_head (tied) not
    assert "lm_head.weight" not in state
    save_file(state, str(tmp_path / "model.safetensors"))
    for rank in range(2):
        build = build_stage(tiny_gpt2, (IDS,), {"labels": IDS}, 2, pp_rank=rank, pp_size=2, seed=0, weights=str(tmp_path))
        for name, p in build.params.items():
            assert torch.equal(p, source.get_parameter(name)), name


def test_peak_memory_window_sees_what_the_step_allocates() -> None:
    """PeakMemory: each reset starts a window; 64 MiB of fresh pages touched in it show, above the baseline."""
    import mmap

    from autopipe.runtime.logs.peak import PeakMemory, resident_bytes

    peak = PeakMemory(torch.device("cpu"))
    assert peak.supported
    size = 64 * 2**20
    peak.reset()
    # An anonymous mapping, not torch.ones: an earlier test may have called keep_freed_memory(), and
    # then a tensor can reuse pages the heap already holds resident (seen in CI: the window read 0).
    held = mmap.mmap(-1, size)
    torch.frombuffer(held, dtype=torch.uint8).fill_(1)  # touched pages: resident
    during = peak.read()
    assert during >= resident_bytes() - peak.baseline - 2**20 and during >= size * 0.9
    held.close()


def test_grad_norm_is_torch_s_and_never_holds_a_float64_copy_of_a_large_gradient() -> None:
    """global_grad_norm (one process) equals torch's clip_grad_norm_ total and the exact float64 norm
    on a plain model, leaves out what another rank counts, and clipping by it gives torch's clipped
    gradients. Its float64 sums go a slice at a time: summing a whole 1M-element gradient at once
    allocated 4x its bytes (a float64 copy and its square), 48 MiB of resident peak at rank 0's norm
    for the showcase's 16384 x 192 tied embedding, which no term of the plan charges."""
    import copy

    from autopipe.costs.measure import peak_bytes
    from autopipe.runtime.process.comm import Comm
    from autopipe.runtime.training.grads import clip_grads_, global_grad_norm

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(8192, 128), nn.Linear(128, 64), nn.LayerNorm(64))
    model(torch.randint(0, 8192, (4, 32))).pow(2).mean().backward()
    plain = copy.deepcopy(model)  # deepcopy leaves .grad behind
    for p, q in zip(model.parameters(), plain.parameters()):
        q.grad = p.grad.clone()
    params = dict(model.named_parameters())
    cpu = torch.device("cpu")
    comm = Comm(cpu)

    peak, norm = peak_bytes(lambda: global_grad_norm(params, set(), None, comm), cpu)
    exact = torch.cat([p.grad.double().reshape(-1) for p in plain.parameters()]).norm()
    assert norm.dtype == torch.float64 and norm.item() == pytest.approx(exact.item(), rel=1e-12)
    rest = global_grad_norm(params, {"0.weight"}, None, comm)
    assert rest.item() == pytest.approx(torch.cat([p.grad.double().reshape(-1) for p in plain[1:].parameters()]).norm().item(), rel=1e-12)
    big = params["0.weight"].grad
    assert big.numel() == 1 << 20 and peak < big.nbytes // 2, peak  # at once: 4 * big.nbytes

    total = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5)  # torch's own, in float32
    assert norm.item() == pytest.approx(total.item(), rel=1e-6)
    clip_grads_(params.values(), norm, 0.5)
    for (name, p), q in zip(params.items(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=0, msg=name)


def test_step_log_carries_the_plan_s_predictions_only_for_the_planned_run(tmp_path: Path) -> None:
    """--log-json lines hold predicted step time and per-rank memory beside the measured ones, when
    the run uses the plan's schedule, micro-batches and stage count; otherwise none."""
    import json as _json

    from autopipe.runtime.logs.steps import StepLogger, StepStats, predictions

    plan = StagePlan((0, 2, 4), schedule="1f1b", microbatches=4, stages=2, chunk_ranks=(0, 1), step_time=1.5,
                     rank_memory=(100, 200))
    assert predictions(plan, schedule="gpipe", microbatches=4, pp_size=2) is None
    assert predictions(plan, schedule="1F1B", microbatches=8, pp_size=2) is None
    assert predictions(StagePlan((0, 2, 4)), schedule="1f1b", microbatches=4, pp_size=2) is None  # hand-written
    assert predictions(2, schedule="1f1b", microbatches=4, pp_size=2) is None  # --plan even
    pred = predictions(plan, schedule="1F1B", microbatches=4, pp_size=2)
    log = StepLogger(0, json_path=tmp_path / "log.json", quiet=True, predicted=pred)
    log.step(StepStats(step=1, loss=1.0, lr=0.1, grad_norm=1.0, step_time=1.4, tokens_per_s=1.0,
                       stage_times=[1.4, 1.3], peak_memory=[110, 190]))
    record = _json.loads((tmp_path / "log.json").read_text())
    assert record["peak_memory"] == [110, 190] and record["predicted_peak_memory"] == [100, 200]
    assert record["predicted_step_time"] == 1.5 and record["step_time"] == 1.4


def test_preallocated_adamw_state_is_what_adamw_makes_itself() -> None:
    """preallocate_ gives each parameter zero gradients and the exact state AdamW would create (same keys,
    shapes, dtypes, devices), so updates from it are bit-identical to lazily initialised AdamW."""
    from autopipe.runtime.training.optim import TrainConfig, make_optimizer, preallocate_

    torch.manual_seed(0)
    a, b = nn.Linear(8, 4), nn.Linear(8, 4)
    b.load_state_dict(a.state_dict())
    cfg = TrainConfig(lr=0.1)
    lazy = make_optimizer(dict(a.named_parameters()), cfg)
    eager = make_optimizer(dict(b.named_parameters()), cfg)
    preallocate_(eager)
    assert all(p.grad is not None and not p.grad.any() for p in b.parameters())
    grads = []
    for _ in range(3):
        x = torch.randn(5, 8)
        for model, opt, zero_to_none in ((a, lazy, True), (b, eager, False)):
            model(x).square().sum().backward()
            grads.append(model.weight.grad.clone())
            opt.step()
            opt.zero_grad(set_to_none=zero_to_none)
        assert torch.equal(grads[-1], grads[-2])
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
        sa, sb = lazy.state[pa], eager.state[pb]
        assert sa.keys() == sb.keys()
        for k in sa:
            assert (sa[k].shape, sa[k].dtype, sa[k].device) == (sb[k].shape, sb[k].dtype, sb[k].device)
            assert torch.equal(sa[k], sb[k]), k


def test_a_local_folder_with_safetensors_builds_each_stage_from_its_file(tmp_path: Path) -> None:
    """A saved BERT masked LM (its tied decoder and its buffers position_ids/token_type_ids are not in
    the file): every stage of a 2-stage build holds exactly what from_pretrained loads."""
    from transformers import BertConfig, BertForMaskedLM

    from autopipe.runtime import model_factory

    saved = BertForMaskedLM(BertConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=16,
                                       vocab_size=64, max_position_embeddings=16))
    saved.save_pretrained(tmp_path / "bert")
    loaded = BertForMaskedLM.from_pretrained(tmp_path / "bert")
    source = model_factory(str(tmp_path / "bert"), batch_size=2, seq_len=8)
    assert source.weights == str(tmp_path / "bert")
    seen: set[str] = set()
    for rank in range(2):
        build = build_stage(source.factory, source.args, source.kwargs, 2, pp_rank=rank, pp_size=2, weights=source.weights)
        for name, t in build.model.state_dict().items():  # every name, tied ones and buffers included
            if t.device.type != "meta":
                assert torch.equal(t, loaded.state_dict()[name]), name
                seen.add(name)
    assert seen == set(loaded.state_dict())  # the tied decoder and the buffers too


def test_a_torch_whose_stages_cannot_receive_integers_is_told_before_any_rank_talks(monkeypatch) -> None:
    """torch 2.6-2.12 make every received buffer require grad; GPT-2's labels (int64) cross every cut,
    so a 2-rank pipeline failed inside torch's stage setup on one rank and its peer waited (the CPU
    reserve probe hung 10 minutes under torch 2.11). Such a torch gets one line naming the tensor,
    the cut and the ways out; a cut carrying only floats, or one process, still runs."""
    from autopipe.errors import AutopipeError
    from autopipe.runtime.torch_engine import pipeline as engine

    model = tiny_gpt2()
    seq = autopipe.flatten(model, (IDS,), {"labels": IDS})
    two = StagePlan((0, 3, len(seq.layers)), schedule="1f1b").placed(2)
    for version, receives in (("2.13.0a0+git1a2b3c", True), ("2.13.0.dev20260101", True), ("2.15.0", True),
                              ("2.12.1", False), ("2.11.0+cu130", False)):  # NVIDIA's images, nightlies
        monkeypatch.setattr(torch, "__version__", version)
        assert engine.receives_integers() is receives, version
    monkeypatch.undo()
    if engine.receives_integers():  # torch >= 2.13 (CI's): the cut runs
        engine.check_cuts_for_this_torch(seq, two)
    monkeypatch.setattr(engine, "receives_integers", lambda: False)
    with pytest.raises(AutopipeError, match=r"\(int64\) crosses the cut before layer 3 .*torch >= 2\.13"):
        engine.check_cuts_for_this_torch(seq, two)
    engine.check_cuts_for_this_torch(seq, StagePlan((0, 3, len(seq.layers)), schedule="1f1b").placed(1))
    floats = autopipe.flatten(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)), (torch.randn(2, 4),))
    engine.check_cuts_for_this_torch(floats, StagePlan((0, 1, 3), schedule="1f1b").placed(2))


HEAP_PROBE = textwrap.dedent('''
    import resource, sys, torch
    from autopipe.costs import devices
    faults = 0
    if sys.argv[1] == "steady":  # the other probes only read which setting the call under test made
        assert devices.steady_heap()
        def step():  # a step's activations: twenty 8 MiB blocks live at once, all freed at its end
            xs = [torch.ones(2 << 20) for _ in range(20)]
            return sum(float(x[0]) for x in xs)
        for _ in range(3):
            step()
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(10):
            step()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
    if sys.argv[1] == "profile":  # the profiler fixes the heap on a CPU
        import autopipe
        seq = autopipe.flatten(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()), (torch.zeros(2, 8),))
        autopipe.profile(seq, (torch.zeros(2, 8),), repeats=2, warmup=1, progress=False)
    if sys.argv[1] in ("dist", "exact"):
        from autopipe.runtime import init_dist
        init_dist(dp=1, exact_memory=sys.argv[1] == "exact")
    print(faults, devices._HEAP_STEADY, devices.heap_kept())
''')


def _heap(which: str) -> tuple[int, bool, bool]:
    alone = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "MASTER_ADDR", "RANK")}  # a world of one
    out = subprocess.run([sys.executable, "-c", HEAP_PROBE, which], check=False, capture_output=True, text=True, timeout=300,
                         env=alone)
    assert out.returncode == 0, out.stderr[-2000:]
    faults, steady, kept = out.stdout.strip().splitlines()[-1].split()
    return int(faults), steady == "True", kept == "True"


@pytest.mark.slow  # six fresh processes
def test_steady_heap_stops_a_loop_of_steps_page_faulting_and_profiler_and_ranks_set_it() -> None:
    """Under ``steady_heap`` a loop that makes and frees a step's large tensors reuses their pages:
    no page faults after the first steps, in every fresh process. Under glibc's own settings the
    same loop page-faulted all 160 MiB again each step (409,290 faults in 10 steps) in 6 of 8 fresh
    processes and none in 2 (whether glibc hands the heap's top back depends on what sits above the
    freed blocks), so that side is not asserted; a steady_heap that set nothing fails here in most
    runs of each probe. The profiler and each CPU rank fix the heap so, and exact memory keeps its
    own settings (``keep_freed_memory``)."""
    for _ in range(2):
        faults, steady_after, _ = _heap("steady")
        assert steady_after and faults < 4096, faults  # 409,600 pages touched in the 10 steps
    assert _heap("default")[1] is False
    assert _heap("profile")[1:] == (True, False)
    assert _heap("dist")[1:] == (True, False)
    assert _heap("exact")[1:] == (False, True)


def test_a_ds_config_whose_zero_stage_disagrees_with_train_py_is_one_line(tmp_path: Path) -> None:
    """train.py's zero (the plan's, or --zero) and a ds_config's zero_optimization.stage must agree:
    a ZeRO-1 file under a ZeRO-0 train.py is one line naming both, not a silent override."""
    import json
    from types import SimpleNamespace

    from autopipe.runtime.deepspeed_engine.settings import ds_config, load_ds_config
    from autopipe.runtime.training.optim import TrainConfig

    cfg = ds_config(TrainConfig(microbatches=2), rows=1, dp=2)
    cfg["zero_optimization"] = {"stage": 1}
    (tmp_path / "ds.json").write_text(json.dumps(cfg))
    with pytest.raises(AutopipeError, match=r"runs ZeRO stage 1 but train.py's zero is 0; make them agree \(--zero 1"):
        load_ds_config(str(tmp_path / "ds.json"), TrainConfig(microbatches=2), SimpleNamespace(batch_size=1, zero=0), 2)
    agreed, _ = load_ds_config(str(tmp_path / "ds.json"), TrainConfig(microbatches=2), SimpleNamespace(batch_size=1, zero=1), 2)
    assert agreed["zero_optimization"]["stage"] == 1
