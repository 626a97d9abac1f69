"""Model names fail fast: a name that is no alias, path or hub id gets the aliases and a "did you mean"; a hub
id that is not cached fails at once with HF_HUB_OFFLINE set or the hub out of reach (no retries)."""

import logging
import time

import pytest

from cohortrl.models import ModelLoadError, load_model


def test_a_mistyped_alias_fails_at_once_with_did_you_mean():
    started = time.perf_counter()
    with pytest.raises(ModelLoadError) as err:
        load_model("tiny-lama")
    assert time.perf_counter() - started < 5  # no hub lookup for a name without '/'
    assert str(err.value) == (
        "unknown model 'tiny-lama': did you mean 'tiny-llama'? Known aliases: smollm2-135m-instruct, tiny-llama, "
        "tiny-llama-4l. Otherwise give a local directory, a .gguf file, or a hub id owner/name "
        "(e.g. HuggingFaceTB/SmolLM2-135M-Instruct)")
    with pytest.raises(ModelLoadError, match=r"^unknown model 'gpt5': Known aliases: "):
        load_model("gpt5")


def test_hub_offline_fails_fast(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # an empty cache
    started = time.perf_counter()
    with pytest.raises(ModelLoadError) as err:
        load_model("nobody-here/no-such-model")
    assert time.perf_counter() - started < 10
    assert str(err.value) == ("model 'nobody-here/no-such-model' is not in the local Hugging Face cache and HF_HUB_OFFLINE "
                              "is set; unset it to download the model, or give a local directory")


def test_an_unreachable_hub_fails_fast(monkeypatch, tmp_path):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing listens, refused at once
    started = time.perf_counter()
    with pytest.raises(ModelLoadError) as err:
        load_model("nobody-here/no-such-model")
    assert time.perf_counter() - started < 15
    assert str(err.value).startswith("model 'nobody-here/no-such-model' is not in the local Hugging Face cache and "
                                     "127.0.0.1:9 cannot be reached (")


def test_loading_reports_progress(caplog):
    with caplog.at_level(logging.INFO, logger="cohortrl.progress"):
        load_model("tiny-llama")
    assert [r.getMessage() for r in caplog.records if r.name == "cohortrl.progress"] == ["loading model tiny-llama"]
