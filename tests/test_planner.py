"""The planner against numbers worked out by hand, and ``cohortrl plan`` in a subprocess."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cohortrl.planner import (
    GIB,
    PRESETS,
    ModelShape,
    PlanError,
    RunSpec,
    activation_elements_per_token,
    forward_flops,
    kv_cache_bytes,
    model_states,
    plan,
    resolve_shape,
)

REPO = Path(__file__).resolve().parent.parent
LLAMA2_7B = PRESETS["7b"]


def test_llama2_7b_parameter_count():
    # embeddings 32000·4096 = 131,072,000; per layer 4·4096² (q, k, v, o) = 67,108,864 + 3·4096·11008 (SwiGLU)
    # = 135,266,304 + 2·4096 (norms) = 202,383,360; 32 layers = 6,476,267,520; + final norm 4096 + untied
    # LM head 131,072,000 = 6,738,415,616 (Llama-2-7B's published count).
    assert LLAMA2_7B.params == 131_072_000 + 32 * (4 * 4096**2 + 3 * 4096 * 11008 + 2 * 4096) + 4096 + 131_072_000
    assert LLAMA2_7B.params == 6_738_415_616


def test_qwen_preset_matches_the_published_count():
    assert PRESETS["0.5b"].params == 494_032_768  # Qwen2.5-0.5B (tied embeddings, q/k/v biases)


def test_lora_parameter_count_llama2_7b_rank_8():
    # r·(in + out) per matrix: q, k, v, o 4096→4096: 4 · 8 · 8192 = 262,144; gate, up 4096→11008 and down
    # 11008→4096: 3 · 8 · 15,104 = 362,496; per layer 624,640; 32 layers = 19,988,480 (what PEFT reports).
    assert LLAMA2_7B.lora_params(8) == 32 * (4 * 8 * 8192 + 3 * 8 * 15104) == 19_988_480


@pytest.mark.parametrize("stage, expected_gb", [("none", 120.0), ("zero1", 31.4), ("zero2", 16.6), ("zero3", 1.9)])
def test_zero_stages_reproduce_figure_1_of_the_zero_paper(stage, expected_gb):
    # arXiv 1910.02054, Fig. 1: Ψ = 7.5B, N = 64, K = 12. Baseline (2 + 2 + 12)·7.5e9 = 120 GB;
    # stage 1: 4·7.5e9 + 12·7.5e9/64 = 31.4 GB; stage 2: 2·7.5e9 + 14·7.5e9/64 = 16.6 GB; stage 3: 16·7.5e9/64 = 1.9 GB.
    states = model_states(7_500_000_000, 7_500_000_000, "bf16", stage, 64)
    assert states.total / 1e9 == pytest.approx(expected_gb, abs=0.05)


def test_fp32_states_are_16_bytes_per_parameter_without_a_master_copy():
    s = model_states(1000, 1000, "fp32", "none", 1)
    assert (s.weights, s.gradients, s.optimizer) == (4000, 4000, 8000)


def test_kv_cache_llama2_7b_is_half_a_mib_per_token():
    # 2 (K, V) · 32 layers · 32 kv heads · 128 head dim · 2 bytes = 524,288 bytes per token.
    assert kv_cache_bytes(LLAMA2_7B, 1, "bf16") == 2 * 32 * 32 * 128 * 2 == 512 * 1024


def test_activation_elements_smollm2_shape():
    smol = ModelShape("smol", 576, 30, 9, 3, 1536, 49152, True)
    # 11h + 4f per layer = 11·576 + 4·1536 = 12,480; 30 layers = 374,400 elements per token.
    assert activation_elements_per_token(smol, checkpointing=False) == 30 * (11 * 576 + 4 * 1536) == 374_400
    # Checkpointing: each layer's input (30·576 = 17,280) + one layer recomputed (12,480) = 29,760.
    assert activation_elements_per_token(smol, checkpointing=True) == 30 * 576 + 12_480


def test_forward_flops_by_hand():
    m = ModelShape("toy", hidden_size=8, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=16,
                   vocab_size=10, tie_embeddings=True)
    # d = 4. Per layer: q 8·8 + k, v 2·8·4 + o 8·8 = 192; MLP 3·8·16 = 384; norms 16: 592.
    assert m.layer_params == 592
    # S = 3 tokens, logits on 2 positions: layers 2·2·592·3 = 7104; LM head 2·8·10·2 = 320;
    # attention 4·L·a·d·S·(S+1)/2 = 4·2·2·4·3·2 = 384.
    assert forward_flops(m, 3, 2) == 7104 + 320 + 384


def test_ppo_adds_exactly_the_critic_and_its_activations():
    run = RunSpec(algorithm="grpo", gpus=8, sharding="zero3", dtype="bf16")
    grpo = plan("7b", run).memory
    ppo = plan("7b", RunSpec(algorithm="ppo", gpus=8, sharding="zero3", dtype="bf16")).memory
    # The critic: Ψ − LM head + Linear(4096, 1) = 6,738,415,616 − 131,072,000 + 4097 = 6,607,347,713 parameters,
    # 16 bytes each (bf16 weights and gradients, fp32 master + two moments), over 8 GPUs: 12.31 GiB.
    critic_params = 6_738_415_616 - 131_072_000 + 4097
    assert ppo.critic.total == pytest.approx(16 * critic_params / 8)
    assert ppo.critic.total / GIB == pytest.approx(12.31, abs=0.01)
    assert ppo.activations == 2 * grpo.activations  # cohortrl backpropagates policy and critic together
    # its weights and optimiser states persist; its gradients, like the policy's, live in the update phase only
    assert ppo.persistent - grpo.persistent == pytest.approx(ppo.critic.weights + ppo.critic.optimizer)
    assert ppo.gradients - grpo.gradients == pytest.approx(ppo.critic.gradients)


def test_gradients_count_in_the_update_phase_not_in_generation():
    """The trainer frees the gradients after each optimiser step, so generation runs without them."""
    m = plan("7b", RunSpec(dtype="bf16")).memory
    assert m.gradients == m.policy.gradients == LLAMA2_7B.params * 2  # bf16, full fine-tuning
    assert m.update_phase == m.activations + m.logits + m.gradients
    assert m.persistent == m.baseline + m.policy.weights + m.policy.optimizer + m.reference + m.reward_model
    assert m.peak == m.persistent + max(m.update_phase, m.generation_phase)


def test_lora_has_no_reference_copy():
    m = plan("7b", RunSpec(lora_rank=16)).memory
    assert m.reference == 0.0
    assert m.policy.gradients == LLAMA2_7B.lora_params(16) * 2


def test_logits_are_chunk_bounded_on_one_process_and_four_full_copies_under_ddp():
    from cohortrl import planner
    from cohortrl.rollout import hf

    assert planner.LOGPROB_CHUNK_BYTES == hf.LOGPROB_CHUNK_BYTES == 32 * 2**20
    assert planner.LOGPROB_KEEP_BYTES == hf.LOGPROB_KEEP_BYTES == 128 * 2**20
    # Llama-2-7B, b = 4, T = 1024: one (b, T+1, V) fp32 tensor is 4·1025·32000·4 = 524,800,000 bytes.
    one = plan("7b", RunSpec(micro_batch_size=4, response_len=1024)).memory
    assert one.logits == 2 * 32 * 2**20  # two 32 MiB chunks: the full tensor never exists
    ddp = plan("7b", RunSpec(gpus=8, micro_batch_size=4, response_len=1024)).memory
    assert ddp.logits == 4 * 524_800_000  # the model's own head: output, scaled copy, entropy's two temporaries
    # within the keep budget, the probabilities are kept for backward, plus one chunk of logits:
    # 1·3·32000·4 = 384,000 bytes (less than a chunk) kept, and the chunk that made them
    assert plan("7b", RunSpec(micro_batch_size=1, response_len=2)).memory.logits == 2 * 384_000
    # 1·1000·32000·4 = 128,000,000 bytes ≤ 128 MiB = 134,217,728: kept, plus a 32 MiB chunk
    assert plan("7b", RunSpec(micro_batch_size=1, response_len=999)).memory.logits == 128_000_000 + 32 * 2**20


def test_cpu_plan_adds_the_baseline():
    spec = dict(device="cpu", dtype="fp32", prompt_len=52, response_len=16, group_size=4, prompts_per_step=2,
                micro_batch_size=8)
    with_base = plan("7b", RunSpec(**spec, cpu_baseline_bytes=350 * 2**20)).memory
    without = plan("7b", RunSpec(**spec)).memory
    assert with_base.peak - without.peak == 350 * 2**20


def test_step_time_follows_flops_peak_and_mfu():
    p = plan("7b", RunSpec(gpus=8, peak_flops=1e15, mfu=0.5, generation_mfu=0.1))
    assert p.step_seconds["policy"] == pytest.approx(p.flops.policy / 8 / (1e15 * 0.5))
    assert p.step_seconds["generation"] == pytest.approx(p.flops.generation / 8 / (1e15 * 0.1))


def test_config_json_directory(tmp_path):
    config = {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
              "intermediate_size": 1536, "vocab_size": 49152, "tie_word_embeddings": True, "model_type": "llama"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert resolve_shape(str(tmp_path)).params == 134_515_008  # SmolLM2-135M's published count


@pytest.mark.parametrize(
    "model, run, message",
    [
        ("9b", RunSpec(), "unknown model '9b': give a size preset (0.5b, 1.5b, 7b, 8b, 70b)"),
        ("7b", RunSpec(algorithm="grpo", group_size=1), "grpo needs a group of at least 2 responses per prompt (G=1)"),
        ("7b", RunSpec(sharding="zero4"), "unknown sharding 'zero4': use one of none, zero1, zero2, zero3 (fsdp = zero3)"),
        ("7b", RunSpec(gpus=3), "P·G = 512 sequences do not split evenly over 3 devices"),
    ],
)
def test_bad_input_is_named_with_its_fix(model, run, message):
    with pytest.raises(PlanError) as e:
        plan(model, run)
    assert message in str(e.value)


def test_fsdp_is_zero3():
    assert plan("7b", RunSpec(sharding="fsdp", gpus=8)).run.sharding == "zero3"


# ---------------------------------------------------------------------------------------------- the CLI
def cli(*args):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "cohortrl", "plan", *args], capture_output=True, text=True, cwd=REPO,
                          env=env, timeout=300)


def test_cli_prints_the_tables():
    out = cli("7b", "--algorithm", "ppo", "--gpus", "8", "--sharding", "zero3", "--dtype", "bf16")
    assert out.returncode == 0, out.stderr
    assert "Llama-2-7B shape: 6.738B parameters" in out.stdout
    assert "| critic optimizer states | 9.230 |" in out.stdout  # 12 · 6,607,347,713 / 8 bytes = 9.230 GiB
    for row in ("| policy weights |", "| KV cache (generation) |", "| reference forward |", "| **total** |"):
        assert row in out.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["9b"], "error: unknown model '9b'"),
        (["7b", "-G", "1"], "error: grpo needs a group of at least 2 responses per prompt (G=1)"),
        (["7b", "--sharding", "zero4"], "error: unknown sharding 'zero4'"),
    ],
)
def test_cli_bad_input_exits_1_with_a_message(args, message):
    out = cli(*args)
    assert out.returncode == 1
    assert message in out.stderr
    assert "Traceback" not in out.stderr


def test_cpu_fp32_generation_holds_the_linear_weights_in_onednns_layout():
    # SmolLM2's shape: per layer q, o 576·576 + k, v 576·192 (3 kv heads of 64) + gate, up, down 3·576·1536
    # = 3,538,944 linear weights; 30 layers = 106,168,320, + the tied head 49,152·576 = 28,311,552 → 134,479,872
    # fp32 values = 537,919,488 bytes, held while decoding (kernels.decoding_weights).
    smol = ModelShape("smol", 576, 30, 9, 3, 1536, 49152, True)
    cpu = plan(smol, RunSpec(device="cpu", dtype="fp32", peak_flops=1e11)).memory
    assert cpu.decode_layout == 4 * (30 * (2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536) + 49152 * 576) == 537_919_488
    assert cpu.generation_phase == cpu.kv_cache + cpu.decode_layout
    assert cpu.peak == cpu.persistent + max(cpu.update_phase, cpu.generation_phase)
    assert plan(smol, RunSpec(device="gpu", dtype="fp32")).memory.decode_layout == 0  # GPUs keep PyTorch's kernels
    assert plan(smol, RunSpec(device="cpu", dtype="bf16", peak_flops=1e11)).memory.decode_layout == 0
