"""The memory model from first principles: layers of known size give exactly the bytes each term says."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autopipe
from autopipe.costs.layer_costs import DeviceInfo, LayerCost, Profile, RecomputeCost
from autopipe.planner.memory import RankMemory, layer_memory, rank_memory

MIB = 2**20


def _profile(n: int = 4, *, tied: bool = False, device: str = "cpu") -> Profile:
    """n layers of 1000 parameter bytes, 100 activation bytes, 10 output bytes; AdamW (state 2x).
    ``device``: the profile's device type ("mps": one where the runtime steps foreach AdamW)."""
    layers = []
    for i in range(n):
        layers.append(LayerCost(
            index=i, name=f"l{i}", forward_time=1.0, backward_time=2.0, param_bytes=1000, grad_bytes=1000,
            optimizer_bytes=2000, activation_bytes=100, output_bytes=10, peak_forward_bytes=130,
            peak_backward_bytes=1050, tied=("w",) if tied and i in (0, n - 1) else (),
            recompute={"full": RecomputeCost(10, 1.0)},
        ))  # fmt: skip
    return Profile(layers=tuple(layers), input_bytes=8, tied_static_bytes={"w": 4000} if tied else {},
                   reserve_bytes=7, device=DeviceInfo(type=device))  # fmt: skip


def test_each_term_of_a_two_stage_1f1b_cut() -> None:
    """Static bytes, activations x in-flight, the last output held, one receive buffer per micro-batch
    on each cut facing another rank, the worst one-layer transient, the reserve; and where foreach
    AdamW steps (a device without torch's fused kernel), its temporaries (one state-sized tensor:
    1000 B per layer), which peak after the activations are gone. On a CPU the fused step has none."""
    cpu = rank_memory(_profile(), (0, 2, 4), stage_ranks=(0, 1), inflight=(2, 1), microbatches=4)
    assert [m.optimizer_step for m in cpu] == [0, 0] and cpu[0].total == 8000 + 40 + 7 + 400 + 50
    prof = _profile(device="mps")
    m0, m1 = rank_memory(prof, (0, 2, 4), stage_ranks=(0, 1), inflight=(2, 1), microbatches=4)
    assert m0 == RankMemory(weights=2000, gradients=2000, optimizer=4000, activations=2 * 200, outputs=0,
                            buffers=4 * 10, transient=50, data_parallel=0, reserve=7, optimizer_step=2000)  # fmt: skip
    assert m1 == RankMemory(weights=2000, gradients=2000, optimizer=4000, activations=1 * 200, outputs=1 * 10,
                            buffers=4 * 10, transient=50, data_parallel=0, reserve=7, optimizer_step=2000)  # fmt: skip
    assert m0.total == 8000 + 40 + 7 + max(400 + 50, 2000)
    # transient: max(peak forward - saved, peak backward - gradients written) = max(30, 50)
    (busy,) = rank_memory(prof, (0, 4), stage_ranks=(0,), inflight=(12,), microbatches=12)
    assert busy.total == 16000 + 7 + 12 * 400 + 12 * 10 + 50  # 12 micro-batches in flight outweigh the step's 4000


def test_tied_tensor_counts_once_per_rank_and_on_each_rank_holding_it() -> None:
    """A tensor tied between layer 0 and 3: one copy on a rank holding both, one on each rank otherwise."""
    prof = _profile(tied=True)
    (alone,) = rank_memory(prof, (0, 4), stage_ranks=(0,), inflight=(1,), microbatches=1)
    assert alone.weights + alone.gradients + alone.optimizer == 4 * 4000 - 4000
    split = rank_memory(prof, (0, 2, 4), stage_ranks=(0, 1), inflight=(1, 1), microbatches=1)
    assert [m.weights + m.gradients + m.optimizer for m in split] == [8000, 8000]


def test_recompute_keeps_what_its_mode_keeps_and_rematerialises_one_layer() -> None:
    """Full recompute: 10 bytes kept per layer and micro-batch; backward rebuilds one layer's 100."""
    prof = _profile()
    (full,) = rank_memory(prof, (0, 4), stage_ranks=(0,), inflight=(3,), microbatches=3, recompute=("full",))
    assert full.activations == 3 * 4 * 10
    assert full.transient == 50 + (100 - 10)
    lm = layer_memory(prof)
    assert lm.activations["selective"] == (100,) * 4  # not profiled: selective keeps what none keeps


