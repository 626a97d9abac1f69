"""The Python API: trainers built from Python objects run the same machinery as ``cohortrl train CONFIG``;
configs built with keywords are checked like YAML; user code loads with exact errors; registries and
callbacks work; the two examples run."""

import json
import runpy
import sys
from pathlib import Path

import pytest
import yaml

from cohortrl import Callback, Config, ConfigError, EarlyStopping, GRPOTrainer, PPOTrainer, load_model, make_trainer
from cohortrl.algorithms import ADVANTAGE_ESTIMATORS, POLICY_LOSSES, register_advantage_estimator
from cohortrl.cli import main as cli_main
from cohortrl.data import DataError
from cohortrl.rewards.scoring import RewardFunctionError
from cohortrl.trainers.metrics import read_metrics
from tests.trainers.reward_fns import starts_with_letter

REPO = Path(__file__).resolve().parent.parent
VOLATILE = ("time/", "tokens_per_s", "peak_rss_mb")
REWARD = "tests.trainers.reward_fns:starts_with_letter"


def sections(data_source: str, **overrides) -> dict:
    base = {
        "model": {"name": "tiny-llama", "system_prompt": None},
        "data": {"source": data_source, "eval_size": 8},
        "sampling": {"max_new_tokens": 8},
        "reward": {"functions": [{"name": REWARD}], "correctness": REWARD},
        "algorithm": {"group_size": 4, "prompts_per_step": 2, "beta": 0.04},
        "optim": {"lr": 1e-2},
        "train": {"steps": 2, "progress": False},
        "eval": {"before": False, "n_prompts": 8, "batch_size": 8},
    }
    for name, values in overrides.items():
        base[name] = {**base.get(name, {}), **values}
    return base


def training_rows(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in read_metrics(run_dir)]


def run_example(name: str, *argv: str) -> None:
    old = sys.argv
    sys.argv = [name, *argv]
    try:
        runpy.run_path(str(REPO / "examples" / name), run_name="__main__")
    finally:
        sys.argv = old


# ------------------------------------------------------------------------------------- one machinery
def test_yaml_and_python_give_the_same_run(tmp_path, addition_jsonl):
    """The same settings through `cohortrl train CONFIG` and through GRPOTrainer with a config built from
    keywords, a reward callable and the rows as a list: the same metrics, step by step."""
    config_file = tmp_path / "run.yaml"
    config_file.write_text(yaml.safe_dump(sections(f"jsonl:{addition_jsonl}")))
    assert cli_main(["train", str(config_file), "--run-dir", str(tmp_path / "cli")]) == 0

    rows = [json.loads(line) for line in addition_jsonl.read_text().splitlines()]
    s = sections("python:train_dataset")
    del s["reward"]
    trainer = GRPOTrainer(Config(**s), tmp_path / "api", reward_funcs=[starts_with_letter], train_dataset=rows)
    trainer.train()

    cli_rows, api_rows = training_rows(tmp_path / "cli"), training_rows(tmp_path / "api")
    assert [r["step"] for r in api_rows] == [1, 2, 2]
    assert api_rows == cli_rows
    saved = yaml.safe_load((tmp_path / "api" / "config.yaml").read_text())
    assert saved["reward"]["functions"] == [{"name": REWARD, "weight": 1.0, "kwargs": {}}]
    assert saved["data"]["source"] == "python:train_dataset"


def test_config_from_keywords_is_checked_exactly_like_yaml(tmp_path):
    bad = {"algorithm": {"group_size": 1}}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    with pytest.raises(ConfigError) as from_yaml:
        Config.from_yaml(path)
    with pytest.raises(ConfigError) as from_keywords:
        Config(**bad)
    assert str(from_keywords.value) == str(from_yaml.value)
    with pytest.raises(ConfigError, match=r"^config key 'algorithm.group_size': expected int, got '4' \(str\)$"):
        Config(algorithm={"group_size": "4"})
    with pytest.raises(ConfigError, match=r"^unknown config key 'sampling.temprature'; did you mean 'sampling.temperature'\?$"):
        Config(sampling={"temprature": 0.5})


