"""The planner against numbers worked out by hand, and ``cohortrl plan`` in a subprocess."""

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

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
    recording_bytes,
    resolve_shape,
    run_spec_from_config,
)

REPO = Path(__file__).resolve().parent.parent
LLAMA2_7B = PRESETS["7b"]
SMOL = ModelShape("SmolLM2-135M shape", 576, 30, 9, 3, 1536, 49152, True)  # h, L, a, k, f, V; d = 64


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


def test_rft_plans_grpos_update_on_the_recording_plus_the_head_at_temperature_1_and_no_reference():
    """RFT (``trainers/rft.py``): no reference ever; on a CPU in fp32 its update differentiates decoding's recording
    as GRPO's does, and its log-probs at temperature 1 (not decoding's) run the head again over every position.
    Without the recording (or with micro-batches) its update runs its own forward over every row."""
    rft = RunSpec(algorithm="rft", device="cpu", dtype="fp32", lora_rank=16, group_size=16, prompts_per_step=4,
                  prompt_len=200, response_len=256)
    grpo = replace(rft, algorithm="grpo", reference=False)
    on, on_grpo = plan(SMOL, rft), plan(SMOL, grpo)
    assert on.run.reuse_rollout_forward and not on.run.reference and on.memory.critic is None
    assert on.memory.peak == on_grpo.memory.peak and on.memory.recording > 0 and on.memory.activations == 0
    assert on.flops.policy == on_grpo.flops.policy + SMOL.vocab_size * SMOL.hidden_size * 2 * 64 * 256  # the head
    own = plan(SMOL, replace(rft, reuse_rollout_forward=False)).memory
    # 4 distinct prompts once each plus 64 responses of 256 tokens: 17,184 tokens × (11h + 4f)·L fp32 values
    assert own.recording == 0 and own.activations == 17_184 * 30 * (11 * 576 + 4 * 1536) * 4
    assert own.peak == plan(SMOL, replace(grpo, reuse_rollout_forward=False)).memory.peak
    quarter = plan(SMOL, replace(rft, micro_batch_size=16)).memory  # one prompt's group per micro-batch
    assert quarter.activations == (200 + 16 * 256) * 30 * (11 * 576 + 4 * 1536) * 4


def test_gradients_count_in_the_update_phase_not_in_generation():
    """The trainer frees the gradients after each optimiser step, so generation runs without them."""
    m = plan("7b", RunSpec(dtype="bf16")).memory
    assert m.gradients == m.policy.gradients == LLAMA2_7B.params * 2  # bf16, full fine-tuning
    assert m.update_phase == m.activations + m.logits + m.gradients
    assert m.persistent == m.baseline + m.policy.weights + m.policy.optimizer + m.reference + m.reward_model
    assert m.peak == m.persistent + max(m.update_phase, m.generation_phase)


def test_fsdp2_over_several_gpus_holds_the_whole_policy_in_bf16_while_generating():
    """Generation under FSDP2 gathers every layer at once (``Dist.gathered``): 2 bytes per parameter in bf16,
    the LoRA adapter's too, beside the shards; nothing of the kind on one GPU or under DDP."""
    fsdp = plan("7b", RunSpec(gpus=8, sharding="zero3", dtype="bf16")).memory
    assert fsdp.gathered_weights == 2 * 6_738_415_616  # 12.55 GiB
    assert fsdp.generation_phase == fsdp.kv_cache + fsdp.gathered_weights
    lora = plan("7b", RunSpec(gpus=8, sharding="zero3", dtype="bf16", lora_rank=16)).memory
    assert lora.gathered_weights == 2 * (6_738_415_616 + LLAMA2_7B.lora_params(16))
    for run in (RunSpec(gpus=8, sharding="none", dtype="bf16"), RunSpec(gpus=1, sharding="zero3", dtype="bf16")):
        assert plan("7b", run).memory.gathered_weights == 0


def test_lora_has_no_reference_copy():
    m = plan("7b", RunSpec(lora_rank=16)).memory
    assert m.reference == 0.0
    assert m.policy.gradients == LLAMA2_7B.lora_params(16) * 2


