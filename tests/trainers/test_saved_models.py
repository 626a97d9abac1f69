"""A saved model is checked against its manifest whenever it is loaded: a run's final/ given as model.init or as
model.name, to ``cohortrl eval`` or as its --adapter, stops with one line naming the damaged file instead of
training from (or evaluating) corrupt weights; ``cohortrl verify PATH`` checks a run, one checkpoint or a final/."""

import shutil
from contextlib import closing
from pathlib import Path

import pytest

from cohortrl import cli
from cohortrl.trainers import checkpoint
from cohortrl.trainers.grpo import GRPOTrainer
from tests.trainers.test_grpo import tiny_config

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny_grpo.yaml")
QUICK = ["train.progress=false", "eval.n_prompts=2", "eval.batch_size=2", "sampling.max_new_tokens=4", "eval.before=false"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, addition_jsonl) -> dict[str, Path]:
    """Two finished one-step runs of the tiny Llama: all weights in final/, and a LoRA adapter in final/."""
    out = {}
    for name, lora in (("full", {}), ("lora", {"lora": {"enabled": True, "r": 4}})):
        run = tmp_path_factory.mktemp(name) / "run"
        cfg = tiny_config(addition_jsonl, train={"steps": 1}, eval={"n_prompts": 0},
                          model={"name": "tiny-llama", "system_prompt": None, **lora})
        with closing(GRPOTrainer(cfg, run)) as trainer:
            trainer.train()
        out[name] = run
    return out


def damaged_copy(final: Path, tmp_path: Path, file: str, how: str) -> Path:
    """A copy of ``final`` with ``file`` damaged: two bytes of its weights flipped, or its header's length field
    overwritten (safetensors then fails to parse it)."""
    copy = tmp_path / "final"
    shutil.copytree(final, copy)
    data = bytearray((copy / file).read_bytes())
    where = [len(data) - 10, len(data) - 9] if how == "weights" else range(8)
    for i in where:
        data[i] ^= 0xFF
    (copy / file).write_bytes(bytes(data))
    return copy


def last_error(capsys) -> str:
    return capsys.readouterr().err.strip().splitlines()[-1]


def sha_line(copy: Path, file: str) -> str:
    return f"{copy / file}: SHA-256 differs from the manifest (changed after it was written: bit rot, a bad copy or an edit)"


@pytest.mark.parametrize("how", ["weights", "header"])
def test_a_damaged_final_as_model_init_stops_before_training_naming_the_file(runs, tmp_path, capsys, how):
    copy = damaged_copy(runs["full"] / "final", tmp_path, "model.safetensors", how)
    run = tmp_path / "new"
    rc = cli.main(["train", TINY, "--run-dir", str(run), "--steps", "1", f"model.init={copy}", *QUICK])
    assert rc == 2
    assert last_error(capsys) == f"error: model.init {copy} is damaged, not loaded: {sha_line(copy, 'model.safetensors')}"
    assert not run.exists()  # the failed start left nothing behind


def test_an_intact_final_as_model_init_trains(runs, tmp_path, capsys):
    rc = cli.main(["train", TINY, "--run-dir", str(tmp_path / "new"), "--steps", "1",
                   f"model.init={runs['full'] / 'final'}", *QUICK])
    assert rc == 0, capsys.readouterr().err


def test_eval_of_a_damaged_final_as_model_name_stops_naming_the_file(runs, tmp_path, capsys):
    copy = damaged_copy(runs["full"] / "final", tmp_path, "model.safetensors", "weights")
    assert cli.main(["eval", TINY, f"model.name={copy}", *QUICK]) == 2
    assert last_error(capsys) == f"error: model.name {copy} is damaged, not loaded: {sha_line(copy, 'model.safetensors')}"


