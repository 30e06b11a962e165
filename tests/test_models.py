"""Model sources (built-in names, HF folders, factories) and the `autopipe inspect` command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import autopipe
from autopipe.cli import app
from autopipe.errors import ModelNotFoundError
from autopipe.graph.sources import BUILTINS, load_model

runner = CliRunner()


@pytest.mark.parametrize("name", ["gpt2", pytest.param("llama-70b", marks=pytest.mark.slow), "bert-base", "t5-small", "vit-base"])
def test_builtins_flatten_on_meta(name: str) -> None:
    """Every family of built-in flattens on meta with one layer per block plus glue."""
    spec = load_model(name, device="meta", batch_size=1, seq_len=16)
    seq = autopipe.flatten(spec.model, spec.args, spec.kwargs)
    blocks = [info for info in seq.infos if info.kind != "glue"]
    settings = BUILTINS[name].settings
    expected = {"gpt2": 12, "llama-70b": 80, "bert-base": 12, "t5-small": 12, "vit-base": 12}[name]
    assert len(blocks) == expected, [i.name for i in seq.infos]
    if name == "llama-70b":
        assert settings["hidden_size"] == 8192 and 70e9 < sum(p.numel() for p in spec.model.parameters()) < 71e9


def _tiny_gpt2_folder(tmp: Path, weights: bool) -> Path:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=96, n_positions=32,
                     architectures=["GPT2LMHeadModel"])
    folder = tmp / "tiny-gpt2"
    if weights:
        GPT2LMHeadModel(cfg).save_pretrained(folder)
    else:
        cfg.save_pretrained(folder)
    return folder


def test_local_folder_with_weights_loads_them(tmp_path: Path) -> None:
    """A HF folder with safetensors loads its weights (and the trace is validated against them)."""
    from transformers import GPT2LMHeadModel

    folder = _tiny_gpt2_folder(tmp_path, weights=True)
    spec = load_model(str(folder), device="cpu", batch_size=2, seq_len=8)
    saved = GPT2LMHeadModel.from_pretrained(folder)
    assert torch.equal(spec.model.transformer.h[1].mlp.c_fc.weight, saved.transformer.h[1].mlp.c_fc.weight)
    assert spec.task == "causal-lm" and spec.source == "folder"
    seq = autopipe.flatten(spec.model, spec.args, spec.kwargs)
    assert len(seq) == 5


def test_factory_from_file(tmp_path: Path) -> None:
    """file.py:function returning (model, args) works, batch_size is passed when accepted."""
    (tmp_path / "mine.py").write_text(
        "import torch\n"
        "def build(batch_size=1):\n"
        "    m = torch.nn.Sequential(*[torch.nn.Linear(6, 6) for _ in range(4)])\n"
        "    return m, (torch.randn(batch_size, 6),)\n"
    )
    spec = load_model(f"{tmp_path / 'mine.py'}:build", batch_size=3)
    assert spec.args[0].shape == (3, 6) and spec.source == "factory"


@pytest.mark.parametrize(
    "spec, message",
    [
        ("gpt3", "unknown model 'gpt3'"),
        ("nosuchpkg.mod:build", "cannot import 'nosuchpkg.mod'"),
        ("missing.py:build", "does not exist"),
    ],
)
def test_unknown_sources(spec: str, message: str) -> None:
    """Unknown names, modules and files each get a one-line error saying what was looked for."""
    with pytest.raises(ModelNotFoundError, match=message):
        load_model(spec)


def test_folder_without_config(tmp_path: Path) -> None:
    """A folder that is not a HF model says it needs config.json."""
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        load_model(str(tmp_path))


def test_inspect_prints_layers_and_ties() -> None:
    """`autopipe inspect` shows each layer with its tuple signature and the tied weights."""
    result = runner.invoke(app, ["inspect", "gpt2", "--seq-len", "16"], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    assert "transformer.h.11" in result.output and "GPT2Block" in result.output
    assert "f32[1,16,768]" in result.output
    assert "tied: lm_head.weight = transformer.wte.weight" in result.output


def test_inspect_json_on_real_weights(tmp_path: Path) -> None:
    """--json --device cpu gives machine-readable layers of a local folder."""
    folder = _tiny_gpt2_folder(tmp_path, weights=False)
    result = runner.invoke(app, ["inspect", str(folder), "--device", "cpu", "--seq-len", "8", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert [layer["kind"] for layer in data["layers"]][1:3] == ["GPT2Block", "GPT2Block"]
    assert data["tied"][0]["names"] == ["lm_head.weight", "transformer.wte.weight"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["inspect", "gpt3"], "unknown model 'gpt3'"),
        (["inspect", "gpt2", "--seq-len", "4096"], "longer than gpt2's 1024 positions"),
        (["inspect", "gpt2", "--granularity", "atoms"], "granularity must be 'block' or 'leaf'"),
    ],
)
def test_inspect_bad_input_is_one_line(argv: list[str], message: str) -> None:
    """Bad input: exit code 1 and one line, no traceback."""
    result = runner.invoke(app, argv)
    assert result.exit_code == 1
    assert message in result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) <= 2


def test_untraceable_factory_through_cli(tmp_path: Path) -> None:
    """An untraceable model through the CLI: exit 1, the module named, no traceback."""
    (tmp_path / "bad.py").write_text(
        "import torch\n"
        "class M(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.lin = torch.nn.Linear(4, 4)\n"
        "    def forward(self, x):\n"
        "        y = self.lin(x)\n"
        "        return y * 2 if y.max() > 0 else y\n"
        "def build():\n"
        "    return M(), (torch.randn(2, 4),)\n"
    )
    result = runner.invoke(app, ["inspect", f"{tmp_path / 'bad.py'}:build", "--device", "cpu"])
    assert result.exit_code == 1
    assert "could not trace M" in result.output and "y.max() > 0" in result.output
    assert "Traceback" not in result.output