def test_logits_are_chunk_bounded_on_one_process_and_under_ddp_and_fsdp2():
    from cohortrl import planner
    from cohortrl.rollout import hf

    assert planner.LOGPROB_CHUNK_BYTES == hf.LOGPROB_CHUNK_BYTES == 32 * 2**20
    assert planner.LOGPROB_KEEP_BYTES == hf.LOGPROB_KEEP_BYTES == 128 * 2**20
    # Llama-2-7B, b = 4, T = 1024: one (b, T+1, V) fp32 tensor is 4·1025·32000·4 = 524,800,000 bytes.
    one = plan("7b", RunSpec(micro_batch_size=4, response_len=1024)).memory
    assert one.logits == 2 * 32 * 2**20  # two 32 MiB chunks: the full tensor never exists
    for sharding in ("none", "zero3"):  # DDP and FSDP2 run the chunked head inside their forward
        assert plan("7b", RunSpec(gpus=8, sharding=sharding, micro_batch_size=4, response_len=1024)).memory.logits == 2 * 32 * 2**20
    # within the keep budget, the probabilities of the scored tokens (the T response tokens, not T + 1: the
    # chunked head runs on real response positions only) are kept for backward, plus one chunk of logits:
    # 1·2·32000·4 = 256,000 bytes (less than a chunk) kept, and the chunk that made them
    assert plan("7b", RunSpec(micro_batch_size=1, response_len=2)).memory.logits == 2 * 256_000
    # 1·999·32000·4 = 127,872,000 bytes ≤ 128 MiB = 134,217,728: kept, plus a 32 MiB chunk
    assert plan("7b", RunSpec(micro_batch_size=1, response_len=999)).memory.logits == 127_872_000 + 32 * 2**20


def test_cpu_plan_adds_the_baseline():
    spec = dict(device="cpu", dtype="fp32", prompt_len=52, response_len=16, group_size=4, prompts_per_step=2,
                micro_batch_size=8)
    with_base = plan("7b", RunSpec(**spec, cpu_baseline_bytes=350 * 2**20)).memory
    without = plan("7b", RunSpec(**spec)).memory
    assert with_base.peak - without.peak == 350 * 2**20


def test_gpu_step_time_follows_flops_peak_and_mfu():
    p = plan("7b", RunSpec(gpus=8, peak_flops=1e15, mfu=0.5, generation_mfu=0.1))
    assert p.step_seconds["policy"] == pytest.approx(p.flops.policy / 8 / (1e15 * 0.5))
    assert p.step_seconds["decoding"] == pytest.approx(p.flops.decoding / 8 / (1e15 * 0.1))
    assert p.step_seconds["prefill"] == pytest.approx(p.flops.prefill / 8 / (1e15 * 0.1))


RATES = {"decode": 2e10, "attention_bytes": 5e9, "layer": 2e11, "thin": 5e10, "step_s": 2e-3, "layer_step_s": 1e-4}


def test_cpu_time_is_shown_only_from_a_measured_rate():
    run = RunSpec(device="cpu", dtype="fp32", prompts_per_step=2, group_size=4, prompt_len=100, response_len=50)
    assert plan(SMOL, run).step_time is None  # no rate: no time, not a datasheet guess
    p = plan(SMOL, replace(run, cpu_rates=RATES))
    # decoding: the products (B·T = 400 rows through 2·30·3,540,096 + 2·576·49,152 = 269,028,864 FLOPs a row) at the
    # decode rate, the attention by the KV cache it reads at the attention rate (test_decodings_attention_...), and
    # T = 50 steps of 2 ms + 30 layers · 0.1 ms = 5 ms around them: 0.25 s
    assert p.step_seconds["decoding"] == pytest.approx(107_611_545_600 / 2e10 + 2_294_784_000 / 5e9 + 0.25)
    assert p.step_seconds["policy"] == pytest.approx(p.flops.policy / 2e11)  # through whole layers: the layer rate
    assert p.step_seconds["prefill"] == pytest.approx(p.flops.prefill / 2e11)
    assert p.step_seconds["adapters"] == pytest.approx(p.flops.adapters / 5e10)  # LoRA's rank-r products


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
        (["7b", "--decode-dtype", "bf16"], "error: decode-dtype bf16 is the CPU lean decoder's"),
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
    cpu = plan(smol, RunSpec(device="cpu", dtype="fp32", reuse_rollout_forward=False)).memory
    assert cpu.decode_layout == 4 * (30 * (2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536) + 49152 * 576) == 537_919_488
    assert cpu.generation_phase == cpu.kv_cache + cpu.decode_layout
    assert cpu.peak == cpu.persistent + max(cpu.update_phase, cpu.generation_phase)
    assert plan(smol, RunSpec(device="gpu", dtype="fp32")).memory.decode_layout == 0  # GPUs keep PyTorch's kernels
    assert plan(smol, RunSpec(device="cpu", dtype="bf16")).memory.decode_layout == 0


def test_bf16_decoding_holds_its_layout_in_half_the_bytes_and_the_rest_in_fp32():
    # The lean decoder's bf16 products (train.cpu_decode_dtype): its 134,479,872 laid-out weights at 2 bytes =
    # 268,959,744 bytes; the KV cache and the recording stay fp32.
    fp32 = plan(SMOL, CPU_GRPO).memory
    bf16 = plan(SMOL, replace(CPU_GRPO, decode_dtype="bf16")).memory
    assert bf16.decode_layout == 2 * 134_479_872 == 268_959_744 == fp32.decode_layout / 2
    assert (bf16.kv_cache, bf16.recording) == (fp32.kv_cache, fp32.recording)
    assert bf16.generation_phase == fp32.generation_phase - 268_959_744


