import json

import pytest

from cohortrl.config import DataConfig
from cohortrl.data import DataError, PromptStream, load_rows, problem_id


def test_jsonl_split_is_disjoint_and_renames_columns(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"question": f"q{i}", "solution": str(i), "extra": i}) + "\n" for i in range(20)))
    cfg = DataConfig(source=f"jsonl:{path}", prompt_column="question", answer_column="solution", eval_size=5)
    train, held_out = load_rows(cfg, seed=0)
    assert len(train) == 15 and len(held_out) == 5
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}
    assert set(train[0]) == {"prompt", "answer", "extra"}


@pytest.mark.parametrize(
    "content, message",
    [
        (b'{"prompt": "a"}\n{"prompt": \n', r"d.jsonl:2: malformed JSON"),
        (b'{"prompt": "a"}\n[1, 2]\n', r"d.jsonl:2: each line must be a JSON object, got list"),
        (b'{"question": "a"}\n', r"d.jsonl:1: missing column\(s\) \['prompt'\]; columns found: \['question'\]"),
        (b'{"prompt": "a\xff"}\n', r"d.jsonl:1: not valid UTF-8"),
        (b"\n\n", r"d.jsonl holds no rows"),
    ],
)
def test_bad_jsonl_names_file_and_line(tmp_path, content, message):
    path = tmp_path / "d.jsonl"
    path.write_bytes(content)
    with pytest.raises(DataError, match=message):
        load_rows(DataConfig(source=f"jsonl:{path}", eval_size=0), seed=0)


def test_missing_file_empty_prompt_and_too_small_dataset(tmp_path):
    with pytest.raises(DataError, match="data file not found"):
        load_rows(DataConfig(source=f"jsonl:{tmp_path / 'x.jsonl'}"), seed=0)
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "  "}\n{"prompt": "b"}\n{"prompt": "c"}\n')
    with pytest.raises(DataError, match=r"d.jsonl:1: the prompt \(column 'prompt'\) is '  '"):
        load_rows(DataConfig(source=f"jsonl:{path}", eval_size=0), seed=0)
    path.write_text('{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "c"}\n')
    with pytest.raises(DataError, match="data.eval_size=3 leaves no training rows out of 3"):
        load_rows(DataConfig(source=f"jsonl:{path}", eval_size=3), seed=0)


EXACT = [
    (b'{"prompt": "a"}\n{"prompt": \n',
     "{path}:2: malformed JSON (Expecting value at column 12)"),
    (b'{"question": "a", "answer": "1"}\n',
     "{path}:1: missing column(s) ['prompt']; columns found: ['answer', 'question'] (set data.prompt_column)"),
    (b'{"prompt": "a"}\n{"prompt": ""}\n',
     "{path}:2: the prompt (column 'prompt') is ''; it must be non-empty text or a list of {{'role': ..., 'content': ...}} messages (fix or remove the row, or set data.prompt_column)"),
    (b'{"prompt": 7}\n',
     "{path}:1: the prompt (column 'prompt') is 7; it must be non-empty text or a list of {{'role': ..., 'content': ...}} messages (fix or remove the row, or set data.prompt_column)"),
    (b'{"prompt": "caf\xe9"}\n',
     "{path}:1: not valid UTF-8 ('utf-8' codec can't decode byte 0xe9 in position 15: invalid continuation byte); "
     "convert the file to UTF-8"),
    (b'{"prompt": "a"}\n{"prompt": "b"}\n',
     "data.eval_size=2 leaves no training rows out of 2; lower it"),
]


@pytest.mark.parametrize("content, message", EXACT, ids=["json", "columns", "empty", "not-text", "utf8", "too-small"])
def test_every_bad_data_case_has_an_exact_message(tmp_path, content, message):
    path = tmp_path / "d.jsonl"
    path.write_bytes(content)
    with pytest.raises(DataError) as err:
        load_rows(DataConfig(source=f"jsonl:{path}", eval_size=2), seed=0)
    assert str(err.value) == message.format(path=path)


def test_prompt_stream_is_seeded_endless_and_resumable():
    rows = [{"prompt": str(i)} for i in range(5)]
    a = PromptStream(rows, seed=1)
    first = [r["prompt"] for r in a.take(7)]  # crosses an epoch boundary
    assert sorted(first[:5]) == ["0", "1", "2", "3", "4"]
    state = a.state_dict()
    rest = [r["prompt"] for r in a.take(6)]
    b = PromptStream(rows, seed=1)
    b.load_state_dict(state)
    assert [r["prompt"] for r in b.take(6)] == rest
    with pytest.raises(DataError, match="checkpoint was taken on 5 training rows, the data now has 4"):
        PromptStream(rows[:4], seed=1).load_state_dict(state)


