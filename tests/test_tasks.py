"""What a job trains on, piece by piece (no processes): data files, each task's inputs and targets,
the masked-LM corruption, losses, dropout seeds, and one line for each bad input."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from autopipe.errors import AutopipeError
from autopipe.planner.stage_plan import StagePlan
from autopipe.runtime import JobData, build_stage, model_factory
from autopipe.runtime.data.losses import LossError, check_loss
from autopipe.runtime.data.sources import DataError, TokenStream, epoch_order, open_data
from autopipe.runtime.data.tasks import mlm_mask
from autopipe.runtime.process.lifecycle import check_launch

SEQ = 8


def _folder(tmp: Path, kind: str, **extra) -> str:
    from transformers import BertConfig, GPT2Config, T5Config

    folder = tmp / kind
    if kind == "gpt2":
        GPT2Config(architectures=["GPT2LMHeadModel"], n_layer=1, n_embd=16, n_head=2, vocab_size=256, n_positions=SEQ,
                   **extra).save_pretrained(folder)
    elif kind == "bert":
        BertConfig(architectures=["BertForMaskedLM"], hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                   intermediate_size=16, vocab_size=256, max_position_embeddings=SEQ, pad_token_id=0).save_pretrained(folder)
    else:
        T5Config(architectures=["T5ForConditionalGeneration"], vocab_size=256, d_model=16, d_kv=8, d_ff=16, num_layers=1,
                 num_heads=2, decoder_start_token_id=0, pad_token_id=0).save_pretrained(folder)
    return str(folder)


def test_masked_lm_corruption_follows_hf_collator() -> None:
    """15% of tokens chosen, never special ones; of those 80% [MASK], 10% random, 10% kept; labels -100 elsewhere."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 1000, (64, 256), generator=g)
    ids[:, 0] = 1  # a special token ([CLS]) in every row
    inputs, labels = mlm_mask(ids, vocab_size=1000, mask_id=999, special={1}, seeds=list(range(64)))
    chosen = labels != -100
    assert torch.equal(labels[chosen], ids[chosen])
    assert not chosen[:, 0].any()
    assert 0.13 < chosen.float().mean() < 0.17
    masked = (inputs == 999) & chosen
    kept = (inputs == ids) & chosen
    assert 0.77 < masked.sum() / chosen.sum() < 0.83
    assert 0.07 < kept.sum() / chosen.sum() < 0.13  # (a random token equal to the original counts as kept)
    assert torch.equal(inputs[~chosen], ids[~chosen])
    # a row is corrupted by its own generator: the same whichever batch it is in
    again, _ = mlm_mask(ids[5:6], vocab_size=1000, mask_id=999, special={1}, seeds=[5])
    assert torch.equal(again[0], inputs[5])


