"""The causal LMs of the installed transformers train as themselves: flattened, then 1, 2 and 3 stages of
the sequence give the untouched model's outputs (its own loss among them) and every parameter gradient.

FAST is a sample by layer kind (dense, MoE, Mamba and hybrid, sliding window, encoder-decoder, a
custom autograd.Function, an expert loop traced batched); SLOW a wider sample (latent attention, RWKV's
recurrence, ...); SWEEP every other architecture measured exact (``-m sweep``, outside the suite's time).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from causal_lms import LEAF, build
from test_flatten import _assert_same, _even, _run, _run_stages

import autopipe
from autopipe.errors import TraceMismatchError
from autopipe.graph.gradients import check_gradients

FAST = ["apertus", "bamba", "bart", "bert", "bloom", "cohere2", "diffllama", "dots1", "exaone_moe", "falcon_mamba",
        "gemma3", "jamba", "llama", "longcat_flash", "mixtral", "reformer"]
SLOW = ["afmoe", "apertus1p5_text", "arcee", "aria_text", "bailing_hybrid", "beam", "bert-generation", "big_bird",
        "bigbird_pegasus", "biogpt", "bitnet", "blenderbot", "blenderbot-small", "camembert", "codegen", "cohere",
        "cohere2_moe", "cpmant", "ctrl", "cwm", "data2vec-text", "deepseek_v4", "doge", "dory", "electra", "ernie",
        "ernie4_5", "exaone", "exaone4", "falcon", "flex_olmo", "flint", "deepseek_v3", "rwkv", "falcon_h1", "mamba2",
        "dbrx"]  # DBRX: its expert loop traced batched, as LongcatFlash's
# every other architecture bench/bench_causal_lms.py measured exact: `python -m pytest -m sweep` (the suite leaves them
# out to keep within its 15 minutes; the bench's table, bench/results/causal-lms.md, has every family's result)
SWEEP = ['axk1', 'axk2', 'deepseek_v2', 'deepseek_v32', 'dots3_note_text', 'ernie4_5_moe', 'gemma', 'gemma2', 'gemma3_text',
    'gemma4', 'gemma4_text', 'gemma4_unified', 'gemma4_unified_text', 'glm', 'glm4', 'glm4_moe', 'glm4_moe_lite',
    'glm_moe_dsa', 'got_ocr2', 'gpt-sw3', 'gpt2', 'gpt_bigcode', 'gpt_neo', 'gpt_neox', 'gpt_neox_japanese',
    'gpt_oss', 'gptj', 'granite', 'granite_swa', 'granitemoe', 'granitemoe_swa', 'granitemoehybrid',
    'granitemoeshared', 'helium', 'hrm_text', 'hunyuan_v1_dense', 'hunyuan_v1_moe', 'hy_v3', 'hy_v4', 'hyperclovax',
    'inkling2_loop_text', 'inkling2_text', 'inkling_text', 'internlm3', 'iquestcoder', 'jais2', 'jetmoe',
    'kimi_linear', 'kolibri1', 'laguna', 'lara_mini', 'lfm2', 'lfm2_moe', 'lfm3', 'llama4', 'llama4_text', 'mamba', 'marian', 'mbart',
    'megatron-bert', 'mellum', 'mimo_v2_flash', 'minicpm3', 'minimax', 'minimax_m2', 'minimax_m3_vl_text',
    'ministral', 'ministral3', 'mistral', 'mllama', 'modernbert-decoder', 'moss_transcribe_diarize', 'mpt', 'mvp',
    'nanochat', 'nemotron', 'nemotron_h', 'olmo', 'olmo2', 'olmo3', 'olmo_hybrid', 'olmoe', 'openai-gpt', 'opt',
    'pegasus', 'persimmon', 'phi', 'phi3', 'phi4_multimodal', 'phimoe', 'plbart', 'prophetnet', 'qwen2',
    'qwen2_moe', 'qwen3', 'qwen3_5', 'qwen3_5_moe', 'qwen3_5_moe_text', 'qwen3_5_text', 'qwen3_moe', 'qwen3_next',
    'qwen4_exp', 'qwen4_exp_text',
    'recurrent_gemma', 'rembert', 'roberta', 'roberta-prelayernorm', 'roc_bert', 'roformer', 'sarvam_mla',
    'sarvam_moe', 'seed_oss', 'smollm3', 'solar_open', 'stablelm', 'starcoder2', 'trocr', 'vaultgemma', 'whisper',
    'xglm', 'xlm', 'xlm-roberta', 'xlm-roberta-xl', 'xlnet', 'xlstm', 'youtu']



@pytest.mark.parametrize("name", [*FAST, *(pytest.param(n, marks=pytest.mark.slow) for n in SLOW),
                                  *(pytest.param(n, marks=[pytest.mark.slow, pytest.mark.sweep]) for n in SWEEP)])
def test_causal_lm_flattens_and_splits_into_the_untouched_model(name: str) -> None:
    """The sequence and its 2- and 3-stage splits: the model's outputs (loss included) and every gradient at 1e-5."""
    model, args, kwargs = build(name)
    ref = _run(model, lambda: model(*args, **kwargs))
    assert getattr(model(*args, **kwargs), "loss", None) is not None, f"{name}: no loss of its own"
    seq = autopipe.flatten(model, args, kwargs, granularity="leaf" if name in LEAF else "block")
    _assert_same(ref, _run(model, lambda: seq(*args, **kwargs)), f"{name} 1 stage")
    for stages in (2, 3):
        parts = seq.split(_even(len(seq), stages))
        _assert_same(ref, _run(model, lambda: _run_stages(parts, args, kwargs)), f"{name} {stages} stages")