def test_config_round_trips_through_yaml_and_takes_overrides(tmp_path):
    cfg = Config(model={"name": "tiny-llama", "lora": {"enabled": True, "r": 4}}, algorithm={"group_size": 4, "beta": 0.0})
    path = tmp_path / "c.yaml"
    path.write_text(cfg.to_yaml())
    assert Config.from_yaml(path) == cfg
    changed = cfg.with_overrides("algorithm.beta=0.1", "train.steps=7")
    assert (changed.algorithm.beta, changed.train.steps, cfg.algorithm.beta) == (0.1, 7, 0.0)


def test_trainer_class_and_config_algorithm_must_agree(tmp_path, addition_jsonl):
    cfg = Config(**sections(f"jsonl:{addition_jsonl}", algorithm={"name": "ppo"}))
    with pytest.raises(ConfigError, match=r"config key 'algorithm.name' = 'ppo' but this is the GRPO trainer"):
        GRPOTrainer(cfg, tmp_path)
    assert type(make_trainer(cfg, tmp_path)) is PPOTrainer


def test_loaded_model_prompt_strings_and_ppo(tmp_path):
    model, tokenizer = load_model("tiny-llama")
    prompts = [f"Say a word about {i}." for i in range(40)]
    cfg = Config(**sections("python:x", algorithm={"name": "ppo", "group_size": 2}))
    with pytest.raises(ConfigError, match="model= is a loaded model: pass its tokenizer= too"):
        PPOTrainer(cfg, tmp_path, model=model, train_dataset=prompts)
    trainer = PPOTrainer(cfg, tmp_path, model=model, tokenizer=tokenizer, train_dataset=prompts,
                         reward_funcs=[starts_with_letter])
    assert trainer.model is model and trainer.eval_rows[0]["prompt"].startswith("Say a word")
    rows = trainer.train(steps=1)
    assert rows[0]["step"] == 1 and "value_loss" in rows[0]


def test_dataset_objects_and_errors(tmp_path, addition_jsonl):
    class FakeDataset:  # the two members of datasets.Dataset the API relies on
        column_names = ["question", "answer"]

        def to_list(self):
            return [{"question": f"q{i}?", "answer": str(i)} for i in range(30)]

    cfg = Config(**sections("python:x", data={"prompt_column": "question"}))
    trainer = GRPOTrainer(cfg, tmp_path / "a", train_dataset=FakeDataset(), eval_dataset=[{"question": "held out?"}])
    assert [r["prompt"] for r in trainer.eval_rows] == ["held out?"]
    assert len(trainer.stream.rows) == 30
    with pytest.raises(ConfigError, match=r"train_dataset='nope' is neither a .jsonl path, a gym task"):
        GRPOTrainer(cfg, tmp_path / "b", train_dataset="nope")
    with pytest.raises(DataError, match=r"means the rows were given in Python: pass train_dataset= to the trainer"):
        GRPOTrainer(cfg, tmp_path / "c")
    trainer = GRPOTrainer(Config(**sections("python:x")), tmp_path / "d", train_dataset=str(addition_jsonl))
    assert trainer.cfg.data.source == f"jsonl:{addition_jsonl}"


# ------------------------------------------------------------------------------------- user code from YAML
@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "mine.py"
    path.write_text(
        "def two_args(prompts, completions):\n    return [0.0] * len(completions)\n"
        "def good(prompts, completions, **columns):\n    return [1.0] * len(completions)\n"
        "def boom(prompts, completions, **columns):\n    raise KeyError('answer')\n"
        "def add_hint(row):\n    return {**row, 'prompt': row['prompt'] + ' Think.'}\n"
        "def drop(row):\n    return None\n"
        "def two_rows(row, other):\n    return row\n"
    )
    return path


def reward_error(tmp_path, addition_jsonl, name) -> str:
    cfg = Config(**sections(f"jsonl:{addition_jsonl}", reward={"functions": [{"name": name}], "correctness": name}))
    with pytest.raises(RewardFunctionError) as err:
        GRPOTrainer(cfg, tmp_path / "run").train()
    return str(err.value)


