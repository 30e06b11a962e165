"""Activation recompute: same numbers as without it, less memory kept, and the profiler's figures exact.

Real numerics in fp32 with dropout on, so a recomputation that drew other masks would show in the
gradients. The pipelined runs use torch's schedules in real processes (gloo, CPU).
"""

from __future__ import annotations

import contextlib
import gc
import json
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from _launch import Launcher
from torch import nn

import autopipe
from autopipe.costs.layer_costs import Profile
from autopipe.costs.measure import LiveBytes, as_tuple
from autopipe.graph.recompute import RecomputeError, chunk_modes, run_layer
from autopipe.planner.stage_plan import StagePlan, even_boundaries
from autopipe.report.tables import profile_table
from autopipe.runtime import build_stage
from autopipe.runtime.stage.build import PipeChunk
from autopipe.units import format_bytes

B, T, V = 2, 8, 96
TOL = 1e-5


def _gpt2() -> tuple[nn.Module, dict[str, Any]]:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=V, n_positions=32,
                     resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg), {"use_cache": False}


def _llama() -> tuple[nn.Module, dict[str, Any]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=48, max_position_embeddings=32, attention_dropout=0.1)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, -2:] = 0
    return LlamaForCausalLM(cfg), {"attention_mask": mask, "use_cache": False}


ARCHS = {"gpt2": _gpt2, "llama": _llama}


@pytest.fixture(scope="module", params=sorted(ARCHS))
def flat(request: pytest.FixtureRequest) -> SimpleNamespace:
    """A tiny HF model with dropout on, flattened in training mode, and one micro-batch."""
    torch.manual_seed(0)
    model, kwargs = ARCHS[request.param]()
    model.train()
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(1))
    kwargs["labels"] = ids.clone()
    # dropout makes two eager runs differ, so the trace cannot be validated against one
    seq = autopipe.flatten(model, (ids,), kwargs, validate=False)
    return SimpleNamespace(name=request.param, model=model, seq=seq, args=(ids,), kwargs=kwargs)


def _loss_and_grads(flat: SimpleNamespace, mode: str, seed: int = 5) -> tuple[float, dict[str, torch.Tensor]]:
    chunk = PipeChunk(flat.seq.layers, 0, (0, len(flat.seq.layers)), recompute=mode)
    for p in flat.model.parameters():
        p.grad = None
    torch.manual_seed(seed)
    out = flat.seq.unpack_outputs(chunk(*flat.seq.pack_inputs(flat.args, flat.kwargs)))
    out.loss.backward()
    return float(out.loss.detach()), {n: p.grad.clone() for n, p in flat.model.named_parameters() if p.grad is not None}


def _act(prof: Profile, mode: str) -> list[int]:
    return [l.activation_bytes if mode == "none" else l.recompute[mode].activation_bytes for l in prof.layers]


def _kept_after_forward(seq: Any, x: Any, mode: str) -> int:
    """Bytes a real forward under ``mode`` leaves alive for backward, seen by the allocation tracker
    (LiveBytes), not by the profiler's ledger: every storage allocated during the forward, the
    inputs' copies included, still alive when only the autograd graph is referenced."""
    live = LiveBytes()
    with live:
        copies: dict[int, torch.Tensor] = {}
        h: Any = tuple(copies.setdefault(t.untyped_storage()._cdata, t.clone()) for t in as_tuple(x))
        h = h if isinstance(x, tuple) else h[0]
        del copies
        for layer in seq.layers:
            h = run_layer(layer, h, mode)
    graph = [t.grad_fn for t in as_tuple(h) if t.grad_fn is not None]  # what backward needs, nothing else
    del h
    gc.collect()
    kept = sum(n for ref, n in live._live.values() if not ref.expired())
    del graph
    return kept


# ---- (a) the flattened sequence: same loss and gradients, dropout masks replayed -------------------


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_sequence_under_recompute_gives_the_same_loss_and_gradients(flat: SimpleNamespace, mode: str) -> None:
    """Every layer checkpointed: loss and every parameter gradient equal the plain run's within 1e-5."""
    loss, grads = _loss_and_grads(flat, "none")
    loss_r, grads_r = _loss_and_grads(flat, mode)
    assert loss_r == pytest.approx(loss, abs=TOL)
    assert grads_r.keys() == grads.keys() and len(grads) > 10
    for name, g in grads.items():
        torch.testing.assert_close(grads_r[name], g, atol=TOL, rtol=0, msg=name)
    # dropout really draws masks here, so a recomputation with other masks would have shown above
    assert abs(_loss_and_grads(flat, "none", seed=6)[0] - loss) > 1e-4


