"""Every example in the package's docstrings runs and shows what it says (doctest), module by module.

Each module of ``autopipe`` (found by walking the package, so a new module is in without a word)
runs its examples in a temporary folder: an example that writes ``jobs/gpt2/README.md`` writes
there. A module leaves the fast loop only for a stated reason (SLOW), and none is left out.
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil
from pathlib import Path

import pytest

import autopipe

PACKAGE = Path(autopipe.__file__).parent

# modules whose examples start processes or profile a real model, with the reason
SLOW = {
    "autopipe.runtime.checks.reserve": "measures the runtime reserve: a probe trained under torchrun (about 20 s) unless cached",
}

MODULES = ["autopipe", *sorted(m.name for m in pkgutil.walk_packages(autopipe.__path__, "autopipe."))]


def test_the_walk_finds_every_module() -> None:
    """The modules walked are exactly the package's files, so no module's examples go unrun."""
    files = {".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
             for p in PACKAGE.rglob("*.py") if (p.parent / "__init__.py").is_file()}
    assert set(MODULES) == files
    assert set(SLOW) <= set(MODULES), "SLOW names a module that is gone"


@pytest.mark.parametrize("name", [pytest.param(m, marks=pytest.mark.slow) if m in SLOW else m for m in MODULES])
def test_docstring_examples_run(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The module imports, and each of its examples gives the output written under it."""
    monkeypatch.chdir(tmp_path)
    module = importlib.import_module(name)
    report: list[str] = []
    runner = doctest.DocTestRunner(verbose=False)
    for test in doctest.DocTestFinder().find(module, name):
        runner.run(test, out=report.append)
    assert runner.failures == 0, f"{runner.failures} of {runner.tries} examples in {name} failed:\n" + "".join(report)
