#!/usr/bin/env bash
# The engineering-RL study of docs/engineering.md, one stage at a time (each is CPU-heavy: never two at once).
# Every stage is resumable: a finished stage is skipped, an interrupted run resumes from its last checkpoint.
#   [FAMILY=beam_bending] [LEVEL=3] [SFT_LEVEL=2] scripts/eng_study.sh STAGE...
#   stages: sft grpo0 grpo1 grpo2 eval_sft eval_base control eval_control
# FAMILY and LEVEL (default axial_stress 3) override the configs' data; every other setting is the configs'.
# REWARD=supported trains the GRPO stages on the task reward's `supported` field (the outcome counts only when
# every required step is right too) instead of the strict outcome; its runs are named grpo_supported_s*.
# TAG names a variant of the GRPO stages (runs grpo*_TAG_s*), e.g. TAG=steps with OVERRIDES that add step rewards.
# OVERRIDES (space-separated key=value, e.g. "sampling.max_new_tokens=512") go to every stage's config; a
# stage already finished is not re-run with them.
# SFT_LEVEL (default LEVEL) is the level of the warm start's references: below LEVEL, the warm start (and the
# control) never see a reference of the level that GRPO trains on and every arm is evaluated on
# (`eval_sft`, `eval_control`); only the grader knows that level.
# SFT_STEPS (default: the config's 40) sets the warm start's length (runs land in runs/eng_..._sftN/).
# SFT_SIZE (default: the config's 2,000) limits the warm start's references to a fixed set of that many
# problems, drawn from the same pool as GRPO's prompts: the warm start and the control then repeat them epoch
# after epoch, as SFT on a finite demonstration set does, while GRPO draws any prompt of the pool (runs land in
# runs/eng_FAMILYLEVEL_refsN/).
# SUFFIX names a changed design's study (runs/eng_FAMILYLEVEL_SUFFIX..., e.g. after a change to the references).
# START (default: the warm start, sft) is the finished supervised run GRPO starts from and the control
# continues: START=sft_more starts GRPO from the first control (the warm start trained on), naming the runs
# grpo*_from_sft_more_s* and the new control sft_more_more.
# `control` continues START (the warm start by default) with supervised steps for the GRPO phase's median wall time
# (CONTROL_STEPS overrides the count). Results land in runs/eng*/ (gitignored); docs/engineering/ keeps their
# metrics.
set -euo pipefail
cd "$(dirname "$0")/.."
CLI=${CLI:-.venv/bin/cohortrl}
FAMILY=${FAMILY:-axial_stress}
LEVEL=${LEVEL:-3}
SFT_LEVEL=${SFT_LEVEL:-$LEVEL}
REWARD=${REWARD:-outcome}
if [[ $REWARD == outcome ]]; then GRPO=grpo; else GRPO=grpo_$REWARD; fi
if [[ $FAMILY == axial_stress && $LEVEL == 3 && $SFT_LEVEL == 3 && -z ${SFT_SIZE:-} ]]; then
  OUT=runs/eng; SFT=sft_axial3_e200  # the first study's names
elif [[ $SFT_LEVEL == "$LEVEL" ]]; then
  OUT=runs/eng_$FAMILY$LEVEL; SFT=sft
else
  OUT=runs/eng_$FAMILY${LEVEL}_from$SFT_LEVEL; SFT=sft
fi
if [[ -n ${SUFFIX:-} ]]; then OUT=${OUT}_$SUFFIX; fi  # a new design's runs beside the old ones' (e.g. SUFFIX=sf)
if [[ -n ${SFT_SIZE:-} ]]; then OUT=${OUT}_refs$SFT_SIZE; SFT_DATA=("data.train_size=$SFT_SIZE"); else SFT_DATA=(); fi
if [[ -n ${SFT_STEPS:-} ]]; then  # a shorter (or longer) warm start, checkpointed at its end, evaluated by eval_sft only
  OUT=${OUT}_sft$SFT_STEPS; SFT_DATA+=("train.steps=$SFT_STEPS" "train.checkpoint_every=0" "eval.n_prompts=0")
