"""DeepSpeed's pipeline engine, as autopipe runs it, reuses a receive buffer only for its own dtype.

Its engine keeps one list of receive buffers for the activations a stage receives and the gradients
sent back, and reused one of enough elements whatever its dtype: a traced Llama's middle stage got a
float gradient into the uint8 mask's buffer, and gloo aborted on any Llama of 3+ stages (seen in
bench/bench_peers.py; after the fix a 4-stage Llama's losses and norms equal the torch engine's).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch


@pytest.mark.deepspeed
def test_a_receive_buffer_of_another_dtype_is_replaced_and_one_of_the_same_reused() -> None:
    from autopipe.runtime.deepspeed_engine.trainer import _import_deepspeed

    deepspeed = _import_deepspeed()  # puts the typed reuse in
    allocate = deepspeed.runtime.pipe.engine.PipelineEngine._allocate_or_extend_buffers
    mask = torch.zeros(4 * 128 * 128, dtype=torch.uint8)  # an activation's buffer at position 0
    engine = SimpleNamespace(_grad_layer_buf=[mask],
                             _allocate_buffer=lambda shape, dtype, num_buffers: [torch.zeros(shape, dtype=dtype)])
    grad = allocate(engine, 0, [1, 128, 64], torch.float32)
    assert grad.dtype == torch.float32 and list(grad.shape) == [1, 128, 64]
    assert engine._grad_layer_buf[0] is grad and mask.dtype == torch.uint8  # the activation keeps its own
    again = allocate(engine, 0, [1, 128, 32], torch.float32)  # the same dtype, fewer elements: a view of it
    assert again.data_ptr() == grad.data_ptr() and list(again.shape) == [1, 128, 32]