def test_eval_of_a_damaged_adapter_stops_naming_the_file(runs, tmp_path, capsys):
    copy = damaged_copy(runs["lora"] / "final", tmp_path, "adapter_model.safetensors", "weights")
    lora = ["model.lora.enabled=true", "model.lora.r=4"]
    assert cli.main(["eval", TINY, "--adapter", str(copy), *lora, *QUICK]) == 2
    assert last_error(capsys) == f"error: --adapter {copy} is damaged, not loaded: {sha_line(copy, 'adapter_model.safetensors')}"
    assert cli.main(["eval", TINY, "--adapter", str(runs["lora"] / "final"), *lora, *QUICK, "--json"]) == 0


def test_verify_accepts_a_run_a_checkpoint_or_a_final(runs, tmp_path, capsys):
    run = runs["full"]
    step = run / "checkpoints" / "step_000001"
    assert cli.main(["verify", str(run)]) == 0
    assert capsys.readouterr().out.splitlines() == [f"ok   {step}", f"ok   {run / 'final'}"]
    assert cli.main(["verify", str(run / "final")]) == 0
    assert capsys.readouterr().out.splitlines() == [f"ok   {run / 'final'}"]
    assert cli.main(["verify", str(step)]) == 0
    assert capsys.readouterr().out.splitlines() == [f"ok   {step}"]
    copy = damaged_copy(run / "final", tmp_path, "model.safetensors", "weights")  # a final/ moved out of its run
    assert cli.main(["verify", str(copy)]) == 1
    assert capsys.readouterr().out.splitlines() == [f"BAD  {sha_line(copy, 'model.safetensors')}"]
    assert cli.main(["verify", str(tmp_path / "new")]) == 1
    assert "nothing to verify" in last_error(capsys)


def test_check_saved_leaves_paths_cohortrl_did_not_write_alone(tmp_path):
    (tmp_path / "config.json").write_text("{}")  # a model saved by another library: no manifest to check against
    assert checkpoint.check_saved(tmp_path, "model.name") is None
    assert checkpoint.check_saved("tiny-llama", "model.name") is None
    (tmp_path / checkpoint.FINAL_MARKER).write_text("{}")  # cohortrl's final/ whose manifest is gone
    with pytest.raises(checkpoint.CheckpointError, match=f"model.name {tmp_path} is damaged, not loaded: {tmp_path}: no "):
        checkpoint.check_saved(tmp_path, "model.name")


