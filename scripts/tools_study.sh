#!/usr/bin/env bash
# Issue 25's measurement (docs/tools.md): SmolLM2's held-out strict accuracy on a numeric family with and
# without the calculator. Each arm is the supervised warm start of docs/engineering.md (configs/eng_sft.yaml,
# 40 LoRA steps on the family's reference solutions), at train.seed 0, 1, 2, each measured by the run's own
# final evaluation (greedy, strict outcome, on the same 200 held-out problems: data.seed 0 fixes the draw and
# the split whatever the train seed; metrics.jsonl's last row, the responses in eval_completions.jsonl):
#   calc_sN:  references in the calculator's call form, evaluated with the calculator (the config as it is);
#   plain_sN: the same references with the arithmetic written out (rollout.tools=[]), evaluated without tools.
# Each stage is CPU-heavy (never two at once) and resumable: a finished stage is skipped. `cohortrl eval` of a
# run's final/ (configs/eng_grpo.yaml, model.init=...) gives the same numbers again.
#   [FAMILY=axial_stress] [LEVEL=3] scripts/tools_study.sh STAGE...   stages: calc0 calc1 calc2 plain0 plain1 plain2
set -euo pipefail
cd "$(dirname "$0")/.."
CLI=${CLI:-.venv/bin/cohortrl}
FAMILY=${FAMILY:-axial_stress}
LEVEL=${LEVEL:-3}
OUT=runs/tools_$FAMILY$LEVEL
DATA=("data.source=task:$FAMILY" "data.level=$LEVEL")
mkdir -p "$OUT"

for stage in "$@"; do
  case $stage in
    calc[0-2]) arm=calc; seed=${stage#calc}; TOOLS=() ;;
    plain[0-2]) arm=plain; seed=${stage#plain}; TOOLS=("rollout.tools=[]") ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
  name=${arm}_s$seed dir=$OUT/${arm}_s$seed
  if [[ ! -d $dir/final ]]; then
    echo "== $name: sft ($(date -u +%FT%TZ))" | tee -a "$OUT/$name.log"
    if ls "$dir"/checkpoints/step_* >/dev/null 2>&1; then
      /usr/bin/time -v $CLI sft --run-dir "$dir" --resume >>"$OUT/$name.log" 2>&1
    else
      /usr/bin/time -v $CLI sft configs/eng_sft.yaml "${DATA[@]}" "train.seed=$seed" ${TOOLS[@]+"${TOOLS[@]}"} \
        --run-dir "$dir" --overwrite >>"$OUT/$name.log" 2>&1
    fi
  fi
done