def test_full_recompute_keeps_only_each_layer_s_input(flat: SimpleNamespace) -> None:
    """Under full, what autograd holds is exactly the layers' input tuples (each storage once)."""
    packed = flat.seq.pack_inputs(flat.args, flat.kwargs)
    inputs: dict[int, torch.UntypedStorage] = {}  # held, so no address is reused while counting
    x: Any = packed
    with torch.no_grad():
        for layer in flat.seq.layers:
            for t in x if isinstance(x, tuple) else (x,):
                inputs.setdefault(t.untyped_storage()._cdata, t.untyped_storage())
            x = layer(x)
    kept: dict[str, dict[int, int]] = {}
    params = {p.untyped_storage()._cdata for p in flat.model.parameters()}
    for mode in ("none", "full"):
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.untyped_storage()._cdata not in params:
                seen[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
            return t

        chunk = PipeChunk(flat.seq.layers, 0, (0, len(flat.seq.layers)), recompute=mode)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = chunk(*packed)
        kept[mode] = seen
        del out
    # every layer's input tuple, a storage passed through several layers (the mask) once
    assert sum(kept["full"].values()) == sum(st.nbytes() for st in inputs.values())
    assert sum(kept["none"].values()) > 4 * sum(kept["full"].values())


def test_profiled_recompute_bytes_of_a_real_model_equal_what_its_forward_keeps(flat: SimpleNamespace) -> None:
    """GPT-2 / Llama: for each mode, the layers' figures sum to what a real forward under it keeps,
    and a transformer block keeps less under selective and far less under full."""
    prof = autopipe.profile(flat.seq, flat.args, flat.kwargs, warmup=0, repeats=1, progress=False)
    packed = flat.seq.pack_inputs(flat.args, flat.kwargs)
    for mode in ("none", "selective", "full"):
        torch.manual_seed(0)
        assert sum(_act(prof, mode)) == _kept_after_forward(flat.seq, packed, mode), mode
    block = prof.layers[1]
    assert block.recompute["full"].activation_bytes < block.recompute["selective"].activation_bytes
    assert block.recompute["selective"].activation_bytes < block.activation_bytes


# ---- (b) pipelined training: every schedule, split backward included ----------------------------

STEPS, MICRO, PP_ROWS, PP_SEQ = 3, 4, 2, 16
SCHEDULES = {"gpipe": 2, "1f1b": 2, "interleaved1f1b": 4, "zbv": 4, "interleavedzb": 4}  # -> chunks

# One torchrun job trains every schedule three times (none, full, selective) from the same weights and
# the same RNG stream, through the runtime train.py uses (build_stage + Trainer), and records the
# losses, every gradient just before each optimizer step (AdamW would hide a constant scale error),
# and the bytes autograd held in step 1. One job, not 15: starting torch and transformers in two
# processes costs more than all the steps.
PIPE_WORKER = textwrap.dedent('''
    import contextlib, functools, json, sys
    import torch
    import autopipe.runtime as rt

    folder, out, steps, micro, rows, seq = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:7])
    schedules = json.loads(sys.argv[7])
    env = rt.init_dist(dp=1)
    # dropout=None keeps the config's dropout (as train.py does)
    source = rt.model_factory(folder, batch_size=rows, seq_len=seq, dropout=None)
    data = rt.TokenData(None, vocab_size=source.vocab_size, seq_len=seq, seed=0)
    results = {}
    for schedule, chunks in schedules.items():
        for mode in ("none", "full", "selective"):
            torch.manual_seed(100 + env.rank)  # the same dropout stream for every mode
            build = rt.build_stage(source.factory, source.args, source.kwargs, chunks, pp_rank=env.pp_rank,
                                   pp_size=env.pp_size, schedule=schedule, seed=0, recompute=mode)
            env.tied_groups = {}  # a new layout: its own tied-weight groups, not the last one's
            trainer = rt.Trainer(build, env, rt.TrainConfig(steps=steps, microbatches=micro, lr=1e-3, grad_clip=0.0))
            grads = []
            trainer.optimizer.register_step_pre_hook(lambda *_: grads.append(
                {n: p.grad.clone() for n, p in trainer.params.items() if p.grad is not None}))
            static = {p.untyped_storage()._cdata for p in build.model.parameters()}
            held = {}

            def pack(t):
                if t.untyped_storage()._cdata not in static:
                    held.setdefault(t.untyped_storage()._cdata, t.untyped_storage())
                return t

            losses = []
            # per chunk: forwards of its last layer in the second step (the first also infers shapes),
            # recomputations included; a pre-hook, since checkpoint stops a recomputation early
            calls = {c.index: 0 for c in trainer.engine.chunks}

            def count(module, _args, index):
                calls[index] += 1

            counters = [c.layers[-1].register_forward_pre_hook(functools.partial(count, index=c.index))
                        for c in trainer.engine.chunks]
            for step in range(steps):
                args, kwargs = source.batch(data.batch(step, rows * micro), rows * micro, step=step)
                hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if step == 0 else contextlib.nullcontext()
                if step == 1:
                    calls = dict.fromkeys(calls, 0)
                with hooks:
                    losses.append(trainer.step(args, kwargs).loss)
                if step == 1:
                    for counter in counters:
                        counter.remove()
            results[f"{schedule}/{mode}"] = dict(losses=losses, grads=grads, modes=[c.recompute for c in trainer.engine.chunks],
                                                 held=sum(st.nbytes() for st in held.values()), calls=calls)
    torch.save(results, f"{out}/rank{env.rank}.pt")
    env.close()
''')


def _tiny_gpt2_folder(root: Path, dropout: float) -> Path:
    from transformers import GPT2Config

    GPT2Config(architectures=["GPT2LMHeadModel"], n_layer=4, n_embd=32, n_head=2, vocab_size=128, n_positions=PP_SEQ,
               resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=0, eos_token_id=0,
               use_cache=False).save_pretrained(root / "tiny")
    return root / "tiny"


@pytest.fixture(scope="module")
def pipelined(torchrun: Launcher, tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    """Per rank: schedule/mode -> losses, gradients before each step, chunk modes, bytes held."""
    root = tmp_path_factory.mktemp("recompute-pp")
    folder = _tiny_gpt2_folder(root, dropout=0.1)
    (root / "worker.py").write_text(PIPE_WORKER)
    torchrun(root / "worker.py", folder, root, STEPS, MICRO, PP_ROWS, PP_SEQ, json.dumps(SCHEDULES), nproc=2, cwd=root)
    return {rank: torch.load(root / f"rank{rank}.pt", weights_only=False) for rank in (0, 1)}


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_recomputation_runs_a_layer_once_more_per_backward_pass(pipelined: dict[int, dict[str, Any]], schedule: str,
                                                                mode: str) -> None:
    """Per micro-batch a recomputed layer runs forward once, then once per backward pass: once more for
    1F1B-like schedules, twice more on zero-bubble ones (input pass, then one shared recomputation for
    all weight groups, not one per group: the engine wraps the weight pass in shared_recompute) except
    in chunk 0, whose backward torch does not split (no input gradient to hurry)."""
    for results in pipelined.values():
        for chunk, calls in results[f"{schedule}/{mode}"]["calls"].items():
            passes = 2 if schedule in ("zbv", "interleavedzb") and chunk > 0 else 1
            assert results[f"{schedule}/none"]["calls"][chunk] == MICRO
            assert calls == MICRO * (1 + passes), (chunk, calls)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_pipelined_recompute_matches_training_without_it(pipelined: dict[int, dict[str, Any]], schedule: str,
                                                         mode: str) -> None:
    """2 ranks, dropout on: per-step losses and every gradient before every optimizer step equal the
    run without recompute within 1e-5, every chunk runs the mode, and autograd holds far less."""
    for rank, results in pipelined.items():
        base, run = results[f"{schedule}/none"], results[f"{schedule}/{mode}"]
        assert run["losses"] == pytest.approx(base["losses"], abs=TOL)
        assert len(run["grads"]) == len(base["grads"]) == STEPS
        for step, (grads, ref) in enumerate(zip(run["grads"], base["grads"])):
            assert grads.keys() == ref.keys() and len(ref) > 5
            for name, g in ref.items():
                torch.testing.assert_close(grads[name], g, atol=TOL, rtol=0, msg=f"rank {rank} step {step} {name}")
        assert {m for chunk in run["modes"] for m in chunk} == {mode}
        assert run["held"] < base["held"] / 5, (rank, run["held"], base["held"])


@pytest.mark.slow
@pytest.mark.distributed
def test_pipelined_runs_draw_the_same_dropout_masks_on_every_layout(pipelined: dict[int, dict[str, Any]]) -> None:
    """Dropout is seeded per layer and micro-batch (MicrobatchSeeds): a V of 4 chunks and 2 plain
    stages, which run the layers in other orders, draw the same masks and lose the same."""
    for rank, results in pipelined.items():
        assert results["zbv/none"]["losses"] == pytest.approx(results["gpipe/none"]["losses"], abs=TOL), rank


@pytest.mark.slow
@pytest.mark.distributed
def test_train_script_recompute_flag_trains_like_the_unpipelined_model(torchrun: Launcher, tmp_path: Path) -> None:
    """train.py --recompute selective on ZBV (split backward), 2 ranks: --verify passes (every gradient
    of step 1 against the untouched model, which rank 1, holding neither end of the V, runs on the
    batch ranks 0 read), the log names the mode, losses equal plain training."""
    from autopipe.job.script import write_train_script
    from autopipe.job.settings import JobSettings
    from autopipe.runtime import TokenData, TrainConfig, build_reference, model_factory
    from autopipe.runtime.checks.reference import ReferenceTrainer

    folder = _tiny_gpt2_folder(tmp_path, dropout=0.0)  # --verify compares with a reference: no dropout
    write_train_script(tmp_path / "train.py", JobSettings(model=str(folder), stages=2, microbatches=MICRO, schedule="zbv", batch_size=PP_ROWS, seq_len=PP_SEQ))
    source = model_factory(str(folder), batch_size=PP_ROWS, seq_len=PP_SEQ)
    num_layers = len(build_stage(source.factory, source.args, source.kwargs, 1, pp_rank=0, pp_size=1).seq.layers)
    (tmp_path / "plan.json").write_text(json.dumps({"boundaries": even_boundaries(num_layers, 4)}))  # a V: 2 chunks per rank
    proc = torchrun(tmp_path / "train.py", "--steps", STEPS, "--lr", "1e-3", "--plan", tmp_path / "plan.json",
                    "--recompute", "selective", "--verify", "--ckpt-dir", tmp_path / "ckpt",
                    "--log-json", tmp_path / "log.json", nproc=2, cwd=tmp_path)
    assert "verify:" in proc.stdout and "recompute selective selective selective selective" in proc.stdout
    logged = {r["step"]: r["loss"] for r in map(json.loads, (tmp_path / "log.json").read_text().splitlines())}

    data = TokenData(None, vocab_size=source.vocab_size, seq_len=PP_SEQ, seed=0)
    reference = ReferenceTrainer(build_reference(source.factory, seed=0), TrainConfig(steps=STEPS, microbatches=MICRO, lr=1e-3))
    rows = PP_ROWS * MICRO
    expected = [reference.step(*source.batch(data.batch(s, rows), rows, step=s), microbatches=MICRO) for s in range(STEPS)]
    assert [logged[s + 1] for s in range(STEPS)] == pytest.approx(expected, abs=TOL)


# ---- (c) the profiler's figures on layers of known size ------------------------------------------


class MLP(nn.Module):
    """Linear(d, 4d) -> GELU -> Linear(4d, d): what autograd keeps is known exactly."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class MLPStack(nn.Module):
    def __init__(self, d: int, n: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MLP(d) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


ROWS, D = 4, 16
UNIT = ROWS * D * 4  # bytes of one (ROWS, D) fp32 tensor


@pytest.fixture(scope="module")
def mlp3() -> SimpleNamespace:
    torch.manual_seed(0)
    model = MLPStack(D, 3)
    x = torch.randn(ROWS, D)
    seq = autopipe.flatten(model, (x,))
    assert len(seq.layers) == 3
    return SimpleNamespace(model=model, seq=seq, x=x)


def test_recompute_bytes_of_mlp_layers_from_first_principles(mlp3: SimpleNamespace) -> None:
    """Per MLP layer on a (b, d) input x: none keeps x, fc1's output (GELU's input) and GELU's output
    (fc2's input): (1 + 4 + 4)·bd; full keeps x: bd; selective keeps x and the two matmul outputs:
    (1 + 4 + 1)·bd. A kept input is charged to the layer that produced it (layer 0 for the model's
    input), so a block pays for its output, which the next block keeps, instead of for its input."""
    prof = autopipe.profile(mlp3.seq, (mlp3.x,), warmup=0, repeats=1, progress=False)
    assert _act(prof, "none") == [(1 + 8 + 1) * UNIT, (8 + 1) * UNIT, 8 * UNIT]
    assert _act(prof, "full") == [(1 + 1) * UNIT, UNIT, 0]
    # fc2's output is both kept by selective and the next block's input: counted once, at its producer
    assert _act(prof, "selective") == [(1 + 4 + 1) * UNIT, (4 + 1) * UNIT, (4 + 1) * UNIT]
    assert [l.source for l in prof.layers] == ["measured", "measured", "reused"]
    for layer in prof.layers:
        assert set(layer.recompute) == {"selective", "full"}
        assert all(rc.extra_backward_time >= 0.0 for rc in layer.recompute.values())
    assert prof.layers[2].recompute["full"].extra_backward_time == prof.layers[1].recompute["full"].extra_backward_time
    assert Profile.from_dict(json.loads(json.dumps(prof.to_dict()))) == prof


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_profiled_bytes_equal_what_a_real_forward_keeps(mlp3: SimpleNamespace, mode: str) -> None:
    """The profile's per-layer figures sum to the bytes a real forward under the mode leaves alive, and
    recompute really drops them: full < selective < none."""
    prof = autopipe.profile(mlp3.seq, (mlp3.x,), warmup=0, repeats=1, progress=False)
    kept = {m: _kept_after_forward(mlp3.seq, mlp3.x, m) for m in ("none", "selective", "full")}
    assert sum(_act(prof, mode)) == kept[mode]
    assert kept["full"] < kept["selective"] < kept["none"]


def test_estimate_mode_fills_recompute_from_meta_tensors(mlp3: SimpleNamespace) -> None:
    """estimate=True: the same bytes (ledger on meta) and roofline extra time: the forward for full,
    the forward minus the matmuls for selective (GELU alone here)."""
    measured = autopipe.profile(mlp3.seq, (mlp3.x,), warmup=0, repeats=1, progress=False)
    est = autopipe.profile(mlp3.seq, (mlp3.x,), estimate=True, device="h100", progress=False)
    for mode in ("none", "selective", "full"):
        assert _act(est, mode) == _act(measured, mode)
    for layer in est.layers:
        full, sel = layer.recompute["full"].extra_backward_time, layer.recompute["selective"].extra_backward_time
        assert full == layer.forward_time
        assert 0.0 < sel < full


def test_profile_table_shows_recompute(mlp3: SimpleNamespace) -> None:
    """The table's caption has one line per mode: what the model keeps under it and the time it adds."""
    from rich.console import Console

    prof = autopipe.profile(mlp3.seq, (mlp3.x,), estimate=True, device="h100", progress=False)
    console = Console(width=200, record=True)
    console.print(profile_table(prof))
    text = console.export_text()
    # none keeps (10 + 9 + 8)·bd, selective (6 + 5 + 5)·bd, full (2 + 1)·bd
    assert f"selective recompute: activations {format_bytes(16 * UNIT)} (59%)" in text
    assert f"full recompute: activations {format_bytes(3 * UNIT)} (11%)" in text


# ---- zero-bubble split backward, one layer -------------------------------------------------------


class NormMLP(nn.Module):
    """LayerNorm -> Linear -> GELU -> Linear plus residual: three weight groups for a split backward."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm, self.mlp = nn.LayerNorm(d), MLP(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.dropout(self.mlp(self.norm(x)), 0.2)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_split_backward_recomputes_per_weight_group_unless_shared(mode: str) -> None:
    """torch's zero-bubble backward (input pass, then one autograd call per weight group) gives the
    plain gradients under recompute; the layer's forward runs 1 + 3 times, or 2 with shared_recompute
    around the weight pass."""
    from torch.distributed.pipelining._backward import (
        stage_backward_input,
        stage_backward_weight,
    )

    from autopipe.graph.recompute import shared_recompute

    torch.manual_seed(0)
    layer, x = NormMLP(D), torch.randn(ROWS, D, requires_grad=True)
    calls = []
    layer.register_forward_pre_hook(lambda *_: calls.append(1))

    def grads(mode: str, split: bool, shared: bool = False) -> list[torch.Tensor]:
        layer.zero_grad(set_to_none=True)
        calls.clear()
        torch.manual_seed(1)
        out = run_layer(layer, x, mode)
        if split:
            dx, groups = stage_backward_input([out], [torch.ones_like(out)], [x], layer.parameters())
            with shared_recompute() if shared else contextlib.nullcontext():
                stage_backward_weight(layer.parameters(), groups)
        else:
            (dx,) = torch.autograd.grad(out, x, torch.ones_like(out), retain_graph=True)
            out.backward(torch.ones_like(out))
        return [dx[0] if isinstance(dx, tuple) else dx, *(p.grad for p in layer.parameters())]

    expected = grads("none", split=False)
    for shared, forwards in ((False, 1 + 1 + 3), (True, 1 + 1 + 1)):
        got = grads(mode, split=True, shared=shared)
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e, atol=TOL, rtol=0)
        assert len(calls) == forwards


# ---- choosing modes ---------------------------------------------------------------------------------


def test_modes_per_chunk_come_from_the_flag_or_the_plan() -> None:
    """One mode for all chunks, one per chunk, or the plan's stage_recompute; bad ones are refused."""
    planned = ("full", "none")
    assert chunk_modes(None, 2, planned) == chunk_modes("plan", 2, planned) == ["full", "none"]
    assert chunk_modes("selective", 2, planned) == ["selective", "selective"]
    assert chunk_modes(["none", "full"], 2) == ["none", "full"]
    assert chunk_modes(None, 3, ()) == ["none"] * 3
    with pytest.raises(RecomputeError, match="2 modes but the plan has 3 chunks"):
        chunk_modes(["full", "none"], 3)
    with pytest.raises(RecomputeError, match="the plan's stage_recompute gives 2 modes"):
        chunk_modes(None, 3, planned)
    with pytest.raises(RecomputeError, match="unknown recompute mode 'partial'"):
        chunk_modes("partial", 2)


def test_build_stage_applies_the_plan_s_modes_and_a_rejoined_chunk_keeps_them() -> None:
    """build_stage gives each chunk the plan's mode; the one-process engine joins the chunks into one,
    which must still run each layer in its own chunk's mode."""
    x = torch.randn(ROWS, D)
    plan = StagePlan((0, 1, 3), recompute=("selective", "full"))
    build = build_stage(lambda: MLPStack(D, 3), (x,), None, plan, pp_rank=0, pp_size=1)
    assert build.recompute == ["selective", "full"]
    assert [c.recompute for c in build.chunks] == [("selective",), ("full", "full")]
    joined = PipeChunk([layer for c in build.chunks for layer in c.layers], 0, (0, 3))
    assert joined.recompute == ("selective", "full", "full")
    override = build_stage(lambda: MLPStack(D, 3), (x,), None, plan, pp_rank=0, pp_size=1, recompute="none")
    assert [c.recompute for c in override.chunks] == [("none",), ("none", "none")]


class _TorchCache:
    """A stand-in for torch's recompute-side (or forward-side) selective mode: its ``storage``
    in either torch's layout, entered and left as torch enters and leaves it."""

    def __init__(self, storage: dict[Any, Any]) -> None:
        self.storage = storage

    def __enter__(self) -> _TorchCache:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class _Kept:  # torch's version-checking wrapper: the kept value is ``.val``
    def __init__(self, val: torch.Tensor) -> None:
        self.val = val


@pytest.mark.parametrize("layout", ["list (torch <= 2.11)", "dict (torch >= 2.12)"])
def test_the_selective_cache_is_put_back_and_counted_in_either_torch_layout(layout: str) -> None:
    """CI runs torch 2.13's layout only; torch 2.11's (a list popped in order) failed in every
    profile on the H200. A recomputation that read part of the cache (the list popped, the dict
    marked consumed) finds it whole for the next one; the forward side reports each kept tensor."""
    from autopipe.graph.recompute import _CountKept, _Replayable

    a, b = torch.ones(2), torch.zeros(3)
    fresh = (lambda: [[_Kept(a)], [_Kept(b)]]) if layout.startswith("list") else (lambda: [{0: _Kept(a)}, {0: _Kept(b)}])
    ops = ("mm", "addmm")
    cache = _TorchCache(dict(zip(ops, fresh())))
    seen: list[torch.Tensor] = []
    with _CountKept(_TorchCache(cache.storage), seen.append):
        pass
    assert [t.shape for t in seen] == [(2,), (3,)]
    replay = _Replayable(cache)
    for _ in range(2):  # two recomputations, as a zero-bubble weight pass makes
        with replay:
            if layout.startswith("list"):
                cache.storage["mm"].pop(0)
            else:
                cache.storage["mm"][0] = "consumed"
        assert cache.storage["mm"][0].val is a and cache.storage["addmm"][0].val is b
