"""Where models run: ``distributed.process_device``, the trainer's choice of ``train.device`` for code without a
``Dist`` (``cohortrl eval``, the ``reward_model`` reward), checked on a CPU by faking what PyTorch reports."""

from pathlib import Path

import pytest
import torch

from cohortrl import distributed
from cohortrl.config import ConfigError

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def one_process(monkeypatch):
    for name in ("WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


def test_auto_is_the_cpu_without_a_gpu_and_the_gpu_with_one(one_process, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert distributed.process_device("auto") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert distributed.process_device("auto") == torch.device("cuda")
    assert distributed.process_device("cpu") == torch.device("cpu")


def test_under_torchrun_each_process_takes_its_local_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert distributed.process_device("auto") == torch.device("cuda:1")
    assert distributed.process_device("auto") == distributed.resolve_device("auto", distributed.Dist(rank=1, world=2, launched=True))


def test_a_gpu_asked_for_where_there_is_none_names_the_setting(one_process, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"^config key 'a.b' = 'cuda': PyTorch sees no CUDA GPU here; use auto or cpu$"):
        distributed.process_device("cuda", key="a.b")


def test_eval_puts_the_model_where_train_device_says(one_process, monkeypatch, capsys):
    """``cohortrl eval`` asks ``process_device`` for ``train.device`` and moves the model there."""
    from cohortrl.cli import main

    asked, moved = [], []
    monkeypatch.setattr(distributed, "process_device", lambda setting: asked.append(setting) or torch.device("cpu"))
    to = torch.nn.Module.to
    monkeypatch.setattr(torch.nn.Module, "to", lambda self, *a, **k: moved.append((type(self).__name__, a)) or to(self, *a, **k))
    assert main(["eval", str(REPO / "configs" / "tiny_grpo.yaml"), "eval.n_prompts=2", "train.device=auto", "--json"]) == 0
    assert asked == ["auto"]
    assert ("LlamaForCausalLM", (torch.device("cpu"),)) in moved


def test_the_reward_model_reward_runs_where_its_device_says(one_process, monkeypatch, tmp_path):
    from cohortrl.reward_models.train import build_reward_model
    from cohortrl.rewards.scoring import resolve

    model, tok = build_reward_model("tiny-llama", "orm", seed=0)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"'reward.functions\[reward_model\].kwargs.device' = 'cuda'"):
        resolve("reward_model", {"model": str(tmp_path), "device": "cuda"})
    score = resolve("reward_model", {"model": str(tmp_path)})  # auto: the CPU here
    assert len(score(["is it yes?", "is it yes?"], ["yes", "no"])) == 2
