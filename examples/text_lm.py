"""A masked LM (BERT) or a seq2seq model (T5) trained pipelined on local text, through its own tokenizer.

The text is autopipe's own documentation (README.md and docs/*.md, beside this file). A small
word-level tokenizer is made from it and saved in the model's folder with the config, as a
HuggingFace folder holds them; the job then reads the text through that tokenizer (``--data
corpus.txt``) and evaluates on its last tenth (``--eval-data``: the held-out perplexity every few
steps). BERT trains with HuggingFace's masked-LM corruption (15% of tokens: 80% [MASK],
10% random, 10% kept); T5 learns to continue each window of text (the next window is its labels).

    python examples/text_lm.py --task mlm      [--steps 30] [--workdir DIR]
    python examples/text_lm.py --task seq2seq
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = ["corpus", "model_folder"]

ROOT = Path(__file__).resolve().parent.parent


def corpus(path: Path) -> Path:
    """autopipe's documentation as one text file."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    path.write_text("\n".join(f.read_text() for f in files))
    return path


def held_out(text: Path, path: Path, share: float = 0.1) -> Path:
    """The last ``share`` of ``text`` as the evaluation text (the job also trains on it: a small
    corpus, and the point is the figure, not generalisation)."""
    words = text.read_text().split()
    path.write_text(" ".join(words[int(len(words) * (1 - share)):]))
    return path


def model_folder(folder: Path, task: str, text: str) -> Path:
    """A HuggingFace folder: a tiny BERT or T5 config and a word-level tokenizer made from ``text``."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import BertConfig, PreTrainedTokenizerFast, T5Config

    words = sorted(set(text.lower().split()))
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(specials + words)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                            sep_token="[SEP]", mask_token="[MASK]").save_pretrained(folder)
    vocab = len(specials) + len(words)
    if task == "mlm":
        config = BertConfig(architectures=["BertForMaskedLM"], vocab_size=vocab, hidden_size=64, num_hidden_layers=4,
                            num_attention_heads=4, intermediate_size=128, max_position_embeddings=64, pad_token_id=0)
    else:
        config = T5Config(architectures=["T5ForConditionalGeneration"], vocab_size=vocab, d_model=64, d_kv=16, d_ff=128,
                          num_layers=2, num_decoder_layers=2, num_heads=4, decoder_start_token_id=0, pad_token_id=0)
    config.save_pretrained(folder)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=["mlm", "seq2seq"], default="mlm")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--workdir", type=Path, default=None)
    opts = parser.parse_args()
    work = opts.workdir or Path(tempfile.mkdtemp(prefix=f"autopipe-{opts.task}-"))
    work.mkdir(parents=True, exist_ok=True)
    text = corpus(work / "corpus.txt")
    folder = model_folder(work / opts.task, opts.task, text.read_text())
    from autopipe.job.converter import convert

    evaluation = held_out(text, work / "held_out.txt")
    result = convert(str(folder), stages=2, batch_size=4, seq_len=32, microbatches=4, data=text, eval_data=evaluation,
                     out=work / "job", repeats=2, progress=False)
    print(f"{result.plan.num_layers} layers -> 2 stages, cuts before layers {list(result.plan.boundaries[1:-1])} "
          f"(schedule {result.plan.schedule})")
    log = work / "log.json"
    command = shlex.split(result.job.launch) + ["--steps", str(opts.steps), "--lr", "2e-3", "--log-json", str(log),
                                                "--eval-every", str(max(1, opts.steps // 2)), "--eval-steps", "4"]
    print("$", shlex.join(command))
    subprocess.run(command, check=True, env=dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1")))
    records = [json.loads(line) for line in log.read_text().splitlines()]
    losses = [r["loss"] for r in records]
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    print(f"{opts.task}: loss {first:.3f} (first 3 steps) -> {last:.3f} (last 3)")
    print("loss fell" if last < first else "loss did not fall")
    print("held-out perplexity: " + ", ".join(f"{r['eval_perplexity']:.1f} at step {r['step']}" for r in records
                                              if "eval_perplexity" in r))


if __name__ == "__main__":
    sys.exit(main())
