"""What bf16 autocast moves a model by itself: the untouched model under autocast with each SDPA
backend, against fp32 and against each other. ``train.py --verify`` under bf16 can only be read
against this floor (a job whose difference sits far above it computes another function).

    python bench/bf16_floor.py llama-1b 1024     # on a GPU (bench/gpu_first.sh PART=llama runs it)

Prints the loss of each run and, per pair, the largest logit and embedding-gradient difference.
Measured on an H200 (2026-11-28, bench/results/gpu.md): Llama-1B at 4 x 1024, logits 0.125-0.176
apart between any two, the embedding gradient 3.5e-4 to 7.3e-4, the loss 3e-4.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from autopipe.graph.sources import load_model  # noqa: E402


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "llama-1b"
    seq = int(sys.argv[2]) if len(sys.argv) > 2 else 1024
    device = "cuda" if torch.cuda.is_available() else "cpu"
    spec = load_model(name, device=device, batch_size=4, seq_len=seq)
    model = spec.model.train()
    ids = torch.randint(0, spec.vocab_size, (4, seq), generator=torch.Generator().manual_seed(1)).to(device)
    embed = model.get_input_embeddings().weight

    def run(amp: bool, backend: SDPBackend | None = None) -> tuple[torch.Tensor, float, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        pick = sdpa_kernel([backend]) if backend is not None else torch.autocast(device, enabled=False)
        with pick, torch.autocast(device, dtype=torch.bfloat16, enabled=amp):
            out = model(ids, labels=ids, use_cache=False)
        out.loss.backward()
        return out.logits.detach().float(), float(out.loss.detach()), embed.grad.detach().float().clone()

    rows = {"fp32": run(False)}
    for label, backend in (("bf16 default", None), ("bf16 flash", SDPBackend.FLASH_ATTENTION),
                           ("bf16 efficient", SDPBackend.EFFICIENT_ATTENTION), ("bf16 math", SDPBackend.MATH)):
        try:
            rows[label] = run(True, backend)
        except RuntimeError as e:  # a backend this device or shape has no kernel for
            print(f"{label}: not run ({str(e).splitlines()[0][:100]})")
    print(f"{name}, 4 x {seq} on {device}: loss", {k: round(v[1], 6) for k, v in rows.items()},
          f"largest |logit| {float(rows['fp32'][0].abs().max()):.3f}")
    names = list(rows)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            (la, _, ga), (lb, _, gb) = rows[a], rows[b]
            print(f"{a:>15} vs {b:<15} logits {float((la - lb).abs().max()):.3e}  embedding gradient "
                  f"{float((ga - gb).abs().max()):.3e}")


if __name__ == "__main__":
    main()