@pytest.mark.parametrize(
    "zero, schedule, weights, grads, state, gathered, buckets, scatter",
    [
        # 4 layers of 1000 B weights, 1000 B gradients, 2000 B AdamW state, over 4 replicas
        (0, "1f1b", 4000, 4000, 8000, 0, 0, 0),  # replicated; DDP's buckets are the gradients themselves
        (1, "1f1b", 4000, 4000, 2000, 0, 0, 0),  # optimizer state sharded
        (0, "zbv", 4000, 4000, 8000, 0, 8000, 0),  # replicate's own weight copy + accumulated gradients
        (1, "zbv", 4000, 4000, 2000, 0, 8000, 0),
        (2, "1f1b", 1000, 1000, 2000, 8000, 0, 1000),  # everything sharded at rest; under pipelining the
        (3, "1f1b", 1000, 1000, 2000, 8000, 0, 1000),  # whole weights and gradients are gathered for the step
        (3, "zbv", 1000, 1000, 2000, 8000, 0, 1000),
    ],
)
def test_zero_stages_shard_what_they_shard(zero, schedule, weights, grads, state, gathered, buckets, scatter) -> None:
    """ZeRO K over 4 replicas, from first principles: K >= 1 divides the optimizer state by 4, K >= 2
    weights and gradients at rest (and gathers them whole for the step, as FSDP2 under
    PipelineStage does); K <= 1 holds nothing more under DDP (gradient_as_bucket_view: the gradients
    are its buckets), while under zbv torch's replicate (FSDP2 over a shard dimension of one) computes
    with its own copy of the weights and accumulates whole gradients until the all-reduce; K >= 2
    reduce-scatters one layer at a time (a one-off like a transient)."""
    prof = _profile(device="mps")  # foreach AdamW's step temporaries shard with the state
    (m,) = rank_memory(prof, (0, 4), stage_ranks=(0,), inflight=(1,), microbatches=1, dp=4, zero=zero,
                       schedule=schedule)
    (fused,) = rank_memory(_profile(), (0, 4), stage_ranks=(0,), inflight=(1,), microbatches=1, dp=4, zero=zero,
                           schedule=schedule)
    assert fused.optimizer_step == 0 and fused.total == m.total - max(0, m.optimizer_step - (
        m.activations + m.outputs + max(m.transient, scatter)))
    assert (m.weights, m.gradients, m.optimizer, m.gathered, m.data_parallel, m.reduce_scatter) == (
        weights, grads, state, gathered, buckets, scatter)
    assert m.optimizer_step == state // 2  # AdamW steps this replica's share: one of its two state tensors
    assert m.total == weights + grads + state + gathered + buckets + m.buffers + m.reserve + max(
        m.activations + m.outputs + max(m.transient, scatter), m.optimizer_step)


@pytest.mark.parametrize(
    "zero, schedule, weights, grads, state, gathered, buckets, scatter",
    [
        # 4 MoE layers of 1000 B weights (3/4 of them routed experts), 1000 B gradients, 2000 B AdamW
        # state, at ep 2 over 4 replicas: a rank holds 375 B of expert slices + 250 B of the rest per
        # layer. The slices stay out of DDP / replicate / fully_shard, whole on their ranks
        (0, "1f1b", 2500, 2500, 5000, 0, 0, 0),
        (0, "zbv", 2500, 2500, 5000, 0, 2000, 0),  # replicate copies and buckets the 250 + 250 B only
        # ZeRO 1: the rest's state over 4 replicas (500 / 4), the slices' over their 2 (750 / 2)
        (1, "1f1b", 2500, 2500, 4 * (125 + 375), 0, 0, 0),
        # ZeRO 3: the rest sharded 4 ways (250 / 4, rounded up), the slices whole; gathered and
        # reduce-scattered: the rest only
        (3, "1f1b", 4 * (63 + 375), 4 * (63 + 375), 4 * (125 + 750), 4 * 500, 0, 250),
    ],
)
def test_expert_slices_under_ep_are_held_whole_outside_zero_s_shards(zero, schedule, weights, grads, state, gathered,
                                                                      buckets, scatter) -> None:  # fmt: skip
    """Under ep the runtime keeps each expert slice out of the data-parallel engine (whole on its
    rank, its optimizer state too; ZeRO 1's expert optimizer shards that state over the dp / ep
    replicas holding the same slice), so ZeRO's shares, gathers and buckets apply to the rest."""
    from dataclasses import replace

    from autopipe.costs.ep import at_ep
    from autopipe.costs.layer_costs import MoeShape

    moe = MoeShape(experts=4, top_k=1, hidden=8, tokens=10, dispatch_bytes=0, expert_param_share=0.75,
                   expert_forward_share=0.5)  # fmt: skip
    dense = _profile()
    prof = at_ep(replace(dense, layers=tuple(replace(l, moe=moe) for l in dense.layers)), 2, bandwidth=1e9,
                 skew="balanced", latency=0.0, count_latency=0.0)  # fmt: skip
    assert [l.param_bytes for l in prof.layers] == [625] * 4
    (m,) = rank_memory(prof, (0, 4), stage_ranks=(0,), inflight=(1,), microbatches=1, dp=4, zero=zero,
                       schedule=schedule)
    assert (m.weights, m.gradients, m.optimizer, m.gathered, m.data_parallel, m.reduce_scatter) == (
        weights, grads, state, gathered, buckets, scatter)
    (one,) = rank_memory(replace(dense, layers=tuple(replace(l, moe=moe) for l in dense.layers)), (0, 4),
                         stage_ranks=(0,), inflight=(1,), microbatches=1, dp=4, zero=zero, schedule=schedule)
    assert one.weights == (4000 if zero < 2 else 1000)  # at ep 1 the experts are parameters like any other