def test_reformer_reversible_layers_run_their_own_backward() -> None:
    """Reformer's reversible stack is one opaque call (a note says so), so the sequence's loss gives a
    gradient to every parameter the untouched model's loss does, those of the reversible layers included."""
    model, args, kwargs = build("reformer")
    seq = autopipe.flatten(model, args, kwargs)
    assert any("_ReversibleFunction: kept as one opaque call" in note for note in seq.notes), seq.notes
    trained = []
    for run in (model, seq):
        model.zero_grad(set_to_none=True)
        run(*args, **kwargs).loss.backward()
        trained.append({n for n, p in model.named_parameters() if p.grad is not None})
    model.zero_grad(set_to_none=True)
    assert trained[1] == trained[0] and any(".encoder.layers." in n for n in trained[0])


def test_a_trace_that_lost_the_backward_is_one_line_naming_the_parameters() -> None:
    """torch.export's own forward-only trace of Reformer leaves its loss connected to no parameter of the
    reversible stack: the check refuses it in one line naming the parameters and the Function."""
    model, args, kwargs = build("reformer")
    ep = torch.export.export(model, args, kwargs, strict=False)
    with pytest.raises(TraceMismatchError, match=r"gives no gradient to \d+ parameters the eager model trains "
                                                 r"\(.*\): they are computed inside custom autograd.Function "
                                                 r"_ReversibleFunction") as err:
        check_gradients(model, ep, args, kwargs, {"_ReversibleFunction"})
    assert "\n" not in str(err.value)


def test_gemma3n_is_refused_in_one_line_naming_the_tensor_its_forward_makes() -> None:
    """Gemma3n's decoder layer computes with ``torch.tensor(0.0)`` made inside forward (its AltUp's
    softplus), which torch.export itself cannot keep ("fake tensor in the exported program constant's
    list"): the error says that, where, and what to change, in one line, not torch's text."""
    from autopipe.errors import TraceError

    model, args, kwargs = build("gemma3n_text")
    with pytest.raises(TraceError, match=r"could not trace Gemma3nForCausalLM: the forward of module 'model\.layers\.0' "
                                         r"\(Gemma3nTextDecoderLayer\) makes a tensor from Python values .*"
                                         r"\(register_buffer") as err:
        autopipe.flatten(model, args, kwargs)
    assert "\n" not in str(err.value) and "file an issue" not in str(err.value)


def test_longcat_flashs_expert_loop_traces_batched_and_leaves_the_model_as_it_was() -> None:
    """LongcatFlash's experts loop over the experts the router chose (a data-dependent count torch.export
    cannot trace): the trace runs the same arithmetic batched, says so in a note, and the model keeps its
    own forward afterwards; the sweep above checks the outputs and every gradient against it."""
    model, args, kwargs = build("longcat_flash")
    seq = autopipe.flatten(model, args, kwargs)
    assert any(n.startswith("LongcatFlashExperts: its loop over the routed experts traced") for n in seq.notes)
    experts = [m for m in model.modules() if type(m).__name__ == "LongcatFlashExperts"]
    assert experts and all("forward" not in m.__dict__ for m in experts)
    with pytest.raises(Exception, match="GuardOnDataDependentSymNode|data-dependent"):  # what torch alone does
        torch.export.export(model, args, kwargs, strict=False)


def test_a_gradient_carried_by_an_in_place_write_is_not_taken_for_a_lost_one() -> None:
    """RWKV's recurrence writes each step into a preallocated tensor (``out[:, t] = ...``), a gradient path
    with no data edge in the graph: the graph walk misses it, the graph's own backward does not, so the
    model flattens (it was refused as "no gradient to 8 parameters" before) and trains as itself."""

    class Recurrent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.step = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = torch.zeros_like(x)
            for t in range(x.shape[1]):
                out[:, t] = self.step(x[:, t])
            return out.sum()

    model = Recurrent()
    x = torch.randn(2, 3, 4)
    ep = torch.export.export(model, (x,), strict=False)
    from autopipe.graph.gradients import unreached_parameters

    assert unreached_parameters(ep) == ["step.bias", "step.weight"]  # the walk alone would refuse it
    check_gradients(model, ep, (x,), {})  # the graph's backward says otherwise: no error
    seq = autopipe.flatten(model, (x,))
    for run in (model, seq):
        model.zero_grad(set_to_none=True)
        run(x).backward()
        if run is model:
            want = model.step.weight.grad.clone()
    torch.testing.assert_close(model.step.weight.grad, want, rtol=0, atol=1e-6)
