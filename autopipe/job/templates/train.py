"""Pipeline-parallel training of $model, written by autopipe.

    torchrun --nproc-per-node $stages train.py                     # one process per pipeline stage
    torchrun --nproc-per-node $stages_x2 train.py --dp 2              # x 2 data-parallel replicas
    torchrun --nproc-per-node $stages_x2 train.py --dp 2 --zero 3     # ... with parameters, gradients, AdamW state sharded
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
# ---- end of settings -----------------------------------------------------------------------------

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--steps", type=int, default=100)
parser.add_argument("--seed", type=int, default=SEED)
parser.add_argument("--lr", type=float, default=3e-4)
parser.add_argument("--warmup", type=int, default=0, help="linear warmup steps before the cosine decay")
parser.add_argument("--grad-clip", type=float, default=1.0, help="global gradient-norm clip (0: off)")
parser.add_argument("--microbatches", type=int, default=MICROBATCHES)
parser.add_argument("--batch-size", type=int, default=BATCH_SIZE, help="rows per micro-batch")
parser.add_argument("--schedule", default=SCHEDULE, help="gpipe | 1f1b | interleaved1f1b | zbv | interleavedzb")
parser.add_argument("--dtype", default=DTYPE, choices=DTYPES)
parser.add_argument("--recompute", default="plan", choices=["plan", "none", "selective", "full"],
                    help="activation recompute per chunk: the plan's choice, or one mode for every chunk")
parser.add_argument("--dp", type=int, default=DP, help="data-parallel replicas (world size = dp x stages)")
parser.add_argument("--zero", default=None, help="ZeRO stage over the replicas: 0 replicate, 1 shard AdamW state, "
                    "2 and gradients, 3 and parameters (default: the plan's; on deepspeed: ds_config's, 0 or 1)")
parser.add_argument("--plan", default=str(PLAN), help="plan.json; 'even' cuts the layers evenly")
parser.add_argument("--loss", default=LOSS, help="auto | model (the model's own; model:PLACE picks one of "
                    "several scalars it returns) | cross_entropy | mse (its output against the data's targets)")
parser.add_argument("--data", default=DATA, help="token file (.bin/.npy/.pt), text, .npz/.pt with x and y, or "
                    ".parquet/.jsonl/.arrow; default: synthetic")
parser.add_argument("--weights", default=None, help="safetensors file or HF folder to start from")
parser.add_argument("--ckpt-dir", default=str(Path(__file__).with_name("checkpoints")))
parser.add_argument("--ckpt-every", type=int, default=0, help="save every N steps (0: only at the end)")
parser.add_argument("--ckpt-keep", type=int, default=2, help="keep the newest N checkpoints (0: all)")
parser.add_argument("--resume", nargs="?", const="must", default=None, choices=["must", "auto"],
                    help="continue from the newest checkpoint in --ckpt-dir ('--resume auto': start afresh if there is none)")
parser.add_argument("--export", default=None, help="write the final weights to this folder (model.safetensors)")
parser.add_argument("--log-json", default=None, help="append one JSON line per step to this file")
parser.add_argument("--verify", action="store_true", help="first compare one pipelined step with your model run untouched (outputs, loss, gradients)")
parser.add_argument("--engine", default=ENGINE, choices=ENGINES)
parser.add_argument("--deepspeed_config", default=None, help="--engine deepspeed: a ds_config.json (default: the job's)")
parser.add_argument("--check", action="store_true",
                    help="debug: refuse tensors off this rank's device at collectives and stages, and host syncs in the step (slow)")
parser.add_argument("--exact-memory", action="store_true",
                    help="CPU: keep freed memory so each step's peak counts the tensors, as the plan does (slower)")
parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # set by the deepspeed launcher
args = parser.parse_args()
rt.one_line_errors(args.ckpt_dir)  # an autopipe error is one line from rank 0; Ctrl-C says how to resume

# ---- model: a factory every rank calls on the meta device, and one micro-batch of example inputs --
source = rt.model_factory(MODEL, batch_size=args.batch_size, seq_len=SEQ_LEN, seed=args.seed, loss=args.loss)
weights = args.weights or source.weights
config = rt.TrainConfig(
    steps=args.steps, microbatches=args.microbatches, lr=args.lr, warmup=args.warmup,
    grad_clip=args.grad_clip, dtype=args.dtype, seed=args.seed,
    zero=rt.check_zero(ZERO if args.zero is None else args.zero),
)

# ---- this rank's stage, on either engine ---------------------------------------------------------
if args.engine == "deepspeed":
    # DeepSpeed's PipelineModule over the same layers, cut where the plan cuts; its engine steps, set by
    # ds_config.json beside this file (ZeRO 0 or 1, AdamW's settings); its checkpoints are its own
    trainer = rt.DeepSpeedTrainer(source, args.plan, config, args)
    env, build, planned = trainer.env, trainer.build, None
    save_checkpoint, resume, latest_checkpoint = rt.ds_save_checkpoint, rt.ds_resume, rt.ds_latest_checkpoint
else:
    # the plan's placement numbers the ranks (which of them share a node): the groups are made by it
    env = rt.init_dist(dp=args.dp, placement=rt.plan_placement(args.plan), check=args.check or None,
                       exact_memory=args.exact_memory or None)
    plan = env.pp_size if args.plan == "even" else rt.load_plan(args.plan)
    rt.check_launch(plan, env.pp_size, env.dp_size, plan_path=args.plan)
    build = rt.build_stage(
        source.factory, source.args, source.kwargs, plan, pp_rank=env.pp_rank, pp_size=env.pp_size,
        schedule=args.schedule, seed=args.seed, weights=weights, device=env.device, recompute=args.recompute,
    )
    trainer = rt.Trainer(build, env, config, loss_fn=rt.make_loss(source.loss))
    # the plan's predictions hold for the run it was made for: same schedule, micro-batches, batch, dtype
    planned = rt.predictions(plan, schedule=args.schedule, microbatches=args.microbatches, pp_size=env.pp_size,
                             dp=env.dp_size, zero=config.zero)
    save_checkpoint, resume, latest_checkpoint = rt.save_checkpoint, rt.resume, rt.latest_checkpoint
same_batch = args.batch_size == BATCH_SIZE and args.dtype == DTYPE

# ---- data: each step's global batch is a function of the step; each replica reads its own rows ----
data = rt.JobData(source, args.data, seq_len=SEQ_LEN, seed=args.seed, seq=build.seq)
rows = args.batch_size * args.microbatches * env.dp_size
log = rt.StepLogger(env.rank, json_path=args.log_json, predicted=planned if same_batch else None, unit=data.unit)
zero = trainer.config.zero
log.info(f"{MODEL}: {len(build.seq.layers)} layers, chunks {build.layout.boundaries} on {env.pp_size} "
         f"stage(s) x {env.dp_size} replica(s), {build.layout.schedule} on {args.engine}, {args.microbatches} "
         f"micro-batches, ZeRO {zero}{'' if env.dp_size > 1 or not zero else ' (one replica: nothing to shard)'}, "
         f"recompute {' '.join(build.recompute)}, loss {rt.loss_name(source.loss)}, data {data.state()['source']}")


def get_batch(step):
    # the first stage reads the inputs, the last one the targets; a middle stage reads nothing
    return data.batch(step, rows, replica=env.dp_rank, replicas=env.dp_size, inputs=trainer.is_first,
                      target=trainer.is_last)


# ---- resume, verify, train -------------------------------------------------------------------------
if args.resume:
    resume(trainer, args.ckpt_dir, mode=args.resume, steps=args.steps, data=data, say=log.info)
if args.verify:
    report = rt.verify_step(trainer, *get_batch(trainer.step_count))
    log.info(f"verify: loss {report.loss:.6f} vs the untouched model's {report.reference_loss:.6f}, max output diff "
             f"{report.max_output_diff:.1e}, max grad diff {report.max_grad_diff:.1e}: ok")

for step in range(trainer.step_count, args.steps):
    batch_args, batch_kwargs, target = get_batch(step)
    stats = trainer.step(batch_args, batch_kwargs, target)
    log.step(stats)
    if (args.ckpt_every and stats.step % args.ckpt_every == 0) or stats.step == args.steps:
        save_checkpoint(trainer, args.ckpt_dir, keep=args.ckpt_keep, data=data.state())

# ---- export: the final weights as one safetensors file ----------------------------------------------
if args.export and env.rank == 0 and (last := latest_checkpoint(args.ckpt_dir)) is not None:
    log.info(f"exported {rt.export(last, args.export, model_fn=source.factory)}")
env.close()
