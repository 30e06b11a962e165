"""Pipeline-parallel training of $model, written by autopipe.

    autopipe run train.py                                    # one process per stage: one line on failure, logs kept
    torchrun --nproc-per-node $stages train.py                     # the same under torchrun, its own output too
    torchrun --nproc-per-node $stages_x2 train.py --dp 2              # x 2 data-parallel replicas
    torchrun --nproc-per-node $stages_x2 train.py --dp 2 --zero 3     # ... with parameters, gradients, optimizer state sharded
    torchrun --nproc-per-node $stages train.py --engine deepspeed  # DeepSpeed's PipelineModule instead
    python train.py                                          # every stage in one process (debugging)

Each rank builds the model on the meta device, keeps only its own stage and gives just that stage
real weights. `python train.py --help` lists the flags.
"""

import argparse
from pathlib import Path

import autopipe.runtime as rt

# ---- settings (from `autopipe convert`; the flags below override them) --------------------------
MODEL = 'gpt2'  # built-in name, HF folder or module:function
PLAN = Path(__file__).with_name("plan.json")  # where to cut
SCHEDULE = '1f1b'
MICROBATCHES = 8
BATCH_SIZE = 1  # rows per micro-batch
SEQ_LEN = 128
DTYPE = 'fp32'  # training precision, one of DTYPES: autocast over fp32 weights and AdamW state
DTYPES = ('fp32', 'bf16', 'fp16')
ENGINE = 'torch'  # one of ENGINES: torch.distributed.pipelining, or DeepSpeed's PipelineModule
ENGINES = ('torch', 'deepspeed')
LOSS = 'auto'  # auto | model (the model's own; model:PLACE picks one of its scalars) | cross_entropy | mse
DATA = None  # token file, text, .npz/.pt with x and y, datasets files; None: synthetic
SEED = 0
DP = 1  # data-parallel replicas of each stage (the plan's)
ZERO = 0  # ZeRO stage across them (the plan's): 0 replicate, 1 shard AdamW state, 2 + gradients, 3 + parameters
OPTIMIZER = 'adamw'  # one of OPTIMIZERS: torch's AdamW, SGD (momentum) or Adafactor (factored state)
OPTIMIZERS = ('adamw', 'sgd', 'adafactor')
LR = 0.0003
WEIGHT_DECAY = 0.1  # on matrices only
BETAS = (0.9, 0.95)  # AdamW's
MOMENTUM = 0.9  # SGD's
WARMUP = 0  # steps of linear warmup
LR_SCHEDULE = 'cosine'  # one of LR_SCHEDULES, after the warmup: to LR x 0.1 at the last step, or constant
LR_SCHEDULES = ('cosine', 'linear', 'constant')
GRAD_CLIP = 1.0  # global gradient-norm clip (0: off)
EVAL_DATA = None  # held-out data, read like DATA; None: no evaluation
# ---- end of settings -----------------------------------------------------------------------------

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--steps", type=int, default=100)
parser.add_argument("--seed", type=int, default=SEED)
parser.add_argument("--optimizer", default=OPTIMIZER, choices=OPTIMIZERS)
parser.add_argument("--lr", type=float, default=LR, help="peak learning rate")
parser.add_argument("--weight-decay", type=float, default=WEIGHT_DECAY, help="on matrices only")
parser.add_argument("--betas", type=rt.float_pair, default=BETAS, help="AdamW's, like 0.9,0.95")
parser.add_argument("--momentum", type=float, default=MOMENTUM, help="SGD's")
parser.add_argument("--warmup", type=int, default=WARMUP, help="steps of linear warmup")
parser.add_argument("--lr-schedule", default=LR_SCHEDULE, choices=LR_SCHEDULES,
                    help="after the warmup: cosine or linear down to a tenth of --lr at the last step, or constant")
parser.add_argument("--grad-clip", type=float, default=GRAD_CLIP, help="global gradient-norm clip (0: off)")
parser.add_argument("--microbatches", type=int, default=MICROBATCHES)
parser.add_argument("--batch-size", type=int, default=BATCH_SIZE, help="rows per micro-batch")
parser.add_argument("--schedule", default=SCHEDULE, help="gpipe | 1f1b | interleaved1f1b | zbv | interleavedzb")
parser.add_argument("--dtype", default=DTYPE, choices=DTYPES)
parser.add_argument("--recompute", default="plan", choices=["plan", "none", "selective", "full"],
                    help="activation recompute per chunk: the plan's choice, or one mode for every chunk")
parser.add_argument("--dp", type=int, default=DP, help="data-parallel replicas (world size = dp x stages)")
parser.add_argument("--zero", default=None, help="ZeRO stage over the replicas: 0 replicate, 1 shard optimizer state, "
                    "2 and gradients, 3 and parameters (default: the plan's; on deepspeed: ds_config's, 0 or 1)")
