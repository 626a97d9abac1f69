#!/usr/bin/env bash
# Mutation testing (issue #28; docs/testing.md, "Mutation testing"): mutmut over one scope, in a throw-away
# copy of the committed tree (HEAD), so the working tree and other people's edits are never touched.
# One worker, niced, under a time limit: it is CPU-bound for a long time and not part of `make test`.
#
#   scripts/mutation.sh algorithms          # cohortrl/algorithms/ against tests/algorithms/
#   scripts/mutation.sh grading             # grading/units.py and grading/answer_format.py against their tests
#   scripts/mutation.sh step                # trainers/step.py and trainers/grpo.py against the wiring, golden,
#                                           # optimiser, rollout-forward-reuse, vLLM, grader-error, options and
#                                           # reliability tests
#   scripts/mutation.sh rl                  # trainers/rl.py (the trainer's setup) against the same tests
#   scripts/mutation.sh setup               # trainers/setup.py (policy, reference, optimiser, LR schedule)
#   scripts/mutation.sh checkpoint          # trainers/checkpoint.py against the integrity, resume and run-directory tests
#   scripts/mutation.sh sandbox             # the sandbox's limit handling, mutants applied to the source (below)
#   scripts/mutation.sh algorithms /tmp/m   # copy into /tmp/m instead of /tmp/cohortrl-mutation-<scope>
#   MUTATION_ONLY='*x_cpu_limit*' scripts/mutation.sh sandbox   # only the mutants matching these globs
#
# Then, in the copy: `mutmut results` lists the survivors, `mutmut show NAME` prints one as a diff, and
# `mutmut run NAME...` re-runs some (e.g. after copying a new test into <copy>/tests and <copy>/mutants/tests).
set -euo pipefail
scope=${1:?usage: scripts/mutation.sh algorithms|grading|step|rl|setup|checkpoint|sandbox [copy-dir]}
root=$(git rev-parse --show-toplevel)
dir=${2:-/tmp/cohortrl-mutation-$scope}
case $scope in
  algorithms)
    mutate='"cohortrl/algorithms/*"'
    tests='"tests/algorithms"' ;;
  grading)
    mutate='"cohortrl/grading/units.py", "cohortrl/grading/answer_format.py"'
    tests='"tests/tasks/test_units.py", "tests/tasks/test_unit_boundaries.py", "tests/tasks/test_answer_format.py",
      "tests/tasks/test_grading_mutation_kills.py"' ;;
  step|rl)  # step: the step (rl_step, update loop, micro-batch loss, log-probs) and GRPO's own part of it;
            # rl: RLTrainer, the setup the step relies on. The step's own settings, vLLM, grader-error logging and
            # the non-finite guard are pinned in the last four files
    if [ "$scope" = step ]; then
      mutate='"cohortrl/trainers/step.py", "cohortrl/trainers/grpo.py"'
    else
      mutate='"cohortrl/trainers/rl.py"'
    fi
    tests='"tests/trainers/test_wiring.py", "tests/trainers/test_golden.py", "tests/trainers/test_optimizer.py",
      "tests/trainers/test_reuse_rollout_forward.py", "tests/trainers/test_micro_batches.py",
      "tests/trainers/test_backends.py", "tests/trainers/test_grader_errors.py", "tests/trainers/test_grpo_options.py",
      "tests/trainers/test_reliability.py"' ;;
  setup)  # the policy and reference, the optimiser and its state, the LR schedule
    mutate='"cohortrl/trainers/setup.py"'
    tests='"tests/trainers/test_wiring.py", "tests/trainers/test_optimizer.py", "tests/trainers/test_golden.py",
      "tests/trainers/test_setup.py", "tests/test_python_api.py", "tests/trainers/test_other_architectures.py",
      "tests/trainers/test_reliability.py"' ;;
  checkpoint)  # atomic writes, the manifest and its checks, finding the last intact checkpoint, resuming
    mutate='"cohortrl/trainers/checkpoint.py"'
    # (less the one test that starts the CLI in another working directory, where mutmut's trampolines cannot
    # find the copy's settings and every run fails; it checks the run directory's claims, not checkpoints)
    tests='"tests/trainers/test_checkpoint_files.py", "tests/trainers/test_checkpoint_integrity.py", "tests/trainers/test_reliability.py",
      "tests/trainers/test_run_dir.py", "tests/trainers/test_grpo.py",
      "--deselect", "tests/trainers/test_run_dir.py::test_cli_train_refuses_names_the_flags_and_overwrites"' ;;
  sandbox)  # the server runs as `python -I -S` with an empty environment: mutmut's trampolines cannot reach it,
            # so mutmut only generates the mutants here (against a test that starts no sandbox) and
            # scripts/mutation_applied.py writes each limit-handling mutant into the copy's source in turn
    mutate='"cohortrl/grading/sandbox_server.py", "cohortrl/grading/sandbox.py"'
    tests='"tests/tasks/test_units.py"' ;;
  *) echo "unknown scope $scope: algorithms, grading, step, rl, setup, checkpoint or sandbox" >&2; exit 2 ;;
