"""A new user's first minutes: the README's quick start, timed as they would meet it.

    python bench/bench_first_minutes.py            # the quick start twice: a cold cache, then warm
    python bench/bench_first_minutes.py --no-write

Runs `autopipe convert gpt2 --stages 4` then `autopipe run jobs/gpt2 --steps 8 --verify` in a
scratch folder, first with an empty autopipe cache (the first time on a machine: the runtime's
memory reserve is measured once per precision and architecture) and again with it warm, and
records for each command the wall time, the seconds to its first line of output (a person
watching a silent terminal), and how many lines it printed; with the load before and after
(a 2-core machine shared with others moves every figure). Results: bench/results/first-minutes.md.
The suite's times come from a fresh clone through .ci/run (its log), noted under the table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _notes import write_keeping_notes  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
AUTOPIPE = [sys.executable, "-m", "autopipe"]
STEPS = [("convert", ["convert", "gpt2", "--stages", "4"]), ("run --steps 8 --verify", ["run", "jobs/gpt2", "--steps", "8",
                                                                                          "--verify"])]


def timed(cmd: list[str], cwd: Path, env: dict[str, str]) -> dict[str, float]:
    """Wall seconds, seconds to the first line on stdout or stderr, lines printed; fails loudly."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first, lines = None, 0
    assert proc.stdout is not None
    for line in proc.stdout:
        lines += 1
        if first is None and line.strip():
            first = time.perf_counter() - start
        sys.stdout.write("    " + line)
    code = proc.wait()
    wall = time.perf_counter() - start
    if code != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {code}")
    return {"wall_s": wall, "first_line_s": first if first is not None else wall, "lines": lines}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    rows = {}
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "cache"
        for rnd in ("cold", "warm"):
            work = Path(tmp) / rnd
            work.mkdir()
            env = {**os.environ, "AUTOPIPE_CACHE": str(cache)}
            for name, cmd in STEPS:
                print(f"[{rnd}] autopipe {' '.join(cmd)}", flush=True)
                rows[f"{rnd}: {name}"] = timed([*AUTOPIPE, *cmd], work, env)
    after = os.getloadavg()[0]
    text = ["# The quick start, timed (bench/bench_first_minutes.py)", "",
            f"`autopipe convert gpt2 --stages 4` then `autopipe run jobs/gpt2 --steps 8 --verify`, with an empty "
            f"autopipe cache (cold) and again (warm); load {load:.1f} before, {after:.1f} after.", "",
            "| run: command | wall s | first line after s | lines printed |", "| --- | --- | --- | --- |"]
    text += [f"| {name} | {r['wall_s']:.0f} | {r['first_line_s']:.1f} | {r['lines']} |" for name, r in rows.items()]
    for name, r in rows.items():
        print(f"{name:32s} {r['wall_s']:7.1f} s, first line after {r['first_line_s']:.1f} s, {r['lines']} lines")
    if not args.no_write:
        write_keeping_notes(RESULTS / "first-minutes.md", "\n".join(text) + "\n")
        (RESULTS / "first-minutes.json").write_text(json.dumps({"load": [load, after], "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
