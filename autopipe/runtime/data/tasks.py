"""From data to the model's arguments and a loss: what each kind of model trains on.

A job's batches come from ``JobData``: the data (synthetic, ``--data``, or the factory's) turned into
the model's own arguments, plus a target when the loss is the user's. The conventions are
HuggingFace's, so a HF user gets what their own training loop would give:

| task | inputs | labels / target |
| --- | --- | --- |
| causal LM | a window of T tokens | the same ids as ``labels`` (the model shifts them) |
| masked LM | the window, 15% of tokens chosen (never special ones): 80% of those become the mask token, 10% a random token, 10% stay | the original id at chosen positions, -100 elsewhere (``DataCollatorForLanguageModeling``) |
| seq2seq | T tokens | the next T tokens as ``labels`` (the model makes the decoder inputs by shifting them right) |
| sequence / image classification | ids or pixels (``x``) | class ids (``y``) as ``labels`` |
| any model, ``--loss cross_entropy|mse`` | ``x`` (or arrays named after the inputs) | ``y`` as the loss's target; from a token file, the next token |

Losses: ``model`` takes the loss the model returns (``.loss``, ``["loss"]`` or a scalar first output);
``cross_entropy`` compares the model's logits (``.logits``, or its first output) with integer targets
(-100 ignored, as torch does); ``mse`` compares the first output with float targets; a factory may
return its own ``loss(outputs, target)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils import _pytree as pytree

from ...errors import AutopipeError
from ..stage.weights import module_seed
from .losses import check_loss, is_model_loss
from .sources import DataError, EpochOrder, TokenData, TokenStream, open_data

__all__ = ["JobData", "LABEL_NAMES", "mlm_mask"]

LABEL_NAMES = ("labels", "label", "targets", "target", "y")
TOKEN_TASKS = ("causal-lm", "masked-lm", "seq2seq")
# sample columns standing for the first input and for the targets (besides the inputs' own names)
_X_NAMES = ("x", "text", "source")
_Y_NAMES = ("y", "labels", "label", "target")


def mlm_mask(ids: torch.Tensor, *, vocab_size: int, mask_id: int, special: set[int], seeds: list[int],
             probability: float = 0.15) -> tuple[torch.Tensor, torch.Tensor]:
    """HuggingFace's masked-LM corruption of ``ids`` (rows, T), one generator per row (``seeds``), so a
    row is corrupted the same whichever replica or micro-batch it falls in.

    Returns ``(inputs, labels)``: labels hold the original id where a token was chosen, -100 elsewhere.
    """
    inputs, labels = ids.clone(), ids.clone()
    for r, seed in enumerate(seeds):
        g = torch.Generator().manual_seed(seed)
        row = ids[r]
        chosen = torch.rand(row.shape, generator=g, device="cpu") < probability
        if special:
            chosen &= ~torch.isin(row, torch.tensor(sorted(special), dtype=row.dtype))
        replace = chosen & (torch.rand(row.shape, generator=g, device="cpu") < 0.8)
        randomize = chosen & ~replace & (torch.rand(row.shape, generator=g, device="cpu") < 0.5)
        random_ids = torch.randint(0, vocab_size, row.shape, generator=g, dtype=row.dtype, device="cpu")
        inputs[r][replace] = mask_id
        inputs[r][randomize] = random_ids[randomize]
        labels[r][~chosen] = -100
    return inputs, labels


@dataclass
class _Input:
    """One tensor argument of the model: where it goes and what one row of it looks like."""

    name: str
    positional: int | None  # index in args, or None for a keyword
    shape: tuple[int, ...]  # per row (the micro-batch dimension left out)
    dtype: torch.dtype


class JobData:
    """The batches a job trains on: ``batch(step, rows)`` gives the model's ``(args, kwargs, target)``.

    Args:
        source: the model (``ModelSource``): its task, example inputs, loss and vocabulary.
        data: ``--data`` (a path), None for the factory's data or synthetic data.
        seq_len: tokens per row for token tasks.

    Example:
        >>> import numpy as np
        >>> from autopipe.runtime.data.factory import model_factory
        >>> np.arange(5000, dtype=np.uint16).tofile("tokens.bin")  # a token file, as nanoGPT writes them
        >>> data = JobData(model_factory("gpt2", batch_size=2, seq_len=64), "tokens.bin", seq_len=64)
        >>> args, kwargs, target = data.batch(step=0, rows=8)
        >>> args[0].shape, sorted(kwargs), target  # GPT-2 takes its labels and computes its own loss: no target
        (torch.Size([8, 64]), ['labels', 'use_cache'], None)
    """

    def __init__(self, source: Any, data: str | None, *, seq_len: int, seed: int = 0, seq: Any = None,
                 shuffle: bool = True, flag: str = "--data") -> None:
        self.source = source
        # the prediction a user loss sees, per row (from the flattened model's outputs; see check_loss)
        self.output_shape: tuple[int, ...] = ()
        self.output_dtype = torch.float32
        if seq is not None:
            self.output_shape, self.output_dtype = check_loss(seq, source.loss, source.name)
        self.seq_len = seq_len
        self.seed = seed
        self.task = source.task
        self.loss = "model" if is_model_loss(source.loss) else source.loss  # model:<place> too: no target
        self.inputs = _inputs_of(source)
        self.path = str(data) if data is not None else None
        self.tokens: TokenStream | None = None
        self.samples: Any = None
        self.synthetic: TokenData | None = None
        if data is not None:
            from pathlib import Path

            from .files import check_data_path

            check_data_path(Path(data), flag=flag)  # named by its flag: --data, or --eval-data
            opened = open_data(data, tokenizer_dir=source.tokenizer_dir)
        elif source.data is not None:
            opened = source.data
        else:
            opened = None
        if isinstance(opened, TokenStream):
            self.tokens = opened
            self.tokens.check(vocab_size=source.vocab_size if self._first_is_ids() else 0, span=self.span,
                              source=data or "the factory's data")
            self.order = EpochOrder(len(self.tokens) // self.span, seed, shuffle=shuffle)
        elif opened is not None:
            self.samples = opened
            self._check_samples()
            self.order = EpochOrder(self.samples.n, seed, shuffle=shuffle)
        elif self.task in TOKEN_TASKS:
            self.synthetic = TokenData(None, vocab_size=source.vocab_size, seq_len=self.span, seed=seed)
        if self.tokens is not None and self.task not in TOKEN_TASKS and not self._first_is_ids():
            raise DataError(
                f"{data} is a token stream but {source.name}'s first input is {self.inputs[0].dtype} "
                f"{tuple(self.inputs[0].shape)} per row; give a .npz/.pt with x (inputs) and y (targets)."
            )
        if self.tokens is not None and source.num_labels:
            raise DataError(f"{data} is a token stream, which holds no class labels, but {source.name} is a "
                            f"{self.task} model with {source.num_labels} classes; give a .npz/.pt with x (inputs) and "
                            "y (class ids), or a datasets file with a label column.")
        if self.tokens is not None and self.task not in TOKEN_TASKS and self.loss == "cross_entropy" and seq is not None \
                and tuple(self.output_shape[:-1]) != (self.span - 1,):
            raise DataError(f"{data} is a token stream, whose targets are the next token at each of {self.span - 1} "
                            f"positions, but {source.name} predicts {tuple(self.output_shape)} per row; give a .npz/.pt "
                            "with x (inputs) and y (targets).")
        if self.tokens is not None and self.task not in TOKEN_TASKS and self.loss == "model" and self._label_input() is None:
            raise DataError(f"{data} is a token stream, which gives next-token targets, but {source.name} takes no labels "
                            "argument; train it with --loss cross_entropy.")

    # ---- what the data looks like -------------------------------------------------------------
    @property
    def span(self) -> int:
        """Tokens one row takes from a token stream."""
        if self.task == "seq2seq":
            return 2 * self.seq_len
        if self.task in TOKEN_TASKS:
            return self.seq_len
        return (self.inputs[0].shape[0] + 1) if self.inputs and self.inputs[0].shape else self.seq_len + 1

    @property
    def unit(self) -> str:
        """What the throughput counts: tokens for token inputs, else samples."""
        return "tok" if self._first_is_ids() else "samples"

    @property
    def size(self) -> int | None:
        """Samples (or token windows) the data holds; None for synthetic data, which has no end."""
        return self.order.n if hasattr(self, "order") else None

    def epoch(self, step: int, rows: int) -> float | None:
        """How many passes over the data ``step`` steps of ``rows`` rows made (None: synthetic)."""
        n = self.size
        return step * rows / n if n else None

    def short_of(self, rows: int) -> str | None:
        """A warning when one step of ``rows`` rows needs more samples than the data holds (each
        step then repeats samples), with the numbers; None when it has enough."""
        n = self.size
        if n is None or n >= rows:
            return None
        what = "token windows" if self.tokens is not None else "samples"
        where = self.path or "the factory's data"
        return (f"warning: {where} holds {n} {what} but one step takes {rows} rows (batch size x micro-batches x "
                f"replicas): every step sees each of them {rows / n:.1f} times (an epoch every {n / rows:.2f} steps); "
                "give more data or a smaller --batch-size / --microbatches.")

    @property
    def classifier(self) -> bool:
        """Whether the model predicts one class per row (accuracy is its evaluation's figure): a
        classification head, or ``--loss cross_entropy`` on logits of one row each."""
        return self.source.num_labels > 1 or (self.loss == "cross_entropy" and len(self.output_shape) == 1)

    @property
    def language_model(self) -> bool:
        """Whether the loss is a token cross-entropy, whose exponential is the perplexity."""
        own = self.loss == "model" and self.task in TOKEN_TASKS
        return own or (self.loss == "cross_entropy" and self.tokens is not None and not self.classifier)

    def class_labels(self, step: int, rows: int, *, replica: int = 0, replicas: int = 1) -> torch.Tensor | None:
        """The class id of each of this replica's rows of batch ``step`` (what accuracy compares the
        prediction with), read alone; None when the model is no classifier."""
        if not self.classifier:
            return None
        per = rows // replicas
        if self.samples is not None:
            names = self.samples.names
            label = self._label_input()
            col = next((n for n in ((label.name,) if label is not None else ()) + _Y_NAMES if n in names), None)
            if col is None:
                return None
            return self.samples.rows(col, self.order.indices(step, rows, replica, replicas)).long().reshape(per)
        args, kwargs, target = self.batch(step, rows, replica=replica, replicas=replicas)
        if target is not None:
            return target.long().reshape(per)
        labels = kwargs.get("labels")
        return labels.long().reshape(per) if isinstance(labels, torch.Tensor) else None

    def state(self) -> dict[str, Any]:
        """What a checkpoint records about the data, so a resume can tell it continues the same data."""
        n = self.order.n if hasattr(self, "order") else 0
        return {"source": self.path or ("factory" if self.source.data is not None else "synthetic"), "samples": n}

    def _first_is_ids(self) -> bool:
        return bool(self.inputs) and not self.inputs[0].dtype.is_floating_point and self.inputs[0].dtype != torch.bool

    def _label_input(self) -> _Input | None:
        return next((i for i in self.inputs if i.name in LABEL_NAMES), None)

    # ---- batches ------------------------------------------------------------------------------
    def batch(self, step: int, rows: int, *, replica: int = 0, replicas: int = 1, inputs: bool = True,
              target: bool = True) -> tuple[tuple[Any, ...], dict[str, Any], torch.Tensor | None]:
        """This replica's share of step ``step``'s global batch of ``rows`` rows: the model's args and
        kwargs (host tensors), and the loss's target (None when the model computes its loss).

        ``inputs=False`` / ``target=False`` skip reading what this rank does not use (a middle
        pipeline stage needs neither); the structure is returned all the same.
        """
        if rows % replicas:
            raise AutopipeError(f"global batch {rows} does not split into {replicas} replicas.")
        per = rows // replicas
        first_row = step * rows + replica * per
        if self.tokens is not None or self.synthetic is not None:
            if not (inputs or target):
                return self._placeholder(per)
            if self.tokens is not None:
                windows = self.tokens.windows(self.order.indices(step, rows, replica, replicas), self.span)
            else:
                windows = self.synthetic.batch(step, rows, replica=replica, replicas=replicas)  # type: ignore[union-attr]
            return self._from_tokens(windows, first_row)
        if self.samples is not None:
            return self._from_samples(self.order.indices(step, rows, replica, replicas), inputs, target)
        return self._random(step, rows, replica, replicas)

    def _placeholder(self, per: int) -> tuple[tuple[Any, ...], dict[str, Any], None]:
        args, kwargs = fill_tensors(self.source, self.inputs, {}, per)
        return args, kwargs, None

    def _from_tokens(self, w: torch.Tensor, first_row: int) -> tuple[tuple[Any, ...], dict[str, Any], torch.Tensor | None]:
        s, rows = self.source, w.shape[0]
        target: torch.Tensor | None = None
        if self.task == "causal-lm":
            ids, labels = w, w
            if self.loss != "model":  # the user's loss gets next-token targets, as HF's own loss shifts
                target = torch.cat([w[:, 1:], torch.full((rows, 1), -100, dtype=w.dtype)], dim=1)
        elif self.task == "masked-lm":
            seeds = [module_seed(self.seed, f"mlm:{first_row + r}") for r in range(rows)]
            ids, labels = mlm_mask(w, vocab_size=s.vocab_size, mask_id=s.mask_token_id, special=set(s.special_ids), seeds=seeds)
            target = labels if self.loss != "model" else None
        elif self.task == "seq2seq":
            # contiguous halves: models view() their labels (T5's loss does)
            ids, labels = w[:, : self.seq_len].contiguous(), w[:, self.seq_len :].contiguous()
            target = labels if self.loss != "model" else None
        else:  # any model taking ids: the window, and the next token as target
            ids, labels = w[:, :-1].contiguous(), w[:, 1:].contiguous()
            if self.loss != "model":
                target = labels
        given = {self.inputs[0].name: ids}
        if self.loss == "model" and (lab := self._label_input()) is not None:
            given[lab.name] = labels
        args, kwargs = fill_tensors(s, self.inputs, given, rows)
        return args, kwargs, target

    def _from_samples(self, index: np.ndarray, want_inputs: bool, want_target: bool) -> tuple[tuple, dict, torch.Tensor | None]:
        names = self.samples.names
        given: dict[str, torch.Tensor] = {}
        target = None
        label = self._label_input()
        y_name = next((n for n in _Y_NAMES if n in names), None)
        for inp in self.inputs:
            if inp is label and self.loss == "model" and y_name is not None:
                src = inp.name if inp.name in names else y_name
            elif inp.name in names:
                src = inp.name
            elif inp is self.inputs[0]:
                src = next(n for n in _X_NAMES if n in names)
            else:
                continue
            if want_inputs:
                given[inp.name] = self._column(src, index, inp)
        if self.loss != "model" and want_target:
            target = self._column(y_name, index, None)  # type: ignore[arg-type]
        args, kwargs = fill_tensors(self.source, self.inputs, given, len(index))
        return args, kwargs, target

    def _column(self, name: str, index: np.ndarray, inp: _Input | None) -> torch.Tensor:
        rows = self.samples.array(name) if self.samples.kind(name) == "ragged" else None
        if rows is not None:  # token rows of their own lengths (tokenized text): cut or padded to the input's width
            width = inp.shape[0] if inp is not None and inp.shape else self.seq_len
            # inputs are padded with the pad id; labels with -100, which the loss ignores
            fill = self.source.pad_token_id if inp is None or inp.name not in LABEL_NAMES else -100
            out = torch.full((len(index), width), fill, dtype=torch.long)
            for r, i in enumerate(index):
                ids = torch.as_tensor(rows[int(i)][:width])
                out[r, : len(ids)] = ids
            return out
        t = self.samples.rows(name, index)
        if inp is not None:
            t = t.to(inp.dtype)
        return t

    def _random(self, step: int, rows: int, replica: int, replicas: int) -> tuple[tuple, dict, torch.Tensor | None]:
        """No data given: the example's shapes, random values drawn for the whole global batch of the
        step (then this replica's rows), and for a user loss a target the inputs decide, so that the
        loss can fall."""
        per = rows // replicas
        args, kwargs = self.source.batch(None, rows, step=step, seed=self.seed)
        if self.source.num_labels and isinstance(kwargs.get("labels"), torch.Tensor):
            # class ids below the head's number of classes, decided by the input so they can be learned
            x = args[0]
            key = (x.reshape(rows, -1)[:, 0] > 0).long() if x.is_floating_point() else x.reshape(rows, -1)[:, 0]
            kwargs = {**kwargs, "labels": key % self.source.num_labels}
        target = None
        if self.loss != "model":
            shape, dtype = self.output_shape, self.output_dtype
            g = torch.Generator().manual_seed(module_seed(self.seed, f"target:{step}"))
            if self.loss == "mse" or (dtype.is_floating_point and self.loss != "cross_entropy" and not callable(self.loss)):
                target = torch.randn((rows, *shape), generator=g, device="cpu")
            else:
                classes = shape[-1] if shape else 2
                x = next((v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)), None)
                # a class the input decides (the sign of its first feature), so a model can learn it
                if x is not None and x.is_floating_point() and x.dim() >= 2:
                    first = (x.reshape(rows, -1)[:, 0] > 0).long() % max(classes, 1)
                    target = first.view(rows, *([1] * (len(shape) - 1))).expand(rows, *shape[:-1]).contiguous()
                else:
                    target = torch.randint(0, max(classes, 1), (rows, *shape[:-1]), generator=g, device="cpu")
        cut = slice(replica * per, (replica + 1) * per)
        take = lambda v: v[cut] if isinstance(v, torch.Tensor) and v.dim() else v  # noqa: E731
        args, kwargs = pytree.tree_map(take, (tuple(args), dict(kwargs)))
        return tuple(args), kwargs, (target[cut] if target is not None else None)

    # ---- checks -------------------------------------------------------------------------------
    def _check_samples(self) -> None:
        names = self.samples.names
        where = self.path or "the factory's data"
        label = self._label_input()
        need_y = self.loss != "model" or label is not None
        first = self.inputs[0] if self.inputs else None
        missing = []
        for inp in self.inputs:
            if inp.name in names or (inp is label and any(n in names for n in _Y_NAMES)):
                continue
            if inp is first and any(n in names for n in _X_NAMES):
                continue
            missing.append(inp.name)
        if need_y and not any(n in names for n in _Y_NAMES):
            missing.append("y")
        if missing:
            raise DataError(
                f"{where} holds {', '.join(names)} but {self.source.name} needs {', '.join(missing)}; save x (the first input), "
                f"y (the targets) and any other input under its name ({', '.join(i.name for i in self.inputs)})."
            )
        for inp in self.inputs:
            src = inp.name if inp.name in names else (next((n for n in _X_NAMES if n in names), None) if inp is first else None)
            if src is None or self.samples.kind(src) == "ragged":
                continue
            row = self.samples.rows(src, np.zeros(1, dtype=np.int64))
            if tuple(row.shape[1:]) != inp.shape:
                raise DataError(
                    f"{where}: {src} has rows of shape {tuple(row.shape[1:])} but {self.source.name}'s input {inp.name} "
                    f"takes {inp.shape} per row (traced with --batch-size/--seq-len); reshape the data or convert again."
                )
            if row.is_floating_point() != inp.dtype.is_floating_point:
                raise DataError(f"{where}: {src} holds {row.dtype} values but {inp.name} takes {inp.dtype}.")
        y_name = next((n for n in _Y_NAMES if n in names), None)
        if y_name is not None and self.loss == "cross_entropy" and self.samples.kind(y_name) != "ragged":
            y = self.samples.rows(y_name, np.arange(min(self.samples.n, 4096)))
            classes = self.output_shape[-1] if self.output_shape else 0
            if y.is_floating_point() or (classes and int(y.max()) >= classes):
                raise DataError(f"{where}: {y_name} must hold class ids below {classes} for --loss cross_entropy "
                                f"(found {y.dtype}, max {y.max().item()}).")
        # a classification head's own loss (HF's, num_labels > 1) takes one class id per row; a row of
        # num_labels floats is multi-label, one float with num_labels 1 regression: left as given
        classes = self.source.num_labels
        col = (label.name if label.name in names else y_name) if label is not None else None
        if self.loss == "model" and classes > 1 and col is not None and self.samples.kind(col) != "ragged":
            y = self.samples.rows(col, np.arange(min(self.samples.n, 4096)))
            if y.dim() == 1 and (y.is_floating_point() or int(y.max()) >= classes):
                raise DataError(f"{where}: {col} must hold class ids below {classes} for {self.source.name}'s "
                                f"classification head (found {y.dtype}, max {y.max().item()}).")


def _inputs_of(source: Any) -> list[_Input]:
    out = []
    for i, v in enumerate(source.args):
        if isinstance(v, torch.Tensor):
            out.append(_Input(source.arg_names[i] if i < len(source.arg_names) else f"arg{i}", i, tuple(v.shape[1:]), v.dtype))
    for k, v in source.kwargs.items():
        if isinstance(v, torch.Tensor):
            out.append(_Input(k, None, tuple(v.shape[1:]), v.dtype))
    return out


def fill_tensors(source: Any, inputs: list[_Input], given: dict[str, torch.Tensor], rows: int) -> tuple[tuple, dict]:
    """The model's arguments: ``given`` tensors where there are, zeros of the example's shape elsewhere
    (placeholders on ranks that do not read inputs), non-tensor arguments as in the example."""
    args = list(source.args)
    kwargs = dict(source.kwargs)
    for inp in inputs:
        value = given.get(inp.name)
        if value is None:
            value = torch.zeros((rows, *inp.shape), dtype=inp.dtype, device="cpu")
        if inp.positional is not None:
            args[inp.positional] = value
        else:
            kwargs[inp.name] = value
    return tuple(args), kwargs
