"""The runtime reserve: measured once per device by a real 2-rank pipeline, cached, kept in profiles."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from autopipe.errors import AutopipeError
from autopipe.runtime.checks.reserve import reserve_for, runtime_reserve

MIB = 2**20


@pytest.mark.slow  # the probe trains a 2-process pipeline
def test_the_cpu_reserve_is_measured_once_then_read_from_the_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first call in a cache (this run's: tests/conftest.py) runs a probe pipeline that measures
    each rank's peak against the memory model's prediction (the reserve is what it holds beyond, a few
    MiB on a CPU since the exact-memory heap keeps no sub-MiB tensors: the module docstring); the
    figure, and the probe's largest rank measured and predicted, are cached under $AUTOPIPE_CACHE and
    every later call reads them without measuring. Whichever test of the run called first (a convert
    on another worker, say) measured; the probe is not run again here for this test."""
    from autopipe.runtime.checks import reserve as mod

    first = runtime_reserve("cpu")  # measured here if nothing in this run measured it before
    key = mod._key("cpu", "fp32", mod._arch(None))
    path = Path(os.environ["AUTOPIPE_CACHE"]) / "reserve.json"
    if f"{key}|measured_bytes" not in json.loads(path.read_text()):  # a cache given from before the record
        first = runtime_reserve("cpu", refresh=True)
    cache = json.loads(path.read_text())
    measured, model = cache[f"{key}|measured_bytes"], cache[f"{key}|model_bytes"]
    # the probe trained a real pipeline whose largest rank the model predicts to within a tenth
    assert model > 32 * MIB and 0.9 < measured / model < 1.1, (measured, model)
    assert 0 <= first < 64 * MIB and first == cache[key], first
    # and beside it the most a rank held beyond its prediction, never under the ranks' mean: memory advice's figure
    assert mod.rank_excess("cpu") == cache[mod._excess_key(key)] >= first

    def no_probe(device: str, **kwargs: object):  # noqa: ANN202
        raise AssertionError("measured again despite the cache")

    monkeypatch.setattr("autopipe.runtime.checks.reserve.measure_reserve", no_probe)
    assert runtime_reserve("cpu") == first


def test_two_processes_needing_the_reserve_at_once_run_one_probe(tmp_path: Path) -> None:
    """Two processes asking at once for a figure not yet cached: one measures, the other waits on the
    cache's lock and reads its figure. Both start asking together (each waits for the other to be
    ready), and the probe's stand-in records each run and takes 2 s, so without the lock both run it."""
    import subprocess
    import sys

    script = tmp_path / "ask.py"
    script.write_text(
        "import json, os, sys, time\n"
        "from autopipe.runtime.checks import reserve as mod\n"
        "def probe(device, **kw):\n"
        "    with open(sys.argv[1], 'a') as f: f.write(f'{os.getpid()}\\n')\n"
        "    time.sleep(2.0)\n"
        "    return {'reserve_bytes': 3 << 20, 'excess_bytes': 4 << 20, 'measured_bytes': 40 << 20,\n"
        "            'model_bytes': 38 << 20, 'clean': 1}\n"
        "mod.measure_reserve = probe\n"
        "open(os.path.join(os.path.dirname(sys.argv[1]), f'ready-{os.getpid()}'), 'w').close()\n"
        "while len([n for n in os.listdir(os.path.dirname(sys.argv[1])) if n.startswith('ready-')]) < 2:\n"
        "    time.sleep(0.01)\n"
        "print(mod.runtime_reserve('cpu'))\n")
    runs = tmp_path / "probes.txt"
    env = {**os.environ, "AUTOPIPE_CACHE": str(tmp_path / "cache")}
    procs = [subprocess.Popen([sys.executable, str(script), str(runs)], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=120)[0].split() for p in procs]
    assert [p.returncode for p in procs] == [0, 0] and outs == [[str(3 << 20)]] * 2, outs
    assert len(runs.read_text().split()) == 1, runs.read_text()


