"""Device placement by design: one place picks the rank's device, every collective and stage input
is checked against it, and the step reads the device on the host once.

On this CPU-only machine a tensor created without ``device=`` is on the right device by luck; the
checking mode makes such a tensor land on meta inside the step, so the regressions NCCL would
refuse on a GPU fail here too. Each regression below is a real one from before this check existed
(a CPU loss tensor all-reduced in the trainer, a CPU norm accumulator in grads.py, a CPU target in
the engine, a ``float(loss)`` in the step).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

import autopipe.runtime.training.grads as grads
from autopipe.errors import AutopipeError
from autopipe.runtime import TrainConfig, Trainer, build_stage, init_dist, model_factory
from autopipe.runtime.process.comm import Comm, DeviceCheckError, HostSyncError
from autopipe.runtime.process.distenv import rank_device, to_device
from autopipe.runtime.torch_engine.pipeline import PipelineEngine


def test_checking_refuses_a_tensor_on_another_device_and_names_the_call() -> None:
    """all_reduce / all_gather / check refuse a tensor off the rank's device, with where it happened."""
    comm = Comm(torch.device("cpu"), checking=True)
    with pytest.raises(DeviceCheckError, match=r"gradient norm: tensor 0 \(\(\), torch.float64\) is on meta"):
        comm.all_reduce(torch.zeros((), dtype=torch.float64, device="meta"), where="gradient norm")
    with pytest.raises(DeviceCheckError, match="step statistics"):
        comm.all_gather(torch.zeros(4, device="meta"), where="step statistics")
    with pytest.raises(DeviceCheckError, match="input of pipeline chunk 1: tensor 1"):
        comm.check("input of pipeline chunk 1", (torch.ones(2), torch.ones(2, device="meta")))
    comm.check("fine", (torch.ones(2), {"x": torch.ones(1)}))  # on the device: no error
    assert torch.equal(comm.all_gather(torch.arange(3.0)), torch.arange(3.0).unsqueeze(0))
    # without checking mode nothing is inspected (and nothing slows down)
    Comm(torch.device("cpu")).check("unchecked", torch.ones(1, device="meta"))


def test_step_region_puts_device_less_tensors_on_meta_and_counts_host_reads() -> None:
    """Inside comm.step() on a CPU rank: factories without device= give meta tensors, and a host read
    from autopipe code outside host_read() fails the step."""
    comm = Comm(torch.device("cpu"), checking=True)
    with comm.step():
        assert torch.zeros(2).device.type == "meta"
        assert torch.zeros(2, device=comm.device).device.type == "cpu"
        with comm.host_read():
            float(torch.ones((), device=comm.device))  # the sanctioned read
    with pytest.raises(HostSyncError, match=r"1 time\(s\).*item at .*test_comm.py"):
        with comm.step():
            torch.ones((), device=comm.device).item()


def test_rank_device_is_the_local_rank_s_gpu_or_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """LOCAL_RANK picks cuda:N (made current); more local ranks than GPUs is an error, not a shared GPU."""
    assert rank_device(0) == torch.device("cpu")  # no GPU here
    current: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert rank_device() == torch.device("cuda", 1) and current == [1]
    with pytest.raises(AutopipeError, match="local rank 2 has no GPU of its own .2 visible.; launch at most 2"):
        rank_device(2)


def test_to_device_moves_host_tensors_and_keeps_the_rest() -> None:
    """Batches reach the rank's device through one function; non-tensors and tensors already there stay."""
    x = torch.ones(2)
    out = to_device({"a": x, "b": 3, "c": (x,)}, torch.device("meta"))
    assert out["a"].device.type == "meta" and out["b"] == 3 and out["c"][0].device.type == "meta"
    assert to_device(x, torch.device("cpu")) is x


# ---- the trainer in checking mode, in this process (a one-rank world) ------------------------------

ROWS, SEQ, MICRO = 2, 8, 2


@pytest.fixture()
def trainer() -> Iterator[tuple[Trainer, tuple, dict]]:
    """A one-rank world training a tiny GPT-2 (2 chunks in one process) with checking on."""
    import os
    import tempfile

    from transformers import GPT2Config

    folder = tempfile.mkdtemp()
    GPT2Config(architectures=["GPT2LMHeadModel"], n_layer=2, n_embd=16, n_head=2, vocab_size=64, n_positions=SEQ,
               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False).save_pretrained(folder)
    for var in ("WORLD_SIZE", "MASTER_ADDR"):
        os.environ.pop(var, None)
    env = init_dist(check=True)
    try:
        source = model_factory(folder, batch_size=ROWS, seq_len=SEQ)
        build = build_stage(source.factory, source.args, source.kwargs, 2, pp_rank=0, pp_size=1)
        ids = torch.arange(ROWS * MICRO * SEQ, device="cpu").reshape(ROWS * MICRO, SEQ) % 64
        args, kwargs = source.batch(ids, ROWS * MICRO)
        yield Trainer(build, env, TrainConfig(steps=3, microbatches=MICRO, lr=1e-2)), args, kwargs
    finally:
        env.close()
        assert not dist.is_initialized()