def test_the_decoding_rate_is_measured_in_the_decoders_dtype_on_its_layout(monkeypatch):
    from cohortrl.planner import cpu_rates
    from cohortrl.trainers.setup import decoding_step_ops

    ops = decoding_step_ops()
    laid_out = []  # (rows, dtype) of every weight the probe lays out
    spy = ops._replace(laid_out=lambda w, rows, dtype: laid_out.append((rows, dtype)) or ops.laid_out(w, rows, dtype))
    fp32_x, fp32_w = cpu_rates.decode_probe(SMOL, 8, "fp32", spy)
    x, w = cpu_rates.decode_probe(SMOL, 8, "bf16", spy)
    # the inputs fp32, as the decoder's (its products cast them); the weights laid out for 8-row products
    assert x.dtype == fp32_x.dtype == torch.float32 and x.shape == fp32_x.shape == (8, 576)
    assert {t.dtype for t in w} == {torch.bfloat16} and {t.dtype for t in fp32_w} == {torch.float32}
    assert set(laid_out) == {(8, torch.float32), (8, torch.bfloat16)}
    # SmolLM2's 134,479,872 linear values: in bf16 268,959,744 bytes, under the 512 MiB cap: // (576·1536·2) =
    # 152 weights of 1,769,472 bytes; in fp32 537,919,488 bytes, capped at 536,870,912: // 3,538,944 = 151
    assert (len(w), len(fp32_w)) == (152, 151)
    # distinct weights, though laid out from one refilled source (laid-out tensors have no storage to compare)
    assert not torch.equal(*(ops.product(fp32_x, w, None, torch.float32) for w in fp32_w[:2]))
    assert ops.product(x, w[0], None, torch.bfloat16).shape == (8, 1536)  # f × h weights
    # as many weights as the model holds (the cap in bytes of the probe's dtype): a cap of 3 fp32 weights holds 6 bf16
    monkeypatch.setattr(cpu_rates, "DECODE_PROBE_BYTES", 3 * 576 * 1536 * 4)
    assert (len(cpu_rates.decode_probe(SMOL, 8, "bf16", ops)[1]), len(cpu_rates.decode_probe(SMOL, 8, "fp32", ops)[1])) == (6, 3)


def test_decodings_attention_is_timed_by_the_kv_cache_it_reads():
    from cohortrl.planner import decoding_kv_read_bytes

    run = RunSpec(device="cpu", dtype="fp32", prompts_per_step=2, group_size=4, prompt_len=100, response_len=50)
    # step t (from 0) attends to 100 + t columns: 8 rows · (50·100 + 50·49/2) = 49,800 columns; a column of every
    # layer is K and V of 3 kv heads of 64 values in fp32: 2·30·3·64·4 = 46,080 bytes → 2,294,784,000 bytes
    assert decoding_kv_read_bytes(SMOL, run) == 49_800 * 46_080 == 2_294_784_000
    p = plan(SMOL, replace(run, cpu_rates=RATES))
    # its FLOPs stay in the decoding phase: 4·30·9·64 per (query, key) pair = 69,120 · 49,800
    assert p.flops.decoding == 107_611_545_600 + 69_120 * 49_800
    # rows leave the computation after their end: the rows with a real token, 300 response + 20 tool-result
    # tokens, each at the mean context 100 + 49/2: 320 · 124.5 = 39,840 columns
    short = replace(run, response_tokens=300, tool_tokens=20)
    assert decoding_kv_read_bytes(SMOL, short) == 39_840 * 46_080 == 1_835_827_200
    assert plan(SMOL, replace(short, cpu_rates=RATES)).flops.decoding == p.flops.decoding  # the FLOPs count every row
    # split over 2 devices: each reads half at its own rate, and runs all 50 steps for its own rows
    two = plan(SMOL, replace(run, gpus=2, cpu_rates=RATES))
    assert two.step_seconds["decoding"] == pytest.approx((107_611_545_600 / 2e10 + 2_294_784_000 / 5e9) / 2 + 0.25)


def test_rates_measured_before_the_attention_rate_are_refused_with_the_fix():
    run = RunSpec(device="cpu", dtype="fp32", prompts_per_step=2, group_size=4, prompt_len=100, response_len=50,
                  cpu_rates={"decode": 2e10, "layer": 2e11, "thin": 5e10})  # a --json file of the benchmark's before it
    with pytest.raises(PlanError, match=r"the CPU rates lack attention_bytes, step_s, layer_step_s .*: measure them again"):
        plan(SMOL, run)


def test_rates_measured_before_the_step_overhead_are_refused_with_the_fix():
    old = {k: v for k, v in RATES.items() if k not in ("step_s", "layer_step_s")}  # a validation JSON measured before them, say
    with pytest.raises(PlanError, match=r"the CPU rates lack step_s, layer_step_s .*: measure them again"):
        plan(SMOL, RunSpec(device="cpu", dtype="fp32", prompts_per_step=2, group_size=4, response_len=50, cpu_rates=old))


