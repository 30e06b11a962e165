#!/usr/bin/env bash
# The first checks on a lent GPU (bench/results/gpu.md says what each decides), as one prepared run
# that fits a short lease: each step has its own limit, and the whole stops starting steps once
# BUDGET seconds have passed, so the logs and artifacts always come back.
#
#   OUT=/tmp/gpu BUDGET=300 bash bench/gpu_first.sh            # on the GPU machine, in the repo root
#   PART=2 / all / verify / llama / optim   # fp32 and expandable segments / all / the jobs with --verify / Llama-1B bf16 --verify / AdamW alone
#
# It runs under the machine's own python3 (its torch and transformers, not this repo's pins) with
# this checkout on PYTHONPATH; nothing is installed. Writes $OUT/run.log and $OUT/art.tar.gz.
set -u
OUT=${OUT:?set OUT}
BUDGET=${BUDGET:-300}
PART=${PART:-1}
PY=${PY:-python3}
SEQ=${SEQ:-1024}
BATCH=${BATCH:-8}
DEV=${DEV:-cuda}  # cpu: try the script here first
START=$(date +%s)
ART=$OUT/art
mkdir -p "$ART"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
exec > >(tee "$OUT/run.log") 2>&1

step() {  # step NAME LIMIT CMD...: runs CMD under min(LIMIT, what is left), says rc and seconds
    local name=$1 limit=$2
    shift 2
    local left=$((START + BUDGET - $(date +%s)))
    if ((left < 25)); then
        echo "=== $name: skipped, ${left}s left of ${BUDGET}s"
        return 0
    fi
    ((limit > left)) && limit=$left
    echo "=== $name (limit ${limit}s) at $(($(date +%s) - START))s: $*"
    local t0
    t0=$(date +%s.%N)
    timeout -k 5 "$limit" "$@"
    local rc=$?
    echo "=== $name rc=$rc in $($PY -c "print(round($(date +%s.%N) - $t0, 1))")s"
}


step env 30 bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv; \
  $PY -m pip list 2>/dev/null | grep -iE '^(torch|transformers|deepspeed|nvidia-ml-py|typer|rich) '; $PY -c 'import torch, transformers, sys; print(sys.version.split()[0], torch.__version__, torch.version.cuda, transformers.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else \"no GPU\")'; nproc; uptime"

# GPT-2 (124M) at a GPU's size: profile with CUDA events, plan 2 stages, job folder; then every stage
# in one process: the loss and gradients against the untouched model (--verify), step vs plan
convert_bf16() {  # convert_bf16 LIMIT
    step convert-bf16 "$1" $PY -m autopipe convert gpt2 --stages 2 --device "$DEV" --dtype bf16 --seq-len "$SEQ" \
        --batch-size "$BATCH" --out jobs/gpt2-cuda --force
}
convert_fp32() {  # convert_fp32 LIMIT
    step convert-fp32 "$1" $PY -m autopipe convert gpt2 --stages 2 --device "$DEV" --seq-len "$SEQ" \
        --batch-size "$BATCH" --out jobs/gpt2-cuda32 --force
}
train_bf16() { step train-bf16 "$1" $PY jobs/gpt2-cuda/train.py --steps 20 --verify --log-json "$ART/log-bf16.json"; }
train_fp32() { step train-fp32 "$1" $PY jobs/gpt2-cuda32/train.py --steps 15 --verify --log-json "$ART/log-fp32.json"; }

if [[ $PART == 1 || $PART == all ]]; then
    # 1 rank on cuda:0: plan vs run (step, allocated, reserved, outside the allocator) and the memory model
    step doctor 110 $PY -m autopipe doctor --device "$DEV" --ranks 1 --out "$ART/doctor-1gpu.md" --force
    convert_bf16 120
    cp jobs/gpt2-cuda/{plan.json,profile.json,report.html} "$ART/" 2>/dev/null
    train_bf16 90
    # no tensor off the device, no host sync inside the step (slow: a few steps)
    step check-bf16 60 $PY jobs/gpt2-cuda/train.py --steps 3 --check
fi
if [[ $PART == verify ]]; then  # the jobs of part 1 and 2, trained against the untouched model only
    convert_bf16 80
    train_bf16 70
    convert_fp32 60
    train_fp32 60
fi
if [[ $PART == 2 || $PART == all ]]; then
    convert_fp32 100
    for f in plan.json profile.json; do cp "jobs/gpt2-cuda32/$f" "$ART/fp32-$f" 2>/dev/null; done
    train_fp32 70
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True step doctor-expandable 90 \
        $PY -m autopipe doctor --device "$DEV" --ranks 1 --out "$ART/doctor-expandable.md" --force
fi
if [[ $PART == all || $PART == verify || $PART == llama ]]; then
    # Llama-1B bf16 against the untouched model: on 2026-11-28 (before flatten traced under the job's
    # autocast) its logits were 1.48 off, 10x bf16's own noise (bench/results/gpu.md)
    step convert-llama 120 $PY -m autopipe convert llama-1b --stages 2 --device "$DEV" --dtype bf16 --seq-len "$SEQ" \
        --batch-size 4 --out jobs/llama-cuda --force
    step train-llama 90 $PY jobs/llama-cuda/train.py --steps 5 --verify --log-json "$ART/log-llama-bf16.json"
    step bf16-floor 60 $PY bench/bf16_floor.py llama-1b "$SEQ"  # what bf16 moves the untouched model by itself
fi
if [[ $PART == all || $PART == optim ]]; then
    # what the plan leaves out on a GPU (no engine row there): the step's norm + clip + AdamW, per
    # parameter, fused (what jobs run since issue 24) against foreach, on GPT-2 124M's tensor mix
    step optim 60 $PY -c "import sys; sys.path.insert(0, 'bench'); from bench_engines import probe_optimizer as p
for n, w in ((124_000_000, 768), (4_000_000, 256)):
    for kind in ('fused', 'foreach'):
        r = p(n, w, '$DEV', kind); print(f'optim {n / 1e6:.0f}M x {w} {kind}: {r * 1e9:.4f} ns per parameter, {r * n * 1e3:.2f} ms a step', flush=True)"
fi
cp autopipe-error-*.log "$ART/" 2>/dev/null
tar -czf "$OUT/art.tar.gz" -C "$OUT" art && rm -rf "$ART"
echo "=== done at $(($(date +%s) - START))s"
