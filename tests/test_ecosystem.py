"""The ecosystem's real parts, not stand-ins: a `datasets.Dataset` (built from a list, saved and reloaded), the
TensorBoard writer (its event files read back with TensorBoard's own reader) and W&B in offline mode (its run
file holds the logged metrics). Each test is skipped, saying why, where its package is not installed: they are
in the dev environment (constraints.txt), optional for users."""

import json
import math
from pathlib import Path

import pytest

from cohortrl import Config, GRPOTrainer
from cohortrl.trainers.metrics import read_metrics

ROWS = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1), "level": i % 3} for i in range(8)]


def tiny(**train) -> Config:
    return Config(model={"name": "tiny-llama"}, sampling={"max_new_tokens": 4},
                  algorithm={"group_size": 2, "prompts_per_step": 2}, train={"steps": 2, "progress": False, **train},
                  eval={"before": False})


def step_rows(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(run_dir) if "loss" in r}


def test_a_datasets_dataset_saved_and_reloaded_trains(tmp_path):
    datasets = pytest.importorskip("datasets")
    dataset = datasets.Dataset.from_list(ROWS)
    dataset.save_to_disk(str(tmp_path / "ds"))
    loaded = datasets.load_from_disk(str(tmp_path / "ds"))
    assert loaded.to_list() == ROWS
    seen = []

    def spy(prompts, completions, level, **kwargs):
        seen.extend(level)
        return [0.0] * len(completions)

    trainer = GRPOTrainer(tiny(), tmp_path / "run", train_dataset=loaded, reward_funcs=[spy])
    assert sorted(r["prompt"] for r in trainer.stream.rows) == sorted(r["prompt"] for r in ROWS)  # none held out
    trainer.train()
    assert len(seen) == 2 * 2 * 2 and set(seen) <= {0, 1, 2}  # the Dataset's own column reached the reward

    chats = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]} for r in ROWS])
    trainer = GRPOTrainer(tiny(steps=1), tmp_path / "chat", train_dataset=chats, reward_funcs=["accuracy"])
    assert trainer.stream.rows[0]["prompt"][0]["role"] == "user"
    trainer.train()


def test_tensorboard_event_files_read_back_with_tensorboards_reader(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    GRPOTrainer(tiny(tensorboard=True), tmp_path / "run", train_dataset=ROWS).train()
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    expected = step_rows(tmp_path / "run")
    for key in ("reward_mean", "loss", "kl", "grad_norm"):
        scalars = events.Scalars(key)
        assert [s.step for s in scalars] == [1, 2], key
        assert all(math.isclose(s.value, expected[s.step][key], rel_tol=1e-6, abs_tol=1e-7) for s in scalars), key


def wandb_records(path: Path):
    """The protobuf records of a W&B run file. The file is a LevelDB-style log (7-byte header ':W&B' + version,
    then 32 KiB blocks of records, each with a 7-byte header: crc32c, length, type) and wandb no longer ships a
    Python reader for it, so the log layer is read here and each record parsed with wandb's own protobuf."""
    from wandb.proto import wandb_internal_pb2

    data, block, pos, parts = path.read_bytes(), 32768, 7, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = block - pos % block
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        if left < 7 or (length == 0 and kind == 0):  # the tail of a block is zero padding
            pos += left
            continue
        parts += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, or LAST of FIRST/MIDDLE/LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            parts = b""
            yield record


def test_wandb_offline_run_holds_the_metrics(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    for name, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONFIG_DIR": tmp_path / "wb_config",
                        "WANDB_CACHE_DIR": tmp_path / "wb_cache", "WANDB_DATA_DIR": tmp_path / "wb_data"}.items():
        monkeypatch.setenv(name, str(value))
    GRPOTrainer(tiny(wandb=True), tmp_path / "run", train_dataset=ROWS).train()
    # run.finish() can return before wandb-core's writer has flushed the run file (on a loaded machine the file
    # was read with no history yet; read again later it held both steps); shutting the service down waits for it.
    wandb.teardown()
    (run_file,) = (tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb")
    history = {}
    for record in wandb_records(run_file):
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history[items["_step"]] = items
    expected = step_rows(tmp_path / "run")
    assert sorted(history) == [1, 2]
    for step in (1, 2):
        for key in ("reward_mean", "loss", "kl", "lr"):
            assert math.isclose(history[step][key], expected[step][key], rel_tol=1e-6, abs_tol=1e-7), (step, key)