def test_the_step_overhead_probe_differences_two_lengths_and_two_depths(monkeypatch):
    from cohortrl.planner import cpu_rates

    # a fake generation loop that costs, per call, 1 s once + per step 0.01 s + 0.002 s a layer + the step's products
    # and attention as the planner counts them: the probe recovers 0.01 s and 0.002 s
    tiny = ModelShape("tiny", 64, 2, 4, 2, 128, 256, True)
    rates = {"decode": 1e9, "attention_bytes": 1e9}
    clock = [0.0]

    def generate(model, rows, steps, dtype, record):
        layers = len(model.model.layers)
        modelled = (2 * layers * tiny.layer_params + 2 * 64 * 256) * rows / 1e9
        kv = 2 * layers * 2 * 16 * 4 * rows  # a column: K and V of 2 kv heads of 16 values in fp32, every layer
        clock[0] += 1 + steps * (0.01 + 0.002 * layers + modelled) + kv * steps * (steps + 1) / 2 / 1e9

    monkeypatch.setattr("time.process_time", lambda: clock[0])
    ops = SimpleNamespace(generate=generate)
    step, layer = cpu_rates.step_overhead(tiny, rows=2, dtype="fp32", ops=ops, record=False, repeats=2, threads=1,
                                          rates=rates)
    assert (step, layer) == (pytest.approx(0.01), pytest.approx(0.002))


def test_one_given_flop_rate_times_decodings_attention_by_its_flops():
    from cohortrl.planner import uniform_cpu_rates

    rates = uniform_cpu_rates(SMOL, 1e11)
    # a column's 2·3·64 values of 4 bytes per 4·9·64 FLOPs: 1,536 / 2,304 = 2/3 bytes per FLOP
    assert rates == {"decode": 1e11, "attention_bytes": pytest.approx(1e11 * 2 / 3), "layer": 1e11, "thin": 1e11,
                     "step_s": 0.0, "layer_step_s": 0.0}  # a FLOP rate times FLOPs only
    p = plan(SMOL, RunSpec(device="cpu", dtype="fp32", prompts_per_step=2, group_size=4, prompt_len=100,
                           response_len=50, cpu_rates=rates))
    assert p.step_seconds["decoding"] == pytest.approx(p.flops.decoding / 1e11)  # every row runs T steps


def test_the_attention_probe_holds_a_decoding_steps_kv_cache(monkeypatch):
    from cohortrl.planner import cpu_rates
    from cohortrl.trainers.setup import decoding_step_ops

    ops = decoding_step_ops()
    q, keys, values, key_bias, length = cpu_rates.attention_probe(SMOL, rows=2, context=10, ops=ops)
    # one column of one layer for 2 rows: 2·3·64·4·2 = 3,072 bytes; 10 columns = 30,720 bytes a layer, 30 layers
    assert (len(keys), len(values), length) == (30, 30, 10)
    assert q.shape == (2, 9, 64) and keys[0].shape == values[0].shape == (2, 3, 10, 64) and key_bias.shape == (6, 1, 10)
    assert sum(t.nbytes for t in (*keys, *values)) == 30 * 30_720
    # capped: as many layers as fit; a single layer that would not fit gets fewer columns
    monkeypatch.setattr(cpu_rates, "ATTENTION_PROBE_BYTES", 4 * 30_720)
    assert (len(cpu_rates.attention_probe(SMOL, 2, 10, ops)[1]), cpu_rates.attention_probe(SMOL, 2, 10, ops)[4]) == (4, 10)
    assert (len(cpu_rates.attention_probe(SMOL, 2, 1000, ops)[1]), cpu_rates.attention_probe(SMOL, 2, 1000, ops)[4]) == (1, 40)


def test_the_cpu_rates_time_the_decoders_own_step(monkeypatch):
    from cohortrl.planner import CPU_RATES, cpu_rates
    from cohortrl.trainers.setup import decoding_step_ops

    ops, called = decoding_step_ops(), set()
    spy = ops._replace(product=lambda *a: called.add("product") or ops.product(*a),
                       attention=lambda *a: called.add("attention") or ops.attention(*a),
                       generate=lambda *a: called.add("generate") or ops.generate(*a))
    monkeypatch.setattr(cpu_rates, "TIMED_AMOUNT", 1)  # one repetition per timing
    tiny = ModelShape("tiny", 64, 2, 4, 2, 128, 256, True)
    rates = cpu_rates.measure_cpu_rates(tiny, threads=1, rows=2, ops=spy, context=16, repeats=1, record=True)
    assert rates.keys() == CPU_RATES.keys()
    assert min(rates[k] for k in ("decode", "attention_bytes", "layer", "thin")) > 0
    assert rates["step_s"] >= 0 and rates["layer_step_s"] >= 0  # what is left after the modelled products and attention
    assert called == {"product", "attention", "generate"}


