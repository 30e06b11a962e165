"""The generated job trains what was converted: each kind of model, its loss, its data, on either engine.

For GPT-2 (causal LM, dropout on), BERT (masked LM, text through its folder's tokenizer), T5
(seq2seq, a datasets .jsonl file), a CNN classifier with the factory's own loss (.npz x/y) and a
custom (hidden, mask) model (.pt with arrays named after its inputs), train.py runs 2 stages on 2
processes and must equal the untouched model trained here on the same batches (the model as its
factory builds it, through its own forward, at the job's initial weights; with dropout on, seeded
where each layer starts as the pipeline seeds it): the loss of every step, the logged gradient norm,
and every gradient of the first step (1e-5), on the torch engine (under --check) and on DeepSpeed's.
Tiny configs, 2 steps: one launch per model and engine.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from _launch import Launcher

from autopipe.graph.flattener import flatten
from autopipe.job.script import write_train_script
from autopipe.job.settings import JobSettings
from autopipe.runtime import (
    JobData,
    TrainConfig,
    build_reference,
    make_loss,
    model_factory,
)
from autopipe.runtime.checks.reference import ReferenceTrainer
from autopipe.runtime.checks.untouched import untouched_model
from autopipe.runtime.stage.build import meta_model

pytestmark = pytest.mark.slow  # every test starts train.py (most on several processes)

ROOT = Path(__file__).resolve().parent.parent
STEPS, MICRO, ROWS, SEQ, LR = 2, 2, 2, 16, 1e-3
TOL = 1e-5

CNN = '''
import torch
from torch import nn
from torch.nn import functional as F


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU())
        self.conv2 = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(8 * 4 * 4, 10))

    def forward(self, images):
        return self.head(self.conv2(self.conv1(images)))


def smoothed_cross_entropy(logits, target):
    return F.cross_entropy(logits, target, label_smoothing=0.1)


def build(batch_size=2):
    return {"model": CNN(), "args": (torch.randn(batch_size, 1, 8, 8),), "loss": smoothed_cross_entropy}
'''


def _tokenizer_folder(folder: Path, text: str) -> int:
    """A word-level tokenizer saved the HF way (tokenizer.json + config): the data must come through it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = sorted(set(text.split()))
    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                            sep_token="[SEP]", mask_token="[MASK]").save_pretrained(folder)
    return len(vocab)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Five models, each with its data file and its loss."""
    from transformers import BertConfig, GPT2Config, T5Config

    root = tmp_path_factory.mktemp("jobs")
    rng = np.random.default_rng(0)
    out: dict[str, dict] = {}

    GPT2Config(architectures=["GPT2LMHeadModel"], n_layer=2, n_embd=32, n_head=2, vocab_size=256, n_positions=SEQ,
               resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, bos_token_id=0, eos_token_id=0).save_pretrained(root / "gpt2")
    rng.integers(0, 256, 4000, dtype=np.uint16).tofile(root / "tokens.bin")
    out["gpt2"] = dict(model=str(root / "gpt2"), data=root / "tokens.bin", loss="auto", dropout=True)

    text = " ".join(f"the {w} sat on {v} mat ." for w, v in zip(["cat", "dog", "bird", "cow"] * 60, ["a", "the", "my"] * 80))
    (root / "bert").mkdir()
    vocab = _tokenizer_folder(root / "bert", text)
    BertConfig(architectures=["BertForMaskedLM"], hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
               intermediate_size=48, vocab_size=vocab, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
               attention_probs_dropout_prob=0.0, pad_token_id=0).save_pretrained(root / "bert")
    (root / "corpus.txt").write_text(text)
    out["bert"] = dict(model=str(root / "bert"), data=root / "corpus.txt", loss="model", dropout=False)

    T5Config(architectures=["T5ForConditionalGeneration"], vocab_size=256, d_model=32, d_kv=8, d_ff=48, num_layers=2,
             num_decoder_layers=2, num_heads=4, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0).save_pretrained(root / "t5")
    with open(root / "stories.jsonl", "w") as f:
        for i in range(40):
            f.write(json.dumps({"text": f"story {i}: once upon a time a pipeline learned to count to {i}."}) + "\n")
    out["t5"] = dict(model=str(root / "t5"), data=root / "stories.jsonl", loss="model", dropout=False)

    (root / "cnn.py").write_text(CNN)
    x = rng.standard_normal((64, 1, 8, 8)).astype(np.float32)
    np.savez(root / "images.npz", x=x, y=(x[:, 0, 0, 0] > 0).astype(np.int64))
    out["cnn"] = dict(model=f"{root / 'cnn.py'}:build", data=root / "images.npz", loss="auto", dropout=False)

    ids = torch.from_numpy(rng.integers(0, 1000, (48, SEQ)))
    lengths = torch.from_numpy(rng.integers(SEQ // 2, SEQ + 1, 48))
    mask = torch.arange(SEQ)[None, :] < lengths[:, None]
    torch.save({"ids": ids, "mask": mask, "labels": ids % 5}, root / "padded.pt")
    out["mask"] = dict(model=f"{ROOT / 'examples' / 'transformer_mask.py'}:build", data=root / "padded.pt", loss="model",
                       dropout=False)

    for name, job in out.items():
        (root / name / "job").mkdir(parents=True, exist_ok=True)
        for engine in ("torch", "deepspeed"):
            write_train_script(root / name / "job" / f"train_{engine}.py", JobSettings(model=job["model"], stages=2, microbatches=MICRO, schedule="1f1b", batch_size=ROWS, seq_len=SEQ, engine=engine, loss=job["loss"], data=str(job["data"])))
        job["root"] = root / name
    return out


_REFS: dict[str, tuple[list[float], list[float], dict[str, torch.Tensor], dict[str, int]]] = {}


def reference(job: dict) -> tuple[list[float], list[float], dict[str, torch.Tensor], dict[str, int]]:
    """(losses, gradient norms, first-step gradients by every name of each parameter, and which tensor
    each name is) of the untouched model trained on the job's batches, one micro-batch after another;
    with dropout on, its forward seeded where each layer starts as the pipeline seeds that layer."""
    key = job["model"]
    if key not in _REFS:
        source = model_factory(job["model"], batch_size=ROWS, seq_len=SEQ, loss=job["loss"])
        data = JobData(source, str(job["data"]), seq_len=SEQ, seed=0)
        model = untouched_model(source.factory, seed=0)
        entries = flatten(meta_model(source.factory), source.args, source.kwargs, device_type="cpu").layer_entries
        trainer = ReferenceTrainer(model, TrainConfig(steps=STEPS, microbatches=MICRO, lr=LR, grad_clip=0.0, seed=0),
                                   loss_fn=make_loss(source.loss), layer_entries=entries if job["dropout"] else None)
        grads: list[dict[str, torch.Tensor]] = []
        trainer.optimizer.register_step_pre_hook(lambda *_: grads.append(
            {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False) if p.grad is not None}))
        losses, norms = [], []
        for step in range(STEPS):
            losses.append(trainer.step(*data.batch(step, ROWS * MICRO)))
            norms.append(trainer.last_grad_norm)
        tensor_of = {n: id(p) for n, p in model.named_parameters(remove_duplicate=False)}
        _REFS[key] = (losses, norms, grads[0], tensor_of)
    return _REFS[key]


def launch(torchrun: Launcher, job: dict, engine: str) -> Path:
    run = job["root"] / engine
    run.mkdir(exist_ok=True)
    torchrun(job["root"] / "job" / f"train_{engine}.py", "--steps", STEPS, "--lr", LR, "--grad-clip", "0",
             "--plan", "even", "--ckpt-dir", run / "ckpt", "--log-json", run / "log.json",
             *(["--check"] if engine == "torch" else []),
             nproc=2, cwd=run, env={"AUTOPIPE_TEST_GRADS": str(run)}, pythonpath=[Path(__file__).parent / "probes"])
    return run


@pytest.mark.distributed
# DeepSpeed on the three input shapes that differ for its engine (one tensor, encoder-decoder, a mask
# beside the ids); bert and cnn read their files through the same JobData as on torch
@pytest.mark.parametrize(("name", "engine"), [
    *[(n, "torch") for n in ("gpt2", "bert", "t5", "cnn", "mask")],
    *[pytest.param(n, "deepspeed", marks=pytest.mark.deepspeed) for n in ("gpt2", "t5", "mask")],
])
def test_two_stage_job_on_files_equals_unpipelined_training(torchrun: Launcher, jobs: dict[str, dict], name: str,
                                                            engine: str) -> None:
    """2 stages on 2 processes, data read from the job's file: per-step losses, the logged gradient
    norm and every gradient of the first step equal the unpipelined run within 1e-5."""
    job = jobs[name]
    _equals_reference(launch(torchrun, job, engine), job, f"{name}/{engine}")


def _equals_reference(run: Path, job: dict, label: str) -> None:
    """The run's logged losses and gradient norms, and every gradient of its first step (the probe's
    files of both ranks), equal the untouched model's within TOL."""
    ref_losses, ref_norms, ref_grads, tensor_of = reference(job)
    grads: dict[str, torch.Tensor] = {}
    for rank in (0, 1):
        grads.update(torch.load(run / f"grads_rank{rank}.pt", weights_only=True))
    assert len(grads) >= 6
    covered = set()
    for param, g in grads.items():
        torch.testing.assert_close(g, ref_grads[param], atol=TOL, rtol=0, msg=f"{label}: {param}")
        covered.add(tensor_of[param])
    assert covered == set(tensor_of.values())  # every tensor of the model was checked on some rank
    # after the gradients: AdamW's first step moves a weight whose gradient is near 0 by ±lr on rounding
    log = [json.loads(line) for line in (run / "log.json").read_text().splitlines()]
    assert [r["loss"] for r in log] == pytest.approx(ref_losses, abs=TOL)
    assert [r["grad_norm"] for r in log] == pytest.approx(ref_norms, rel=TOL)