parser.add_argument("--plan", default=str(PLAN), help="plan.json; 'even' cuts the layers evenly")
parser.add_argument("--loss", default=LOSS, help="auto | model (the model's own; model:PLACE picks one of "
                    "several scalars it returns) | cross_entropy | mse (its output against the data's targets)")
parser.add_argument("--data", default=DATA, help="token file (.bin/.npy/.pt), text, .npz/.pt with x and y, or "
                    ".parquet/.jsonl/.arrow; default: synthetic")
parser.add_argument("--eval-data", default=EVAL_DATA, help="held-out data (as --data) to evaluate on: loss, and "
                    "perplexity or accuracy")
parser.add_argument("--eval-every", type=int, default=0, help="evaluate every N steps (0: at the end only)")
parser.add_argument("--eval-steps", type=int, default=None, help="batches per evaluation (default: all of --eval-data)")
parser.add_argument("--weights", default=None, help="safetensors file or HF folder to start from")
parser.add_argument("--ckpt-dir", default=str(Path(__file__).with_name("checkpoints")),
                    help="one run's checkpoints (a folder holding another run's is refused unless --resume)")
parser.add_argument("--ckpt-every", type=int, default=0, help="save every N steps and at the last (0: no checkpoints)")
parser.add_argument("--ckpt-keep", type=int, default=2, help="keep this run's newest N checkpoints (0: all)")
parser.add_argument("--resume", nargs="?", const="must", default=None, choices=["must", "auto"],
                    help="continue from the newest checkpoint in --ckpt-dir ('--resume auto': start afresh if there is none)")
parser.add_argument("--export", default=None, help="write the final weights to this folder (model.safetensors)")
parser.add_argument("--log-json", default=None, help="append one JSON line per step to this file")
parser.add_argument("--tensorboard", nargs="?", const=str(Path(__file__).with_name("tensorboard")), default=None,
                    help="write TensorBoard event files (to DIR; default: tensorboard/ beside train.py)")
parser.add_argument("--wandb", default=None, metavar="PROJECT", help="log to Weights & Biases (pip install wandb)")
parser.add_argument("--log-every", type=int, default=None,
                    help="keep a line every N steps (default: 10 on a terminal, which shows a live line, else 1)")
parser.add_argument("--verify", action="store_true", help="first compare one pipelined step with your model run untouched (outputs, loss, gradients)")
parser.add_argument("--engine", default=ENGINE, choices=ENGINES)
parser.add_argument("--deepspeed_config", default=None, help="--engine deepspeed: a ds_config.json (default: the job's)")
parser.add_argument("--check", action="store_true",
                    help="debug: refuse tensors off this rank's device at collectives and stages, and host syncs in the step (slow)")
parser.add_argument("--exact-memory", action="store_true",
                    help="CPU: keep freed memory so each step's peak counts the tensors, as the plan does (slower)")
parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # set by the deepspeed launcher
args = rt.parse_flags(parser)  # a bad flag is one line from rank 0 (did you mean ...?); Ctrl-C says how to resume
rt.check_ckpt_dir(args.ckpt_dir, resume=args.resume, saving=args.ckpt_every > 0)  # never into another run's folder

# ---- model: a factory every rank calls on the meta device, and one micro-batch of example inputs --
source = rt.model_factory(MODEL, batch_size=args.batch_size, seq_len=SEQ_LEN, seed=args.seed, loss=args.loss)
weights = args.weights or source.weights
config = rt.TrainConfig(
    steps=args.steps, microbatches=args.microbatches, optimizer=args.optimizer, lr=args.lr,
    weight_decay=args.weight_decay, betas=args.betas, momentum=args.momentum, warmup=args.warmup,
    lr_schedule=args.lr_schedule, grad_clip=args.grad_clip, dtype=args.dtype, seed=args.seed,
    zero=rt.check_zero(ZERO if args.zero is None else args.zero),
)

# ---- this rank's stage, on either engine ---------------------------------------------------------
if args.engine == "deepspeed":
    # DeepSpeed's PipelineModule over the same layers, cut where the plan cuts; its engine steps, set by
    # ds_config.json beside this file (ZeRO 0 or 1, AdamW's settings); its checkpoints are its own
    trainer = rt.DeepSpeedTrainer(source, args.plan, config, args)
    env, build, planned = trainer.env, trainer.build, None
    save_checkpoint, resume = rt.ds_save_checkpoint, rt.ds_resume
