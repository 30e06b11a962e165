"""Models nobody on this team wrote train as themselves: 2 processes == 1 process == the untouched model.

Each model of tests/zoo.py (HF MoE decoders with their default experts kernels, Jamba's hybrid
Mamba/attention, DeepSeek-V3's latent attention, Gemma, Whisper, a
nanoGPT-style model returning ``(logits, loss)``, a litgpt-style GPT with rotary caches as
non-persistent buffers, CNNs with BatchNorm and with ConvNeXt's permuted channels-last blocks,
AlexNet with the factory's micro-batch) is written as a job of 2 stages and trained one step, at the
model's own weights (its state dict as --weights: non-persistent buffers are the job's to build),
on 2 processes with ``--verify`` and on 1. The reference is the model as the factory builds it,
called through its own forward on the job's rows, micro-batch by micro-batch: the first-step loss
and every parameter's gradient of both runs must equal it (fp32, 1e-5).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import zoo
from _launch import Launcher
from safetensors.torch import save_file

from autopipe.graph.flattener import flatten
from autopipe.graph.sources import load_model
from autopipe.job.script import read_settings, write_train_script
from autopipe.job.settings import JobSettings
from autopipe.runtime import JobData, make_loss, model_factory
from autopipe.runtime.data.batches import split_batch
from autopipe.runtime.data.losses import model_loss

pytestmark = pytest.mark.slow

ZOO_FILE = Path(zoo.__file__).resolve()
PROBES = Path(__file__).parent / "probes"
# the one-process leg (every stage in one process) for one model of each kind only: the 2-process leg
# already compares every model with the untouched one, and each launch costs the suite ~10 s
ONE_PROCESS = {"gemma", "llama", "whisper", "resnet"}
MICRO, SEQ, TOL = 2, zoo.T, 1e-5


def untouched(name: str, batch_size: int | None) -> torch.nn.Module:
    """The model exactly as the user's factory builds it (seed 0), in training mode."""
    torch.manual_seed(0)
    made = zoo.ZOO[name](batch_size=batch_size) if batch_size is not None else zoo.ZOO[name]()
    model = made["model"] if isinstance(made, dict) else made[0]
    return model.train()


def save_weights(model: torch.nn.Module, path: Path) -> None:
    """The model's state dict (each tied name its own copy: safetensors stores no shared tensors)."""
    save_file({k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}, str(path))


def reference(name: str, spec: str, rows: int, loss: str) -> tuple[float, dict[str, torch.Tensor]]:
    """The untouched model's first-step loss (mean over micro-batches) and gradients on the job's rows."""
    source = model_factory(spec, batch_size=rows, seq_len=SEQ, loss=loss)
    shapes = load_model(spec, device="meta", batch_size=rows, seq_len=SEQ)  # the outputs' shapes: what targets are drawn like
    seq = flatten(shapes.model, shapes.args, shapes.kwargs)
    args, kwargs, target = JobData(source, None, seq_len=SEQ, seed=0, seq=seq).batch(0, rows * MICRO)
    model = untouched(name, None if name == "alexnet" else rows)
    fn = make_loss(source.loss)
    targets = list(target.chunk(MICRO)) if target is not None else [None] * MICRO
    total = 0.0
    for (a, k), t in zip(split_batch(args, kwargs, MICRO), targets):
        out = model(*a, **k)
        value = model_loss(out) if fn is None else fn(out, t)
        (value / MICRO).backward()
        total += float(value.detach()) / MICRO
    grads = {n: p.grad for n, p in model.named_parameters(remove_duplicate=False) if p.grad is not None}
    return total, grads


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("zoo")


