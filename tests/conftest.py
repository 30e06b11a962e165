import os
import sys

import pytest
import torch

# Tests build small models; one thread keeps runs repeatable and leaves a core for the rest.
torch.set_num_threads(1)
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# A pytest-xdist worker starts with COLUMNS=80 in its environment where the run itself has none; rich
# reads it once, when autopipe.cli's console is made, which then ignores the COLUMNS a test gives the CLI.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.pop("COLUMNS", None)
sys.path.insert(0, os.path.dirname(__file__))

from _launch import Launcher  # noqa: E402  (tests/ is put on sys.path just above)

# The runtime reserve is measured once per device and cached (autopipe.runtime.checks.reserve); a session-wide
# cache of its own makes the suite measure it once itself, on this machine, rather than trust a
# figure left in the home folder by another torch or another machine. The process that makes it
# removes it when the run ends (a run used to leave one in the temp folder for good: 194 of them here).
# xdist's workers inherit the controller's environment, so they share its folder and the probe runs once a
# run, not once a worker.
_MADE_CACHE = ""
if "AUTOPIPE_CACHE" not in os.environ:
    import tempfile

    os.environ["AUTOPIPE_CACHE"] = _MADE_CACHE = tempfile.mkdtemp(prefix="autopipe-cache-")


def pytest_unconfigure(config: pytest.Config) -> None:
    if _MADE_CACHE:
        import shutil

        shutil.rmtree(_MADE_CACHE, ignore_errors=True)


@pytest.fixture(scope="session")
def torchrun() -> Launcher:
    """Runs a script on N processes: ``torchrun(script, *args, nproc=2, cwd=..., env=..., pythonpath=...,
    timeout=..., check=True, elastic=False)`` -> CompletedProcess. The ranks get torchrun's environment
    but are started directly (half the wall time); ``elastic=True`` for a test of torchrun itself.
    ``torchrun.command(...)`` (a real torchrun line) and ``torchrun.environ(...)`` for a test that
    must start the process itself (see tests/_launch.py)."""
    return Launcher()


@pytest.fixture(autouse=True)
def _no_engine_table(request, monkeypatch, tmp_path_factory) -> None:
    """In-process plans cost the layers alone, as the tests' figures are worked out by hand: the table
    bench_engines.py measured on some machine (autopipe/costs/engine_costs.json) is not in them. A test
    about that table is marked ``shipped_engine_table``; processes a test starts read the table as a
    user's would."""
    if request.node.get_closest_marker("shipped_engine_table"):
        return
    from autopipe.costs import engines

    monkeypatch.setattr(engines, "TABLE", tmp_path_factory.getbasetemp() / "no-engine-table.json")


# torchtitan 0.2 (its last TOML release) beside the 0.3 the test extra installs: pip puts the release alone,
# without its dependencies (0.3's serve it), in a folder of pytest's cache, once; a test runs it in a
# subprocess with that folder first on PYTHONPATH, so the two versions never meet in one interpreter.
TITAN_TOML_RELEASE = "0.2.2"


@pytest.fixture(scope="session")
def titan022(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A folder holding torchtitan 0.2.2 alone, to put first on PYTHONPATH (installed by pip on first use)."""
    import subprocess

    cache = getattr(request.config, "cache", None)
    where = (cache.mkdir(f"torchtitan-{TITAN_TOML_RELEASE}") if cache is not None
             else tmp_path_factory.mktemp(f"torchtitan-{TITAN_TOML_RELEASE}"))  # fmt: skip
    done = where / ".installed"
    import fcntl

    with open(str(where) + ".lock", "w") as lock:  # two pytest workers (xdist) may ask at once: one installs
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.is_file():
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--upgrade", "--target",
                            str(where), f"torchtitan=={TITAN_TOML_RELEASE}"], check=True, timeout=300)  # fmt: skip
            done.write_text(TITAN_TOML_RELEASE)
    return str(where)
