"""``convert --gpus`` searches tensor and expert parallelism with the rest of the layout, over what the
job it writes runs the layout it chose.

On a CPU a tp rank's compute is priced by each layer timed at that degree (DTensor on a fake process
group: autopipe.runtime.checks.tp_timing), so every tp degree the search tries is timed first. A
fixed --tp or --ep is the only degree searched. The ep job is
launched by the real launcher (``autopipe run``: torchrun, gloo) and trains a step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tp_models
from test_tensor_parallel import SEQ

from autopipe import Profile
from autopipe.cluster.layout_search import search
from autopipe.cluster.topology import cluster_for
from autopipe.errors import AutopipeError
from autopipe.job.converter import _searched_tps, convert
from autopipe.job.settings import ConvertSettings

MODELS = Path(tp_models.__file__).resolve()


def test_gpus_takes_a_fixed_degree_and_refuses_one_that_cannot_fit() -> None:
    assert ConvertSettings(gpus=4, global_batch=8, tp=2).tp == 2
    assert ConvertSettings(gpus=4, global_batch=8, ep=2).ep == 2
    with pytest.raises(AutopipeError, match="--ep 3 does not divide --gpus 4"):
        ConvertSettings(gpus=4, global_batch=8, ep=3)
    with pytest.raises(AutopipeError, match="--tp 4 does not fit nodes of 2"):
        ConvertSettings(gpus=4, global_batch=8, tp=4, gpus_per_node=2)


@pytest.mark.slow
def test_convert_gpus_times_each_tp_it_searches_and_keeps_what_runs(tmp_path: Path) -> None:
    result = convert(f"{MODELS}:llama", gpus=4, global_batch=8, out=tmp_path / "job", repeats=2, warmup=1,
                     progress=False, reserve="0")  # fmt: skip
    prof = Profile.load(tmp_path / "job" / "profile.json")
    tps = _searched_tps(prof, result.options)
    assert tps[0] == 1 and 2 in tps, tps  # the tiny Llama's heads split at 2
    timed = {d for l in prof.layers if l.tp is not None for d, _sp, _f, _b in l.tp.timed}
    assert timed == set(tps) - {1}
    # the same search over the degrees convert searched tries the tp layouts too: more than tp 1 alone
    both = [search(prof, cluster_for("cpu", 4, None), global_batch=8, memory_limit=None, tps=t)
            for t in (tps, [1])]  # fmt: skip
    assert both[0].considered > both[1].considered, (both[0].considered, both[1].considered)
    # a fixed degree is the only one searched, and the job is written for it
    fixed = convert(f"{MODELS}:llama", gpus=4, global_batch=8, tp=2, out=tmp_path / "tp2", repeats=2, warmup=1,
                    progress=False, reserve="0")  # fmt: skip
    plan = json.loads((tmp_path / "tp2" / "plan.json").read_text())
    assert plan["tp"] == 2 and plan["stages"] * plan["dp"] * 2 == 4, plan
    assert all(x.tp == 2 for x in fixed.search.layouts)
    assert "    tp: int = 2" in (tmp_path / "tp2" / "train.py").read_text()


@pytest.mark.slow
@pytest.mark.distributed
def test_convert_gpus_searches_ep_on_a_moe_model_and_its_job_trains(tmp_path: Path) -> None:
    """Mixtral (4 experts): ep 1, 2 and 4 searched (dividing the replicas and the experts); with
    --ep 2 fixed the plan is ep 2 on replicas, and its job trains a step on 4 gloo processes."""
    # tp fixed at 1: the tp search (each degree timed on a CPU) has its own test above
    auto = convert(f"{MODELS}:mixtral", gpus=4, global_batch=8, tp=1, out=tmp_path / "auto", repeats=1, warmup=0,
                   progress=False, reserve="0")  # fmt: skip
    assert {x.tp for x in auto.search.layouts} == {1}
    job = tmp_path / "ep2"
    fixed = convert(f"{MODELS}:mixtral", gpus=4, global_batch=8, ep=2, tp=1, out=job, repeats=1, warmup=0,
                    progress=False, reserve="0", seq_len=SEQ)  # fmt: skip
    plan = json.loads((job / "plan.json").read_text())
    assert plan["ep"] == 2 and plan["dp"] % 2 == 0, plan
    assert all(x.ep == 2 and x.dp % 2 == 0 for x in fixed.search.layouts)
    assert "    ep: int = 2" in (job / "train.py").read_text()
    done = subprocess.run([sys.executable, "-m", "autopipe", "run", str(job), "--steps", "1"], cwd=job,
                          capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert f"ep 2: " in done.stdout and "step     1/1" in done.stdout, done.stdout[-3000:]