def test_trainer_passes_the_check(trainer: tuple[Trainer, tuple, dict]) -> None:
    """The trainer as written: every collective and stage input on the device, one host read a step."""
    t, args, kwargs = trainer
    first = t.step(args, kwargs)
    second = t.step(args, kwargs)
    assert second.loss < first.loss and first.grad_norm > 0


def test_check_catches_a_cpu_tensor_handed_to_a_collective(
    trainer: tuple[Trainer, tuple, dict], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The old grad-norm accumulator (torch.zeros without device) fails the step on a CPU machine."""
    t, args, kwargs = trainer

    def old_norm(params, counted_elsewhere, pp_group, comm):  # noqa: ANN001, ANN202
        local = torch.zeros((), dtype=torch.float64)  # the regression: no device=
        comm.all_reduce(local, group=pp_group, where="gradient norm")
        return local

    monkeypatch.setattr("autopipe.runtime.torch_engine.trainer.global_grad_norm", old_norm)
    with pytest.raises(DeviceCheckError, match="gradient norm: .* is on meta, not on this rank's device cpu"):
        t.step(args, kwargs)


def test_check_catches_a_device_less_target_given_to_the_stage(
    trainer: tuple[Trainer, tuple, dict], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A target made without device= (the engine's old placeholder) is refused before the schedule."""
    t, args, kwargs = trainer
    run = PipelineEngine.run
    monkeypatch.setattr(PipelineEngine, "run", lambda self, inputs, target, *seeds: run(self, inputs, torch.zeros(MICRO), *seeds))
    with pytest.raises(DeviceCheckError, match="pipeline target"):
        t.step(args, kwargs)


def test_check_catches_a_host_sync_in_the_step(
    trainer: tuple[Trainer, tuple, dict], monkeypatch: pytest.MonkeyPatch
) -> None:
    """float(loss) in the step (the old engine's return) waits for the GPU: the check names it."""
    t, args, kwargs = trainer
    norm = grads.global_grad_norm

    def reading_norm(*a, **k):  # noqa: ANN002, ANN003, ANN202
        value = norm(*a, **k)
        float(value)  # the regression: a host read outside the logging reduction
        return value

    monkeypatch.setattr("autopipe.runtime.torch_engine.trainer.global_grad_norm", reading_norm)
    with pytest.raises(HostSyncError, match=r"__float__ at .*test_comm.py"):
        t.step(args, kwargs)


def test_verify_compares_with_the_untouched_model_and_catches_what_differs(
    trainer: tuple[Trainer, tuple, dict], monkeypatch: pytest.MonkeyPatch
) -> None:
    """--verify runs the user's model as its factory builds it (never the flattened layers, never
    autopipe's own unpipelined run): it passes the trainer as written and leaves no gradient behind;
    it fails in one line when the job computes another function than the model (a weight of its
    layers off by 1e-3, which a comparison of autopipe's layers with themselves cannot see), and when
    the pipelined gradients are off by a little (one entry of one tensor, 1e-3), naming the parameter."""
    import autopipe.runtime.checks.verify as verify
    from autopipe.runtime.checks.verify import VerifyError, verify_step

    t, args, kwargs = trainer
    built: list[torch.nn.Module] = []
    untouched = verify.untouched_model
    monkeypatch.setattr(verify, "untouched_model", lambda *a, **k: built.append(untouched(*a, **k)) or built[-1])
    for where in ("autopipe.runtime.stage.build.build_reference", "autopipe.runtime.checks.reference.SequenceModel.build_from"):
        monkeypatch.setattr(where, lambda *a, **k: pytest.fail("--verify compared autopipe with autopipe"))
    report = verify_step(t, args, kwargs)
    assert report.ok and report.loss == pytest.approx(report.reference_loss, abs=1e-6) and report.max_grad_diff < 1e-5
    assert type(built[0]).__name__ == "GPT2LMHeadModel" and report.max_output_diff < 1e-5  # the model itself, its logits
    assert all(p.grad is None or not p.grad.any() for p in t.params.values())
    first = sorted(t.params)[0]
    with torch.no_grad():
        t.params[first].view(-1)[0] += 1e-3
    with pytest.raises(VerifyError, match=r"differs from the untouched model: loss .*largest output difference [1-9]"):
        verify_step(t, args, kwargs)
    with torch.no_grad():
        t.params[first].view(-1)[0] -= 1e-3
    name = sorted(t.params)[-1]
    run = t.engine.run

    def off_by_a_little(*a, **k):  # noqa: ANN002, ANN003, ANN202
        loss = run(*a, **k)
        with torch.no_grad():
            t.params[name].grad.view(-1)[0] += 1e-3
        return loss

    monkeypatch.setattr(t.engine, "run", off_by_a_little)
    with pytest.raises(VerifyError, match=rf"largest gradient difference 1\.00e-03 .*worst: {name}\)") as err:
        verify_step(t, args, kwargs)
    assert "\n" not in str(err.value)
