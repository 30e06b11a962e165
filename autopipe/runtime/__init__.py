"""autopipe.runtime: what a generated train.py calls to train a plan for real.

Each rank reads one record, the plan's ``StagePlan`` (``load_plan``): the cut, the rank of each
chunk, the schedule, the world's layout and what the plan promised. The rooms, lowest first:

    logs/             the step record and its line on rank 0, the sinks, peak memory, FLOPs
    checkpoints/      per-stage shards written atomically, one run per folder, --resume, export
    stage/            this rank's chunks: meta model -> flatten -> placed by the plan -> its tensors only
    data/             the model's factory and example batch, the data, micro-batches, the loss
    process/          the rank's device and process groups, every collective, flags, launch, one error line
    training/         what both engines share: TrainConfig, optimizer and LR schedule, clip, evaluation
    torch_engine/     torch.distributed.pipelining's schedules, DDP/FSDP2/ZeRO, the Trainer
    deepspeed_engine/ DeepSpeed's PipelineModule over the same layers, DeepSpeedTrainer
    checks/           the untouched model (--verify), plain training of the same layers, the reserve probe
    api/              pipeline(model, plan): this rank's Pipeline, for a training loop of your own

    env = init_dist(dp=1)
    source = model_factory("gpt2", batch_size=2, seq_len=128)
    plan = load_plan("plan.json")
    build = build_stage(source.factory, source.args, source.kwargs, plan, pp_rank=env.pp_rank, pp_size=env.pp_size)
    data = JobData(source, "tokens.bin", seq_len=128, seq=build.seq)
    trainer = Trainer(build, env, TrainConfig(steps=100, microbatches=4), loss_fn=make_loss(source.loss))
    stats = trainer.step(*data.batch(step=0, rows=8))

Names are imported on first use, so ``import autopipe.runtime`` stays cheap.
"""

from __future__ import annotations

from ..lazy import lazy_exports

_LAZY = {
    "even_boundaries": "autopipe.planner.stage_plan",
    "schedule_name": "autopipe.planner.stage_plan",
    "load_plan": "autopipe.planner.plan",
    "StagePlan": "autopipe.planner.stage_plan",
    "plan_placement": "autopipe.planner.stage_plan",
    "DistEnv": "process.distenv",
    "init_dist": "process.distenv",
    "rank_device": "process.distenv",
    "to_device": "process.distenv",
    "Comm": "process.comm",
    "StageBuild": "stage.build",
    "PipeChunk": "stage.build",
    "build_stage": "stage.build",
    "build_reference": "stage.build",
    "PipelineEngine": "torch_engine.pipeline",
    "TrainConfig": "training.optim",
    "Trainer": "torch_engine.trainer",
    "StepStats": "logs.steps",
    "ReferenceTrainer": "checks.reference",
    "save_checkpoint": "checkpoints.store",
    "load_checkpoint": "checkpoints.store",
    "latest_checkpoint": "checkpoints.folders",
    "export": "checkpoints.exports",
    "export_final": "checkpoints.exports",
    "checkpoint_params": "checkpoints.exports",
    "check_ckpt_dir": "checkpoints.folders",
    "TokenData": "data.sources",
    "open_data": "data.sources",
    "JobData": "data.tasks",
    "make_loss": "data.losses",
    "loss_name": "data.losses",
    "check_loss": "data.losses",
    "one_line_errors": "process.lifecycle",
    "check_launch": "process.lifecycle",
    "resume": "checkpoints.resume",
    "MicrobatchSeeds": "stage.build",
    "SequenceModel": "checks.reference",
    "StepLogger": "logs.steps",
    "Predictions": "logs.steps",
    "predictions": "logs.steps",
    "PeakMemory": "logs.peak",
    "verify_step": "checks.verify",
    "untouched_model": "checks.untouched",
    "seeded_like_pipeline": "checks.untouched",
    "model_factory": "data.factory",
    "train_deepspeed": "deepspeed_engine.trainer",
    "DeepSpeedTrainer": "deepspeed_engine.trainer",
    "ds_save_checkpoint": "deepspeed_engine.trainer",
    "ds_resume": "deepspeed_engine.trainer",
    "ds_latest_checkpoint": "deepspeed_engine.trainer",
    "check_zero": "training.optim",
    "ZERO_STAGES": "autopipe.choices",
    "runtime_reserve": "checks.reserve",
    "parse_flags": "process.flags",
    "flag": "process.flags",
    "float_pair": "process.flags",
    "describe_optimizer": "training.optim",
    "step_flops": "logs.flops",
    "world_peak_flops": "logs.flops",
    "Evaluator": "training.evaluate",
    "preflight": "training.preflight",
    "Pipeline": "api.pipeline",
    "pipeline": "api.pipeline",
    "EvalResult": "training.evaluate",
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
    "StagePlan",
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
    "flag",
    "float_pair",
    "describe_optimizer",
    "step_flops",
    "world_peak_flops",
    "Evaluator",
    "preflight",
    "Pipeline",
    "pipeline",
    "EvalResult",
]


__getattr__ = lazy_exports(__name__, _LAZY, globals())