@pytest.mark.distributed
def test_t5_under_zbv_with_evaluation_equals_unpipelined_training(torchrun: Launcher, jobs: dict[str, dict]) -> None:
    """An encoder-decoder under the V schedule, on the cut that failed (stop 48: the decoder's first
    chunk alone on rank 1 beside the encoder's last): its weight pass ran one autograd call per
    weight group and the second walked a graph the first had freed; and eval() under zbv asserted
    in torch's hand-over of input gradients between a rank's adjacent chunks. Now exact, evaluating."""
    import autopipe

    job = jobs["t5"]
    source = model_factory(job["model"], batch_size=ROWS, seq_len=SEQ, loss=job["loss"])
    seq = flatten(meta_model(source.factory), source.args, source.kwargs, device_type="cpu")
    prof = autopipe.profile(seq, source.args, source.kwargs, estimate=True, progress=False, tp_shapes=False)
    cut = (0, 4, 6, 7, len(seq.layers)) if len(seq.layers) == 9 else None
    assert cut is not None, f"the tiny T5 flattens to {len(seq.layers)} layers, not the 9 this cut was found on"
    plan = autopipe.partition(prof, 2, microbatches=MICRO, schedule="zbv", boundaries=cut)
    run = job["root"] / "zbv"
    run.mkdir(exist_ok=True)
    plan.save(run / "plan.json")
    torchrun(job["root"] / "job" / "train_torch.py", "--steps", STEPS, "--lr", LR, "--grad-clip", "0",
             "--plan", run / "plan.json", "--schedule", "zbv", "--ckpt-dir", run / "ckpt", "--log-json", run / "log.json",
             "--eval-data", job["data"], "--eval-every", "1", "--eval-steps", "1",
             nproc=2, cwd=run, env={"AUTOPIPE_TEST_GRADS": str(run)}, pythonpath=[Path(__file__).parent / "probes"])
    _equals_reference(run, job, "t5/zbv")
    log = [json.loads(line) for line in (run / "log.json").read_text().splitlines()]
    assert all("eval_loss" in r for r in log), log


