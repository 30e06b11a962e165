"""Every causal LM the installed transformers maps, flattened and split as tests/test_causal_lms.py checks
it: how many are exact, how long each takes, and why the others are not.

    python bench/bench_causal_lms.py [NAME ...]   # all by default; writes bench/results/causal-lms.json/.md

Each family runs in its own process (a hung or crashing trace cannot take the others with it), with a
time limit; "exact" means the flattened sequence and its 2- and 3-stage splits give the untouched
model's outputs (its own loss among them) and every parameter gradient at 1e-5.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "results"
ONE = r'''
import sys, time, json
sys.path.insert(0, "tests")
name = sys.argv[1]
t0 = time.perf_counter()
status, why = "exact", ""
try:
    from causal_lms import LEAF, build
    try:
        model, args, kwargs = build(name)
        out = model(*args, **kwargs)
    except Exception as e:
        status, why = "unbuildable", f"{type(e).__name__}: {e}"
    else:
        if getattr(out, "loss", None) is None:
            status, why = "no loss", "the model returns no loss of its own"
        else:
            import autopipe
            from test_flatten import _assert_same, _even, _run, _run_stages
            ref = _run(model, lambda: model(*args, **kwargs))
            try:
                seq = autopipe.flatten(model, args, kwargs, granularity="leaf" if name in LEAF else "block")
            except Exception as e:
                status, why = "refused", f"{type(e).__name__}: {e}"
            else:
                try:
                    _assert_same(ref, _run(model, lambda: seq(*args, **kwargs)), "1 stage")
                    for stages in (2, 3):
                        parts = seq.split(_even(len(seq), stages))
                        _assert_same(ref, _run(model, lambda: _run_stages(parts, args, kwargs)), f"{stages} stages")
                except Exception as e:
                    status, why = "mismatch", f"{type(e).__name__}: {e}"
except Exception as e:
    status, why = "error", f"{type(e).__name__}: {e}"
print("RESULT " + json.dumps({"status": status, "why": why.splitlines()[0][:400] if why else "", "s": round(time.perf_counter() - t0, 1)}))
'''


def run(name: str, limit: float = 300) -> dict:
    t0 = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, "-c", ONE, name], cwd=ROOT, capture_output=True, text=True, timeout=limit,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "why": f"over {limit:.0f} s", "s": round(time.perf_counter() - t0, 1)}
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    tail = (p.stderr.strip().splitlines() or ["no output"])[-1]
    return {"status": "crash", "why": tail[:400], "s": round(time.perf_counter() - t0, 1)}


def main(argv: list[str]) -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    from causal_lms import names

    import transformers

    todo = argv or names()
    path = OUT / "causal-lms.json"
    results = json.loads(path.read_text())["families"] if path.exists() and argv else {}
    for i, name in enumerate(todo):
        results[name] = run(name)
        print(f"[{i + 1}/{len(todo)}] {name}: {results[name]}", flush=True)
        path.write_text(json.dumps({"transformers": transformers.__version__, "families": results}, indent=1))
    counts: dict[str, int] = {}
    for r in results.values():
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    buildable = sum(v for k, v in counts.items() if k != "unbuildable")
    lines = ["# Every causal LM of the installed transformers, flattened and split (bench/bench_causal_lms.py)", "",
             f"transformers {transformers.__version__}: {len(results)} families mapped; "
             f"**{counts.get('exact', 0)} of {buildable} buildable are exact** (1, 2 and 3 stages: outputs, the model's "
             "own loss and every gradient at 1e-5). Counts: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) + ".",
             "", "| family | status | seconds | why (first line) |", "| --- | --- | ---: | --- |"]
    for name, r in sorted(results.items()):
        lines.append(f"| {name} | {r['status']} | {r['s']} | {r['why'].replace('|', '/')} |")
    (OUT / "causal-lms.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
