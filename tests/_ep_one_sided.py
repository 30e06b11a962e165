"""Run by tests/test_expert_parallel.py on 2 gloo processes: every token of both ranks routed to rank
0's experts, so rank 1 receives no rows. Each rank's output, input gradient and expert-slice
gradients must equal the untouched experts module's (rank 0's slices: the sum over both ranks'
tokens; rank 1's: zero), forward and backward finishing on both. Prints ``ok RANK``."""

import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tp_models  # noqa: E402

from autopipe.graph.expert_calls import experts_as_calls  # noqa: E402
from autopipe.runtime.stage.expert_parallel import apply_expert_parallel_, plan_expert_parallel  # noqa: E402

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = tp_models.qwen3_moe_aux(2)[0]
name = "model.layers.0.mlp.experts"
experts = model.get_submodule(name)
tokens, k, hidden = 6, 2, experts.gate_up_proj.shape[-1]
xs = [torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(r)) for r in range(2)]
idx = torch.tensor([[0, 1], [1, 0], [0, 1], [0, 1], [1, 0], [1, 0]])  # experts 0 and 1: ep rank 0's
w = torch.softmax(torch.randn(tokens, k, generator=torch.Generator().manual_seed(9)), -1)

refs, grads = [], {}
for r in range(2):  # the untouched module, on each rank's tokens
    x = xs[r].clone().requires_grad_(True)
    out = experts(x, idx, w)
    out.square().sum().backward()
    refs.append((out.detach(), x.grad))
whole = {a: p.grad.clone() for a, p in experts.named_parameters()}

x = xs[rank].clone().requires_grad_(True)
with experts_as_calls(model) as calls:
    params = {f"{name}.{a}": p for a, p in experts.named_parameters()}
    build = SimpleNamespace(params=params, chunks=[experts])
    apply_expert_parallel_(build, plan_expert_parallel({name: calls[name]}, 2, dist.group.WORLD))
    out = experts(x, idx, w)
    out.square().sum().backward()
torch.testing.assert_close(out.detach(), refs[rank][0], atol=1e-6, rtol=1e-5)
torch.testing.assert_close(x.grad, refs[rank][1], atol=1e-6, rtol=1e-5)
for a, p in experts.named_parameters():
    assert p.shape[0] == 2, (a, p.shape)
    expected = whole[a][:2] if rank == 0 else torch.zeros_like(p)  # rank 1 received nothing
    got = p.grad if p.grad is not None else torch.zeros_like(p)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)
print(f"ok {rank}", flush=True)
dist.destroy_process_group()