# ---- what a user sees when something is wrong ---------------------------------------------------

def _train(torchrun: Launcher, job: dict, *flags: str, nproc: int = 1) -> subprocess.CompletedProcess:
    run = job["root"] / "errors"
    run.mkdir(exist_ok=True)
    return torchrun(job["root"] / "job" / "train_torch.py", "--steps", "2", "--ckpt-dir", run / "ckpt", *flags,
                    nproc=nproc, cwd=run, check=False)


def _one_line(proc: subprocess.CompletedProcess, expected: str) -> None:
    """Exit 1, and from train.py's ranks exactly one line, the error, with no traceback of ours."""
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and expected in errors[0], out[-3000:]
    assert "autopipe/" not in out and "[rank" not in out, out[-3000:]


@pytest.mark.distributed  # the wrong process count: 3 under torchrun
def test_train_py_errors_are_one_line_from_rank_0(torchrun: Launcher, jobs: dict[str, dict], tmp_path: Path) -> None:
    """No plan, data that does not fit, --resume with nothing to resume, and the wrong process count:
    one line each saying what to do, exit 1. (A missing --data file is test_run_launcher's case, at the
    same place as data that does not fit; a flag DeepSpeed does not run is test_zero's --zero 2 launch
    and, for each flag, test_cli_convert's refusals.)"""
    job = jobs["cnn"]
    _one_line(_train(torchrun, job), "no plan at")
    np.savez(tmp_path / "small.npz", x=np.zeros((4, 1, 4, 4), np.float32), y=np.zeros(4, np.int64))
    _one_line(_train(torchrun, job, "--plan", "even", "--data", str(tmp_path / "small.npz")), "takes (1, 8, 8) per row")
    _one_line(_train(torchrun, job, "--plan", "even", "--resume"), "--resume: no checkpoint in")
    (tmp_path / "plan.json").write_text(json.dumps({"boundaries": [0, 1, 3]}))
    _one_line(_train(torchrun, job, "--plan", str(tmp_path / "plan.json"), nproc=3), "launch with --nproc-per-node 2")