def make_job(root: Path, name: str) -> tuple[Path, int]:
    """The job folder (train.py, and the model's own weights) and its micro-batch rows. AlexNet goes
    through convert with no --batch-size: its factory's 8 rows are the micro-batch everywhere."""
    job = root / name
    spec = f"{ZOO_FILE}:{name}"
    loss = zoo.LOSS.get(name, "auto")
    if name == "alexnet":
        from autopipe.job.converter import convert

        result = convert(spec, stages=2, microbatches=MICRO, loss=loss, out=job, repeats=1, warmup=0, progress=False,
                         reserve="0")
        rows = result.settings.batch_size
        assert rows == 8 and read_settings(job / "train.py")["batch_size"] == 8
        assert "micro-batch args[0] 8×3×32×32." in (job / "README.md").read_text()
        assert json.loads((job / "profile.json").read_text())["microbatch"] == {"args[0]": [8, 3, 32, 32]}
    else:
        rows = zoo.B if name not in ("resnet",) else 4
        job.mkdir()
        write_train_script(job, JobSettings(model=spec, stages=2, microbatches=MICRO, schedule="1f1b", batch_size=rows, seq_len=SEQ, loss=loss))
    save_weights(untouched(name, None if name == "alexnet" else rows), job / "weights.safetensors")
    return job, rows


def train(torchrun: Launcher, job: Path, nproc: int, *flags: str) -> tuple[float, dict[str, torch.Tensor], str]:
    run = job / f"run{nproc}"
    run.mkdir()
    plan = [] if (job / "plan.json").exists() else ["--plan", "even"]
    proc = torchrun(job / "train.py", "--steps", 1, "--lr", 1e-3, "--grad-clip", 0, "--weights", job / "weights.safetensors",
                    "--ckpt-dir", run / "ckpt", "--log-json", run / "log.json", *plan, *flags, nproc=nproc, cwd=run,
                    env={"AUTOPIPE_TEST_GRADS": str(run)}, pythonpath=[PROBES])
    (step,) = [json.loads(line) for line in (run / "log.json").read_text().splitlines()]
    grads: dict[str, torch.Tensor] = {}
    for rank in range(nproc):
        grads.update(torch.load(run / f"grads_rank{rank}.pt", weights_only=True))
    return step["loss"], grads, proc.stdout


def check(name: str, loss: float, grads: dict[str, torch.Tensor], ref: tuple[float, dict[str, torch.Tensor]]) -> float:
    """The job's loss and every gradient equal the untouched model's; returns the largest gradient difference."""
    ref_loss, ref_grads = ref
    assert loss == pytest.approx(ref_loss, abs=TOL, rel=TOL), f"{name}: loss {loss} vs the untouched model's {ref_loss}"
    covered = {n for n in ref_grads if n in grads}
    tensors = {id(ref_grads[n]) for n in ref_grads}
    assert {id(ref_grads[n]) for n in covered} == tensors, f"{name}: gradients missing for {set(ref_grads) - covered}"
    worst = 0.0
    for n in covered:
        torch.testing.assert_close(grads[n], ref_grads[n], atol=TOL, rtol=TOL, msg=f"{name}: gradient of {n}")
        worst = max(worst, float((grads[n] - ref_grads[n]).abs().max()))
    return worst


@pytest.mark.distributed
@pytest.mark.parametrize("name", sorted(zoo.ZOO))
def test_zoo_model_trains_as_itself_on_2_and_1_processes(torchrun: Launcher, root: Path, name: str) -> None:
    """2 stages on 2 processes (with --verify against the untouched model) and, for ONE_PROCESS, on 1
    process: the first step's loss and every gradient equal the untouched model's within 1e-5."""
    job, rows = make_job(root, name)
    ref = reference(name, f"{ZOO_FILE}:{name}", rows, zoo.LOSS.get(name, "auto"))
    loss2, grads2, out2 = train(torchrun, job, 2, "--verify")
    assert "verify: loss" in out2 and ": ok" in out2, out2[-2000:]
    worst = check(name, loss2, grads2, ref)
    loss1 = None
    if name in ONE_PROCESS:
        loss1, grads1, _ = train(torchrun, job, 1)
        worst = max(worst, check(name, loss1, grads1, ref))
    verify = next(line for line in out2.splitlines() if "verify:" in line)
    with open(root / "figures.jsonl", "a") as f:  # what bench/results/zoo.md reports
        f.write(json.dumps({"model": name, "loss_2proc": loss2, "loss_1proc": loss1, "untouched": ref[0],
                            "max_grad_diff": worst, "verify": verify.split("verify: ", 1)[1]}) + "\n")


