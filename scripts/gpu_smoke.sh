#!/usr/bin/env bash
# The first run on a GPU, in one script of at most 8 minutes on one GPU: one line per check, PASS / FAIL / SKIP.
#
#   scripts/gpu_smoke.sh              # on a GPU machine (train.device auto: the GPU)
#   SMOKE_DEVICE=cpu scripts/gpu_smoke.sh   # the checks a CPU can run (gloo instead of NCCL; no vLLM)
#
# Each check's time limit is its GPU budget (they sum to 8 minutes); on a CPU every limit is multiplied by
# SMOKE_TIME_SCALE (default 6 with SMOKE_DEVICE=cpu, 1 otherwise): the same checks, given the time a small
# shared CPU needs (a run with the GPU limits on a loaded 2-core machine timed out in 4 checks that pass).
#
# Checks: NCCL (with gloo for CPU tensors) collectives under a 1-process torchrun; a training run under a
# 1-process torchrun (one process wraps no DDP and short-circuits the trainer's collectives: DDP itself needs
# 2 GPUs); bf16 full fine-tuning moves the weights at lr 1e-5; LoRA on a bf16 base learns; FSDP2 in bf16 saves
# and resumes to the weights of an uninterrupted run; FSDP2's forward runs the chunked LM head (no (B, T, V)
# logits, the log-probs and gradients of the unwrapped model) and a model loaded on rank 0 is sent into the
# shards (tests/wrapped_logprobs_check.py, tests/fsdp_rank0_load_check.py, on the GPU with one process);
# vLLM (if installed) syncs every step and its importance weights at temperature 0.7 are near 1. Models are
# built from a config (tiny-llama-4l; the two checks from tests/, tiny-llama); nothing is downloaded.
# Results go in docs/distributed.md with the date and the machine.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
WORK=$(mktemp -d /tmp/cohortrl-gpu-smoke.XXXXXX)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" SMOKE_DEVICE=${SMOKE_DEVICE:-auto}
export PY WORK TORCHRUN="$PY -m torch.distributed.run --standalone --nproc-per-node 1"
SCALE=${SMOKE_TIME_SCALE:-$([ "$SMOKE_DEVICE" = cpu ] && echo 6 || echo 1)}
FAILED=0
START=$SECONDS

# check NAME LIMIT_S COMMAND: one line; on failure (or past LIMIT_S × SCALE seconds) the last line the command wrote.
check() {
    local name=$1 limit=$(($2 * SCALE)) command=$3
    local log="$WORK/$name.log" t0=$SECONDS rc=0
    timeout "$limit" bash -c "$command" >"$log" 2>&1 || rc=$?
    if [ "$rc" -eq 0 ]; then
        local line
        line=$(grep -E '^(PASS|SKIP)' "$log" | tail -n 1)
        echo "${line:-PASS $name} ($((SECONDS - t0)) s)"
    else
        FAILED=$((FAILED + 1))
        # the last error line (torchrun ends its report with a rule of '='), else the last line
        local why
        why=$(grep -E '[A-Za-z]+Error: |^[A-Za-z ]*error: ' "$log" | grep -v ChildFailedError | tail -n 1)
        echo "FAIL $name ($((SECONDS - t0)) s, exit $rc$([ "$rc" -eq 124 ] && echo ': timed out')): ${why:-$(grep -v '^\s*$' "$log" | tail -n 1)}"
    fi
}

train() {  # train RUN_DIR ARGS...: the tiny GRPO config under a 1-process torchrun
    local run=$1; shift
    $TORCHRUN -m cohortrl train configs/tiny_grpo.yaml --run-dir "$WORK/$run" model.name=tiny-llama-4l \
        train.device="$SMOKE_DEVICE" train.progress=false eval.n_prompts=4 eval.before=false "$@"
}

fsdp_save_resume() {
    local fsdp=(train.strategy=fsdp model.dtype=bfloat16 train.checkpoint_every=2)
    train fsdp_whole --steps 4 "${fsdp[@]}" &&
        train fsdp_resumed --steps 2 "${fsdp[@]}" &&
        train fsdp_resumed --steps 4 --resume "${fsdp[@]}" &&
        "$PY" scripts/gpu_smoke.py fsdp_save_resume "$WORK"
}
export -f train fsdp_save_resume

check collectives 60 '$TORCHRUN scripts/gpu_smoke.py collectives "$WORK"'
check torchrun_train 60 'train one --steps 2 && echo "PASS torchrun_train: 2 GRPO steps, a checkpoint and final/ under a 1-process torchrun"'
check bf16_full 50 '"$PY" scripts/gpu_smoke.py bf16_full "$WORK"'
check lora 50 '"$PY" scripts/gpu_smoke.py lora "$WORK"'
check fsdp_save_resume 90 fsdp_save_resume
check fsdp_chunked_head_rank0_load 50 '$TORCHRUN tests/wrapped_logprobs_check.py fsdp && $TORCHRUN tests/fsdp_rank0_load_check.py bf16 &&
    echo "PASS fsdp_chunked_head_rank0_load: log-probs and gradients through FSDP2 without (B, T, V) logits; bf16 weights loaded on rank 0 reach the shards"'
check vllm 120 '"$PY" scripts/gpu_smoke.py vllm "$WORK"'

echo "$FAILED failed, $((SECONDS - START)) s in all, time limits x$SCALE (logs in $WORK)"
exit $((FAILED > 0))
