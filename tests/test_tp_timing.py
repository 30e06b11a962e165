"""Each layer timed at a tp degree as the runtime runs it (autopipe/runtime/checks/tp_timing.py): on a
real traced Llama at tp 2, plain and with sequence parallelism, every layer gets a ratio, identical
blocks one ratio, and the sequence and the process are left as they were; a process that already has
a process group is refused in one line."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import autopipe
from autopipe.errors import AutopipeError
from autopipe.runtime.checks.tp_timing import time_at_tp


@pytest.fixture(scope="module")
def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256, use_cache=False)  # fmt: skip
    model = LlamaForCausalLM(cfg)
    ids = torch.randint(0, 256, (2, 16))
    seq = autopipe.flatten(model, (ids,), {"labels": ids}, validate=False)
    return model, seq, (ids,), {"labels": ids}


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_every_layer_is_timed_at_tp_and_the_sequence_is_left_as_it_was(llama, sp: bool) -> None:
    model, seq, args, kwargs = llama
    before = {n: (p, p.detach().clone()) for n, p in seq.named_parameters()}
    forwards = [l.forward for l in seq.layers]
    expected = seq(*args, **kwargs).loss
    ratios = time_at_tp(seq, model, args, kwargs, 2, sequence_parallel=sp, warmup=0, repeats=2)
    assert len(ratios) == len(seq.layers)
    assert all(math.isfinite(f) and math.isfinite(b) and f > 0 and b > 0 for f, b in ratios), ratios
    blocks = [r for r, info in zip(ratios, seq.infos) if info.name.startswith("model.layers.")]
    assert len(blocks) == 2 and blocks[0] == blocks[1]  # one structure, timed once
    assert not dist.is_initialized()
    after = dict(seq.named_parameters())
    assert all(after[n] is p and type(p) is torch.nn.Parameter and torch.equal(p, v) for n, (p, v) in before.items())
    assert [l.forward for l in seq.layers] == forwards
    torch.testing.assert_close(seq(*args, **kwargs).loss, expected, rtol=0, atol=0)


def test_a_process_with_a_process_group_is_refused(llama) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    model, seq, args, kwargs = llama
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        with pytest.raises(AutopipeError, match="has a process group already"):
            time_at_tp(seq, model, args, kwargs, 2)
    finally:
        dist.destroy_process_group()
