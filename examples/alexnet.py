"""An AlexNet-like CNN cut into a 2-stage pipeline, with no hand-written layer list.

With DeepSpeed today one rewrites the model as a list of layers for ``PipelineModule``, and the
flatten between the convolutions and the classifier becomes a lambda layer:

    layers = [*model.features, lambda x: torch.flatten(x, 1), *model.classifier]  # by hand
    net = PipelineModule(layers=layers, loss_fn=nn.CrossEntropyLoss(), num_stages=2)

autopipe traces the model's own forward instead; ``torch.flatten`` is just part of the graph, and the
cut goes where the measured costs are balanced, not where the parameters are (the convolutions hold
few parameters and cost much; the classifier the opposite).

    python examples/alexnet.py
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["AlexNetLike", "build"]


class AlexNetLike(nn.Module):
    """AlexNet's shape (5 convolutions, 3 fully connected layers) for 32x32 images."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # 16x16
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # 8x8
            nn.Conv2d(64, 96, 3, padding=1), nn.ReLU(),
            nn.Conv2d(96, 64, 3, padding=1), nn.ReLU(),
            nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # 4x4
        )  # fmt: skip
        self.classifier = nn.Sequential(
            nn.Dropout(0.0), nn.Linear(64 * 4 * 4, 512), nn.ReLU(),
            nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, classes),
        )  # fmt: skip

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.features(images)
        x = torch.flatten(x, 1)  # the step DeepSpeed users write as a lambda layer
        return F.cross_entropy(self.classifier(x), labels)


def build(batch_size: int = 16) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """Factory for `autopipe convert examples/alexnet.py:build --stages 2`."""
    torch.manual_seed(0)
    return AlexNetLike(), (torch.randn(batch_size, 3, 32, 32), torch.randint(0, 10, (batch_size,)))


if __name__ == "__main__":
    import autopipe

    model, args = build()
    seq = autopipe.flatten(model, args)
    print(f"{len(seq.layers)} layers, each one Tensor or a tuple of Tensors in and out:")
    for info in seq.infos:
        print(f"  {info.index:2d} {info.name:28s} params {info.params:>7d}  out {', '.join(map(str, info.outputs))}")
    prof = autopipe.profile(seq, args, repeats=3, warmup=1, progress=False)
    plan = autopipe.partition(prof, stages=2)
    by_params = autopipe.partition(prof, stages=2, method="parameters")
    print(f"autopipe cuts before layer {plan.boundaries[1]} ({seq.infos[plan.boundaries[1]].name}); "
          f"balancing parameters would cut before layer {by_params.boundaries[1]}")
    print(f"slowest stage: autopipe {plan.bottleneck_time * 1e3:.2f} ms, by parameters "
          f"{by_params.bottleneck_time * 1e3:.2f} ms per micro-batch")

    # The two stages run one after the other are the model: same loss, same gradients. The layers
    # hold the model's own Parameter objects, so take the pipeline's gradients, then the model's.
    stage0, stage1 = seq.split(plan)
    loss = stage1(stage0(*args))
    loss.backward()
    piped = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    expected = model(*args)
    expected.backward()
    torch.testing.assert_close(loss, expected)
    for name, p in model.named_parameters():
        torch.testing.assert_close(piped[name], p.grad, msg=lambda m: f"{name}: {m}")
    print(f"2 stages reproduce the model: loss {loss.item():.4f}, gradients of {len(piped)} tensors equal")
