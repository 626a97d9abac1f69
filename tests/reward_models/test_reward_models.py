"""Learned reward models: AUROC, step-end token mapping, gym and Math-Shepherd labels, ORM/PRM training,
saving and loading, and label-data errors."""

import json
import math
import random

import pytest
import torch

from cohortrl import tasks
from cohortrl.models import build_tiny_tokenizer
from cohortrl.reward_models.evaluate import auroc, auroc_interval
from cohortrl.reward_models.labels import (
    LabelDataError,
    PairExample,
    PointExample,
    StepExample,
    gym_pair_examples,
    gym_step_examples,
    load_jsonl,
    math_shepherd_labels,
    perturb_reference,
    response_steps,
)
from cohortrl.reward_models.scoring import encode_steps, load_prm, prm_step_scores, step_char_ends, token_containing
from cohortrl.reward_models.train import bradley_terry_loss, build_reward_model, train_on


# ------------------------------------------------------------------------------------------- AUROC
def test_auroc_hand_worked():
    # positives score 0.35, 0.8; negatives 0.1, 0.4. Pairs won by the positive: (0.35>0.1), (0.8>0.1),
    # (0.8>0.4) = 3 of 4 → 0.75. Rank-sum: ranks 0.1→1, 0.35→2, 0.4→3, 0.8→4; R_pos = 6;
    # U = 6 − 2·3/2 = 3; 3 / (2·2) = 0.75.
    assert auroc([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1]) == 0.75
    # A tie counts ½: positive 0.5 vs negatives 0.5 (½) and 0.2 (1) → 1.5 / 2 = 0.75 (mid-rank 2.5: U = 2.5 − 1).
    assert auroc([0.5, 0.5, 0.2], [1, 0, 0]) == 0.75
    assert auroc([3, 2, 1], [1, 1, 0]) == 1.0 and auroc([1, 2, 3], [1, 1, 0]) == 0.0
    assert math.isnan(auroc([0.2, 0.3], [1, 1]))


def test_auroc_interval_hand_worked():
    # A = .75, 2 positives, 2 negatives: Q1 = .75/1.25 = .6, Q2 = 2·.5625/1.75 = .642857;
    # SE² = [.1875 + (.6 − .5625) + (.642857 − .5625)] / 4 = .076339, SE = .276295; .75 ± 1.96·SE, clipped
    lo, hi = auroc_interval(0.75, 2, 2)
    assert lo == pytest.approx(0.75 - 1.96 * 0.276295, abs=1e-5) and hi == 1.0
    lo, hi = auroc_interval(0.6, 200, 300)  # narrower with more labels, and it excludes 0.5 here
    assert 0.5 < lo < 0.6 < hi < 0.7
    assert all(math.isnan(x) for x in auroc_interval(0.7, 0, 5))


# ------------------------------------------------------------------------------------------- step ends
def test_step_end_tokens_on_the_tiny_tokenizer():
    tok = build_tiny_tokenizer()
    steps = ["s1 = 3 + 4 = 7", "ANSWER: 7"]
    text, ends = step_char_ends(tok, "What is 3 + 4?", steps)
    assert [text[e - len(s) + 1 : e + 1] for s, e in zip(steps, ends)] == steps
    ids, where = encode_steps(tok, "What is 3 + 4?", steps)
    offsets = tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    for e, t in zip(ends, where):
        assert offsets[t][0] <= e < offsets[t][1]  # the token holding the step's last character
    assert [tok.decode(ids[t]) for t in where] == [" 7", " 7"]


def test_step_ending_mid_token_takes_the_token_that_contains_it():
    tok = build_tiny_tokenizer()
    enc = tok("ANSWER: 7", add_special_tokens=False, return_offsets_mapping=True)
    offsets = [tuple(o) for o in enc["offset_mapping"]]  # AN | SWER | : | Ġ7
    assert tok.convert_ids_to_tokens(enc["input_ids"])[1] == "SWER"
    assert token_containing(offsets, 3) == 1  # a step ending at "W" is read at "SWER"
    assert token_containing([(0, 0), (0, 3), (5, 7)], 4) == 1  # in a gap: the last token starting before it
    assert token_containing([(0, 3)], 3) is None  # past every token: cut off


def test_truncated_last_step_has_no_index():
    tok = build_tiny_tokenizer()
    steps = ["s1 = 3 + 4 = 7", "s2 = 7 * 2 = 14", "ANSWER: 14"]
    full, where = encode_steps(tok, "Compute (3 + 4) * 2.", steps)
    cut, where_cut = encode_steps(tok, "Compute (3 + 4) * 2.", steps, max_length=where[2] - 1)
    assert len(cut) == where[2] - 1
    assert where_cut == [where[0], where[1], None]
    with pytest.raises(ValueError, match="step 1 is empty"):
        encode_steps(tok, "q", ["a", ""])


