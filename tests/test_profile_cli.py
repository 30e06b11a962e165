"""The `autopipe profile` command, through typer's CliRunner."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from autopipe.cli import app
from autopipe.costs.layer_costs import Profile

runner = CliRunner()


def test_cli_estimate_prints_table_and_saves_json(tmp_path: Path) -> None:
    """`profile llama-tiny --estimate` prints a per-layer table and writes a loadable profile."""
    out = tmp_path / "p.json"
    result = runner.invoke(app, ["profile", "llama-tiny", "--estimate", "--device", "h100", "--seq-len", "16",
                                 "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "share" in result.output and "saved" in result.output
    prof = Profile.load(out)
    assert prof.mode == "estimated" and prof.model == "llama-tiny" and len(prof.layers) >= 4


@pytest.mark.slow  # measures every layer, and the runtime reserve under torchrun if no test has yet
def test_cli_measures_on_cpu_as_json(tmp_path: Path) -> None:
    """`profile ... --json` measures on the CPU and prints the profile as JSON."""
    out = tmp_path / "p.json"
    # --reserve given: the measured profile is this test's, not the Llama reserve probe's (tests/test_reserve.py
    # runs the probe; here it was the suite's only Llama probe, two processes for 20-40 s)
    result = runner.invoke(app, ["profile", "llama-tiny", "--seq-len", "8", "--repeats", "1", "--warmup", "0",
                                 "--reserve", "8MiB", "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    assert '"kind": "autopipe.profile"' in result.output
    assert Profile.load(out).mode == "measured"


def test_cli_never_overwrites_without_force(tmp_path: Path) -> None:
    """An existing --out is kept and the command exits 1 with one line, unless --force."""
    out = tmp_path / "p.json"
    out.write_text("precious")
    # --reserve given: this is about --force, not the reserve probe (tests/test_reserve.py), 22 s of processes
    cmd = ["profile", "llama-tiny", "--estimate", "--seq-len", "8", "--reserve", "8MiB", "--out", str(out)]
    result = runner.invoke(app, cmd)
    assert result.exit_code == 1 and "--force" in result.output
    assert out.read_text() == "precious"
    forced = runner.invoke(app, [*cmd, "--force"])
    assert forced.exit_code == 0, forced.output
    assert Profile.load(out).mode == "estimated"


def test_cli_unknown_model_is_one_line_error(tmp_path: Path) -> None:
    """An unknown model name exits 1 with a one-line error, no traceback."""
    result = runner.invoke(app, ["profile", "no-such-model", "--out", str(tmp_path / "p.json")])
    assert result.exit_code == 1 and "unknown model" in result.output and "Traceback" not in result.output


def test_profile_table_formats_bytes_like_the_plan() -> None:
    """The profile table and the plan share one byte format (two decimals, up to TiB)."""
    from rich.console import Console

    from autopipe.report.tables import profile_table
    from autopipe.units import format_bytes

    assert [format_bytes(n) for n in (512, 1536, 5 * 2**30, 3 * 2**40)] == ["512 B", "1.50 KiB", "5.00 GiB", "3.00 TiB"]
    prof = Profile.from_costs([1.0], param_bytes=[2**40], activation_bytes=[1536])  # static: 4 x 1 TiB (adamw)
    console = Console(width=200, record=True)
    console.print(profile_table(prof))
    text = console.export_text()
    assert "4.00 TiB" in text and "1.50 KiB" in text


AVX2_ONLY = {"avx": True, "avx2": True, "fma": True, "avx512_f": False, "avx512_bf16": False, "avx512_fp16": False,
             "amx_bf16": False, "amx_tile": False, "amx_fp16": False}


def test_a_16_bit_job_on_a_cpu_that_emulates_it_is_warned_of(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 without AVX512-BF16 or AMX (an AVX2 CPU: torch emulates it, ~30x slower than fp32) is
    warned of, naming the way out; with either instruction set, in fp32, or where torch cannot say: nothing."""
    import torch

    from autopipe.costs.devices import slow_16bit_cpu_note

    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: AVX2_ONLY)
    note = slow_16bit_cpu_note("bf16")
    assert note is not None and "no bf16 instructions (AVX512_BF16 or AMX_BF16)" in note and "--dtype fp32" in note
    assert "no fp16 instructions" in (slow_16bit_cpu_note("fp16") or "")
    assert slow_16bit_cpu_note("bfloat16") == note  # torch's spelling, as the profiler passes it
    assert slow_16bit_cpu_note("fp32") is None and slow_16bit_cpu_note("float64") is None
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {**AVX2_ONLY, "avx512_bf16": True})
    assert slow_16bit_cpu_note("bf16") is None
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {**AVX2_ONLY, "amx_bf16": True})
    assert slow_16bit_cpu_note("bf16") is None

    def unknown() -> dict:
        raise RuntimeError("cpuinfo failed")

    monkeypatch.setattr(torch.cpu, "get_capabilities", unknown)
    assert slow_16bit_cpu_note("bf16") is None


def test_profile_in_bf16_on_such_a_cpu_warns_once_before_it_measures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The warning comes before the table (the profile it warns of may take many minutes), once, and
    stays in the saved profile's warnings."""
    import torch

    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: AVX2_ONLY)
    out = tmp_path / "p.json"
    result = runner.invoke(app, ["profile", "llama-tiny", "--autocast", "bf16", "--seq-len", "8", "--repeats", "1",
                                 "--warmup", "0", "--reserve", "0", "--out", str(out)])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert text.count("no bf16 instructions") == 1 and text.index("no bf16 instructions") < text.index("measured on")
    assert any("no bf16 instructions" in w for w in Profile.load(out).warnings)
