"""Pipeline-parallel training of $model, written by `autopipe convert`.

    autopipe run . --steps 8          # $stages process(es), one per stage; one line on failure
    torchrun --nproc-per-node $stages train.py                  # the same under torchrun
    torchrun --nproc-per-node $stages_x2 train.py --dp 2 --zero 3   # x 2 replicas, sharded
    torchrun --nproc-per-node $stages train.py --engine deepspeed  # DeepSpeed's PipelineModule
    python train.py                   # every stage in one process (debugging)

Every setting below is also a flag of its name (`--batch-size 4`, `--verify`); `python train.py
--help` lists them. Each rank builds the model on the meta device and gives real weights only to
its own stage; the machinery is autopipe.runtime's, the loop is yours to edit.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

import autopipe.runtime as rt

HERE = Path(__file__).resolve().parent


@dataclass
class Settings:
    # ---- the model and its plan (from `autopipe convert`) -----------------------------------
    model: str = 'gpt2'  # built-in name, HF folder or module:function
    plan: str = str(HERE / "plan.json")  # where to cut; 'even' cuts the layers evenly
    schedule: str = '1f1b'  # gpipe | 1f1b | interleaved1f1b | zbv | interleavedzb
    microbatches: int = 8  # per step; the gradients are their mean
    batch_size: int = 1  # rows per micro-batch
    seq_len: int = 128
    dtype: Literal['fp32', 'bf16', 'fp16'] = 'fp32'  # autocast over fp32 weights and state
    recompute: Literal['plan', 'none', 'selective', 'full'] = 'plan'  # activation recompute per
    # chunk: the plan's choice, or one mode for every chunk
    engine: Literal['torch', 'deepspeed'] = 'torch'  # torch.distributed.pipelining, or DeepSpeed's
    deepspeed_config: Optional[str] = None  # its ds_config.json (default: the job's)
    dp: int = 1  # data-parallel replicas of each stage (world size = dp x stages)
    zero: int = 0  # ZeRO stage over the replicas: 0 replicate, 1 shard optimizer state, 2 and
    # gradients, 3 and parameters (on deepspeed 0 or 1)
    tp: int = 1  # tensor-parallel ranks inside each stage (world size = dp x stages x tp; torch
    # engine only)
    sequence_parallel: bool = False  # with tp: the activations between layers sharded on the
    # sequence (Megatron's sequence parallelism; with replicas, any ZeRO stage)
    ep: int = 1  # expert-parallel degree: each MoE layer's experts shared out over ep of a stage's
    # dp replicas (ep divides dp; the world is unchanged; torch engine, any ZeRO stage)
    # ---- what it trains on ------------------------------------------------------------------
    loss: str = 'auto'  # auto | model (model:PLACE picks one of its scalars) | cross_entropy | mse
    data: Optional[str] = None  # token file, text, .npz/.pt with x and y, or datasets files;
    # None: synthetic
    eval_data: Optional[str] = None  # held-out data, read like data: loss, perplexity or accuracy
    eval_every: int = 0  # evaluate every N steps (0: at the end only)
    eval_steps: Optional[int] = None  # batches per evaluation (default: all of eval_data)
    seed: int = 0  # the initial weights' and the synthetic data's
    # ---- how it is optimised ----------------------------------------------------------------
    steps: int = 100
    optimizer: Literal['adamw', 'sgd', 'adafactor'] = 'adamw'  # torch's AdamW, SGD or Adafactor
    lr: float = 0.0003  # peak learning rate
    weight_decay: float = 0.1  # on matrices only
    betas: tuple[float, float] = (0.9, 0.95)  # AdamW's, like 0.9,0.95
    momentum: float = 0.9  # SGD's
    warmup: int = 0  # steps of linear warmup
    lr_schedule: Literal['cosine', 'linear', 'constant'] = 'cosine'  # after the warmup: to lr x 0.1
    # at the last step, or constant
    grad_clip: float = 1.0  # global gradient-norm clip (0: off)
    # ---- weights, checkpoints and logs ------------------------------------------------------
    weights: Optional[str] = None  # safetensors file or HF folder to start from
    ckpt_dir: str = str(HERE / "checkpoints")  # one run's checkpoints (another run's is refused)
    ckpt_every: int = 0  # save every N steps and at the last (0: no checkpoints)
    ckpt_keep: int = 2  # keep this run's newest N checkpoints (0: all)
    resume: Optional[Literal['must', 'auto']] = rt.flag(None, bare='must')  # continue from the
    # newest checkpoint in ckpt_dir ('--resume auto': start afresh if there is none)
    export: Optional[str] = None  # write the final weights to this folder (model.safetensors)
    log_json: Optional[str] = None  # append one JSON line per step to this file
    tensorboard: Optional[str] = rt.flag(None, bare=str(HERE / "tensorboard"))  # TensorBoard event
    # files to this folder (--tensorboard alone: tensorboard/ beside train.py)
    wandb: Optional[str] = None  # log to this Weights & Biases project (pip install wandb)
    log_every: Optional[int] = None  # keep a line every N steps (default: 10 on a terminal, else 1)
    # ---- checks -----------------------------------------------------------------------------
    verify: bool = False  # first compare one pipelined step with your model run untouched
    check: bool = False  # debug: refuse tensors off the rank's device, and host syncs in a step
    exact_memory: bool = False  # CPU: keep freed memory, so a step's peak counts what the plan does
    local_rank: Optional[int] = rt.flag(None, hidden=True)  # set by the deepspeed launcher


cfg = rt.parse_flags(Settings)  # a bad flag is one line from rank 0 (did you mean ...?)
# what needs no model, said at once: another run's checkpoint folder, --resume with nothing to
# resume, a plan the processes launched do not fit, a data file that is not there
plan = rt.preflight(cfg)  # the plan's StagePlan (None: 'even')

# ---- the model: a factory every rank calls on the meta device, and one micro-batch of inputs ----
source = rt.model_factory(cfg.model, batch_size=cfg.batch_size, seq_len=cfg.seq_len, seed=cfg.seed,
                          loss=cfg.loss)
config = rt.TrainConfig(
    steps=cfg.steps, microbatches=cfg.microbatches, optimizer=cfg.optimizer, lr=cfg.lr,
    weight_decay=cfg.weight_decay, betas=cfg.betas, momentum=cfg.momentum, warmup=cfg.warmup,
    lr_schedule=cfg.lr_schedule, grad_clip=cfg.grad_clip, dtype=cfg.dtype, seed=cfg.seed,
    zero=rt.check_zero(cfg.zero),
)

# ---- this rank's stage, on either engine -------------------------------------------------------
if cfg.engine == "deepspeed":
    # DeepSpeed's PipelineModule over the same layers, cut where the plan cuts; its engine steps,
    # set by ds_config.json beside this file (AdamW's settings, ZeRO 0 or 1); its own checkpoints
    trainer = rt.DeepSpeedTrainer(source, cfg.plan, config, cfg)
    env, build, planned = trainer.env, trainer.build, None
    save_checkpoint, resume = rt.ds_save_checkpoint, rt.ds_resume
else:
    # the plan's placement numbers the ranks (which of them share a node): the groups follow it
    placement = plan.placement if plan is not None else "pipeline-inner"
    env = rt.init_dist(dp=cfg.dp, tp=cfg.tp, ep=cfg.ep, placement=placement,
                       check=cfg.check or None, exact_memory=cfg.exact_memory or None)
    cut = plan if plan is not None else env.pp_size  # 'even': as many chunks as pipeline ranks
    build = rt.build_stage(
        source.factory, source.args, source.kwargs, cut, pp_rank=env.pp_rank, pp_size=env.pp_size,
        schedule=cfg.schedule, seed=cfg.seed, weights=cfg.weights or source.weights,
        device=env.device, recompute=cfg.recompute, autocast=config.autocast_dtype,
        tp_mesh=env.tp_mesh,  # tensor parallelism inside the stage (None without --tp)
        sequence_parallel=cfg.sequence_parallel,  # and its activations sharded on the sequence
        ep_group=env.ep_group,  # its experts shared out over ep replicas (None without --ep)
    )
    trainer = rt.Trainer(build, env, config, loss_fn=rt.make_loss(source.loss))
    # the plan's predictions hold for the run it was made for: its schedule, micro-batches, layout
    planned = rt.predictions(plan, schedule=cfg.schedule, microbatches=cfg.microbatches,
                             pp_size=env.pp_size, dp=env.dp_size, zero=config.zero, tp=env.tp_size)
    save_checkpoint, resume = rt.save_checkpoint, rt.resume
as_planned = cfg.batch_size == Settings.batch_size and cfg.dtype == Settings.dtype

# ---- data: each step's global batch is a function of the step; each replica reads its own rows --
data = rt.JobData(source, cfg.data, seq_len=cfg.seq_len, seed=cfg.seed, seq=build.seq)
rows = cfg.batch_size * cfg.microbatches * env.dp_size
flops = rt.step_flops(build.seq, source, microbatches=cfg.microbatches, replicas=env.dp_size) \
    if env.rank == 0 else None
log = rt.StepLogger(env.rank, json_path=cfg.log_json, predicted=planned if as_planned else None,
                    unit=data.unit, steps=cfg.steps, flops_per_step=flops,
                    peak_flops=rt.world_peak_flops(env, cfg.dtype), tensorboard=cfg.tensorboard,
                    wandb=cfg.wandb, run_config=vars(cfg), log_every=cfg.log_every)
zero = trainer.config.zero
log.info(f"{cfg.model}: {len(build.seq.layers)} layers, chunks {build.plan.boundaries} on "
         f"{env.pp_size} stage(s) x {env.dp_size} replica(s)"
         f"{f' x tp {env.tp_size}' if env.tp_size > 1 else ''}, "
         f"{build.plan.schedule} on "
         f"{cfg.engine}, "
         f"{cfg.microbatches} micro-batches, ZeRO {zero}"
         f"{'' if env.dp_size > 1 or not zero else ' (one replica: nothing to shard)'}, recompute "
         f"{' '.join(build.recompute)}, {rt.describe_optimizer(trainer.config)}, loss "
         f"{rt.loss_name(source.loss)}, data {data.state()['source']}")
# what tensor parallelism shards, and the layers it runs whole
if getattr(build, "tp_layout", None) is not None:
    log.info(build.tp_layout.describe(build.seq))
if getattr(build, "ep_layout", None) is not None:
    log.info(build.ep_layout.describe())
if (short := data.short_of(rows)) is not None:
    log.info(short)
evaluate = None
if cfg.eval_data is not None:
    eval_data = rt.JobData(source, cfg.eval_data, seq_len=cfg.seq_len, seed=cfg.seed, seq=build.seq,
                           shuffle=False, flag="--eval-data")
    evaluate = rt.Evaluator(trainer, eval_data, rows=rows, steps=cfg.eval_steps,
                            every=cfg.eval_every)
    log.info(evaluate.describe())
log.open()  # a missing tensorboard or wandb is said now, not after the first step


def get_batch(step):
    # the first stage reads the inputs, the last one the targets; a middle stage reads nothing
    return data.batch(step, rows, replica=env.dp_rank, replicas=env.dp_size,
                      inputs=trainer.is_first, target=trainer.is_last)


# ---- resume, verify ----------------------------------------------------------------------------
if cfg.resume and resume(trainer, cfg.ckpt_dir, mode=cfg.resume, steps=cfg.steps, data=data,
                         say=log.info):
    log.resumed(trainer.step_count)  # the steps a stopped run logged after its checkpoint run again
if cfg.verify:
    log.info(rt.verify_step(trainer, *get_batch(trainer.step_count)).line())  # or one line why not

# ---- train: one optimizer step per batch -------------------------------------------------------
for step in range(trainer.step_count, cfg.steps):
    batch_args, batch_kwargs, target = get_batch(step)
    # every micro-batch forward and backward under the schedule, the gradients clipped to their
    # global norm, the optimizer's update: Trainer.step runs forward_backward, clip_gradients and
    # optimizer_step (autopipe/runtime/torch_engine/trainer.py); on DeepSpeed, its train_batch
    stats = trainer.step(batch_args, batch_kwargs, target)
    due = evaluate is not None and evaluate.due(stats.step, cfg.steps)
    evaluated = evaluate().fields() if due else {}
    log.step(stats, **evaluated, **({"epoch": data.epoch(stats.step, rows)} if data.size else {}))
    if cfg.ckpt_every and (stats.step % cfg.ckpt_every == 0 or stats.step == cfg.steps):
        save_checkpoint(trainer, cfg.ckpt_dir, keep=cfg.ckpt_keep, data=data.state())
if evaluate is not None and evaluate.last != trainer.step_count:  # steps reached before this run
    log.eval(trainer.step_count, evaluate().fields())

# ---- export: the final weights as one safetensors file -----------------------------------------
if cfg.export:
    log.info(f"exported {rt.export_final(trainer, cfg.export, model_fn=source.factory)}")
log.close()
env.close()