def test_reserve_for_a_profile() -> None:
    """Given sizes win; estimates for a named GPU carry none (the device table's CUDA memory model
    stands for the GPU: autopipe/costs/gpu_memory.py); cpu is this machine's."""
    assert reserve_for("cpu", estimate=False, given="64MiB") == 64 * MIB
    assert reserve_for("cpu", estimate=False, given=0) == 0
    assert reserve_for("h100", estimate=True) == 0
    assert reserve_for("cpu", estimate=True) == runtime_reserve("cpu")
    with pytest.raises(AutopipeError, match="measured on cpu or cuda"):
        runtime_reserve("tpu")



def test_each_precision_and_architecture_has_a_reserve_of_its_own(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """What a rank holds beyond the counted tensors depends on the precision (bf16's per-micro-batch
    weight copies fragment the CPU heap) and the architecture (measured here: GPT-2-shaped fp32 28-29
    MiB, bf16 36-38; Llama-shaped fp32 35-38, bf16 45-52). So the probe runs in the profile's mode on
    the profile's architecture, and the cache keeps one figure for each."""
    from transformers import LlamaConfig

    monkeypatch.setenv("AUTOPIPE_CACHE", str(tmp_path))  # a cache of its own: other tests fill the session's
    asked: list[tuple[str, str]] = []

    def fake_probe(device: str, *, dtype: str = "fp32", config: object = None, progress: object = False) -> dict[str, int]:
        asked.append((dtype, getattr(config, "model_type", "gpt2")))
        return {"reserve_bytes": len(asked) * MIB, "excess_bytes": 2 * len(asked) * MIB}

    monkeypatch.setattr("autopipe.runtime.checks.reserve.measure_reserve", fake_probe)
    llama = LlamaConfig(architectures=["LlamaForCausalLM"], hidden_size=512, intermediate_size=1376,
                        num_attention_heads=8, num_key_value_heads=4)  # fmt: skip
    got = [runtime_reserve("cpu"), runtime_reserve("cpu", dtype="bf16"), reserve_for("cpu", estimate=False, config=llama),
           reserve_for("cpu", estimate=False, config=llama, dtype="bf16")]  # fmt: skip
    assert asked == [("fp32", "gpt2"), ("bf16", "gpt2"), ("fp32", "llama"), ("bf16", "llama")]
    assert got == [1 * MIB, 2 * MIB, 3 * MIB, 4 * MIB]
    # cached: asking again measures nothing
    again = [runtime_reserve("cpu"), runtime_reserve("cpu", dtype="bf16"), runtime_reserve("cpu", config=llama),
             runtime_reserve("cpu", dtype="bf16", config=llama)]  # fmt: skip
    assert again == got and len(asked) == 4
    with pytest.raises(AutopipeError, match="fp32, bf16 or fp16"):
        runtime_reserve("cpu", dtype="int8")


def test_the_probe_takes_the_architecture_at_probe_size() -> None:
    """A Llama config shrinks to the probe's size with its shape ratios; what the probe cannot shrink
    (not a decoder-only LM, or GPT-2 itself) gets the GPT-2 probe."""
    from transformers import BertConfig, GPT2Config, LlamaConfig, T5Config

    from autopipe.runtime.checks.reserve import probe_config

    big = LlamaConfig(architectures=["LlamaForCausalLM"], hidden_size=8192, intermediate_size=28672,
                      num_attention_heads=64, num_key_value_heads=8, vocab_size=128256, num_hidden_layers=80,
                      head_dim=128, bos_token_id=128000, eos_token_id=128001)  # fmt: skip
    small = probe_config(big)
    assert (small.num_hidden_layers, small.hidden_size, small.num_attention_heads) == (4, 256, 4)
    assert (small.intermediate_size, small.num_key_value_heads, small.head_dim) == (896, 1, 64)
    assert small.vocab_size == 4096 and small.bos_token_id == 0 and small.eos_token_id == 0
    assert big.hidden_size == 8192  # the user's config is not touched
    for other in (GPT2Config(architectures=["GPT2LMHeadModel"]), BertConfig(architectures=["BertForMaskedLM"]),
                  T5Config(architectures=["T5ForConditionalGeneration"]), LlamaConfig()):
        assert probe_config(other) is None