def test_bf16_decoding_is_timed_at_the_rate_measured_in_bf16():
    # decode: the probe in bf16 (measure_cpu_rates); attention_bytes: the fp32 KV cache, whatever the products' dtype
    rates = {"decode": 5e10, "attention_bytes": 4e9, "layer": 2e11, "thin": 7e10, "step_s": 0.0, "layer_step_s": 0.0}
    p = plan(SMOL, replace(CPU_GRPO, decode_dtype="bf16", cpu_rates=rates))
    assert p.run.reuse_rollout_forward
    # decoding: B·T rows of the layers (3,540,096 weights each) and the head, plus attention:
    # (2·30·3,540,096 + 2·576·49,152)·8·50 = 107,611,545,600 + 4·30·9·64·8·(50·101 + 50·49/2) = 3,469,824,000
    # FLOPs; the products at the bf16 decode rate, the attention by its 8·6,275 columns · 46,080 bytes =
    # 2,313,216,000 bytes of fp32 KV cache at the attention rate
    assert p.flops.decoding == 111_081_369_600
    assert p.step_seconds["decoding"] == pytest.approx(107_611_545_600 / 5e10 + 2_313_216_000 / 4e9)
    # the recording decoder prefills through the same bf16 products (LlamaDecoder._prefill): at the decode rate
    assert p.step_seconds["prefill"] == pytest.approx(p.flops.prefill / 5e10)
    assert p.step_seconds["policy"] == pytest.approx(p.flops.policy / 2e11)
    assert p.flops.old_logprobs == 0  # the update differentiates decoding's own forward: π_old is decoding's


def test_bf16_decoding_without_the_recording_adds_a_forward_for_the_old_log_probs():
    # RLTrainer.needs_old_logp: the sampler's numerics are not the trainer's, so the update corrects with
    # importance weights, π_old from its own fp32 forward (a log-prob pass: each distinct prompt once, every
    # response token scored), and transformers' fp32 prefill runs at the layer rate
    rates = {"decode": 5e10, "attention_bytes": 4e9, "layer": 2e11, "thin": 7e10, "step_s": 0.0, "layer_step_s": 0.0}
    fp32 = plan(SMOL, replace(CPU_GRPO, reuse_rollout_forward=False, cpu_rates=rates))
    bf16 = plan(SMOL, replace(CPU_GRPO, reuse_rollout_forward=False, decode_dtype="bf16", cpu_rates=rates))
    tokens = 2 * 101 + 8 * 50
    pairs = 2 * 101 * 102 / 2 + 8 * (50 * 101 + 50 * 51 / 2)
    forward = 2 * 30 * SMOL.layer_params * tokens + 4 * 30 * 9 * 64 * pairs + 2 * 576 * 49152 * 8 * 50
    assert fp32.flops.old_logprobs == 0
    assert bf16.flops.old_logprobs == pytest.approx(forward)
    assert bf16.flops.adapters - fp32.flops.adapters == 2 * 4_884_480 * tokens  # the adapters in that forward
    assert bf16.step_seconds["prefill"] == pytest.approx(bf16.flops.prefill / 2e11)


# ---------------------------------------------------------------------------------------------- what the trainer does
CPU_GRPO = RunSpec(device="cpu", dtype="fp32", lora_rank=16, prompts_per_step=2, group_size=4, prompt_len=101,
                   response_len=50, reference=False)


def test_lora_trains_no_frozen_weight_its_states_are_the_adapters_only():
    # SmolLM2, r = 16: per layer q, o 2·(576+576), k, v 2·(576+192), gate, up, down 3·(576+1536)
    # = 10,176 inputs + outputs; · 16 · 30 layers = 4,884,480 trained parameters, fp32: 4 bytes of gradient and
    # 8 of AdamW moments each. The 134.5M frozen base weights are counted once, as weights only.
    lora = plan(SMOL, CPU_GRPO).memory
    assert SMOL.lora_params(16) == 16 * 30 * 10_176 == 4_884_480
    assert lora.policy.gradients == 4 * 4_884_480
    assert lora.policy.optimizer == 8 * 4_884_480
    assert lora.policy.weights == 4 * (SMOL.params + 4_884_480)
    full = plan(SMOL, replace(CPU_GRPO, lora_rank=0)).memory
    assert full.policy.gradients == 4 * SMOL.params


def test_lora_backward_has_no_weight_gradient_products():
    # Frozen weights pass dx (one product per weight) but get no dW (the other): the layers' backward is 1x
    # their forward with LoRA, 2x without; the update's own forward and attention's 2x are the same for both.
    run = replace(CPU_GRPO, reuse_rollout_forward=False)
    lora, full = plan(SMOL, run).flops, plan(SMOL, replace(run, lora_rank=0)).flops
    tokens = 2 * 101 + 8 * 50  # each distinct prompt once, then every response (shared prompts)
    layers = 2 * 30 * SMOL.layer_params * tokens
    head = 2 * 576 * 49152 * 8 * 50  # the scored response tokens; the tied head is frozen under LoRA
    assert full.policy - lora.policy == pytest.approx(layers + head)


