"""What a job trains on: synthetic tokens, or the user's files, read only where and as far as needed.

Sources (``open_data``):

- token files: ``.bin`` (uint16 ids, nanoGPT's format), ``.npy`` (memory-mapped), ``.pt`` (a 1-D
  tensor, memory-mapped): a stream of token ids cut into windows;
- text (``.txt`` or any other file): through the model folder's tokenizer when it has one, else
  UTF-8 bytes as ids (the vocabulary must then have 256 entries or more);
- sample files: ``.npz`` or ``.pt`` holding ``x`` and ``y`` (inputs and targets) for any model, or
  arrays named after the model's inputs (``input_ids``, ``mask``, ``labels``...);
- HuggingFace ``datasets`` files (``.parquet``, ``.jsonl``/``.json``, ``.arrow``; a folder of them or
  one ``Dataset.save_to_disk`` wrote): a ``text`` or
  ``input_ids`` column is a token stream (concatenated, as HF's ``group_texts`` does); with a
  ``label`` column, ``source``/``target`` text pairs (seq2seq), or columns named ``x``/``y`` or after
  the inputs, rows are samples (text columns tokenized row by row).

Every batch is a pure function of ``(seed, step)``: epoch ``e`` visits the samples (or windows) in a
permutation seeded from ``(seed, e)``; step ``s`` takes the next ``rows`` of that order and
data-parallel replica ``r`` its own slice of them, so replicas read disjoint samples and a resumed run
continues the data exactly where it stopped (the position, ``step x rows``, is in each checkpoint).

Only what a rank needs is read: the first pipeline stage reads inputs, the last one targets, middle
stages nothing; token files are memory-mapped, so a rank touches just the windows it trains on.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...errors import AutopipeError
from .files import DataError, check_data_path
from ..stage.weights import module_seed

__all__ = ["DataError", "SampleData", "TokenData", "TokenStream", "open_data", "epoch_order"]

TOKEN_SUFFIXES = (".bin", ".npy")
DATASET_SUFFIXES = (".parquet", ".jsonl", ".json", ".arrow")


class TokenData:
    """Synthetic windows of ``seq_len`` tokens (what a job trains on without --data), or windows of
    a token file (``source``), drawn at random positions.

    The synthetic tokens walk a fixed random cycle through 64 of the vocabulary's ids, so a model
    can learn them (uniform random tokens cannot be learned: the loss would stay at ln V).

    Example:
        >>> data = TokenData(None, vocab_size=128, seq_len=16, seed=0)
        >>> data.batch(step=0, batch_size=8).shape
        torch.Size([8, 16])
    """

    def __init__(self, source: str | os.PathLike[str] | None, *, vocab_size: int, seq_len: int, seed: int = 0) -> None:
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.seed = seed
        self.stream: TokenStream | None = None
        if source is not None:
            self.stream = TokenStream.open(Path(source), vocab_size=vocab_size)
            self.stream.check(vocab_size=vocab_size, span=seq_len, source=source)

    def batch(self, step: int, batch_size: int, *, replica: int = 0, replicas: int = 1) -> torch.Tensor:
        """Rows of the global batch of ``step`` that data-parallel ``replica`` trains on."""
        if batch_size % replicas:
            raise AutopipeError(f"global batch {batch_size} does not split into {replicas} replicas.")
        g = torch.Generator().manual_seed(module_seed(self.seed, f"data:{step}"))
        per = batch_size // replicas
        if self.stream is None:
            return self._synthetic(batch_size, g)[replica * per : (replica + 1) * per].clone()
        starts = torch.randint(0, len(self.stream.ids) - self.seq_len, (batch_size,), generator=g, device="cpu")
        mine = starts[replica * per : (replica + 1) * per].tolist()
        return torch.from_numpy(np.stack([np.asarray(self.stream.ids[s : s + self.seq_len], dtype=np.int64) for s in mine]))

    def _synthetic(self, rows: int, g: torch.Generator) -> torch.Tensor:
        perm = torch.randperm(self.vocab_size, generator=torch.Generator().manual_seed(module_seed(self.seed, "data:ids")),
                              device="cpu")
        ids = perm[: min(self.vocab_size, _SYNTHETIC_IDS)]
        k = len(ids)
        # host tensors: batches are made on the CPU and copied to each rank's device by the trainer
        pos = torch.randint(0, k, (rows, 1), generator=g, device="cpu") + torch.arange(self.seq_len, device="cpu")
        return ids[pos % k]


_SYNTHETIC_IDS = 64


def epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
    """The order epoch ``epoch`` visits ``n`` samples in (a permutation seeded from seed and epoch)."""
    g = torch.Generator().manual_seed(module_seed(seed, f"data:epoch:{epoch}"))
    return torch.randperm(n, generator=g, device="cpu").numpy()


class EpochOrder:
    """Which samples step ``s`` of a run takes: rows ``[s·R, (s+1)·R)`` of the concatenated epoch orders.

    ``shuffle=False`` (evaluation) visits the samples in their order, every epoch alike.
    """

    def __init__(self, n: int, seed: int, *, shuffle: bool = True) -> None:
        self.n, self.seed, self.shuffle = n, seed, shuffle
        self._cache: dict[int, np.ndarray] = {} if shuffle else {0: np.arange(n)}

    def indices(self, step: int, rows: int, replica: int, replicas: int) -> np.ndarray:
        if rows % replicas:
            raise AutopipeError(f"global batch {rows} does not split into {replicas} replicas.")
        per = rows // replicas
        first = step * rows + replica * per
        out = np.empty(per, dtype=np.int64)
        for i in range(per):
            epoch, pos = divmod(first + i, self.n)
            epoch = epoch if self.shuffle else 0
            if epoch not in self._cache:
                self._cache = {epoch: epoch_order(self.n, self.seed, epoch)}  # one epoch held at a time
            out[i] = self._cache[epoch][pos]
        return out


@dataclass
class TokenStream:
    """A 1-D sequence of token ids, memory-mapped where the format allows."""

    ids: Any  # np.memmap / np.ndarray / torch.Tensor (1-D)
    path: Path
    tokenizer: str = ""  # how text was tokenized ("bytes", a tokenizer's name), "" for token files

    @classmethod
    def open(cls, path: Path, *, vocab_size: int, tokenizer_dir: str | None = None) -> "TokenStream":
        check_data_path(path)
        suffix = path.suffix.lower()
        if suffix == ".bin":
            if path.stat().st_size % 2:
                raise DataError(f"{path} has an odd number of bytes; a .bin token file holds uint16 ids (nanoGPT's format).")
            return cls(np.memmap(path, dtype=np.uint16, mode="r") if path.stat().st_size else np.zeros(0, np.uint16), path)
        if suffix == ".npy":
            arr = np.load(path, mmap_mode="r")
            if arr.ndim != 1 or arr.dtype.kind not in "iu":
                raise DataError(f"{path} holds a {arr.dtype} array of shape {arr.shape}; a token file is a 1-D integer array.")
            return cls(arr, path)
        if suffix == ".pt":
            t = _torch_load(path)
            if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.is_floating_point():
                raise DataError(f"{path} holds no 1-D integer tensor of token ids (for inputs and targets save a dict with 'x' and 'y').")
            return cls(t, path)
        return _tokenize_text(path, vocab_size=vocab_size, tokenizer_dir=tokenizer_dir)

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def check(self, *, vocab_size: int, span: int, source: Any) -> None:
        if len(self) < span:
            raise DataError(f"{source} holds {len(self)} tokens, fewer than one window of {span}; give more data or a smaller --seq-len.")
        top = _sampled_max(self.ids)
        if vocab_size and top >= vocab_size:
            how = "tokenize it for this model" if self.tokenizer in ("", "bytes") else "use the model's own tokenizer"
            raise DataError(
                f"{source} holds token id {top} but the model's vocabulary has {vocab_size} entries; {how}"
                + (" (text read as bytes needs a vocabulary of at least 256)." if self.tokenizer == "bytes" else ".")
            )

    def windows(self, index: np.ndarray, span: int) -> torch.Tensor:
        """Windows ``index`` of ``span`` tokens (window i covers ids[i·span, (i+1)·span)); reads only those."""
        rows = [np.asarray(self.ids[int(i) * span : (int(i) + 1) * span], dtype=np.int64) for i in index]
        return torch.from_numpy(np.stack(rows)) if rows else torch.zeros(0, span, dtype=torch.long)


def _sampled_max(ids: Any) -> int:
    """The largest id, reading at most ~4M ids spread over the file (a 20 GB file is not read whole)."""
    n = int(ids.shape[0])
    if n <= 1 << 22:
        return int(np.asarray(ids).max()) if n else 0
    step = n // 64
    return max(int(np.asarray(ids[i : i + (1 << 16)]).max()) for i in range(0, n, step))


def _tokenize_text(path: Path, *, vocab_size: int, tokenizer_dir: str | None) -> TokenStream:
    text = path.read_text(encoding="utf-8", errors="replace")
    if tokenizer_dir is not None:
        tok = load_tokenizer(tokenizer_dir)
        if tok is not None:
            ids = tok(text, add_special_tokens=False)["input_ids"]
            return TokenStream(np.asarray(ids, dtype=np.int64), path, tokenizer=type(tok).__name__)
    return TokenStream(np.frombuffer(text.encode("utf-8"), dtype=np.uint8), path, tokenizer="bytes")


def load_tokenizer(folder: str | os.PathLike[str] | None) -> Any:
    """The tokenizer saved in a local HuggingFace folder, or None when it has none."""
    if folder is None or not Path(folder).is_dir():
        return None
    names = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "spiece.model", "tokenizer.model", "vocab.json")
    if not any((Path(folder) / n).is_file() for n in names):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError) as e:
        raise DataError(f"the tokenizer in {folder} could not be loaded ({e}); fix it or remove its files to read text as bytes.") from None


@dataclass
class SampleData:
    """Samples: named arrays with one row per sample (``x``/``y``, or the model's input names).

    Arrays are loaded on first use, so a rank that needs only ``y`` never reads ``x``.
    """

    path: Path
    loaders: dict[str, Any]  # name -> zero-argument function returning the array
    n: int
    _cache: dict[str, Any] = field(default_factory=dict)

    @property
    def names(self) -> list[str]:
        return list(self.loaders)

    def array(self, name: str) -> Any:
        if name not in self._cache:
            self._cache[name] = self.loaders[name]()
        return self._cache[name]

    def kind(self, name: str) -> str:
        """``ragged`` for tokenized text (rows of their own lengths), else ``array``."""
        return "ragged" if isinstance(self.array(name), list) else "array"

    def rows(self, name: str, index: np.ndarray) -> torch.Tensor:
        arr = self.array(name)
        if isinstance(arr, torch.Tensor):
            return arr[torch.from_numpy(index)].clone()
        return torch.from_numpy(np.ascontiguousarray(np.asarray(arr)[index]))


def _torch_load(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # an old (non-zipfile) .pt cannot be memory-mapped
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:
            raise DataError(f"{path} could not be read as a torch file ({type(e).__name__}: {str(e).splitlines()[0]}).") from None


def samples_from_mapping(path: Path, loaders: dict[str, Any], lengths: dict[str, int]) -> SampleData:
    if not loaders:
        raise DataError(f"{path} holds no arrays; save x (inputs) and y (targets), or arrays named after the model's inputs.")
    if len(set(lengths.values())) > 1:
        raise DataError(f"{path}: arrays have different numbers of rows ({lengths}); every array needs one row per sample.")
    n = next(iter(lengths.values()))
    if n == 0:
        raise DataError(f"--data {str(path)!r} is empty (0 samples).")
    return SampleData(path, loaders, n)


def _open_samples(path: Path) -> SampleData | TokenStream:
    suffix = path.suffix.lower()
    if suffix == ".npz":
        try:
            f = np.load(path)
        except Exception as e:
            raise DataError(f"{path} could not be read as a .npz file ({e}).") from None
        lengths = {k: int(f[k].shape[0]) if f[k].ndim else 0 for k in f.files}
        return samples_from_mapping(path, {k: (lambda k=k: f[k]) for k in f.files}, lengths)
    obj = _torch_load(path)
    if isinstance(obj, torch.Tensor):
        return TokenStream.open(path, vocab_size=0)
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise DataError(f"{path} holds a {type(obj).__name__}; save a dict of tensors with 'x' and 'y', or a 1-D tensor of token ids.")
    return samples_from_mapping(path, {k: (lambda v=v: v) for k, v in obj.items()},
                                 {k: int(v.shape[0]) if v.dim() else 0 for k, v in obj.items()})


def _open_dataset(path: Path, *, tokenizer_dir: str | None) -> SampleData | TokenStream:
    try:
        import datasets
    except ImportError:
        raise DataError(f"reading {path.name} needs HuggingFace datasets: pip install datasets.") from None
    builders = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}
    saved = path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file())
    if saved:  # a folder Dataset.save_to_disk wrote: its .arrow shards beside its own .json metadata
        builder = "save_to_disk"
    else:
        files = sorted(str(p) for p in path.iterdir() if p.suffix.lower() in DATASET_SUFFIXES) if path.is_dir() else [str(path)]
        if not files:
            raise DataError(f"{path} holds no .parquet, .jsonl or .arrow files.")
        builder = builders[Path(files[0]).suffix.lower()]
        files = [f for f in files if builders[Path(f).suffix.lower()] == builder]  # one format: the first file's
    try:
        if saved:
            ds = datasets.load_from_disk(str(path))
            if isinstance(ds, datasets.DatasetDict):
                ds = ds["train"] if "train" in ds else next(iter(ds.values()))
        else:
            ds = datasets.load_dataset(builder, data_files=files, split="train")
    except Exception as e:
        raise DataError(f"{path} could not be read as {builder} data ({type(e).__name__}: {str(e).splitlines()[0]}).") from None
    if len(ds) == 0:
        raise DataError(f"--data {str(path)!r} is empty (0 rows).")
    cols = set(ds.column_names)
    stream_col = "input_ids" if "input_ids" in cols else "text" if "text" in cols else None
    labelled = cols & {"label", "labels", "y", "target"}
    if stream_col is not None and not labelled:
        if stream_col == "text":
            tok = load_tokenizer(tokenizer_dir)
            texts = list(ds["text"])  # datasets 4+: a lazy Column, which tokenizers do not take
            if tok is not None:
                ids = [i for row in tok(texts, add_special_tokens=True)["input_ids"] for i in row]
                return TokenStream(np.asarray(ids, dtype=np.int64), path, tokenizer=type(tok).__name__)
            joined = "\n".join(texts).encode("utf-8")
            return TokenStream(np.frombuffer(joined, dtype=np.uint8), path, tokenizer="bytes")
        return TokenStream(np.asarray([i for row in ds["input_ids"] for i in row], dtype=np.int64), path)
    loaders: dict[str, Any] = {}
    tok = None
    for col in ds.column_names:
        if getattr(ds.features[col], "dtype", None) in ("string", "large_string"):  # text: token rows of their own lengths
            tok = tok or load_tokenizer(tokenizer_dir)
            loaders[col] = lambda col=col, tok=tok: _tokenize_rows(ds[col], tok)
        else:
            loaders[col] = lambda col=col: np.asarray(ds[col])
    return SampleData(path, loaders, len(ds))


def _tokenize_rows(texts: Sequence[str], tok: Any) -> list[np.ndarray]:
    if tok is None:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.int64) for t in texts]
    return [np.asarray(r, dtype=np.int64) for r in tok(list(texts), add_special_tokens=True)["input_ids"]]


def open_data(path: str | os.PathLike[str], *, tokenizer_dir: str | None = None) -> SampleData | TokenStream:
    """Open ``--data``: a token stream or samples (see the module docstring). Nothing is read yet
    beyond what telling them apart needs; a missing or empty file is a one-line :class:`DataError`."""
    p = Path(path)
    check_data_path(p)
    suffix = p.suffix.lower()
    if p.is_dir() or suffix in DATASET_SUFFIXES:
        return _open_dataset(p, tokenizer_dir=tokenizer_dir)
    if suffix in (".npz", ".pt"):
        return _open_samples(p)
    return TokenStream.open(p, vocab_size=0, tokenizer_dir=tokenizer_dir)
