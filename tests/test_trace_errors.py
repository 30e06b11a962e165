"""Bad input gets a clear error that names what was wrong and what to do."""

from __future__ import annotations

import pytest
import torch
from archs import build
from torch import nn

import autopipe
from autopipe.errors import (
    InputMismatchError,
    PartitionError,
    TraceError,
    TraceMismatchError,
)


class Gate(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # data-dependent: export cannot decide this branch
            return x * 2
        return x


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.gate = Gate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(self.lin(x))


class TraceOnlyBranch(nn.Module):
    """Eager Python takes a branch the trace cannot see: the graph would silently be wrong."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.a(x)
        if type(x) is torch.Tensor:  # False for the fake tensors export traces with
            x = x + 1
        return self.b(x)


def test_data_dependent_branch_names_module_and_line() -> None:
    """The error names the module ('gate'), the source line and what to try."""
    with pytest.raises(TraceError) as err:
        autopipe.flatten(Branchy(), (torch.randn(2, 4),))
    msg = str(err.value)
    assert "module 'gate'" in msg and "if x.sum() > 0" in msg and "branches on tensor values" in msg
    assert "\n" not in msg


class LayerDropDecoder(nn.Module):
    """The decoder loop of OPT and BART in transformers 5.17: a draw per layer even at layerdrop 0."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.layerdrop = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if self.training:
                dropout_probability = torch.rand([])
                if dropout_probability < self.layerdrop:
                    continue
            x = layer(x)
        return x


def test_layerdrop_is_named_with_the_transformers_that_traces_it() -> None:
    """transformers 5.17 (a GPU image's) did not trace OPT or BART for this; the line says what it is."""
    with pytest.raises(TraceError, match=r"LayerDrop.*upgrade transformers \(5\.24") as err:
        autopipe.flatten(LayerDropDecoder().train(), (torch.randn(2, 4),))
    assert "dropout_probability < self.layerdrop" in str(err.value)


def test_a_failed_trace_keeps_torch_s_graph_dump_off_the_screen(capfd: pytest.CaptureFixture[str]) -> None:
    """torch prints the partial FX graph of a failed export (screens of it); it goes to a file the error names."""
    import re
    from pathlib import Path

    with pytest.raises(TraceError) as err:
        autopipe.flatten(Branchy(), (torch.randn(2, 4),))
    shown = capfd.readouterr()
    assert "def forward" not in shown.err + shown.out
    log = Path(re.search(r"failed trace \(its FX graph\): (\S+)\.$", str(err.value)).group(1))
    assert "def forward" in log.read_text()
    log.unlink()


def test_validation_catches_a_graph_that_differs_from_eager() -> None:
    """A trace that dropped a branch is refused, with the output index and the difference."""
    with pytest.raises(TraceMismatchError, match="differs from the eager model in output 0"):
        autopipe.flatten(TraceOnlyBranch(), (torch.randn(2, 4),))
    seq = autopipe.flatten(TraceOnlyBranch(), (torch.randn(2, 4),), validate=False)  # the user may insist
    assert len(seq) == 2


def test_example_inputs_that_do_not_fit_forward() -> None:
    """Inputs that don't bind to forward's signature: the signature is shown."""
    with pytest.raises(InputMismatchError, match=r"Branchy.forward\(x\): too many positional arguments"):
        autopipe.flatten(Branchy(), (torch.randn(2, 4), torch.randn(2, 4)))


def test_calling_the_sequence_with_other_shapes_or_structure() -> None:
    """The sequence is specialised to the traced micro-batch shape and says so."""
    model, args, kwargs = build("gpt2")
    seq = autopipe.flatten(model, args, kwargs)
    with pytest.raises(InputMismatchError, match=r"input 'input_ids' has shape \(4, 8\).*\(2, 8\)"):
        seq(torch.zeros(4, 8, dtype=torch.long), labels=args[0], use_cache=False)
    with pytest.raises(InputMismatchError, match="keywords"):
        seq(*args)


@pytest.mark.parametrize(
    "boundaries, message",
    [
        ([0, 2, 2, 6], "give stage 1 no layers"),
        ([0, 2], "must start at 0 and end at 6"),
        ([0, 1, 2, 3, 4, 5, 6, 6], "7 stages asked for but the sequence has only 6 layers"),
        ([5], "at least two entries"),
    ],
)
def test_bad_boundaries(boundaries: list[int], message: str) -> None:
    """Empty stages, wrong ends and more stages than layers are refused with the numbers."""
    model, args, kwargs = build("gpt2")
    seq = autopipe.flatten(model, args, kwargs)
    with pytest.raises(PartitionError, match=message):
        seq.split(boundaries)


def test_meta_device_flatten_holds_meta_parameters_and_rebinds() -> None:
    """On meta nothing is allocated; rebind_ swaps in materialised tensors, keeping ties as one object."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=96, n_positions=32)
    with torch.device("meta"):
        model = GPT2LMHeadModel(cfg)
        ids = torch.zeros(2, 8, dtype=torch.long)
    seq = autopipe.flatten(model, (ids,), {"labels": ids, "use_cache": False})
    assert all(p.is_meta for layer in seq.layers for p in layer.parameters())
    model.to_empty(device="cpu")
    model.tie_weights()
    seq.rebind_(model)
    first, last = seq.layers[0], seq.layers[-1]
    assert first.get_parameter("transformer.wte.weight") is model.transformer.wte.weight
    assert last.get_parameter("lm_head.weight") is first.get_parameter("transformer.wte.weight")
    assert not any(p.is_meta for layer in seq.layers for p in layer.parameters())


def test_meta_trace_runs_on_cpu_after_rebind_and_retarget() -> None:
    """Trace on meta, materialise, rebind_ and retarget_: the layers give the real model's outputs
    and gradients (device constants like arange(device=meta) now point at the CPU)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=96, n_positions=32,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    real = GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 96, (2, 8))
    with torch.device("meta"):
        model = GPT2LMHeadModel(cfg)
    seq = autopipe.flatten(model, (ids.to("meta"),), {"labels": ids.to("meta"), "use_cache": False})
    model.to_empty(device="cpu")
    model.load_state_dict(real.state_dict())
    model.tie_weights()
    stages = seq.rebind_(model).retarget_("cpu").split([0, 2, len(seq)])
    x = stages[0](ids, labels=ids, use_cache=False)
    out = stages[1](*x)
    ref = real(ids, labels=ids, use_cache=False)
    torch.testing.assert_close(out.logits, ref.logits)
    out.loss.backward()
    ref.loss.backward()
    torch.testing.assert_close(model.transformer.wte.weight.grad, real.transformer.wte.weight.grad)