@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.distributed)])
def test_ctrl_c_stops_cleanly_and_says_how_to_resume(torchrun: Launcher, jobs: dict[str, dict], nproc: int) -> None:
    """Ctrl-C mid-run (SIGINT to the whole process group, as a terminal sends it; under torchrun the
    workers get torchrun's SIGTERM too): every rank stops, no traceback of ours, and rank 0 alone prints
    one line naming the newest checkpoint and the command that resumes from it; exit 130 without torchrun."""

    job = jobs["cnn"]
    run = job["root"] / f"interrupted{nproc}"
    run.mkdir(exist_ok=True)
    # a shell's background job ignores SIGINT, and Python then never raises KeyboardInterrupt: start
    # the job with SIGINT as a terminal leaves it, in a group of its own to signal as a terminal does
    cmd = torchrun.command(job["root"] / "job" / "train_torch.py", "--steps", "100000", "--plan", "even",
                           "--ckpt-dir", run / "ckpt", "--ckpt-every", "1", nproc=nproc)
    proc = torchrun.interrupt_at(cmd, cwd=run)
    err = proc.stderr
    said = [line for line in err.splitlines() if line.startswith("interrupted:")]
    assert len(said) == 1 and "interrupted: newest checkpoint" in said[0], err[-3000:]
    assert f"{run / 'ckpt'}/step_000000" in said[0] and said[0].endswith("--resume")
    assert said[0].split("resume with: ")[1].startswith("torchrun --nproc-per-node=2" if nproc > 1 else "python ")
    assert "autopipe/" not in err and "[rank" not in err and "error:" not in err, err[-3000:]
    newest = Path(said[0].split("newest checkpoint ")[1].split(";")[0])
    assert sorted(p.name for p in newest.iterdir()) == ["meta.json", *(f"rank{r:05d}.pt" for r in range(nproc)), "sharded"]
    if nproc == 1:
        assert proc.returncode == 130 and "Traceback" not in err, err[-3000:]
    else:  # torchrun reports the signal in its own words after the line, and exits non-zero
        assert proc.returncode != 0


