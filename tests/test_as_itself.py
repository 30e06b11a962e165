"""Each way a model could train as something other than itself, checked in one process (the zoo's jobs
in tests/test_zoo.py check the same end to end): the user's micro-batch, the loss wherever the model
returns it, the cache off, the trace for the run's device type, the plan's record of it, and weights
and buffers built the way the model builds them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import zoo
from safetensors.torch import save_file
from torch import nn

import autopipe
from autopipe.errors import AutopipeError
from autopipe.graph.sources import load_model
from autopipe.runtime import build_stage, model_factory
from autopipe.runtime.checks.untouched import untouched_model
from autopipe.runtime.data.losses import LossError, check_loss, make_loss, model_loss

ZOO = Path(zoo.__file__).resolve()


def test_the_factory_s_example_rows_are_the_micro_batch_unless_asked() -> None:
    """A factory without batch_size (the DeepSpeed tutorial's AlexNet, 8 rows): 8 is the micro-batch;
    asked for 4, every example tensor of 8 rows becomes 4 rows, so the job traces what it trains on."""
    own = load_model(f"{ZOO}:alexnet", device="meta")
    assert own.batch_size == 8 and own.args[0].shape == (8, 3, 32, 32)
    asked = model_factory(f"{ZOO}:alexnet", batch_size=4, seq_len=8)
    assert asked.batch_size == 4 and asked.args[0].shape == (4, 3, 32, 32)
    assert model_factory(f"{ZOO}:alexnet", batch_size=None, seq_len=8).batch_size == 8


def test_a_loss_anywhere_in_the_outputs_is_found_and_several_are_named() -> None:
    """nanoGPT's (logits, loss) trains on its loss; a model returning two scalars is refused in one
    line naming both places and the flag, and --loss model:PLACE picks one."""
    ms = load_model(f"{ZOO}:nanogpt", device="meta")
    seq = autopipe.flatten(ms.model, ms.args, ms.kwargs)
    assert check_loss(seq, "model", "nanogpt") == ((), torch.float32)
    logits, main, aux = torch.zeros(2, 3), torch.tensor(1.0), torch.tensor(0.25)
    outputs = {"logits": logits, "stats": (main, aux)}
    with pytest.raises(AutopipeError, match=r"returns 2 scalars \(stats\.0, stats\.1\); say which is the loss with "
                                            r"--loss model:stats\.0") as err:
        model_loss(outputs)
    assert "\n" not in str(err.value)
    assert make_loss("model:stats.1")(outputs, None) is aux
    with pytest.raises(AutopipeError, match=r"no scalar at 'logits'"):
        make_loss("model:logits")(outputs, None)


def test_a_model_without_a_scalar_output_is_still_refused_with_the_fix() -> None:
    ms = load_model(f"{ZOO}:litgpt", device="meta")
    seq = autopipe.flatten(ms.model, ms.args, ms.kwargs)
    with pytest.raises(LossError, match=r"no scalar loss: train it with --loss cross_entropy"):
        check_loss(seq, "model", "litgpt")


def test_an_hf_factory_that_leaves_the_cache_on_flattens() -> None:
    """Mixtral's factory passes no use_cache (its config's default is on): autopipe turns it off
    rather than fail on the DynamicCache it would return."""
    ms = load_model(f"{ZOO}:mixtral", device="meta")
    assert ms.model.config.use_cache is False
    assert len(autopipe.flatten(ms.model, ms.args, ms.kwargs)) == 6


class _Branchy(nn.Module):
    """Python that branches on the device type, as transformers' MoE kernels do."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x) * (2.0 if x.device.type == "cpu" else 3.0)
        return x.sum()


