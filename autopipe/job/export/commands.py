"""The user's whole command for each engine, and what the export leaves them to do by hand.

An export is a part of a job, not the job: the engine still needs the model (its flags, or the
config function that builds it), the weights in its own checkpoint format, a tokenizer and data.
What autopipe knows (the model's registry name, its HuggingFace folder, its sizes) is filled in; the
rest is a line of ``todo``, printed with the command.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import ExportError
from .modules import StageModules
from .titan_names import HF_BACKEND, TitanVersion
from .torchtitan import FUNCTION, TitanJob

__all__ = ["Command", "titan_command", "megatron_command", "deepspeed_command", "check_titan_path"]


@dataclass(frozen=True)
class Command:
    """The command that runs the exported file, and the steps it still needs (one line each)."""

    command: str
    todo: tuple[str, ...] = ()


def _ranks(sm: StageModules) -> int:
    return sm.stages * sm.dp * sm.tp


def check_titan_path(path: Path, v: TitanVersion) -> None:
    """0.3 imports the file as a Python module, 0.2 reads TOML: refuse a name the release cannot use."""
    if v.toml and path.suffix != ".toml":
        raise ExportError(f"torchtitan {v.release} reads a TOML config (--job.config_file); name the file {path.stem}.toml, "
                          "or export --to torchtitan@0.3 for a config function.")
    if not v.toml and (path.suffix != ".py" or not path.stem.isidentifier()):
        raise ExportError(f"torchtitan {v.release} reads no TOML: it imports the config as a Python module (--module "
                          f"{path.stem}), so name the file like one, e.g. autopipe_plan.py; or export --to torchtitan@0.2 for TOML.")


def titan_command(sm: StageModules, v: TitanVersion, job: TitanJob, path: Path, args: list[str],
                  backend: str) -> Command:  # fmt: skip
    """torchrun over torchtitan's trainer with the exported file (and, for 0.3, the same as overrides)."""
    n = _ranks(sm)
    todo = []
    if v.toml:
        command = (f"torchrun --nproc-per-node {n} -m torchtitan.train --job.config_file {path}\n# or your own "
                   f"config file with the plan as overrides:\n# torchrun --nproc-per-node {n} -m torchtitan.train "
                   "--job.config_file YOUR.toml " + " ".join(args))  # fmt: skip
        if not job.module:
            todo.append(f"set [model] name and flavor in {path.name} to the torchtitan model you train")
        data = "[model] hf_assets_path (tokenizer) and [training] dataset"
    else:
        where = path.parent.resolve()
        command = (f"PYTHONPATH={where}:$PYTHONPATH torchrun --nproc-per-node {n} -m torchtitan.train "
                   f"--module {path.stem} --config {FUNCTION}")
        fn = job.config_fn.partition(":")[2]
        short = job.module if job.module and fn else "YOUR_MODULE"
        command += (f"\n# or your own config with the plan as overrides:\n# torchrun --nproc-per-node {n} -m torchtitan.train "
                    f"--module {short} --config {fn or 'YOUR_CONFIG'} " + " ".join(args))  # fmt: skip
        if not job.config_fn:
            todo.append(f"name the config function you train with in {path.name} (the line importing base_config)")
        data = "hf_assets_path (tokenizer) and --dataloader.dataset"
    if backend == "hf" and not job.hf_model:
        todo.append("set hf_model (0.3) or [hf_transformers] model (0.2) to your model's HuggingFace folder or hub id")
    todo.append(f"point {data} at your tokenizer and data")
    todo.append("torchtitan initialises the weights; to start from a checkpoint add --checkpoint.initial_load_path "
                "ABSOLUTE_PATH (and --checkpoint.initial_load_in_hf for HuggingFace safetensors)")
    if backend == "model":
        todo.append("the times were measured with SDPA in place of torchtitan's flex attention (same modules, causal "
                    "mask); flex's kernel runs at its own speed")
    return Command(command, tuple(todo))


def megatron_model_flags(config: Any) -> list[str]:
    """Megatron-LM's model flags for a HuggingFace Llama- or GPT-2-shaped config ([] for others)."""
    kind = getattr(config, "model_type", "")
    if kind in ("llama", "mistral", "qwen2"):
        heads, groups = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        flags = [f"--num-layers {config.num_hidden_layers}", f"--hidden-size {config.hidden_size}",
                 f"--ffn-hidden-size {config.intermediate_size}", f"--num-attention-heads {heads}",
                 f"--max-position-embeddings {config.max_position_embeddings}", "--normalization RMSNorm",
                 f"--norm-epsilon {config.rms_norm_eps}", "--swiglu", "--position-embedding-type rope",
                 "--disable-bias-linear"]  # fmt: skip
        if groups != heads:
            flags += ["--group-query-attention", f"--num-query-groups {groups}"]
        return flags
    if kind == "gpt2":
        return [f"--num-layers {config.n_layer}", f"--hidden-size {config.n_embd}",
                f"--num-attention-heads {config.n_head}", f"--max-position-embeddings {config.n_positions}"]
    return []


def megatron_command(sm: StageModules, path: Path, config: Any = None) -> Command:
    """pretrain_gpt.py with the model's flags (where autopipe knows them) and the exported PIPELINE_ARGS."""
    flags = megatron_model_flags(config) if config is not None else []
    # --num-layers is already in PIPELINE_ARGS (it must match the layout); keep one
    flags = [f for f in flags if not f.startswith("--num-layers")]
    seq = [f"--seq-length {sm.seq_len}"] if sm.seq_len else []
    model = " ".join(flags + seq) if flags else "MODEL_FLAGS"
    command = (f"source {path} && torchrun --nproc-per-node {_ranks(sm)} pretrain_gpt.py {model} "
               '"${PIPELINE_ARGS[@]}" --tokenizer-type ... --data-path ... --save CKPT --load CKPT')
    todo = [] if flags else ["give Megatron-LM the model's flags (--hidden-size, --num-attention-heads, ...): "
                             "autopipe knows them for HuggingFace Llama and GPT-2 configs only"]
    todo += ["convert the HuggingFace weights to a Megatron checkpoint (Megatron-Bridge, or Megatron-LM's "
             "tools/checkpoint) and --load it; without one Megatron initialises the weights",
             "set --tokenizer-type/--tokenizer-model and --data-path for your data",
             "the times were profiled on the model's own (HuggingFace) layers, not on Megatron-Core's kernels"]
    return Command(command, tuple(todo))


def deepspeed_command(sm: StageModules, path: Path) -> Command:
    """DeepSpeed's launcher over the user's script, which imports the exported file."""
    command = f"deepspeed --num_gpus {_ranks(sm)} YOUR_TRAIN.py  # it imports {path.stem}: parts_for, planned_pipeline_module, DS_CONFIG"
    todo = ("write your model as a list of LayerSpec layers in model order (TiedLayerSpec for tied tensors) and "
            f"map them onto the plan's stages with parts_for(STAGE_MODULES, <the module each layer runs>)",
            "pass DS_CONFIG (micro-batch size and count, ZeRO stage) to deepspeed.initialize, with your optimizer")
    return Command(command, todo)