@pytest.mark.distributed
@pytest.mark.deepspeed
def test_deepspeed_resumes_and_exports_through_its_own_checkpoints(torchrun: Launcher, tmp_path: Path) -> None:
    """Llama on DeepSpeed with the job's ds_config at ZeRO stage 1: a rank killed after step 2's
    checkpoint, then --resume from DeepSpeed's own checkpoint to step 4; the 4 losses equal unpipelined
    training's, and --export writes weights HF's from_pretrained loads, equal to the reference's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from autopipe.runtime.deepspeed_engine.trainer import ds_config

    LlamaConfig(architectures=["LlamaForCausalLM"], hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, intermediate_size=48, vocab_size=128, max_position_embeddings=SEQ).save_pretrained(tmp_path / "llama")
    job = tmp_path / "job"
    job.mkdir()
    write_train_script(job / "train.py", JobSettings(model=str(tmp_path / "llama"), stages=2, microbatches=MICRO,
                                                     schedule="1f1b", batch_size=ROWS, seq_len=SEQ, engine="deepspeed"),
                       zero=1)
    cfg = ds_config(TrainConfig(microbatches=MICRO), rows=ROWS, dp=1)
    cfg["zero_optimization"] = {"stage": 1}
    (job / "ds_config.json").write_text(json.dumps(cfg))  # the job's own: read without --deepspeed_config
    base = [job / "train.py", "--steps", "4", "--lr", LR, "--grad-clip", "0", "--plan", "even", "--ckpt-dir", job / "ckpt",
            "--log-json", job / "log.json", "--ckpt-every", "1"]
    # tests/faults/sitecustomize.py makes rank 1 SIGKILL itself once DeepSpeed's checkpoint of step 2 is saved
    proc = torchrun(*base, nproc=2, cwd=job, env={"AUTOPIPE_TEST_KILL_AT": "2:1"}, pythonpath=[Path(__file__).parent / "faults"],
                    check=False)
    assert proc.returncode != 0
    proc = torchrun(*base, "--resume", "--export", job / "exported", nproc=2, cwd=job)
    assert "ZeRO 1" in proc.stdout and "resumed from" in proc.stdout and "at step 2" in proc.stdout
    assert sorted(p.name for p in (job / "ckpt").glob("step_*")) == ["step_00000003", "step_00000004"]  # DeepSpeed's tags, 2 kept
    source = model_factory(str(tmp_path / "llama"), batch_size=ROWS, seq_len=SEQ)
    data = JobData(source, None, seq_len=SEQ)
    model = build_reference(source.factory, seed=0)
    trainer = ReferenceTrainer(model, TrainConfig(steps=4, microbatches=MICRO, lr=LR, grad_clip=0.0, seed=0))
    expected = [trainer.step(*data.batch(step, ROWS * MICRO)) for step in range(4)]
    logged = {r["step"]: r["loss"] for r in map(json.loads, (job / "log.json").read_text().splitlines())}
    assert [logged[s] for s in (1, 2, 3, 4)] == pytest.approx(expected, abs=TOL)
    exported = LlamaForCausalLM.from_pretrained(job / "exported")
    for name, p in exported.named_parameters():
        torch.testing.assert_close(p.detach(), model.get_parameter(name).detach(), atol=TOL, rtol=0, msg=name)


RANK1_FAILS = '''
import autopipe.runtime as rt
from autopipe.errors import AutopipeError

rt.one_line_errors()
env = rt.init_dist()
if env.rank == 1:
    raise AutopipeError("only rank 1 read this file: fix it")
env.barrier()  # rank 0 waits here and loses its peer
env.close()
'''


@pytest.mark.distributed
def test_an_error_only_another_rank_meets_is_rank_0_s_one_line(torchrun: Launcher, tmp_path: Path) -> None:
    """Rank 1 fails alone: rank 0, which only lost its peer, prints rank 1's line (from the store); no traceback."""
    (tmp_path / "fails.py").write_text(RANK1_FAILS)
    proc = torchrun(tmp_path / "fails.py", nproc=2, cwd=tmp_path, timeout=120, check=False)
    _one_line(proc, "rank 1: only rank 1 read this file: fix it")


BOTH_FAIL_RANK1_FIRST = '''
import time
import autopipe.runtime as rt
from autopipe.errors import AutopipeError

rt.one_line_errors()
env = rt.init_dist()
if env.rank == 0:
    time.sleep(1.5)  # rank 0 reaches the same check later (a slower rank, a loaded machine)
if env.rank <= 1:
    raise AutopipeError("--data 'missing.bin' does not exist.")
env.barrier()  # a third rank has not got there yet: it only sees rank 1's mark
'''


@pytest.mark.distributed
@pytest.mark.parametrize("nproc", [2, 3])
def test_an_error_every_rank_meets_is_rank_0_s_own_line_whichever_rank_meets_it_first(torchrun: Launcher,
                                                                                         tmp_path: Path, nproc: int) -> None:
    """A missing file fails ranks 0 and 1; rank 1 gets there 1.5 s first. The line is rank 0's own,
    without "rank 1:": rank 1, and a third rank that only saw rank 1's mark, wait for it rather than
    exiting, which would make torchrun stop rank 0 first."""
    (tmp_path / "fails.py").write_text(BOTH_FAIL_RANK1_FIRST)
    proc = torchrun(tmp_path / "fails.py", nproc=nproc, cwd=tmp_path, timeout=120, check=False)
    _one_line(proc, "--data 'missing.bin' does not exist.")
    assert "error: --data 'missing.bin' does not exist." in (proc.stdout + proc.stderr).splitlines()
