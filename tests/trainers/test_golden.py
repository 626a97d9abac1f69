"""Golden training runs: 3 steps of each tiny configuration in ``tests/golden/runs.py`` (every advantage
estimator, every aggregation mode, KL in the loss and in the reward, several epochs and minibatches, PPO, SFT)
reproduce the per-step loss, KL, grad norm, reward, advantage statistics and the rest of the logged numbers
pinned in ``tests/golden/golden_runs.json`` to a relative 1e-5. A silent numerical change anywhere in
rollout -> reward -> advantage -> loss -> update fails here, naming the run, the step and the metric.

The numbers are pinned per torch version and CPU vendor (``golden_key``): with another, these tests skip,
saying how to pin them; so does a run pinned on other machines only (added after their numbers were pinned).
After an intended change: ``python -m tests.golden.regenerate`` (prints what moved, then writes)."""

import json

import pytest
import torch

from cohortrl.algorithms import ADVANTAGE_ESTIMATORS, AGGREGATION_MODES, POLICY_LOSSES
from tests.golden.runs import GOLDEN_FILE, REGENERATE, RUNS, THREADS, compare, config, golden_key, is_sft, run

PINNED_BY_KEY = json.loads(GOLDEN_FILE.read_text())  # {golden_key(): {run: [per-step numbers]}}


@pytest.fixture(scope="module")
def golden(cpu_fast_path_pass) -> tuple[str, dict | None, str]:
    """The key of the numbers that apply to this machine and this pass's CPU path, those numbers (None if none
    are pinned) and the command that pins them."""
    key = golden_key(cpu_fast_path_pass)
    return key, PINNED_BY_KEY.get(key), REGENERATE + ("" if cpu_fast_path_pass == "auto" else " --cpu-fast-path=off")


@pytest.fixture
def golden_threads():
    """The runs were pinned with THREADS threads (the numbers do not depend on it here, but the time does)."""
    before = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("name", list(RUNS))
def test_golden_run_reproduces_its_pinned_numbers(tmp_path, golden_threads, golden, name):
    key, pinned, regenerate = golden
    if pinned is None:
        pytest.skip(f"no golden numbers for {key} (pinned: {', '.join(PINNED_BY_KEY)}); "
                    f"pin them with `{regenerate}`")
    if name not in pinned:
        # A run added since another machine's numbers were pinned is pinned for the machines it was run on: it
        # skips elsewhere (saying which), and fails only when no machine has pinned it.
        elsewhere = [k for k, runs in PINNED_BY_KEY.items() if name in runs]
        assert elsewhere, f"golden run {name!r} has no pinned numbers for any machine; run `{regenerate} {name}`"
        pytest.skip(f"golden run {name!r} is pinned only for {', '.join(elsewhere)}, not for {key}; "
                    f"pin it here with `{regenerate} {name}`")
    got = run(name, tmp_path)
    differences = compare(pinned[name], got)
    assert not differences, (
        f"golden run {name!r} moved:\n  " + "\n  ".join(differences)
        + f"\nIf the change is intended, `{regenerate}` pins the new numbers (and prints this diff)."
    )


def test_every_estimator_and_aggregation_mode_has_a_golden_run():
    """A newly registered estimator, mode or policy loss gets its own golden run; so does the SFT trainer."""
    rl = [n for n in RUNS if not is_sft(n)]  # an SFT run's algorithm section is BASE's, unused
    estimators = {config(n)["algorithm"].get("estimator", "grpo") for n in rl if config(n)["algorithm"].get("name") != "ppo"}
    aggregations = {config(n)["algorithm"].get("aggregation", "seq-mean-token-mean") for n in rl}
    assert set(ADVANTAGE_ESTIMATORS) <= estimators, sorted(set(ADVANTAGE_ESTIMATORS) - estimators)
    assert set(AGGREGATION_MODES) <= aggregations, sorted(set(AGGREGATION_MODES) - aggregations)
    policy_losses = {config(n)["algorithm"].get("policy_loss", "clip") for n in rl}
    assert set(POLICY_LOSSES) <= policy_losses, sorted(set(POLICY_LOSSES) - policy_losses)
    assert any(config(n)["algorithm"].get("kl_in_reward") for n in RUNS)
    assert any(config(n)["algorithm"].get("name") == "ppo" for n in RUNS)
    assert any(is_sft(n) for n in RUNS)


def test_the_runs_are_distinguishable(golden):
    """Every run's pinned numbers differ from every other's: a setting swapped for another (an estimator run
    as grpo, an aggregation mode ignored) cannot reproduce the run it replaced."""
    key, pinned, regenerate = golden
    if pinned is None:
        pytest.skip(f"no golden numbers for {key}; pin them with `{regenerate}`")
    names = [n for n in RUNS if n in pinned]
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert compare(pinned[a], pinned[b]), f"golden runs {a!r} and {b!r} have the same numbers"