def test_an_adapter_trained_on_a_model_init_is_loaded_on_top_of_it(tmp_path, monkeypatch, capsys):
    """A LoRA run that starts from ``model.init`` A trains an adapter for A's weights. Its final/ records A
    (path and manifest hash); a run or an evaluation starting from it merges A first, then the adapter, as
    PEFT does by hand. Before, the adapter went onto the base model's weights with no warning. A moved away
    or trained again, or an ``eval --adapter`` under another model.init, stops with one line."""
    import json

    import torch
    from peft import PeftModel

    from cohortrl.models import ModelLoadError, load_model
    from cohortrl.trainers.setup import load_configured_model
    from cohortrl.trainers.sft import SFTTrainer
    from tests.trainers.test_sft import sft_config

    monkeypatch.chdir(tmp_path)  # the recorded path is the config's, relative to where the run ran
    lora = {"name": "tiny-llama", "system_prompt": None, "lora": {"enabled": True, "r": 4}}
    with closing(SFTTrainer(sft_config(model=lora), "a")) as trainer:
        trainer.train()
    with closing(SFTTrainer(sft_config(model={**lora, "init": "a/final"}), "b")) as trainer:
        trainer.train()
    a, b = Path("a/final"), Path("b/final")
    assert json.loads((a / checkpoint.FINAL_MARKER).read_text())["init"] is None  # trained on the base model
    record = json.loads((b / checkpoint.FINAL_MARKER).read_text())["init"]
    assert record["path"] == "a/final" and len(record["manifest_sha256"]) == 64
    assert checkpoint.init_chain(b) == ["a/final"]

    loaded, _ = load_configured_model(sft_config(model={**lora, "init": "b/final"}).model, 0)
    by_hand, _ = load_model("tiny-llama")
    by_hand = PeftModel.from_pretrained(by_hand, "a/final").merge_and_unload()
    by_hand = PeftModel.from_pretrained(by_hand, "b/final").merge_and_unload()
    b_alone, _ = load_model("tiny-llama")  # what model.init=b/final loaded before: b merged into the base
    b_alone = PeftModel.from_pretrained(b_alone, "b/final").merge_and_unload()
    expected, wrong = by_hand.state_dict(), b_alone.state_dict()
    assert all(torch.equal(t, expected[k]) for k, t in loaded.state_dict().items())
    assert any(not torch.equal(t, wrong[k]) for k, t in loaded.state_dict().items())
    with pytest.raises(ModelLoadError, match="trained on top of a/final, which must be merged first"):
        load_model("tiny-llama", init="b/final")  # the library's loader refuses the adapter alone
    other = tmp_path / "elsewhere"
    other.mkdir()
    monkeypatch.chdir(other)  # a/final is not there relative to here: found at the absolute path recorded
    assert checkpoint.init_chain(tmp_path / "b" / "final") == [str(tmp_path / "a" / "final")]
    monkeypatch.chdir(tmp_path)

    config = tmp_path / "c.yaml"
    config.write_text((Path("b") / "config.yaml").read_text())
    rc = cli.main(["eval", str(config), "--adapter", "b/final", "model.init=null", "eval.n_prompts=1"])
    error = last_error(capsys)
    assert rc != 0 and "trained on top of a/final" in error and "set model.init=a/final" in error

    assert record["absolute"] == str(tmp_path / "a" / "final")
    shutil.move("a", "a_moved")
    with pytest.raises(checkpoint.CheckpointError, match="trained on top of a/final .* which is not there"):
        checkpoint.init_chain(b)
    shutil.move("a_moved", "a")
    with closing(SFTTrainer(sft_config(model=lora, train={"steps": 3}), "a", overwrite=True)) as trainer:
        trainer.train()  # A trained again in place
    with pytest.raises(checkpoint.CheckpointError, match="has changed since"):
        checkpoint.init_chain(b)


def test_a_resume_refuses_a_model_init_trained_again_since_the_run_started(tmp_path, monkeypatch):
    """A checkpoint records the weights its run started from (the init's manifest hash, as loaded): a resume
    whose model.init holds other weights under the same path (a warm start trained again in place) stops with
    one line instead of going on from an adapter trained on the earlier ones. The same weights resume."""
    from cohortrl.config import ConfigError
    from cohortrl.trainers.sft import SFTTrainer
    from tests.trainers.test_sft import sft_config

    monkeypatch.chdir(tmp_path)
    lora = {"name": "tiny-llama", "system_prompt": None, "lora": {"enabled": True, "r": 4}}
    with closing(SFTTrainer(sft_config(model=lora), "a")) as trainer:
        trainer.train()
    on_a = sft_config(model={**lora, "init": "a/final"}, train={"steps": 3, "checkpoint_every": 1})
    with closing(SFTTrainer(on_a, "b")) as trainer:
        trainer.train(steps=1)
    with closing(SFTTrainer.resume("b")) as trainer:  # model.init unchanged: the resume goes on
        assert trainer.step_count == 1
        trainer.train(steps=2)
    saved = checkpoint.load(Path("b/checkpoints/step_000002"))["trained_on"]
    assert saved["path"] == "a/final" and saved["manifest_sha256"] == checkpoint.manifest_sha256("a/final")

    with closing(SFTTrainer(sft_config(model=lora, train={"steps": 3}), "a", overwrite=True)) as trainer:
        trainer.train()  # A trained again in place: same path, other weights
    with pytest.raises(ConfigError, match="model.init a/final has changed since the run started"):
        SFTTrainer.resume("b")
