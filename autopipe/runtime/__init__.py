"""autopipe.runtime: what a generated train.py calls to train a plan for real.

On each rank: ``init_dist`` lays the world out as dp × pp; ``model_factory`` resolves the model, its
task and its loss; ``build_stage`` builds only this rank's chunks (meta model -> flatten ->
materialise just their tensors); ``JobData`` turns the data into each step's inputs and targets;
``Trainer`` runs the plan's torch.distributed.pipelining schedule, syncs tied gradients, averages
over replicas, clips the global norm and steps the optimizer; ``save_checkpoint``/``load_checkpoint`` write
and read per-stage shards atomically, one run per folder (``check_ckpt_dir``); ``export`` joins a
checkpoint's weights into one safetensors file, ``export_final`` the weights a run holds;
``DeepSpeedTrainer`` does the same on DeepSpeed's engine (with ``ds_save_checkpoint``, ``ds_resume``
and ``ds_latest_checkpoint`` for its own checkpoints); ``one_line_errors`` makes failures one line;
``runtime_reserve`` (the ``reserve`` module) measures what a rank holds beyond the tensors;
``untouched_model`` builds the user's model as its factory does, at the job's weights: what
``verify_step`` (``--verify``) and the tests compare a job with.

    env = init_dist(dp=1)
    source = model_factory("gpt2", batch_size=2, seq_len=128)
    build = build_stage(source.factory, source.args, source.kwargs, plan, pp_rank=env.pp_rank, pp_size=env.pp_size)
    data = JobData(source, "tokens.bin", seq_len=128, seq=build.seq)
    trainer = Trainer(build, env, TrainConfig(steps=100, microbatches=4), loss_fn=make_loss(source.loss))
    stats = trainer.step(*data.batch(step=0, rows=8))

Submodules are imported on first use, so ``import autopipe.runtime`` stays cheap.
"""

from __future__ import annotations

from ..lazy import lazy_exports

_LAZY = {
    "ChunkLayout": "layout",
    "even_boundaries": "layout",
    "schedule_name": "layout",
    "load_plan": "layout",
    "plan_placement": "layout",
    "DistEnv": "distenv",
    "init_dist": "distenv",
    "rank_device": "distenv",
    "to_device": "distenv",
    "Comm": "comm",
    "StageBuild": "build",
    "PipeChunk": "build",
    "build_stage": "build",
    "build_reference": "build",
    "PipelineEngine": "engine",
    "TrainConfig": "optim",
    "Trainer": "trainer",
    "StepStats": "trainer",
    "ReferenceTrainer": "reference",
    "save_checkpoint": "checkpoint",
    "load_checkpoint": "checkpoint",
    "latest_checkpoint": "checkpoint",
    "export": "exports",
    "export_final": "exports",
    "checkpoint_params": "exports",
    "check_ckpt_dir": "checkpoint",
    "TokenData": "data",
    "open_data": "data",
    "JobData": "tasks",
    "make_loss": "tasks",
    "loss_name": "tasks",
    "check_loss": "tasks",
    "one_line_errors": "main",
    "check_launch": "main",
    "resume": "main",
    "MicrobatchSeeds": "build",
    "SequenceModel": "reference",
    "StepLogger": "logs",
    "Predictions": "logs",
    "predictions": "logs",
    "PeakMemory": "peak",
    "verify_step": "verify",
    "untouched_model": "untouched",
    "seeded_like_pipeline": "untouched",
    "model_factory": "factory",
    "train_deepspeed": "ds",
    "DeepSpeedTrainer": "ds",
    "ds_save_checkpoint": "ds",
    "ds_resume": "ds",
    "ds_latest_checkpoint": "ds",
    "check_zero": "zero",
    "ZERO_STAGES": "zero",
    "runtime_reserve": "reserve",
    "parse_flags": "flags",
    "float_pair": "flags",
    "describe_optimizer": "optim",
    "step_flops": "flops",
    "world_peak_flops": "flops",
    "Evaluator": "evaluate",
    "EvalResult": "evaluate",
}

__all__ = [
    "ZERO_STAGES",
    "runtime_reserve",
    "check_zero",
    "Comm",
    "JobData",
    "MicrobatchSeeds",
    "SequenceModel",
    "check_launch",
    "check_loss",
    "loss_name",
    "make_loss",
    "one_line_errors",
    "open_data",
    "resume",
    "DistEnv",
    "DeepSpeedTrainer",
    "ds_latest_checkpoint",
    "ds_resume",
    "ds_save_checkpoint",
    "ChunkLayout",
    "PipeChunk",
    "PeakMemory",
    "PipelineEngine",
    "Predictions",
    "ReferenceTrainer",
    "StageBuild",
    "StepLogger",
    "StepStats",
    "TokenData",
    "TrainConfig",
    "Trainer",
    "build_reference",
    "build_stage",
    "even_boundaries",
    "export",
    "export_final",
    "checkpoint_params",
    "check_ckpt_dir",
    "init_dist",
    "latest_checkpoint",
    "load_checkpoint",
    "load_plan",
    "plan_placement",
    "model_factory",
    "predictions",
    "rank_device",
    "save_checkpoint",
    "schedule_name",
    "to_device",
    "train_deepspeed",
    "verify_step",
    "untouched_model",
    "seeded_like_pipeline",
    "parse_flags",
    "float_pair",
    "describe_optimizer",
    "step_flops",
    "world_peak_flops",
    "Evaluator",
    "EvalResult",
]


__getattr__ = lazy_exports(__name__, _LAZY, globals())