fi
START=${START:-$SFT}
if [[ $START != "$SFT" ]]; then GRPO=${GRPO}_from_$START; fi
if [[ -n ${TAG:-} ]]; then GRPO=${GRPO}_$TAG; fi
read -r -a EXTRA <<<"${OVERRIDES:-}"
DATA=("data.source=task:$FAMILY" "data.level=$LEVEL" ${EXTRA[@]+"${EXTRA[@]}"})
mkdir -p "$OUT"

timed() {  # run a command under /usr/bin/time, its log and resource use in $OUT/NAME.log
  local name=$1; shift
  echo "== $name: $* ($(date -u +%FT%TZ))" | tee -a "$OUT/$name.log"
  /usr/bin/time -v "$@" >>"$OUT/$name.log" 2>&1
}

train() {  # NAME CONFIG OVERRIDES...: train, or resume an interrupted run, or skip a finished one
  local name=$1 config=$2; shift 2
  local dir=$OUT/$name
  if [[ -d $dir/final ]]; then echo "$name: done"; return; fi
  if [[ -d $dir/checkpoints ]] && ls "$dir"/checkpoints/step_* >/dev/null 2>&1; then
    timed "$name" $CLI "${SUBCMD:-train}" --run-dir "$dir" --resume  # the run's own config.yaml
  else
    timed "$name" $CLI "${SUBCMD:-train}" "$config" --run-dir "$dir" --overwrite "$@"
  fi
}

evaluate() {  # NAME OVERRIDES...: greedy held-out accuracy with error categories, once
  local name=$1; shift
  if [[ -f $OUT/$name.json ]]; then echo "$name: done"; return; fi
  rm -f "$OUT/$name.jsonl"
  echo "== $name: eval configs/eng_grpo.yaml $* ($(date -u +%FT%TZ))" >>"$OUT/$name.log"
  /usr/bin/time -v $CLI eval configs/eng_grpo.yaml "${DATA[@]}" "$@" --json --responses "$OUT/$name.jsonl" \
    >"$OUT/$name.json.tmp" 2>>"$OUT/$name.log"
  mv "$OUT/$name.json.tmp" "$OUT/$name.json"
}

control_steps() {  # the GRPO phase's wall time in warm-start steps, from median step times: a step slowed by
  # other work on the shared machine says nothing about either method's cost
  python3 - "$OUT" "$START" "$GRPO" <<'EOF'
import json, pathlib, statistics, sys
out, sft_run, grpo_run = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3]
def step_times(run):
    rows = [json.loads(l) for l in (out / run / "metrics.jsonl").read_text().splitlines() if l.strip()]
    return [r["time/step"] for r in rows if "time/step" in r]
grpo = [t for s in range(3) if (out / f"{grpo_run}_s{s}" / "final").is_dir() for t in step_times(f"{grpo_run}_s{s}")]
sft = step_times(sft_run)[1:]  # the first step pays for warm-up
done = json.loads((out / sft_run / "final" / "cohortrl_run.json").read_text())["step"]
print(round(done + 20 * statistics.median(grpo) / statistics.median(sft)))
EOF
}

for stage in "$@"; do
  case $stage in
    sft) SUBCMD=sft train "$SFT" configs/eng_sft.yaml "data.source=task:$FAMILY" "data.level=$SFT_LEVEL" \
      ${SFT_DATA[@]+"${SFT_DATA[@]}"} ${EXTRA[@]+"${EXTRA[@]}"} ;;
    grpo0|grpo1|grpo2) train "${GRPO}_s${stage#grpo}" configs/eng_grpo.yaml "${DATA[@]}" "train.seed=${stage#grpo}" \
      "model.init=$OUT/$START/final" "reward.functions=[{name: task, kwargs: {field: $REWARD}}]" ;;
    eval_sft) evaluate eval_sft "model.init=$OUT/$SFT/final" ;;  # the warm start (merged), as GRPO starts from it
    eval_base) evaluate eval_base model.init=null ;;     # SmolLM2 itself, with the calculator
    control)
      dir=$OUT/${START}_more
      [[ -d $dir ]] || cp -a "$OUT/$START" "$dir"
      steps=${CONTROL_STEPS:-$(control_steps)}
      echo "control: $START continued to $steps supervised steps"
      timed "${START}_more" $CLI sft --run-dir "$dir" --resume --steps "$steps" ;;
    eval_control) evaluate eval_control "model.init=$OUT/${START}_more/final" ;;  # on LEVEL, where SFT_LEVEL differs
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done