def test_token_file_is_memory_mapped_and_replicas_read_disjoint_windows(tmp_path: Path) -> None:
    """A .bin file is mapped, not read; an epoch visits every window once; replicas split each step's rows."""
    tokens = np.arange(8 * 30, dtype=np.uint16)  # 30 windows of 8
    tokens.tofile(tmp_path / "t.bin")
    stream = TokenStream.open(tmp_path / "t.bin", vocab_size=256)
    assert isinstance(stream.ids, np.memmap)
    source = model_factory(_folder(tmp_path, "gpt2"), batch_size=2, seq_len=SEQ)
    data = JobData(source, str(tmp_path / "t.bin"), seq_len=SEQ)
    seen = []
    for step in range(5):  # 5 steps x 6 rows = the 30 windows of one epoch
        (ids,), kwargs, target = data.batch(step, 6)
        halves = [data.batch(step, 6, replica=r, replicas=2)[0][0] for r in range(2)]
        assert torch.equal(torch.cat(halves), ids) and target is None
        assert torch.equal(kwargs["labels"], ids)  # HF shifts the labels itself
        seen += [int(row[0]) // SEQ for row in ids]
        assert all(torch.equal(row, torch.arange(int(row[0]), int(row[0]) + SEQ)) for row in ids)
    assert sorted(seen) == list(range(30))
    assert list(epoch_order(30, 0, 1)) != list(epoch_order(30, 0, 0))


def test_seq2seq_labels_and_user_loss_targets(tmp_path: Path) -> None:
    """T5: the next T tokens are the labels; a causal LM under --loss cross_entropy gets next-token targets, no labels."""
    np.save(tmp_path / "t.npy", np.arange(400, dtype=np.int32) % 256)
    t5 = model_factory(_folder(tmp_path, "t5"), batch_size=2, seq_len=SEQ)
    (ids,), kwargs, _ = JobData(t5, str(tmp_path / "t.npy"), seq_len=SEQ).batch(0, 4)
    assert torch.equal(kwargs["labels"], ids + SEQ)
    gpt = model_factory(_folder(tmp_path, "gpt2"), batch_size=2, seq_len=SEQ, loss="cross_entropy")
    assert "labels" not in gpt.kwargs
    (ids,), kwargs, target = JobData(gpt, str(tmp_path / "t.npy"), seq_len=SEQ).batch(0, 4)
    assert torch.equal(target[:, :-1], ids[:, 1:]) and (target[:, -1] == -100).all()
    with pytest.raises(LossError, match="seq2seq"):
        model_factory(_folder(tmp_path, "t5"), batch_size=2, seq_len=SEQ, loss="mse")


def test_text_goes_through_the_folder_s_tokenizer(tmp_path: Path) -> None:
    """Text is tokenized by the model folder's tokenizer when it has one, else read as bytes."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    text = "red fish blue fish " * 50
    folder = Path(_folder(tmp_path, "bert"))
    words = {"[PAD]": 0, "[UNK]": 1, "[MASK]": 2, "red": 3, "fish": 4, "blue": 5}
    tok = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", mask_token="[MASK]").save_pretrained(folder)
    (tmp_path / "c.txt").write_text(text)
    stream = open_data(tmp_path / "c.txt", tokenizer_dir=str(folder))
    assert list(stream.ids[:4]) == [3, 4, 5, 4]
    assert open_data(tmp_path / "c.txt").tokenizer == "bytes"
    bert = model_factory(str(folder), batch_size=2, seq_len=SEQ)
    assert bert.mask_token_id == 2 and 2 not in bert.special_ids and 0 in bert.special_ids


def test_datasets_files_and_samples_are_read_lazily(tmp_path: Path) -> None:
    """A parquet text column is a token stream; jsonl rows with x/y are samples; a rank that needs only
    the targets never loads the inputs."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["hello pipeline"] * 10}), tmp_path / "d.parquet")
    assert isinstance(open_data(tmp_path / "d.parquet"), TokenStream)
    with open(tmp_path / "d.jsonl", "w") as f:
        for i in range(6):
            f.write(json.dumps({"x": [float(i)] * 4, "y": i % 3}) + "\n")
    samples = open_data(tmp_path / "d.jsonl")
    assert samples.n == 6 and set(samples.names) == {"x", "y"}
    (tmp_path / "net.py").write_text(
        "import torch\nfrom torch import nn\n"
        "def build(batch_size=2):\n    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)), (torch.randn(batch_size, 4),)\n")
    source = model_factory(f"{tmp_path / 'net.py'}:build", batch_size=2, seq_len=SEQ, loss="cross_entropy")
    data = JobData(source, str(tmp_path / "d.jsonl"), seq_len=SEQ)
    data.samples._cache.clear()
    (x,), _, y = data.batch(0, 4, inputs=False, target=True)
    assert set(data.samples._cache) == {"y"} and y.shape == (4,) and not x.any()
    (x,), _, y = data.batch(0, 4)
    assert torch.equal(x[:, 0].long() % 3, y)


@pytest.mark.parametrize("case,expected", [
    ("missing", "does not exist"),
    ("empty", "is empty"),
    ("shape", "takes (4,) per row"),
    ("float_y", "class ids below 3"),
    ("no_y", "needs y"),
    ("vocab", "vocabulary has 256 entries"),
])
def test_bad_data_is_one_line(tmp_path: Path, case: str, expected: str) -> None:
    """Data that is missing, empty or does not fit the model's inputs: one line saying so (no traceback)."""
    (tmp_path / "net.py").write_text(
        "import torch\nfrom torch import nn\n"
        "def build(batch_size=2):\n    return nn.Sequential(nn.Linear(4, 3)), (torch.randn(batch_size, 4),)\n")
    spec, path = f"{tmp_path / 'net.py'}:build", tmp_path / "d.npz"
    if case == "empty":
        path = tmp_path / "d.bin"
        path.write_bytes(b"")
    elif case == "shape":
        np.savez(path, x=np.zeros((4, 5), np.float32), y=np.zeros(4, np.int64))
    elif case == "float_y":
        np.savez(path, x=np.zeros((4, 4), np.float32), y=np.zeros(4, np.float32))
    elif case == "no_y":
        np.savez(path, x=np.zeros((4, 4), np.float32))
    elif case == "vocab":
        spec, path = _folder(tmp_path, "gpt2"), tmp_path / "t.npy"
        np.save(path, np.full(100, 300, dtype=np.int64))
    source = model_factory(spec, batch_size=2, seq_len=SEQ, loss="model" if case == "vocab" else "cross_entropy")
    seq = build_stage(source.factory, source.args, source.kwargs, 1, pp_rank=0, pp_size=1).seq
    with pytest.raises(DataError) as err:
        JobData(source, str(path), seq_len=SEQ, seq=seq)
    assert expected in str(err.value) and "\n" not in str(err.value)


def test_a_model_without_a_scalar_loss_is_refused_with_the_fix(tmp_path: Path) -> None:
    """A classifier returning logits has no loss of its own: --loss model is refused, cross_entropy takes its logits."""
    (tmp_path / "net.py").write_text(
        "import torch\nfrom torch import nn\n"
        "def build(batch_size=2):\n    return nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 10)), (torch.randn(batch_size, 4),)\n")
    spec = f"{tmp_path / 'net.py'}:build"
    source = model_factory(spec, batch_size=2, seq_len=SEQ)
    seq = build_stage(source.factory, source.args, source.kwargs, 1, pp_rank=0, pp_size=1).seq
    with pytest.raises(LossError, match=r"no scalar loss: train it with --loss cross_entropy"):
        check_loss(seq, "model", spec)
    assert check_loss(seq, "cross_entropy", spec) == ((10,), torch.float32)


def test_dropout_is_kept_and_seeded_per_layer_and_micro_batch(tmp_path: Path) -> None:
    """The model's dropout stays on; the same step and micro-batch draw the same masks, another step others."""
    from autopipe.runtime.checks.reference import SequenceModel
    from autopipe.runtime.stage.build import MicrobatchSeeds

    source = model_factory(_folder(tmp_path, "gpt2", resid_pdrop=0.5, embd_pdrop=0.5, attn_pdrop=0.5),
                           batch_size=2, seq_len=SEQ)
    model = SequenceModel.build_from(source.factory, source.args, source.kwargs)
    ids = torch.randint(0, 256, (2, SEQ))

    def loss(step: int) -> float:
        model.start_step(MicrobatchSeeds(0, step, 0))
        return float(model(ids, labels=ids, use_cache=False).loss)

    assert loss(0) == loss(0) != loss(1)
    still = model_factory(_folder(tmp_path / "x", "gpt2", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0), batch_size=2, seq_len=SEQ)
    plain = SequenceModel.build_from(still.factory, still.args, still.kwargs)
    plain.start_step(MicrobatchSeeds(0, 0, 0))
    assert float(plain(ids, labels=ids, use_cache=False).loss) != loss(0)


def test_launching_the_wrong_number_of_processes_says_the_right_one() -> None:
    """A plan of 2 stages on 3 or 4 processes: one line with the --nproc-per-node that fits (one process runs any plan)."""
    plan = StagePlan((0, 3, 6), stages=2, chunk_ranks=(0, 1))
    with pytest.raises(AutopipeError, match="has 2 stages but 3 processes were launched .* launch with --nproc-per-node 2"):
        check_launch(plan, 3, 1)
    with pytest.raises(AutopipeError, match="--nproc-per-node 4 with --dp 2"):
        check_launch(plan, 3, 2)
    check_launch(plan, 1, 1)
    check_launch(plan, 2, 2)
    with pytest.raises(AutopipeError, match="launch with --nproc-per-node 2 or 4"):
        check_launch(StagePlan((0, 1, 2, 3, 4)), 3, 1)


def test_seq2seq_pairs_from_a_datasets_file(tmp_path: Path) -> None:
    """A .jsonl of source/target text pairs: the source (cut or padded with the pad id) is the input,
    the target the labels, padded with -100 so the loss ignores the padding."""
    with open(tmp_path / "pairs.jsonl", "w") as f:
        for i in range(6):
            f.write(json.dumps({"source": f"say {i}", "target": "ok" * (i + 1)}) + "\n")
    t5 = model_factory(_folder(tmp_path, "t5"), batch_size=2, seq_len=SEQ)
    data = JobData(t5, str(tmp_path / "pairs.jsonl"), seq_len=SEQ)
    (ids,), kwargs, _ = data.batch(0, 6)
    for row, labels in zip(ids, kwargs["labels"]):
        source = bytes(row[row != 0].tolist()).decode()
        i = int(source.split()[1])
        assert source == f"say {i}"
        assert bytes(labels[labels != -100].tolist()).decode() == ("ok" * (i + 1))[:SEQ]


def test_resume_says_what_changed_and_refuses_nothing_to_resume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--resume: nothing there is an error (--resume auto starts afresh, saying so); a checkpoint made
    with another --steps (the LR schedule then decays over the new count) or other data is said so; a
    checkpoint already at --steps is an error naming the larger --steps to pass."""
    from autopipe.runtime.checkpoints.resume import ResumeError, resume

    said: list[str] = []
    trainer = SimpleNamespace(step_count=0)
    data = SimpleNamespace(state=lambda: {"source": "b.bin"})
    with pytest.raises(ResumeError, match=r"--resume: no checkpoint in .*use --resume auto"):
        resume(trainer, tmp_path / "ckpt", mode="must", steps=8, data=data, say=said.append)
    assert resume(trainer, tmp_path / "ckpt", mode="auto", steps=8, data=data, say=said.append) is None
    assert said == [f"no checkpoint in {tmp_path / 'ckpt'}: starting at step 0 (--resume auto)"]

    step = tmp_path / "ckpt" / "step_00000002"
    step.mkdir(parents=True)
    (step / "meta.json").write_text(json.dumps({"step": 2, "config": {"steps": 4}, "data": {"source": "a.bin"}}))
    monkeypatch.setattr("autopipe.runtime.checkpoints.store.load_checkpoint", lambda t, path: setattr(t, "step_count", 2))
    said.clear()
    assert resume(trainer, tmp_path / "ckpt", mode="must", steps=8, data=data, say=said.append) == step
    assert said == [f"resumed from {step} at step 2",
                    "note: the checkpoint was trained for --steps 4; the learning rate now decays over 8 steps from step 2",
                    "note: the checkpoint was trained on a.bin; this run reads b.bin"]
    said.clear()
    resume(trainer, tmp_path / "ckpt", mode="must", steps=4, data=SimpleNamespace(state=lambda: {"source": "a.bin"}),
           say=said.append)
    assert said == [f"resumed from {step} at step 2"]  # the same run: nothing to note
    with pytest.raises(ResumeError, match="already at --steps 2: pass a larger --steps"):
        resume(trainer, tmp_path / "ckpt", mode="must", steps=2, data=data, say=said.append)


def test_classification_heads_train_on_class_ids(tmp_path: Path) -> None:
    """HF sequence and image classification: the data's y reaches the head as `labels` (one class id a
    row), synthetic labels are class ids below num_labels; y beyond the head's classes, or a token
    stream (next tokens are not classes), is one line, whatever the loss."""
    from transformers import BertConfig, ViTConfig

    BertConfig(architectures=["BertForSequenceClassification"], hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
               intermediate_size=16, vocab_size=64, max_position_embeddings=SEQ, pad_token_id=0, num_labels=3,
               ).save_pretrained(tmp_path / "bert")
    ViTConfig(architectures=["ViTForImageClassification"], hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
              intermediate_size=16, image_size=8, patch_size=4, num_channels=3, num_labels=4).save_pretrained(tmp_path / "vit")
    rng = np.random.default_rng(0)
    (np.arange(400) % 64).astype(np.uint16).tofile(tmp_path / "t.bin")
    for name, classes, x in [("bert", 3, rng.integers(1, 64, (12, SEQ))),
                             ("vit", 4, rng.standard_normal((12, 3, 8, 8)).astype(np.float32))]:
        source = model_factory(str(tmp_path / name), batch_size=2, seq_len=SEQ)
        assert source.num_labels == classes and source.kwargs["labels"].shape == (2,)
        seq = build_stage(source.factory, source.args, source.kwargs, 1, pp_rank=0, pp_size=1).seq
        y = rng.integers(0, classes, 12)
        np.savez(tmp_path / f"{name}.npz", x=x, y=y)
        data = JobData(source, str(tmp_path / f"{name}.npz"), seq_len=SEQ, seq=seq)
        seen = {}
        for step in range(3):  # one epoch of 12 rows
            (inputs,), kwargs, target = data.batch(step, 4)
            assert target is None and kwargs["labels"].dtype == torch.long
            for row, label in zip(inputs, kwargs["labels"]):
                seen[int(np.flatnonzero([np.array_equal(row.numpy(), r) for r in x])[0])] = int(label)
        assert seen == {i: int(y[i]) for i in range(12)}
        _, kwargs, _ = JobData(source, None, seq_len=SEQ, seq=seq).batch(0, 64)
        labels = kwargs["labels"]
        assert labels.shape == (64,) and 0 <= int(labels.min()) and int(labels.max()) < classes and len(set(labels.tolist())) > 1
        np.savez(tmp_path / "bad.npz", x=x, y=np.arange(12))
        with pytest.raises(DataError, match=rf"y must hold class ids below {classes} for .*classification head \(found torch.int64, max 11\)"):
            JobData(source, str(tmp_path / "bad.npz"), seq_len=SEQ, seq=seq)
    for loss in ("model", "cross_entropy"):
        source = model_factory(str(tmp_path / "bert"), batch_size=2, seq_len=SEQ, loss=loss)
        seq = build_stage(source.factory, source.args, source.kwargs, 1, pp_rank=0, pp_size=1).seq
        with pytest.raises(DataError, match="is a token stream, which holds no class labels, but .* 3 classes"):
            JobData(source, str(tmp_path / "t.bin"), seq_len=SEQ, seq=seq)


def test_a_token_stream_for_a_model_that_does_not_predict_tokens_is_one_line(tmp_path: Path) -> None:
    """--loss cross_entropy on a token stream trains next-token targets: a model predicting one class a
    row is refused in one line; one predicting a token at each position takes them."""
    (tmp_path / "nets.py").write_text(
        "import torch\nfrom torch import nn\n"
        "def classifier(batch_size=2):\n"
        "    return nn.Sequential(nn.Embedding(64, 4), nn.Flatten(), nn.Linear(4 * 8, 5)), (torch.zeros(batch_size, 8, dtype=torch.long),)\n"
        "def tagger(batch_size=2):\n"
        "    return nn.Sequential(nn.Embedding(64, 4), nn.Linear(4, 64)), (torch.zeros(batch_size, 8, dtype=torch.long),)\n")
    (np.arange(400) % 64).astype(np.uint16).tofile(tmp_path / "t.bin")
    for fn, ok in (("classifier", False), ("tagger", True)):
        source = model_factory(f"{tmp_path / 'nets.py'}:{fn}", batch_size=2, seq_len=SEQ, loss="cross_entropy")
        seq = build_stage(source.factory, source.args, source.kwargs, 1, pp_rank=0, pp_size=1).seq
        if ok:
            (ids,), _, target = JobData(source, str(tmp_path / "t.bin"), seq_len=SEQ, seq=seq).batch(0, 4)
            assert torch.equal(target[:, :-1], ids[:, 1:]) and target.shape == (4, 8)
        else:
            with pytest.raises(DataError, match=r"next token at each of 8 positions, but .* predicts \(5,\) per row"):
                JobData(source, str(tmp_path / "t.bin"), seq_len=SEQ, seq=seq)


def test_datasets_text_goes_through_the_tokenizer_and_saved_folders_open(tmp_path: Path) -> None:
    """A datasets file's text column goes through the model folder's tokenizer (datasets hands it over as
    a lazy column, which tokenizers refused); a folder `Dataset.save_to_disk` wrote (its .arrow shards
    beside its own .json metadata) opens as one dataset, as does its .arrow file on its own."""
    import datasets
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"[PAD]": 0, "[UNK]": 1, "[MASK]": 2, "red": 3, "fish": 4, "blue": 5}
    tok = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", mask_token="[MASK]").save_pretrained(tmp_path / "tok")
    with open(tmp_path / "t.jsonl", "w") as f:
        for _ in range(3):
            f.write(json.dumps({"text": "red fish blue fish"}) + "\n")
    datasets.Dataset.from_dict({"text": ["blue fish red"] * 4}).save_to_disk(tmp_path / "saved_text")
    datasets.Dataset.from_dict({"x": [[float(i)] * 4 for i in range(6)], "y": [i % 3 for i in range(6)]}).save_to_disk(
        tmp_path / "saved_xy")
    stream = open_data(tmp_path / "t.jsonl", tokenizer_dir=str(tmp_path / "tok"))
    assert list(stream.ids) == [3, 4, 5, 4] * 3
    assert list(open_data(tmp_path / "saved_text", tokenizer_dir=str(tmp_path / "tok")).ids) == [5, 4, 3] * 4
    for where in (tmp_path / "saved_xy", next((tmp_path / "saved_xy").glob("*.arrow"))):
        samples = open_data(where)
        assert samples.n == 6 and set(samples.names) == {"x", "y"}
        assert samples.rows("y", np.arange(6)).tolist() == [0, 1, 2, 0, 1, 2]