def test_task_source_holds_out_distinct_prompts():
    cfg = DataConfig(source="task:arithmetic", level=2, train_size=100, eval_size=50)
    train, held_out = load_rows(cfg, seed=0)
    assert len(held_out) == 50 and {"prompt", "answer", "sample"} <= set(held_out[0])
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}


def test_small_task_pools_still_give_distinct_held_out_prompts():
    cfg = DataConfig(source="task:arithmetic", level=1, train_size=500, eval_size=200)
    train, held_out = load_rows(cfg, seed=0)
    assert len({r["prompt"] for r in held_out}) == 200
    assert train and not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}
    with pytest.raises(DataError, match="has only about .* distinct prompts; lower data.eval_size"):
        load_rows(DataConfig(source="task:arithmetic", level=1, eval_size=2000), seed=0)


def test_hub_source_uses_datasets_load_dataset(monkeypatch):
    """The hub path can't reach the network here: a stand-in `datasets` module checks what it is asked for."""
    import sys
    import types

    calls = []

    def load_dataset(name, subset):
        calls.append((name, subset))
        rows = lambda n, off: [{"question": f"q{i + off}", "answer": str(i)} for i in range(n)]  # noqa: E731
        return {"train": rows(10, 0), "test": rows(4, 100)}

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    cfg = DataConfig(source="hf:openai/gsm8k@main", prompt_column="question", eval_size=3, train_size=5)
    train, held_out = load_rows(cfg, seed=0)
    assert calls == [("openai/gsm8k", "main")]
    assert [r["prompt"] for r in held_out] == ["q100", "q101", "q102"] and len(train) == 5
    assert train[0] == {"prompt": "q0", "answer": "0"}


def test_data_seed_fixes_the_problems_and_held_out_set_across_run_seeds():
    """Seeds of one study (and the SFT and GRPO phases of a pipeline) must see the same held-out problems, or a
    GRPO seed's held-out set could hold the warm start's training problems."""
    def draw(run_seed, data_seed):
        train, held = load_rows(DataConfig(source="task:axial_stress", level=3, train_size=50, eval_size=20, seed=data_seed), run_seed)
        return [r["prompt"] for r in train], [r["prompt"] for r in held]

    assert draw(0, 7) == draw(1, 7) == draw(2, 7)
    assert draw(0, None) == draw(0, 0)
    assert draw(1, None)[1] != draw(0, None)[1]  # unset: the run's seed draws them, as before
    train, held = draw(3, 7)
    assert not set(train) & set(held)


def test_exclude_from_training_keeps_a_function_out_of_training_and_marks_the_held_out_set():
    cfg = DataConfig(source="task:python_function", level=1, seed=0, train_size=60, eval_size=40,
                     exclude_from_training={"function": ["circle_area"]})
    train, held_out = load_rows(cfg, 0)
    assert len(train) == 60 and all(r["sample"]["extra"]["function"] != "circle_area" for r in train)
    unseen = [r for r in held_out if r["unseen"]]
    assert unseen and all(r["sample"]["extra"]["function"] == "circle_area" for r in unseen)
    assert all(r["sample"]["extra"]["function"] != "circle_area" for r in held_out if not r["unseen"])
    plain_train, plain_held_out = load_rows(DataConfig(source="task:python_function", level=1, seed=0, train_size=60, eval_size=40), 0)
    assert [r["prompt"] for r in plain_held_out] == [r["prompt"] for r in held_out]  # the same held-out problems
    assert any(r["sample"]["extra"]["function"] == "circle_area" for r in plain_train)


@pytest.mark.parametrize("spec, message", [
    ({"fn": ["circle_area"]}, "data.exclude_from_training: task 'python_function' samples have no field 'fn'; use one of"),
    ({"function": ["circle"]}, "data.exclude_from_training: no held-out problem of task 'python_function' has function 'circle'; "
                               "its held-out problems have ['axial_stress', 'circle_area', 'hydrostatic_pressure', 'kinetic_energy']"),
])
def test_exclude_from_training_names_a_field_or_value_that_matches_nothing(spec, message):
    cfg = DataConfig(source="task:python_function", level=1, seed=0, train_size=20, eval_size=40, exclude_from_training=spec)
    with pytest.raises(DataError) as e:
        load_rows(cfg, 0)
    assert str(e.value).startswith(message)


