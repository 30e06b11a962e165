"""The README and the docs site say what the code does: the site builds with warnings as errors,
its generated pages (the command line, every error line) are the code's own, the README fits a
screenful of reading and its quick start is the command CI runs, and every autopipe command and
flag the README shows exists."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import click
import pytest
import typer

from autopipe.cli import app

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _bash_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, re.S)


def test_the_generated_pages_are_the_code_s() -> None:
    """docs/cli.md is typer's reference of the CLI and docs/errors.md every error the source can raise
    (python docs/generate.py rewrites them)."""
    done = subprocess.run([sys.executable, "docs/generate.py", "--check"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr


@pytest.mark.slow
def test_the_site_builds_with_warnings_as_errors(tmp_path: Path) -> None:
    """mkdocs build --strict: every page in the nav, every link and anchor found, every API docstring
    parsed (mkdocstrings)."""
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "site" / "api" / "index.html").is_file() and (tmp_path / "site" / "errors" / "index.html").is_file()


def test_the_readme_is_short_and_its_quick_start_is_ci_s() -> None:
    """Under 150 lines; the quick start is two commands, the second exactly what .ci/run runs."""
    assert len(README.splitlines()) <= 150
    quick = _bash_blocks(README)[0].strip().splitlines()
    assert len(quick) == 2 and "autopipe convert gpt2" in quick[0] and "autopipe run" in quick[0]
    ci = (ROOT / ".ci" / "run").read_text()
    assert quick[1] in ci
    assert "TIME_" not in README, "the quick start's times are measured placeholders still"


def _commands() -> list[list[str]]:
    out = []
    for block in _bash_blocks(README):
        for line in block.splitlines():
            for part in re.split(r"&&", line.split("  #")[0]):
                words = shlex.split(part.strip())
                if words[:1] == ["autopipe"]:
                    out.append(words[1:])
    return out


def test_every_command_and_flag_the_readme_shows_exists() -> None:
    """Each `autopipe CMD --flag` in the README's commands is a command of the CLI with that option
    (`autopipe run JOB --flag`: a flag of the job's train.py), and so is each train.py flag shown."""
    from autopipe.job.script import load_settings
    from autopipe.runtime.process.flags import settings_parser

    parser = settings_parser(load_settings(ROOT / "autopipe" / "job" / "templates" / "train.py"))
    train_flags = {o for action in parser._actions for o in action.option_strings}
    group = typer.main.get_command(app)
    commands = _commands()
    assert len(commands) >= 6
    for words in commands:
        command = group.get_command(click.Context(group), words[0])
        assert command is not None, words
        options = {o for p in command.params for o in getattr(p, "opts", [])}
        if words[0] == "run":
            options |= train_flags
        flags = [w.split("=")[0] for w in words[1:] if w.startswith("--")]
        assert set(flags) <= options, (words, set(flags) - options)
    for block in _bash_blocks(README):
        for line in block.splitlines():
            if "train.py" in line:
                flags = {w for w in shlex.split(line.split("  #")[0]) if w.startswith("--")} - {"--nproc-per-node"}
                assert flags <= train_flags, (line, flags - train_flags)