esac
rm -rf "$dir" && mkdir -p "$dir"
git -C "$root" archive HEAD | tar -x -C "$dir"
# mutmut reads its settings from the copy's pyproject.toml. source_paths is the whole package so that the
# mutated copy imports; only_mutate picks the scope. docs/ is copied because a registry test reads it, configs/ because the
# kill-and-resume tests start the CLI on one of them, examples/ because the Python API's tests run them.
# forkserver: workers are not forked from a process that has already imported torch and run the tests.
# timeout_multiplier: mutmut gives a mutant 15 x (its tests' time + 1 s) x 2 CPU seconds and half that in wall
# time, i.e. 15 s for these fast tests; a niced worker on a busy machine runs past that without hanging (the
# first grading pass had 131 such "timeouts"), so the default here is 60 (a minute of wall time).
cat >> "$dir/pyproject.toml" <<TOML

[tool.mutmut]
source_paths = ["cohortrl"]
only_mutate = [$mutate]
also_copy = ["docs/", "configs/", "examples/"]
pytest_add_cli_args = ["-p", "no:cacheprovider", "-x"]
pytest_add_cli_args_test_selection = [$tests]
process_isolation = "forkserver"
timeout_multiplier = ${MUTATION_TIMEOUT_MULTIPLIER:-60}
TOML
cd "$dir"
# PYTHONPATH: the copy, not the editable install of the checkout, must be what the tests import.
# MUTATION_ONLY: space-separated globs over mutant names (mutmut's own matching), e.g. one function's mutants.
read -r -a only <<< "${MUTATION_ONLY:-}"
if [ "$scope" = sandbox ]; then
  PYTHONPATH="$dir" nice -n 19 "$root/.venv/bin/mutmut" run --max-children 1 | tail -n 1 || true  # generate only
  # The limit handling: the CPU-time rlimit's value, the wall-clock timers and the kills, the output and
  # result size limits, the checks of a job's limits before it is sent, and the client's wait for an answer
  # (161 mutants). Child.deadline is a property, which mutmut 3.8.1 does not mutate. Their tests: the limits
  # at their edges, then the hostile payloads (output floods, fork bombs, ...).
  default='*sandbox_server.x_cpu_limit__* *ǁServerǁnext_timer__* *ǁServerǁenforce_timers__* *ǁServerǁkill__* *ǁServerǁread_child__* *ǁSandboxǁ_wait__* *ǁSandboxǁ_refuse__*'
  read -r -a globs <<< "${MUTATION_ONLY:-$default}"
  nice -n 19 timeout "${MUTATION_TIMEOUT_S:-7200}" "$root/.venv/bin/python" "$root/scripts/mutation_applied.py" "$dir" \
    --mutants "${globs[@]}" --tests tests/rewards/test_sandbox_limits.py tests/rewards/test_sandbox.py --timeout 300 || true
  awk -F '\t' '{n[$2]++} END {for (s in n) print s, n[s]}' "$dir/applied-results.tsv"
  exit 0
fi
PYTHONPATH="$dir" nice -n 19 timeout "${MUTATION_TIMEOUT_S:-7200}" "$root/.venv/bin/mutmut" run --max-children 1 "${only[@]}" \
  | tr '\r' '\n' | grep -v '^\s*$' | tail -n 3 || true
"$root/.venv/bin/mutmut" results