def test_lora_adapters_run_in_the_update_but_are_folded_into_decoding_on_a_cpu():
    # The adapters' own products: 2·r·(in + out) per matrix and token forward = 2·4,884,480 per token; the
    # update runs them forward and back (3x) on each distinct prompt's tokens once and every response token. On
    # the CPU the update is the replay, on the recorded rows: each prompt's first s_p - 1 columns, 2·100 + 8·50 =
    # 600; the CPU decoder folds them into its weights; the reference switches them off. On a GPU the update's
    # own forward runs 2·101 + 8·50 = 602 tokens, and generation runs them too.
    assert plan(SMOL, CPU_GRPO).flops.adapters == 3 * 2 * 4_884_480 * 600
    on_gpu = plan(SMOL, replace(CPU_GRPO, device="gpu", dtype="bf16")).flops.adapters
    assert on_gpu == 4 * 2 * 4_884_480 * 602
    assert plan(SMOL, replace(CPU_GRPO, lora_rank=0)).flops.adapters == 0


def test_a_shared_prompt_is_prefilled_and_recorded_once_per_distinct_prompt():
    one_prompt = replace(CPU_GRPO, prompts_per_step=1, group_size=8)  # B = 8 either way
    two_prompts = CPU_GRPO
    # prefill: U·(s_p − 1) tokens through the layers; G does not multiply it
    per_token = 2 * 30 * SMOL.layer_params
    attention = lambda U: 4 * 30 * 9 * 64 * U * 100 * 101 / 2  # noqa: E731  causal over s_p − 1 = 100 columns
    assert plan(SMOL, one_prompt).flops.prefill == pytest.approx(per_token * 100 + attention(1))
    assert plan(SMOL, two_prompts).flops.prefill == pytest.approx(per_token * 200 + attention(2))
    # the recording: U·(s_p − 1) prefix rows + B·T decoding rows, 2h + (a + 2k)·d + 2f = 5,184 values per
    # layer and row; + the final hidden state of each decoding row; + the logits while B·T·V·4 fits in 128 MiB
    # (8·50·49,152·4 = 78,643,200 bytes: kept)
    rows = 100 + 8 * 50
    assert recording_bytes(SMOL, one_prompt) == (rows * 30 * 5_184 + 8 * 50 * 576) * 4 + 78_643_200
    # allocated for the sampling budget, in memory maps resident only where written: the rows of the T steps
    # decoding ran count, the budget decides only whether the logits are kept
    # (8·90·49,152·4 = 141,557,760 bytes of logits > 128 MiB: not kept)
    budget = replace(one_prompt, max_new_tokens=90)
    assert recording_bytes(SMOL, budget) == (rows * 30 * 5_184 + 8 * 50 * 576) * 4
    # rows that ended leave the products: the rows written are about the real tokens, 300 of B·T = 400 here
    ended = replace(budget, response_tokens=280, tool_tokens=20)
    assert recording_bytes(SMOL, ended) == ((100 + 300) * 30 * 5_184 + 300 * 576) * 4
    # identical prompts passed as distinct ones cost their prefix again
    assert plan(SMOL, replace(two_prompts, distinct_prompts=1)).flops.prefill == plan(SMOL, one_prompt).flops.prefill


def test_tool_result_tokens_run_through_the_model_but_are_not_scored():
    plain = replace(CPU_GRPO, reference=True)
    with_tools = replace(plain, tool_tokens=120)  # the same padded length: results are part of T
    a, b = plan(SMOL, plain), plan(SMOL, with_tools)
    assert b.memory.recording == a.memory.recording and b.memory.kv_cache == a.memory.kv_cache
    assert b.flops.decoding == a.flops.decoding  # fed one per step like sampled tokens, head included
    # the reference's log-prob pass: the head (2·h·V each) skips the 120 tool tokens
    assert a.flops.reference - b.flops.reference == pytest.approx(120 * 2 * 576 * 49152)
    assert b.run.scored_tokens == 8 * 50 - 120


def test_the_update_on_decodings_recording_replaces_activations_and_holds_through_both_phases():
    replayed = plan(SMOL, CPU_GRPO)
    assert replayed.run.reuse_rollout_forward  # the trainer's default on a CPU in fp32 for GRPO
    m = replayed.memory
    assert m.activations == m.logits == 0 and m.recording > 0
    assert m.generation_phase == m.recording + m.kv_cache + m.decode_layout
    assert m.update_phase == m.recording + m.replay_temporaries + m.gradients
    # no forward in the update: its FLOPs are the backward's and attention's recomputed forward
    plain = plan(SMOL, replace(CPU_GRPO, reuse_rollout_forward=False))
    assert replayed.flops.policy < plain.flops.policy
    # PPO, several micro-batches or a GPU: the update runs its own forward
    for run in (replace(CPU_GRPO, algorithm="ppo"), replace(CPU_GRPO, micro_batch_size=2),
                replace(CPU_GRPO, device="gpu"), replace(CPU_GRPO, epochs=2)):
        assert not plan(SMOL, run).run.reuse_rollout_forward