def test_one_replica_shards_nothing_whatever_the_zero_stage() -> None:
    prof = _profile()
    plain = rank_memory(prof, (0, 2, 4), stage_ranks=(0, 1), inflight=(2, 1), microbatches=4)
    for zero in (1, 2, 3):
        assert rank_memory(prof, (0, 2, 4), stage_ranks=(0, 1), inflight=(2, 1), microbatches=4, zero=zero) == plain


def test_a_tied_tensor_is_sharded_and_gathered_once_per_rank() -> None:
    """GPT-2's wte/lm_head under ZeRO 3 on one rank: the tie's shard and its gathered copy count once."""
    prof = _profile(tied=True)  # tied tensor: 1000 weights + 1000 gradients + 2000 state, in layers 0 and 3
    (m,) = rank_memory(prof, (0, 4), stage_ranks=(0,), inflight=(1,), microbatches=1, dp=2, zero=3)
    assert (m.weights, m.gradients, m.optimizer) == (3 * 500, 3 * 500, 3 * 1000)
    assert m.gathered == 3 * 2000


def test_interleaved_ranks_hold_their_chunks_and_no_buffer_between_local_chunks() -> None:
    """zbv: rank 0 holds chunks 0 and 3 (V); rank 1 chunks 1 and 2, which meet on rank 1 itself."""
    prof = _profile()
    m0, m1 = rank_memory(prof, (0, 1, 2, 3, 4), stage_ranks=(0, 1, 1, 0), inflight=(2, 2, 2, 2), microbatches=2)
    assert m0.buffers == 2 * 10 + 2 * 10  # chunk 0's output cut, chunk 3's input cut
    assert m1.buffers == 2 * 10 + 2 * 10  # chunk 1's input, chunk 2's output; 1->2 stays on the rank
    assert m0.outputs == 2 * 10 and m1.outputs == 0