@pytest.mark.distributed
@pytest.mark.deepspeed
def test_permuted_channels_last_activations_cross_a_cut_on_deepspeed(torchrun: Launcher, root: Path) -> None:
    """ConvNeXt's permuted, channels-last activations and the permuted gradients its LayerNorm2d sends
    back cross the cut on DeepSpeed's engine too: the first step's loss and every gradient on 2
    processes equal the untouched model's."""
    job = root / "convnext-deepspeed"
    job.mkdir()
    spec = f"{ZOO_FILE}:convnext"
    write_train_script(job, JobSettings(model=spec, stages=2, microbatches=MICRO, schedule="1f1b", batch_size=zoo.B, seq_len=SEQ, engine="deepspeed"))
    save_weights(untouched("convnext", zoo.B), job / "weights.safetensors")
    loss, grads, _ = train(torchrun, job, 2)
    ref = reference("convnext", spec, zoo.B, "auto")
    worst = check("convnext", loss, grads, ref)
    with open(root / "figures.jsonl", "a") as f:
        f.write(json.dumps({"model": "convnext-deepspeed", "loss_2proc": loss, "untouched": ref[0], "max_grad_diff": worst}) + "\n")


FAILS_IN_TRAINING = '''
import torch
from torch import nn


class Lookup(nn.Module):
    """Traces (fake tensors hold no values) but fails at its first real step: an id past the table."""

    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(1, 8)

    def forward(self, x, ids):
        return x + self.table(ids)  # ids hold 0 and 1; the table has one row


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        self.lookup = Lookup()

    def forward(self, x, ids):
        for block in self.blocks:
            x = block(x)
        return self.lookup(x, ids).pow(2).mean()


def build(batch_size=2):
    return Net(), (torch.randn(batch_size, 8), torch.zeros(batch_size, dtype=torch.long))
'''


@pytest.mark.distributed
def test_an_unexpected_error_in_a_layer_is_one_line_naming_stage_layer_and_operation(torchrun: Launcher,
                                                                                      tmp_path: Path) -> None:
    """A torch error inside a layer of stage 1 (on rank 1 only) reaches the user as one line from rank 0
    naming the stage, the layer, the operation and its source line, with the path of a file holding
    the rank's full traceback and the AUTOPIPE_DEBUG=1 hint; no traceback on the screen."""
    (tmp_path / "net.py").write_text(FAILS_IN_TRAINING)
    write_train_script(tmp_path, JobSettings(model=f"{tmp_path / 'net.py'}:build", stages=2, microbatches=2, schedule="1f1b", batch_size=2))
    proc = torchrun(tmp_path / "train.py", "--steps", 1, "--plan", "even", "--ckpt-dir", tmp_path / "ckpt", nproc=2,
                    cwd=tmp_path, check=False)
    out = proc.stdout + proc.stderr
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert proc.returncode != 0 and len(errors) == 1, out[-3000:]
    line = errors[0]
    assert line.startswith("error: rank 1: stage 1, layer 2 'lookup.table', "), line
    assert "operation aten.embedding (net.py:14 `return x + self.table(ids)" in line, line
    assert "IndexError: index out of range" in line and "AUTOPIPE_DEBUG=1" in line, line
    assert "autopipe/" not in out and "[rank" not in out, out[-3000:]  # no traceback of ours (torchrun adds its summary)
    log = Path(line.split("every rank's traceback: ")[1].split(";")[0])
    text = log.read_text()
    assert "==== rank 1" in text and "Traceback (most recent call last)" in text and "IndexError" in text