# ------------------------------------------------------------------------------------------- gym labels
def test_gym_labels_mark_exactly_the_corrupted_steps_wrong():
    family = tasks.get("arithmetic")
    rng = random.Random(0)
    for sample in family.sample(20, seed=3, level=4):
        completion, k = perturb_reference(family, sample, rng)
        example = response_steps(family, sample, completion)
        changed = [a != b for a, b in zip(completion.split("\n"), sample.reference_solution.split("\n"))]
        assert [y == 0.0 for y in example.labels] == changed, (sample.reference_solution, completion)
        assert changed[k] and not any(changed[:k])  # the chosen step is wrong, everything before it right
        assert example.outcome == 0.0  # arithmetic's last step is the answer: every error reaches it


def test_gym_labels_are_deterministic_and_keep_some_references():
    a = gym_step_examples("axial_stress", 40, seed=1, level=2)
    assert a == gym_step_examples("axial_stress", 40, seed=1, level=2)
    assert any(all(y == 1.0 for y in e.labels) for e in a) and any(e.outcome == 0.0 for e in a)
    gsm8k = tasks.get("gsm8k")
    with pytest.raises(ValueError, match="not 'KEY = ... = value' lines"):
        perturb_reference(gsm8k, gsm8k.sample(1, level=1)[0], random.Random(0))


def test_gym_pairs_put_the_reference_above_a_perturbation_the_grader_fails():
    family = tasks.get("arithmetic")
    pairs = gym_pair_examples("arithmetic", 30, seed=2, level=3)
    assert pairs == gym_pair_examples("arithmetic", 30, seed=2, level=3)
    for pair, sample in zip(pairs, family.sample(30, seed=2, level=3)):
        assert pair.prompt == sample.prompt and pair.chosen == sample.reference_solution
        assert family.grade(sample, pair.rejected).outcome == 0.0 and pair.rejected != pair.chosen


def test_train_rm_on_gym_pairs_reports_pointwise_and_pair_held_out_numbers(tmp_path):
    from cohortrl.cli import main

    out = tmp_path / "orm"
    assert main(["train-rm", "kind=orm", "data_kind=pairs", "level=2", "steps=2", "n_train=8", "n_eval=24",
                 "batch_size=2", f"out={out}"]) == 0
    summary = json.loads((out / "train_rm.json").read_text())
    assert summary["n_train"] == 8 and summary["held_out"]["n"] == 24 and summary["held_out_pairs"]["n_pairs"] == 24
    assert 0.0 <= summary["held_out"]["auroc"] <= 1.0


# ------------------------------------------------------------------------------------------- Math-Shepherd
def test_math_shepherd_hard_and_soft_estimates():
    family = tasks.get("arithmetic")
    sample = family.sample(1, seed=0, level=3)[0]  # s1, s2, s3 then ANSWER: 74
    steps = sample.reference_solution.split("\n")[:3]
    right, wrong = f"ANSWER: {sample.answer}", "ANSWER: 0"
    # From step i the scripted policy finishes right in (3, 1, 0) of 4 tries.
    scripted = {1: [right] * 3 + [wrong], 2: [right] + [wrong] * 3, 3: [wrong] * 4}

    def complete(prefix, n):
        return scripted[prefix.count("\n")][:n]

    labels = math_shepherd_labels(family, sample, steps, complete, n=4)
    assert [(x.hard, x.soft) for x in labels] == [(1.0, 0.75), (1.0, 0.25), (0.0, 0.0)]


# ------------------------------------------------------------------------------------------- training
def test_bradley_terry_loss_hand_worked():
    # r_c − r_r = 0 → −log σ(0) = log 2; = ln 3 → −log(3/4) = log(4/3).
    loss = bradley_terry_loss(torch.tensor([1.0, math.log(3)]), torch.tensor([1.0, 0.0]))
    assert loss.item() == pytest.approx((math.log(2) + math.log(4 / 3)) / 2)


def _separable(n=16):
    return [("is it yes?", "yes", 1.0) if i % 2 else ("is it yes?", "no", 0.0) for i in range(n)]


def test_orm_trains_saves_and_loads_as_reward_model(tmp_path):
    from cohortrl.rewards.scoring import resolve

    model, tok = build_reward_model("tiny-llama", "orm", seed=0)
    points = [PointExample(p, c, y) for p, c, y in _separable()]
    losses = train_on(model, tok, points, steps=30, batch_size=8, lr=3e-3, seed=0)
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5
    pairs = [PairExample("is it yes?", "yes", "no")] * 8
    pair_losses = train_on(model, tok, pairs, steps=5, batch_size=4, lr=1e-3, seed=0)
    assert pair_losses[-1] < math.log(2)  # already better than indifference
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    score = resolve("reward_model", {"model": str(tmp_path)})
    good, bad = score(["is it yes?", "is it yes?"], ["yes", "no"])
    assert good > bad


def test_prm_trains_saves_and_loads(tmp_path):
    model, tok = build_reward_model("tiny-llama", "prm", seed=0)
    examples = [StepExample("check each step", ["first yes", "then no", "then yes"], [1.0, 0.0, 1.0])] * 8
    losses = train_on(model, tok, examples, steps=30, batch_size=4, lr=3e-3, seed=0)
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded, loaded_tok = load_prm(tmp_path)
    scores = prm_step_scores(loaded, loaded_tok, "check each step", ["first yes", "then no", "then yes"])
    assert scores[0] > 0.5 > scores[1] and scores[2] > 0.5