class _MLP(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + b(x)
        return x


def test_profiled_mlp_terms_match_first_principles() -> None:
    """A real profile of 4 MLP blocks (d=64, batch 32): static = params x 4 bytes x (1 + 1 + 2) for
    AdamW in fp32; receive buffers = micro-batches x the tensors crossing the cut."""
    d, rows = 64, 32
    torch.manual_seed(0)
    model = _MLP(d)
    x = torch.randn(rows, d, requires_grad=True)
    seq = autopipe.flatten(model, (x,))
    prof = autopipe.profile(seq, (x,), repeats=1, warmup=0, progress=False)
    params_per_block = 4 * d * d + 4 * d + 4 * d * d + d
    bounds = (0, 2, len(seq.layers))
    m0, m1 = rank_memory(prof, bounds, stage_ranks=(0, 1), inflight=(2, 1), microbatches=4)
    per_layer = [sum(p.numel() for p in layer.parameters()) for layer in seq.layers]
    assert sum(per_layer) == 4 * params_per_block
    assert m0.weights == 4 * sum(per_layer[:2]) and m0.optimizer == 2 * m0.weights and m0.gradients == m0.weights
    hidden = rows * d * 4
    # the residual add runs in the parent's forward, so x and the block's output both cross a cut
    assert prof.layers[1].output_bytes == 2 * hidden
    assert m0.buffers == 4 * 2 * hidden and m1.buffers == 4 * 2 * hidden
    assert m1.outputs == 1 * hidden  # the model's output, held until its backward
    assert m0.activations == 2 * sum(prof.layers[i].activation_bytes for i in range(2))


@pytest.mark.parametrize("inflight", [1, 3])
def test_total_grows_by_one_micro_batch_of_activations_per_micro_batch_in_flight(inflight: int) -> None:
    """Each further micro-batch in flight adds exactly the chunk's activations and held outputs (SGD:
    no step temporaries for the activations to stay below)."""
    prof = _profile()
    (a,) = rank_memory(prof, (0, 4), stage_ranks=(0,), inflight=(inflight,), microbatches=4, optimizer="sgd")
    (b,) = rank_memory(prof, (0, 4), stage_ranks=(0,), inflight=(inflight + 1,), microbatches=4, optimizer="sgd")
    assert b.total - a.total == 4 * 100 + 10


class _Embed(nn.Module):
    def __init__(self, vocab: int, d: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.proj = nn.Linear(d, d)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.proj(self.emb(ids))


def test_a_backward_s_fresh_gradient_is_a_transient_on_top_of_the_held_one() -> None:
    """The trainer holds ``.grad`` from the start, so a backward computes each gradient into a new
    tensor and adds it in: an embedding's dense gradient (vocab x d x 4 bytes) exists twice for a
    moment. The profile's backward peak is taken that way, so the embedding layer's transient is at
    least one more embedding-sized gradient (taken with autograd.grad it read ~0: the fresh gradient
    was counted as the held one)."""
    vocab, d = 4096, 64
    torch.manual_seed(0)
    model = _Embed(vocab, d)
    ids = torch.randint(0, vocab, (8, 16))
    seq = autopipe.flatten(model, (ids,))
    prof = autopipe.profile(seq, (ids,), repeats=1, warmup=0, progress=False)
    lm = layer_memory(prof)
    emb = next(i for i, layer in enumerate(seq.layers) if any(p.shape == (vocab, d) for p in layer.parameters()))
    assert lm.transient["none"][emb] >= vocab * d * 4
    # and no .grad is left behind by the profiler
    assert all(p.grad is None for p in model.parameters())


def test_runtime_driven_schedules_hold_every_send_to_the_step_s_end() -> None:
    """torch's action runtime (interleaved, zbv) waits its sends at the step's end: each cut facing
    another rank holds M sent tensors beside its M receive buffers; zbv's hand-off between its two
    tip chunks on one rank holds M inputs and M gradients. 1F1B and GPipe wait theirs at once."""
    prof = _profile(8)  # 10 bytes cross every cut
    m = 4
    inter = rank_memory(prof, (0, 2, 4, 6, 8), stage_ranks=(0, 1, 0, 1), inflight=(4, 3, 2, 1), microbatches=m,
                        schedule="interleaved1f1b")  # fmt: skip
    assert [r.buffers for r in inter] == [3 * m * 10, 3 * m * 10]  # rank 0: chunk 0 out; chunk 2 in and out
    assert [r.sends for r in inter] == [r.buffers for r in inter]
    zbv = rank_memory(prof, (0, 2, 4, 6, 8), stage_ranks=(0, 1, 1, 0), inflight=(4, 3, 2, 1), microbatches=m,
                      schedule="zbv")  # fmt: skip
    assert [r.buffers for r in zbv] == [2 * m * 10, 2 * m * 10]
    assert [r.sends for r in zbv] == [2 * m * 10, 2 * m * 10 + 2 * m * 10]  # rank 1 also keeps the hand-off
    for schedule in ("1f1b", "gpipe"):
        flat = rank_memory(prof, (0, 4, 8), stage_ranks=(0, 1), inflight=(2, 1), microbatches=m, schedule=schedule)
        assert [r.sends for r in flat] == [0, 0]
    assert inter[0].total - inter[0].sends == rank_memory(
        prof, (0, 2, 4, 6, 8), stage_ranks=(0, 1, 0, 1), inflight=(4, 3, 2, 1), microbatches=m)[0].total