def _upcast_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32, reorder_and_upcast_attn=True,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    cfg._attn_implementation = "eager"  # the upcast attention is eager attention's
    return GPT2LMHeadModel(cfg)


def test_a_bf16_stage_keeps_the_models_fp32_regions_and_computes_the_untouched_model() -> None:
    """transformers' ``maybe_autocast(enabled=False)`` enters GPT-2's fp32 attention region only when
    autocast is on. Traced without autocast the region was gone and a bf16 job ran those matmuls in
    bf16 (a Llama-1B bf16 job on an H200, transformers 5.17: logits 1.48 off). A stage traced under
    the job's autocast (``build_stage(autocast=)``, as train.py builds it) computes the untouched
    model's outputs, loss and gradients under autocast; the old trace is shown to differ."""
    from autopipe.runtime.stage.build import build_reference, build_stage

    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    kwargs = {"labels": ids, "use_cache": False}
    ref = build_reference(_upcast_gpt2, seed=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = ref(ids, **kwargs)
    want.loss.backward()

    def stage(autocast: torch.dtype | None) -> tuple:
        b = build_stage(_upcast_gpt2, (ids,), kwargs, 1, pp_rank=0, pp_size=1, device="cpu", autocast=autocast)
        (chunk,) = b.chunks
        chunk.autocast_dtype = torch.bfloat16  # as the engine runs it for --dtype bf16
        got = b.seq.unpack_outputs(chunk(*b.seq.pack_inputs((ids,), kwargs)))
        got.loss.backward()
        return got, b.params

    got, params = stage(torch.bfloat16)
    torch.testing.assert_close(got.logits.float(), want.logits.float(), rtol=0, atol=0)
    torch.testing.assert_close(got.loss, want.loss, rtol=0, atol=0)
    for name, p in params.items():
        torch.testing.assert_close(p.grad, ref.get_parameter(name).grad, rtol=0, atol=0, msg=name)
    old, _ = stage(None)  # traced without autocast: the upcast matmuls ran in bf16
    assert float((old.logits.float() - want.logits.float()).abs().max()) > 1e-3


def test_layers_run_under_autocast_after_an_fp32_trace() -> None:
    """Export's dtype assertions are dropped: a layer traced in fp32 runs under bf16 autocast and
    gives the eager model's autocast result."""
    model, args, kwargs = build("llama")  # RMSNorm casts with .to(): export asserted those dtypes
    seq = autopipe.flatten(model, args, kwargs)
    assert not any(
        n.target is torch.ops.aten._assert_tensor_metadata.default for layer in seq.layers for n in layer.graph.nodes
    )
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = seq(*args, **kwargs)
        ref = model(*args, **kwargs)
    # Values and loss match; the logits' dtype may not: export returns them through the loss's
    # .float(), a no-op in the fp32 trace, so the sequence hands them back upcast.
    torch.testing.assert_close(got.loss, ref.loss)
    torch.testing.assert_close(got.logits.float(), ref.logits.float())
