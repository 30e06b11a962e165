"""Token batches for language-model training: synthetic, from a token file, or from a text file.

A batch is a pure function of ``(seed, step)``: every rank draws the same global batch without
talking to the others, each data-parallel replica takes its slice, and a resumed run sees exactly
the batches an uninterrupted one would have.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from ..errors import AutopipeError
from .weights import module_seed

__all__ = ["TokenData"]


class TokenData:
    """Windows of ``seq_len`` tokens.

    Sources: None (synthetic: a learnable cycle through 64 token ids), a ``.npy`` / ``.pt`` array of token ids, a ``.bin`` file of
    uint16 ids (nanoGPT's format), or any other file read as UTF-8 bytes (one token per byte, so
    the model's vocabulary must have at least 256 entries).

    Example:
        >>> data = TokenData(None, vocab_size=128, seq_len=16, seed=0)
        >>> data.batch(step=0, batch_size=8).shape
        torch.Size([8, 16])
    """

    def __init__(self, source: str | os.PathLike[str] | None, *, vocab_size: int, seq_len: int, seed: int = 0) -> None:
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.seed = seed
        self.tokens: torch.Tensor | None = None
        if source is not None:
            self.tokens = _read_tokens(Path(source))
            top = int(self.tokens.max()) if self.tokens.numel() else 0
            if top >= vocab_size:
                raise AutopipeError(
                    f"{source} holds token id {top} but the model's vocabulary has {vocab_size} entries; "
                    "tokenize for this model (or use a text file with a vocabulary of at least 256)."
                )
            if self.tokens.numel() <= seq_len:
                raise AutopipeError(f"{source} holds {self.tokens.numel()} tokens, fewer than one window of {seq_len + 1}.")

    def batch(self, step: int, batch_size: int, *, replica: int = 0, replicas: int = 1) -> torch.Tensor:
        """Rows of the global batch of ``step`` that data-parallel ``replica`` trains on."""
        if batch_size % replicas:
            raise AutopipeError(f"global batch {batch_size} does not split into {replicas} replicas.")
        g = torch.Generator().manual_seed(module_seed(self.seed, f"data:{step}"))
        if self.tokens is None:
            full = self._synthetic(batch_size, g)
        else:
            starts = torch.randint(0, self.tokens.numel() - self.seq_len, (batch_size,), generator=g, device="cpu")
            full = torch.stack([self.tokens[s : s + self.seq_len] for s in starts.tolist()])
        per = batch_size // replicas
        return full[replica * per : (replica + 1) * per].clone()


    def _synthetic(self, rows: int, g: torch.Generator) -> torch.Tensor:
        """Rows that walk a fixed random cycle through 64 of the vocabulary's ids, from random starts.

        Uniform random tokens cannot be learned (the loss stays at ln V), so a run could not show
        that training works. Here the next token is a function of the current one and only 64 ids
        occur: within a few steps a model learns which ids occur (loss towards ln 64), then the cycle.
        """
        perm = torch.randperm(self.vocab_size, generator=torch.Generator().manual_seed(module_seed(self.seed, "data:ids")))
        ids = perm[: min(self.vocab_size, _SYNTHETIC_IDS)]
        k = len(ids)
        # host tensors: batches are made on the CPU and copied to each rank's device by the trainer
        pos = torch.randint(0, k, (rows, 1), generator=g, device="cpu") + torch.arange(self.seq_len, device="cpu")
        return ids[pos % k]


_SYNTHETIC_IDS = 64


def _read_tokens(path: Path) -> torch.Tensor:
    if not path.is_file():
        raise AutopipeError(f"data file {str(path)!r} does not exist.")
    if path.suffix == ".npy":
        return torch.from_numpy(np.load(path).astype(np.int64).reshape(-1))
    if path.suffix == ".pt":
        return torch.load(path, weights_only=True).long().reshape(-1)
    if path.suffix == ".bin":
        return torch.from_numpy(np.fromfile(path, dtype=np.uint16).astype(np.int64))
    return torch.from_numpy(np.frombuffer(path.read_bytes(), dtype=np.uint8).astype(np.int64))