def test_the_replayed_update_multiplies_only_the_rows_the_gradient_reaches():
    """cpu/replay.py runs the layers' products of its backward on each distinct prompt's prefix once (its first
    s_p - 1 columns) and each row's steps up to its last real token (Recording._reached_rows), not on the steps after
    a row's end: with half the B·T rows real, the products' backward FLOPs (and LoRA's update) count
    U·(s_p - 1) + B·T/2 rows; the attention,
    recomputed over the whole step-major layout, does not change. The update's own forward counts them all."""
    from cohortrl.planner import Pass, backward_flops, batch_pass

    B, T, U, sp = 8, 50, 2, 101
    full, half = replace(CPU_GRPO, response_tokens=B * T), replace(CPU_GRPO, response_tokens=B * T // 2)
    p_full, p_half = plan(SMOL, full), plan(SMOL, half)
    layers_full = batch_pass(SMOL, p_full.run, True, B * T).layers
    layers_half = layers_full * (U * (sp - 1) + B * T // 2) / (U * sp + B * T)
    layers_full = layers_full * (U * (sp - 1) + B * T) / (U * sp + B * T)  # the prefix is s_p - 1 columns
    # the head's share scales with the scored tokens in both; what is left is the products' backward
    head_full, head_half = (backward_flops(Pass(0.0, 0.0, 2 * 576 * 49152 * n), True, False) for n in (B * T, B * T // 2))
    products = lambda layers: backward_flops(Pass(layers, 0.0, 0.0), True, False)  # noqa: E731
    assert p_full.flops.policy - p_half.flops.policy == pytest.approx(
        products(layers_full) - products(layers_half) + head_full - head_half, rel=1e-9)
    lora_rows = 3 * 2 * SMOL.lora_params(16)  # LoRA's update per row: forward and backward, 3 x 2 FLOPs a parameter
    assert p_full.flops.adapters - p_half.flops.adapters == pytest.approx(lora_rows * B * T // 2, rel=1e-9)
    plain_full, plain_half = (plan(SMOL, replace(r, reuse_rollout_forward=False)) for r in (full, half))
    assert plain_full.flops.policy - plain_half.flops.policy == pytest.approx(head_full - head_half + 2 * 576 * 49152 * B * T // 2, rel=1e-9)


def test_asking_for_the_recording_where_the_trainer_cannot_use_it_is_refused():
    with pytest.raises(PlanError, match="reuses decoding's forward only on a CPU in fp32"):
        plan(SMOL, replace(CPU_GRPO, algorithm="ppo", reuse_rollout_forward=True))


def test_micro_batches_divide_the_update_activations():
    whole = plan(SMOL, replace(CPU_GRPO, algorithm="ppo")).memory
    halves = plan(SMOL, replace(CPU_GRPO, algorithm="ppo", micro_batch_size=4)).memory
    # policy: each distinct prompt once + b·T (2·101 + 8·50 = 602 tokens, then 101 + 4·50 = 301);
    # the critic runs every sequence whole: b·S (8·151 = 1208, then 604). Half the batch, half of both.
    per_token = activation_elements_per_token(SMOL, False) * 4
    assert whole.activations == pytest.approx((602 + 1208) * per_token)
    assert halves.activations == pytest.approx((301 + 604) * per_token)


def test_run_spec_from_config_takes_the_trainers_settings():
    from cohortrl.config import Config

    cfg = Config.from_yaml(REPO / "configs" / "eng_grpo.yaml", ["model.init=null"])
    run = run_spec_from_config(cfg, prompt_len=185)
    assert (run.algorithm, run.lora_rank, run.prompts_per_step, run.group_size) == ("grpo", 16, 4, 8)
    assert (run.reference, run.micro_batch_size, run.response_len, run.dtype, run.device) == (False, 0, 256, "fp32", "cpu")
    assert plan(SMOL, run).run.reuse_rollout_forward
    ppo = run_spec_from_config(cfg.with_overrides("algorithm.name=ppo"), prompt_len=185)
    assert ppo.algorithm == "ppo" and not plan(SMOL, ppo).run.reuse_rollout_forward
    off = run_spec_from_config(cfg.with_overrides("train.reuse_rollout_forward=false"), prompt_len=185)
    assert not plan(SMOL, off).run.reuse_rollout_forward
    rft = run_spec_from_config(cfg.with_overrides("algorithm.name=rft"), prompt_len=185)
    assert rft.algorithm == "rft" and plan(SMOL, rft).run.reuse_rollout_forward and not rft.reference


def test_run_spec_from_config_resolves_the_decoders_dtype_as_the_trainer(monkeypatch):
    from cohortrl.config import Config
    from cohortrl.cpu import kernels
    from cohortrl.trainers.setup import cpu_bf16_products

    cfg = Config.from_yaml(REPO / "configs" / "demo_grpo.yaml", ["model.init=null"])  # train.cpu_decode_dtype: auto
    monkeypatch.setattr(kernels, "onednn_available", lambda: True)
    monkeypatch.setattr(kernels, "cpu_has_bf16_units", lambda: True)
    assert run_spec_from_config(cfg, bf16_units=cpu_bf16_products()).decode_dtype == "bf16"
    monkeypatch.setattr(kernels, "cpu_has_bf16_units", lambda: False)
    assert run_spec_from_config(cfg, bf16_units=cpu_bf16_products()).decode_dtype == "fp32"
    # auto takes bf16 only where the lean decoder runs: the fast path's oneDNN kernel, an fp32 model, a CPU
    for override in ("train.cpu_linear=aten", "train.cpu_fast_path=off", "model.dtype=bfloat16", "train.device=cuda"):
        assert run_spec_from_config(cfg.with_overrides(override), bf16_units=True).decode_dtype == "fp32", override
    assert run_spec_from_config(cfg, bf16_units=True, device="gpu").decode_dtype == "fp32"
    # an explicit setting is the setting (the trainer refuses bfloat16 where it cannot run)
    assert run_spec_from_config(cfg.with_overrides("train.cpu_decode_dtype=bfloat16")).decode_dtype == "bf16"
    assert run_spec_from_config(cfg.with_overrides("train.cpu_decode_dtype=float32"), bf16_units=True).decode_dtype == "fp32"


def test_the_recordings_logit_budget_is_the_decoders():
    from cohortrl import planner
    from cohortrl.cpu import decoder

    assert planner.RECORD_LOGITS_BYTES == decoder.RECORD_LOGITS_BYTES


def test_cli_labels_gpu_figures_as_predictions_and_shows_no_unmeasured_cpu_time():
    gpu = cli("7b", "--gpus", "8", "--sharding", "zero3")
    assert gpu.returncode == 0, gpu.stderr
    assert "model prediction, not measured" in gpu.stdout
    cpu = cli("tiny-llama", "--device", "cpu", "--dtype", "fp32", "-P", "2", "-G", "4", "--no-measure")
    assert cpu.returncode == 0, cpu.stderr
    assert "not shown: no measured CPU rate" in cpu.stdout
    assert "| **total** |" in cpu.stdout and cpu.stdout.rstrip().endswith("| - |")
    bf16 = cli("tiny-llama", "--device", "cpu", "--dtype", "fp32", "--decode-dtype", "bf16", "-P", "2", "-G", "4",
               "--peak-gflops", "100")
    assert bf16.returncode == 0, bf16.stderr
    assert "GFLOP/s: decoding 100 in bf16 at 8 rows" in bf16.stdout
    # tiny-llama's column of K and V, 2·2·16 values of 4 bytes, per 4·4·16 FLOPs: 1 byte per FLOP
    assert "decoding's attention 100.0 GB/s of KV cache" in bf16.stdout
    assert "| (of which attention: " in bf16.stdout
    assert "| linear weights in oneDNN's layout (bf16, cpu, generation) |" in bf16.stdout


def test_the_update_shares_prompts_under_ddp_but_not_fsdp2_over_several_processes():
    from cohortrl.planner import update_tokens

    ddp, fsdp = (plan("7b", RunSpec(gpus=8, sharding=s, micro_batch_size=4)).run for s in ("none", "zero3"))
    assert update_tokens(fsdp) == 4 * fsdp.seq_len  # every row runs its own prompt
    # a micro-batch of 4 rows of groups of G ≥ 4 holds one distinct prompt: s_p + 4·T
    assert update_tokens(ddp) == ddp.prompt_len + 4 * ddp.response_len


def test_the_committed_validation_table_regenerates_from_its_measurements_on_a_clean_checkout():
    """docs/planner.md's validation table is the planner run over docs/planner_validation.json: re-planned here,
    where the warm-start directories its configurations named are not, it gives the same rows and verdict."""
    from benchmarks.planner_validation import compare, table
    from cohortrl.models import cached_models, load_model

    if "smollm2-135m-instruct" not in cached_models():
        load_model("smollm2-135m-instruct")  # the planner reads the converted model's shape (converted once, cached)
    repo = Path(__file__).resolve().parent.parent
    measurements = json.loads((repo / "docs" / "planner_validation.json").read_text())
    text, ok = table([(m, compare(m)) for m in measurements])
    doc = (repo / "docs" / "planner.md").read_text()
    rows = text.splitlines()[2:]  # below the header and its rule
    assert len(rows) == sum(len(m["steps"]) for m in measurements)
    assert all(row in doc for row in rows), [row for row in rows if row not in doc]
    assert ok