def test_user_reward_function_errors_are_exact(tmp_path, addition_jsonl, user_file, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert reward_error(tmp_path, addition_jsonl, "missing.py:good") == (
        f"reward function file not found: missing.py (from 'missing.py:good'; relative paths start at {tmp_path})"
    )
    assert reward_error(tmp_path, addition_jsonl, "mine.py:nothing") == (
        "mine.py has no 'nothing' (from reward function 'mine.py:nothing'); it defines: add_hint, boom, drop, good, two_args, two_rows"
    )
    assert reward_error(tmp_path, addition_jsonl, "mine.py:two_args") == (
        "reward function 'mine.py:two_args' has signature two_args(prompts, completions); reward functions are called "
        "by keyword as in TRL (prompts=, completions=, completion_ids=, trainer_state= and every dataset column), so it "
        "must take **kwargs and no positional-only parameters, e.g. def f(completions, **kwargs); it returns one float "
        "or None per completion"
    )
    assert reward_error(tmp_path, addition_jsonl, "no_such_module_q:good").startswith(
        "cannot import module 'no_such_module_q' for reward function 'no_such_module_q:good': No module named"
    )
    assert reward_error(tmp_path, addition_jsonl, "mine.py:boom") == (
        "reward function 'mine.py:boom' raised KeyError: 'answer' at mine.py:6 (in boom) on sample 0 (prompt: 'What is 3 + 4?')"
    )


def test_data_transform_from_yaml(tmp_path, addition_jsonl, user_file, monkeypatch):
    monkeypatch.chdir(tmp_path)
    trainer = GRPOTrainer(Config(**sections(f"jsonl:{addition_jsonl}", data={"transform": "mine.py:add_hint"})), tmp_path / "a")
    assert all(r["prompt"].endswith("? Think.") for r in trainer.stream.rows + trainer.eval_rows)
    with pytest.raises(DataError, match=rf"^data.transform 'mine.py:drop' returned NoneType for {addition_jsonl}:1; it must return the row as a dict$"):
        GRPOTrainer(Config(**sections(f"jsonl:{addition_jsonl}", data={"transform": "mine.py:drop"})), tmp_path / "b")
    with pytest.raises(DataError, match=r"^data.transform 'mine.py:two_rows' has signature two_rows\(row, other\); it must take one row"):
        GRPOTrainer(Config(**sections(f"jsonl:{addition_jsonl}", data={"transform": "mine.py:two_rows"})), tmp_path / "c")


def test_registered_estimator_loss_and_reward_selected_from_yaml(tmp_path, addition_jsonl):
    plugin = tmp_path / "plugin.py"
    plugin.write_text(
        "import torch\n"
        "from cohortrl.algorithms import register_advantage_estimator, register_policy_loss, get_policy_loss\n"
        "from cohortrl.rewards import register_reward_function\n"
        "CALLS, BONUSES = [], []\n"
        "@register_advantage_estimator('sign_test')\n"
        "def sign(*, rewards, response_mask, group_size, **unused):\n"
        "    CALLS.append('estimator')\n"
        "    return torch.sign(rewards - rewards.mean()).unsqueeze(-1) * response_mask\n"
        "@register_policy_loss('clip_test')\n"
        "def clip(**kwargs):\n"
        "    CALLS.append('loss')\n"
        "    return get_policy_loss('clip')(**kwargs)\n"
        "@register_reward_function('letter_test')\n"
        "def letter(prompts, completions, bonus=0.0, **columns):\n"
        "    BONUSES.append(bonus)\n"
        "    return [float(c[:1].isalpha()) + bonus for c in completions]\n"
    )
    data = sections(f"jsonl:{addition_jsonl}", algorithm={"estimator": "sign_test", "policy_loss": "clip_test"},
                    train={"steps": 1})
    data["reward"] = {"functions": [{"name": "letter_test", "kwargs": {"bonus": 0.5}}], "correctness": "letter_test"}
    data["imports"] = [str(plugin)]
    config_file = tmp_path / "run.yaml"
    config_file.write_text(yaml.safe_dump(data))
    try:
        assert cli_main(["train", str(config_file), "--run-dir", str(tmp_path / "run")]) == 0
        module = sys.modules[next(m for m in sys.modules if m.endswith("plugin") and m.startswith("cohortrl_user."))]
        assert module.CALLS[:2] == ["estimator", "loss"]
        assert read_metrics(tmp_path / "run")[0]["reward_mean"] >= 0.5  # the kwargs reached the function
        assert module.BONUSES and set(module.BONUSES) == {0.5}
        with pytest.raises(TypeError, match=r"^advantage estimator 'bad' \(<lambda>\) does not accept response_mask, group_size"):
            register_advantage_estimator("bad")(lambda *, rewards, token_rewards=None, step_rewards=None, step_ends=None, eps=1e-6: rewards)
        with pytest.raises(ValueError, match="advantage estimator 'sign_test' is already registered"):
            register_advantage_estimator("sign_test")(lambda **kw: None)
    finally:
        ADVANTAGE_ESTIMATORS.pop("sign_test", None)
        POLICY_LOSSES.pop("clip_test", None)
        from cohortrl.rewards.functions import BUILTIN_REWARDS

        BUILTIN_REWARDS.pop("letter_test", None)


def test_unknown_registered_name_without_its_import_fails_early():
    with pytest.raises(ConfigError, match=r"config key 'algorithm.estimator' = 'sign_test2': unknown name"):
        Config(algorithm={"estimator": "sign_test2"})
    with pytest.raises(Exception, match=r"imports entry file not found: nowhere.py"):
        Config(imports=["nowhere.py"])


# ------------------------------------------------------------------------------------- callbacks
class Recorder(Callback):
    def __init__(self):
        self.events = []

    def on_step_end(self, trainer, metrics):
        self.events.append(("step", metrics["step"]))

    def on_evaluate(self, trainer, metrics):
        self.events.append(("eval", metrics["step"]))

    def on_save(self, trainer, path):
        self.events.append(("save", Path(path).name))

    def on_train_end(self, trainer, rows):
        self.events.append(("end", len(rows)))


def test_callbacks_see_every_event_in_order(tmp_path, addition_jsonl):
    recorder = Recorder()
    cfg = Config(**sections(f"jsonl:{addition_jsonl}", train={"steps": 2, "checkpoint_every": 1}, eval={"before": True}))
    GRPOTrainer(cfg, tmp_path, callbacks=[recorder]).train()
    assert recorder.events == [
        ("eval", 0), ("step", 1), ("save", "step_000001"), ("step", 2), ("eval", 2), ("save", "step_000002"),
        ("save", "final"), ("end", 4),
    ]


def test_early_stopping_checkpoints_and_the_run_resumes(tmp_path, addition_jsonl):
    cfg = Config(**sections(f"jsonl:{addition_jsonl}", train={"steps": 5}, eval={"every": 1}))
    stopper = EarlyStopping(monitor="eval/accuracy", patience=1, mode="max", min_delta=2.0)  # never improves by 2
    rows = GRPOTrainer(cfg, tmp_path, callbacks=[stopper]).train()
    assert max(r["step"] for r in rows) == 2  # first evaluation sets the best, the second does not improve
    resumed = GRPOTrainer.resume(tmp_path, reward_funcs=None)
    assert resumed.step_count == 2
    assert max(r["step"] for r in resumed.train()) == 5


# ------------------------------------------------------------------------------------- the examples
def test_example_custom_reward_runs(tmp_path, capsys):
    run_example("grpo_custom_reward.py", "--run-dir", str(tmp_path), "--steps", "2")
    out = capsys.readouterr().out
    assert "step 2: reward" in out and "held-out accuracy" in out
    assert (tmp_path / "final").is_dir()


def test_example_custom_task_runs(tmp_path, capsys):
    run_example("custom_task.py", "--run-dir", str(tmp_path), "--steps", "2")
    out = capsys.readouterr().out
    assert "a held-out prompt: 'Convert the " in out and "held-out accuracy" in out
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["data"]["source"] == "task:unit_conversion"


def test_register_task_checks_the_family():
    from dataclasses import dataclass

    from cohortrl import register_task
    from cohortrl.tasks import TaskFamily

    class NoLevels(TaskFamily):
        name = "no_levels"

    with pytest.raises(TypeError, match=r"^task family NoLevels must set the class attributes name and levels$"):
        register_task(NoLevels)

    @dataclass(frozen=True)
    class NoSampler(TaskFamily):
        name, levels = "no_sampler", (1,)

    with pytest.raises(TypeError, match=r"^task family NoSampler must implement make_sample\(seed, level, index\)"):
        register_task(NoSampler)

    @dataclass(frozen=True)
    class Clash(TaskFamily):
        name, levels = "arithmetic", (1,)

        def make_sample(self, seed, level, index):
            raise NotImplementedError

    with pytest.raises(ValueError, match=r"^task family name 'arithmetic' is already registered by Arithmetic; pick another name$"):
        register_task(Clash)
    with pytest.raises(TypeError, match=r"^tasks.register takes a TaskFamily subclass, got 3$"):
        register_task(3)
