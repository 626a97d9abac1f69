"""The cached supervised warm start (``trainers/warm_start.py``, what ``cohortrl demo`` starts GRPO from), on the
tiny model: trained once and reused; a damaged, partial or foreign entry is trained again, never used."""

import json
import os
import shutil

import pytest

from cohortrl.config import Config
from cohortrl.trainers.sft import SFTTrainer
from cohortrl.trainers.warm_start import cache_key, cached_sft, lookup, problem


def sft_config(**train) -> Config:
    return Config.from_dict({
        "model": {"name": "tiny-llama", "system_prompt": None, "lora": {"enabled": True, "r": 4}},
        "data": {"source": "task:arithmetic", "seed": 0, "train_size": 24, "eval_size": 4},
        "reward": {"functions": [{"name": "task", "kwargs": {"field": "outcome"}}], "correctness": "task"},
        "sampling": {"max_new_tokens": 4},
        "optim": {"lr": 1e-2},
        "train": {"steps": 2, "progress": False, **train},
        "eval": {"before": True, "n_prompts": 4, "batch_size": 4},
        "sft": {"batch_size": 4},
    })


@pytest.fixture
def no_training(monkeypatch):
    """Any SFT training from here on fails the test: a reuse must not train."""
    def refuse(self, steps=None):
        raise AssertionError("the warm start was trained again")
    monkeypatch.setattr(SFTTrainer, "train", refuse)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One entry, trained once for the tests that only read it."""
    root = tmp_path_factory.mktemp("cache")
    return root, cached_sft(sft_config(), root)


def test_the_first_call_trains_and_caches_a_whole_run(built):
    root, warm = built
    assert not warm.reused and warm.rejected is None
    assert warm.path == root / cache_key(sft_config().to_dict())
    assert (warm.final / "adapter_config.json").is_file() and (warm.path / "curves.png").is_file()
    assert [r["step"] for r in warm.evaluations()] == [0, 2]  # the base model, then the warm start
    assert problem(warm.path, sft_config()) is None
    assert [p.name for p in root.iterdir()] == [warm.path.name]  # the build directory was renamed into place


def test_a_second_call_reuses_it_without_training(built, no_training):
    root, warm = built
    again = cached_sft(sft_config(), root)
    assert again.reused and again.path == warm.path and again.evaluations() == warm.evaluations()


def test_the_key_follows_what_is_computed_and_the_version():
    base = cache_key(sft_config().to_dict())
    assert cache_key(sft_config(progress=True).to_dict()) == base  # display only
    assert cache_key(sft_config(steps=3).to_dict()) != base  # unlike a resume's config hash, the steps count
    assert cache_key(sft_config(seed=1).to_dict()) != base


def test_a_damaged_entry_is_trained_again(tmp_path):
    cfg = sft_config()
    warm = cached_sft(cfg, tmp_path)
    weights = warm.final / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    path, why = lookup(cfg, tmp_path)
    assert path == warm.path and "adapter_model.safetensors" in why
    rebuilt = cached_sft(cfg, tmp_path)
    assert not rebuilt.reused and "adapter_model.safetensors" in rebuilt.rejected
    assert problem(rebuilt.path, cfg) is None and sorted(p.name for p in tmp_path.iterdir()) == [warm.path.name]


class Trained(Exception):
    """Raised in place of training: the cache decided to train."""


@pytest.mark.parametrize("damage, reason", [
    (lambda p: (p / "final" / "cohortrl_manifest.json").unlink(), "cohortrl_manifest.json, which is written last"),
    (lambda p: (p / "config.yaml").write_text((p / "config.yaml").read_text().replace("steps: 2", "steps: 3")), "not this config"),
    (lambda p: (p / "metrics.jsonl").write_text(""), "no held-out evaluation at step 2"),
    (lambda p: (p / "final" / "extra.txt").write_text("x"), "not in the manifest"),
], ids=["no manifest", "another config", "no final evaluation", "a file added"])
def test_a_partial_or_foreign_entry_is_not_used(built, tmp_path, damage, reason, monkeypatch):
    cfg = sft_config()
    copy = tmp_path / built[1].path.name
    shutil.copytree(built[1].path, copy)
    damage(copy)
    assert reason in lookup(cfg, tmp_path)[1]

    def train(self, steps=None):
        raise Trained
    monkeypatch.setattr(SFTTrainer, "train", train)
    with pytest.raises(Trained):
        cached_sft(cfg, tmp_path)


def test_a_build_killed_half_way_is_started_over_and_fresh_trains_again(tmp_path):
    cfg = sft_config()
    key = cache_key(cfg.to_dict())
    stale = tmp_path / f".building-{key}"  # what a demo killed mid-training leaves: a run with no final/
    stale.mkdir()
    (stale / "config.yaml").write_text(cfg.to_yaml())
    (stale / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 9.0}) + "\n")
    warm = cached_sft(cfg, tmp_path)
    assert not warm.reused and not stale.exists() and problem(warm.path, cfg) is None
    assert all("loss" not in r or r["loss"] != 9.0 for r in map(json.loads, (warm.path / "metrics.jsonl").read_text().splitlines()))
    before = os.stat(warm.final / "cohortrl_manifest.json").st_mtime_ns
    fresh = cached_sft(cfg, tmp_path, fresh=True)
    assert not fresh.reused and fresh.rejected == "a new one was asked for (fresh)"
    assert os.stat(fresh.final / "cohortrl_manifest.json").st_mtime_ns != before


def test_an_entry_trained_on_a_model_init_that_changed_since_is_trained_again(tmp_path):
    """An adapter's final/ records the manifest of the model.init it was trained on; the cache does not hand it
    out once that directory holds other weights (the config, and so the key, name only its path)."""
    first = cached_sft(sft_config(), tmp_path / "inits")
    init = tmp_path / "init"
    shutil.copytree(first.final, init)
    on_init = Config.from_dict({**sft_config().to_dict(), "model": {**sft_config().to_dict()["model"], "init": str(init)}})
    warm = cached_sft(on_init, tmp_path / "cache")
    assert problem(warm.path, on_init) is None
    other = cached_sft(sft_config(steps=3), tmp_path / "inits")
    shutil.rmtree(init)
    shutil.copytree(other.final, init)  # other weights under the same path
    assert "as it was before (its manifest has changed since)" in lookup(on_init, tmp_path / "cache")[1]