def test_eval_level_holds_out_exactly_what_a_run_at_that_level_holds_out():
    """A warm start trained on level 2 and measured on level 1 must answer the same held-out problems as a GRPO
    run on level 1, or the two cannot be paired problem by problem."""
    cross = DataConfig(source="task:axial_stress", level=2, eval_level=1, seed=0, train_size=30, eval_size=20)
    train, held_out = load_rows(cross, 0)
    level2_train, level2_held_out = load_rows(DataConfig(source="task:axial_stress", level=2, seed=0, train_size=30, eval_size=20), 0)
    _, level1_held_out = load_rows(DataConfig(source="task:axial_stress", level=1, seed=0, train_size=30, eval_size=20), 0)
    assert [r["prompt"] for r in held_out] == [r["prompt"] for r in level1_held_out]
    assert [r["prompt"] for r in held_out] != [r["prompt"] for r in level2_held_out]
    assert [r["prompt"] for r in train] == [r["prompt"] for r in level2_train]  # training stays on data.level
    assert {r["sample"]["level"] for r in train} == {2} and {r["sample"]["level"] for r in held_out} == {1}


def test_eval_level_names_a_level_the_family_lacks():
    with pytest.raises(DataError) as e:
        load_rows(DataConfig(source="task:axial_stress", level=2, eval_level=9, seed=0, train_size=10, eval_size=5), 0)
    assert str(e.value).startswith("data.eval_level=9: axial_stress has levels [")
    assert str(e.value).endswith("set data.eval_level to one of them")


def test_a_retired_row_is_skipped_and_every_row_comes_back_when_all_are_retired(caplog):
    import logging

    rows = [{"prompt": str(i)} for i in range(5)]
    plain, retiring = PromptStream(rows, seed=1), PromptStream(rows, seed=1, retire_after=2)
    order = [r["prompt"] for r in plain.take(10)]
    first = retiring.take(5)
    assert [r["prompt"] for r in first] == order[:5]  # the same shuffle
    retiring.solved([rows[0], rows[0], rows[1]])  # row 0 twice: retired; row 1 once: not yet
    assert [r["prompt"] for r in retiring.take(4)] == [p for p in order[5:] if p != "0"]
    state = retiring.state_dict()
    back = PromptStream(rows, seed=1, retire_after=2)
    back.load_state_dict(state)
    assert back.retired == {problem_id(rows[0])} and back.take(3) == retiring.take(3)
    retiring.solved(rows * 2)
    with caplog.at_level(logging.WARNING, logger="cohortrl"):
        assert len(retiring.take(5)) == 5
    assert "every one of the 5 training prompts is retired (algorithm.retire_solved=2)" in caplog.text


def test_a_mix_of_levels_draws_each_level_as_it_would_alone_in_equal_shares():
    """``data.levels``: each level's training and held-out problems are the ones that level alone draws (so a
    mixed run pairs with single-level runs problem by problem), in equal shares (the first levels take the
    remainder), training rows interleaved level by level; a wrong level or a clash is one line."""
    from cohortrl.config import Config, ConfigError

    mix = DataConfig(source="task:arithmetic", levels=[1, 3], seed=0, train_size=11, eval_size=5)
    train, held_out = load_rows(mix, 0)
    assert [r["sample"]["level"] for r in train] == [1, 3] * 5 + [1]
    assert [r["sample"]["level"] for r in held_out] == [1, 1, 1, 3, 3]
    for level, n_train, n_held in ((1, 6, 3), (3, 5, 2)):
        alone = load_rows(DataConfig(source="task:arithmetic", level=level, seed=0, train_size=n_train, eval_size=n_held), 0)
        assert [r["prompt"] for r in train if r["sample"]["level"] == level] == [r["prompt"] for r in alone[0]]
        assert [r["prompt"] for r in held_out if r["sample"]["level"] == level] == [r["prompt"] for r in alone[1]]
    with pytest.raises(DataError, match=r"data.levels=\[1, 9\]: .*not 9; list only those"):
        load_rows(DataConfig(source="task:arithmetic", levels=[1, 9]), 0)
    for bad, message in (({"levels": [1, 3], "eval_level": 2}, "drop data.eval_level"),
                         ({"levels": [2, 2]}, "names a level twice"),
                         ({"levels": [1, 3], "source": "jsonl:x.jsonl"}, "task: sources only")):
        with pytest.raises(ConfigError, match=message):
            Config.from_dict({"data": {"source": "task:arithmetic", **bad}})