def test_a_meta_model_is_traced_for_the_device_type_it_runs_on() -> None:
    """On meta, the graph takes the branch of the device type asked for (fake tensors of that type), and
    the job built on the CPU equals the untouched model; traced as meta it took the other branch."""
    with torch.device("meta"):
        meta = _Branchy()
    x = torch.randn(2, 4, device="meta")
    seq = autopipe.flatten(meta, (x,), device_type="cpu")
    assert seq.trace_device == "cpu"
    assert autopipe.flatten(meta, (x,), device_type="meta").trace_device == "meta"
    build = build_stage(_Branchy, (torch.randn(2, 4),), {}, 2, pp_rank=0, pp_size=1, device="cpu")
    assert build.seq.trace_device == "cpu"
    model = untouched_model(_Branchy, seed=0)
    real = torch.randn(2, 4)
    got = build.seq(real)
    torch.testing.assert_close(got, model(real), rtol=0, atol=0)


def test_a_plan_traced_for_another_device_type_whose_layers_differ_is_one_line(tmp_path: Path) -> None:
    """plan.json records the device type; one without the field (older) still loads; a plan traced for
    cuda whose layers differ from this CPU rank's retrace is refused naming both and the fix."""
    from autopipe import Profile, partition
    from autopipe.planner.plan import Plan

    plan = partition(Profile.from_costs([1, 1, 1]), stages=2)
    old = plan.to_dict()
    old.pop("trace_device")
    assert Plan.from_dict(old).trace_device == ""
    cuda = Plan.from_dict({**plan.to_dict(), "trace_device": "cuda"})
    with pytest.raises(AutopipeError, match=r"the plan was traced for cuda and cuts 3 layers, but on cpu this model "
                                            r"flattens into 2 .*--device cpu"):
        build_stage(_Branchy, (torch.randn(2, 4),), {}, cuda, pp_rank=0, pp_size=1, device="cpu")
    (tmp_path / "plan.json").write_text(json.dumps(cuda.to_dict()))
    assert Plan.load(tmp_path / "plan.json").trace_device == "cuda"


def test_loaded_weights_are_not_overwritten_to_fill_a_buffer_the_file_lacks(tmp_path: Path) -> None:
    """Gemma: a checkpoint holds no non-persistent embed_scale; filling it ran the embedding's init,
    which overwrote the weight just loaded (the job then trained another function, 2-process equal to
    1-process). The job's embedding is the file's, and every buffer is the constructor's."""
    torch.manual_seed(0)
    model = zoo.gemma()[0]
    save_file({k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "w.safetensors"))
    source = model_factory(f"{ZOO}:gemma", batch_size=2, seq_len=8)
    build = build_stage(source.factory, source.args, source.kwargs, 2, pp_rank=0, pp_size=1,
                        weights=str(tmp_path / "w.safetensors"))
    for name, p in model.named_parameters():
        torch.testing.assert_close(build.model.get_parameter(name), p, rtol=0, atol=0, msg=name)
    held = [name for name, _ in model.named_buffers() if not build.model.get_buffer(name).is_meta]  # what layers use
    assert {"model.embed_tokens.embed_scale", "model.rotary_emb.inv_freq"} <= set(held)
    for name in held:
        torch.testing.assert_close(build.model.get_buffer(name), model.get_buffer(name), rtol=0, atol=0, msg=name)


def test_an_init_that_assigns_new_tensors_is_taken_in_place() -> None:
    """litgpt's root reset_parameters assigns new rotary tables instead of writing them (it failed with
    IndexError): the layers keep their tensors, with the values the model made."""
    source = model_factory(f"{ZOO}:litgpt", batch_size=2, seq_len=8)
    build = build_stage(source.factory, source.args, source.kwargs, 2, pp_rank=0, pp_size=1)
    model = untouched_model(source.factory, seed=0)
    for name in ("cos", "sin"):
        held = [b for layer in build.seq.layers for n, b in layer.named_buffers() if n == name]
        assert held and all(b is build.model.get_buffer(name) for b in held)
        torch.testing.assert_close(build.model.get_buffer(name), model.get_buffer(name), rtol=0, atol=0)