def test_train_rm_cli_smoke(tmp_path, capsys):
    from cohortrl.cli import main

    assert main(["train-rm", "kind=prm", "steps=2", "n_train=8", "n_eval=8", "batch_size=2", f"out={tmp_path}"]) == 0
    summary = json.loads((tmp_path / "train_rm.json").read_text())
    assert len(summary["losses"]) == 2 and 0.0 <= summary["held_out"]["auroc"] <= 1.0
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("\n".join(json.dumps({"prompt": "q", "chosen": "yes", "rejected": "no"}) for _ in range(4)))
    out = tmp_path / "orm"
    assert main(["train-rm", "kind=orm", f"data={pairs}", "data_kind=pairs", f"eval_data={pairs}", "steps=2", f"out={out}"]) == 0
    assert json.loads((out / "train_rm.json").read_text())["held_out"]["n_pairs"] == 4
    assert main(["train-rm", "kind=prm", f"data={pairs}", "data_kind=pairs"]) == 2
    assert main(["train-rm", "kinds=prm"]) == 2
    assert "unknown train-rm key 'kinds'; did you mean 'kind'?" in capsys.readouterr().err


@pytest.mark.parametrize("setting", ["auto", "aten"])
def test_train_rm_runs_under_the_configured_linear_kernel(tmp_path, monkeypatch, setting):
    from cohortrl.cpu import kernels
    from cohortrl.reward_models.train import load_rm_config, train_reward_model

    original = torch.nn.functional.linear
    calls = []
    real = kernels._onednn
    monkeypatch.setattr(kernels, "_onednn", lambda *a: calls.append(1) or real(*a))
    cfg = load_rm_config(None, ["kind=prm", "steps=1", "n_train=4", "n_eval=4", "batch_size=2", f"cpu_linear={setting}",
                                f"out={tmp_path}"])
    train_reward_model(cfg)
    assert torch.nn.functional.linear is original
    assert bool(calls) == (setting == "auto" and kernels.onednn_available())


# ------------------------------------------------------------------------------------------- bad rows
@pytest.mark.parametrize(
    "kind, line, message",
    [
        ("pointwise", '{"prompt": "q", "completion": "a"}', "rows.jsonl:2: missing key(s) label; a pointwise row needs prompt, completion, label"),
        ("pointwise", '{"prompt": "q", "completion": "a", "label": 2}', "rows.jsonl:2: a label must be true/false or a number in [0, 1], got 2"),
        ("pairs", '{"prompt": "q", "chosen": "a", "rejected": "a"}', "rows.jsonl:2: 'chosen' and 'rejected' are the same text; a pair must differ"),
        ("steps", '{"prompt": "q", "steps": ["a", "b"], "labels": [1]}', "rows.jsonl:2: 2 steps but 1 labels; give one label per step"),
        ("steps", '{"prompt": "q", "steps": ["a", ""], "labels": [1, 0]}', "rows.jsonl:2: 'steps' must be a non-empty list of non-empty strings"),
        ("steps", '{"prompt": "", "steps": ["a"], "labels": [1]}', "rows.jsonl:2: 'prompt' must be a non-empty string, got ''"),
        ("steps", '{"prompt": "q", "steps": ["a"], "labels": [1],', "rows.jsonl:2: not valid JSON"),
        ("steps", '["q", ["a"], [1]]', "rows.jsonl:2: expected a JSON object with keys prompt, steps, labels, got list"),
    ],
)
def test_bad_rows_give_exact_errors(tmp_path, kind, line, message):
    good = {"pointwise": '{"prompt": "q", "completion": "a", "label": 1}',
            "pairs": '{"prompt": "q", "chosen": "a", "rejected": "b"}',
            "steps": '{"prompt": "q", "steps": ["a"], "labels": [true]}'}[kind]
    path = tmp_path / "rows.jsonl"
    path.write_text(good + "\n" + line + "\n")
    with pytest.raises(LabelDataError) as info:
        load_jsonl(path, kind)
    expected = f"{path}:2: " + message.removeprefix("rows.jsonl:2: ")
    if expected.endswith("not valid JSON"):  # followed by the decoder's reason and column
        assert str(info.value).startswith(expected + " (")
    else:
        assert str(info.value) == expected


def test_policy_completer_samples_n_continuations_of_the_prefix_reproducibly():
    from cohortrl.models import load_model
    from cohortrl.reward_models.labels import policy_completer

    model, tok = load_model("tiny-llama", seed=0)
    model.eval()
    first = policy_completer(model, tok, "What is 2 + 8?", max_new_tokens=5, seed=3)
    again = policy_completer(model, tok, "What is 2 + 8?", max_new_tokens=5, seed=3)
    outs = first("s1 = 2 + 8 = ", 4)
    assert len(outs) == 4 and len(set(outs)) > 1  # sampled: the four continuations differ
    assert outs == again("s1 = 2 + 8 = ", 4)  # seeded: the same four again
    # continuations only: neither the prompt nor the prefix echoed back
    assert not any("What is" in o or "s1 = 2 + 8" in o for o in outs)