else:
    # the plan's placement numbers the ranks (which of them share a node): the groups are made by it
    env = rt.init_dist(dp=args.dp, placement=rt.plan_placement(args.plan), check=args.check or None,
                       exact_memory=args.exact_memory or None)
    plan = env.pp_size if args.plan == "even" else rt.load_plan(args.plan)
    rt.check_launch(plan, env.pp_size, env.dp_size, plan_path=args.plan)
    build = rt.build_stage(
        source.factory, source.args, source.kwargs, plan, pp_rank=env.pp_rank, pp_size=env.pp_size,
        schedule=args.schedule, seed=args.seed, weights=weights, device=env.device, recompute=args.recompute,
        autocast=config.autocast_dtype,
    )
    trainer = rt.Trainer(build, env, config, loss_fn=rt.make_loss(source.loss))
    # the plan's predictions hold for the run it was made for: same schedule, micro-batches, batch, dtype
    planned = rt.predictions(plan, schedule=args.schedule, microbatches=args.microbatches, pp_size=env.pp_size,
                             dp=env.dp_size, zero=config.zero)
    save_checkpoint, resume = rt.save_checkpoint, rt.resume
same_batch = args.batch_size == BATCH_SIZE and args.dtype == DTYPE

# ---- data: each step's global batch is a function of the step; each replica reads its own rows ----
data = rt.JobData(source, args.data, seq_len=SEQ_LEN, seed=args.seed, seq=build.seq)
rows = args.batch_size * args.microbatches * env.dp_size
log = rt.StepLogger(env.rank, json_path=args.log_json, predicted=planned if same_batch else None, unit=data.unit,
                    steps=args.steps, flops_per_step=rt.step_flops(build.seq, source, microbatches=args.microbatches,
                    replicas=env.dp_size) if env.rank == 0 else None, peak_flops=rt.world_peak_flops(env, args.dtype),
                    tensorboard=args.tensorboard, wandb=args.wandb, run_config=vars(args), log_every=args.log_every)
zero = trainer.config.zero
log.info(f"{MODEL}: {len(build.seq.layers)} layers, chunks {build.plan.boundaries} on {env.pp_size} "
         f"stage(s) x {env.dp_size} replica(s), {build.plan.schedule} on {args.engine}, {args.microbatches} "
         f"micro-batches, ZeRO {zero}{'' if env.dp_size > 1 or not zero else ' (one replica: nothing to shard)'}, "
         f"recompute {' '.join(build.recompute)}, {rt.describe_optimizer(trainer.config)}, loss "
         f"{rt.loss_name(source.loss)}, data {data.state()['source']}")
if (short := data.short_of(rows)) is not None:
    log.info(short)
evaluate = None
if args.eval_data is not None:
    eval_data = rt.JobData(source, args.eval_data, seq_len=SEQ_LEN, seed=args.seed, seq=build.seq, shuffle=False,
                           flag="--eval-data")
    evaluate = rt.Evaluator(trainer, eval_data, rows=rows, steps=args.eval_steps, every=args.eval_every)
    log.info(evaluate.describe())
log.open()  # a missing tensorboard or wandb is said now, not after the first step


def get_batch(step):
    # the first stage reads the inputs, the last one the targets; a middle stage reads nothing
    return data.batch(step, rows, replica=env.dp_rank, replicas=env.dp_size, inputs=trainer.is_first,
                      target=trainer.is_last)


# ---- resume, verify, train, evaluate -----------------------------------------------------------------
if args.resume and resume(trainer, args.ckpt_dir, mode=args.resume, steps=args.steps, data=data, say=log.info):
    log.resumed(trainer.step_count)  # the steps a stopped run logged after its checkpoint are trained again
if args.verify:
    report = rt.verify_step(trainer, *get_batch(trainer.step_count))
    log.info(f"verify: loss {report.loss:.6f} vs the untouched model's {report.reference_loss:.6f}, max output diff "
             f"{report.max_output_diff:.1e}, max grad diff {report.max_grad_diff:.1e}: ok")

for step in range(trainer.step_count, args.steps):
    batch_args, batch_kwargs, target = get_batch(step)
    stats = trainer.step(batch_args, batch_kwargs, target)
    evaluated = evaluate().fields() if evaluate is not None and evaluate.due(stats.step, args.steps) else {}
    log.step(stats, **evaluated, **({"epoch": data.epoch(stats.step, rows)} if data.size else {}))
    if args.ckpt_every and (stats.step % args.ckpt_every == 0 or stats.step == args.steps):
        save_checkpoint(trainer, args.ckpt_dir, keep=args.ckpt_keep, data=data.state())
if evaluate is not None and evaluate.last != trainer.step_count:  # --steps reached before this run began
    log.eval(trainer.step_count, evaluate().fields())

# ---- export: the final weights as one safetensors file ----------------------------------------------
if args.export:
    log.info(f"exported {rt.export_final(trainer, args.export, model_fn=source.factory)}")
log.close()
env.close()
