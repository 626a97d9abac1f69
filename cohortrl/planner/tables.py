"""``cohortrl plan``'s output: a :class:`~cohortrl.planner.Plan` as two markdown tables, memory per device and
FLOPs and time per step."""

from __future__ import annotations

from cohortrl.planner import (GIB, Plan, RunSpec, decoding_attention_flops, decoding_attention_seconds,
                              decoding_kv_read_bytes)


def memory_rows(p: Plan) -> list[tuple[str, float]]:
    """(component, bytes per device) in table order; the CLI and the docs print these."""
    mem, rows = p.memory, []
    if mem.baseline:
        rows.append(("process baseline (cpu)", mem.baseline))
    rows += [("policy weights", mem.policy.weights), ("policy gradients", mem.policy.gradients),
             ("policy optimizer states", mem.policy.optimizer)]
    if mem.critic:
        rows += [("critic weights", mem.critic.weights), ("critic gradients", mem.critic.gradients),
                 ("critic optimizer states", mem.critic.optimizer)]
    rows += [("reference model", mem.reference), ("reward model", mem.reward_model)]
    if p.run.reuse_rollout_forward:
        rows += [("decoding's recording (update on it, generation through update)", mem.recording),
                 ("replayed backward's temporaries (update)", mem.replay_temporaries)]
    else:
        rows += [("activations, no checkpointing", mem.activations_no_ckpt),
                 ("activations, checkpointing", mem.activations_ckpt),
                 ("logits (fp32, update micro-batch)", mem.logits)]
    rows.append(("KV cache (generation)", mem.kv_cache))
    if mem.decode_layout:
        rows.append((f"linear weights in oneDNN's layout ({p.run.decode_dtype}, cpu, generation)", mem.decode_layout))
    if mem.gathered_weights:
        rows.append(("policy weights gathered whole (zero3, generation)", mem.gathered_weights))
    return rows


def time_heading(r: RunSpec) -> str:
    """What the time column is: a CPU calibration measured on this machine, or a GPU model prediction."""
    if r.device == "cpu":
        if not r.cpu_rates:
            return "s (not shown: no measured CPU rate)"
        rates = r.cpu_rates
        return (f"s, calibrated (measured here, GFLOP/s: decoding {rates['decode'] / 1e9:.0f} in {r.decode_dtype} at "
                f"{r.sequences // r.gpus} rows, layers {rates['layer'] / 1e9:.0f}, rank-r {rates['thin'] / 1e9:.0f}; "
                f"decoding's attention {rates['attention_bytes'] / 1e9:.1f} GB/s of KV cache; per decoding step "
                f"{rates['step_s'] * 1e3:.2f} ms + {rates['layer_step_s'] * 1e3:.2f} ms a layer besides them)")
    return (f"s, model prediction, not measured ({r.peak_flops / 1e12:g} TFLOP/s datasheet peak, "
            f"MFU {r.mfu:g}, decoding {r.generation_mfu:g})")


def format_plan(p: Plan) -> str:
    """The plan as two markdown tables (memory per device, FLOPs and time per step)."""
    r, m = p.run, p.model
    lora = f"LoRA r={r.lora_rank}" if r.lora_rank else "full fine-tuning"
    tokens = f"; {r.prompts} distinct prompts" if r.prompts != r.prompts_per_step else ""
    if r.tool_tokens or r.response_tokens is not None:
        tokens += f"; {r.scored_tokens} scored response tokens, {r.tool_tokens} tool-result tokens"
    lines = [
        f"{m.name}: {m.params / 1e9:.3f}B parameters (h={m.hidden_size}, L={m.num_layers}, heads={m.num_heads}, "
        f"kv heads={m.num_kv_heads}, f={m.intermediate_size}, V={m.vocab_size})",
        f"{r.algorithm}, {r.gpus} {r.device}(s), sharding {r.sharding}, {r.dtype}"
        f"{', decoding in bf16 products' if r.decode_dtype == 'bf16' else ''}, {lora}; P={r.prompts_per_step} x "
        f"G={r.group_size} = {r.sequences} sequences of {r.prompt_len}+{r.response_len} tokens{tokens}; micro-batch "
        f"{r.micro_batch}; activation checkpointing {'on' if r.checkpointing else 'off'}; update "
        f"{'on decoding' + chr(39) + 's recording' if r.reuse_rollout_forward else 'with its own forward'}",
        "",
        f"| memory per device{'' if r.device == 'cpu' else ' (model prediction, not measured)'} | GiB |",
        "|---|---:|",
    ]
    lines += [f"| {name} | {value / GIB:.3f} |" for name, value in memory_rows(p)]
    mem = p.memory
    lines += [
        f"| **persistent (weights, optimizer states, models{' + baseline' if mem.baseline else ''})** | {mem.persistent / GIB:.3f} |",
        f"| **update phase** | {mem.update_phase / GIB:.3f} |",
        f"| **generation phase** | {mem.generation_phase / GIB:.3f} |",
        f"| **peak = persistent + max(update phase, generation phase)** | {mem.peak / GIB:.3f} |",
        "",
        f"| FLOPs per step (all devices) | TFLOP | {time_heading(r)} |",
        "|---|---:|---:|",
    ]
    names = {"prefill": "generation: prefill", "decoding": "generation: decoding", "reference": "reference forward",
             "reward_model": "reward model forward", "old_logprobs": "old log-probs forward",
             "critic": "critic forward/backward",
             "policy": "policy backward on the recording" if r.reuse_rollout_forward else "policy forward/backward",
             "adapters": "LoRA adapters' products (all passes)"}
    for key, label in names.items():
        seconds = f"{p.step_seconds[key]:.2f}" if p.step_seconds else "-"
        lines.append(f"| {label} | {getattr(p.flops, key) / 1e12:.3f} | {seconds} |")
        if key == "decoding" and r.device == "cpu":  # timed by the bytes it reads, not its FLOPs
            seconds = f"{decoding_attention_seconds(m, r):.2f}" if p.step_seconds else "-"
            lines.append(f"| (of which attention: {decoding_kv_read_bytes(m, r) / GIB:.2f} GiB of KV cache read) | "
                         f"{decoding_attention_flops(m, r) / 1e12:.3f} | {seconds} |")
    total = f"{p.step_time:.2f}" if p.step_seconds else "-"
    lines.append(f"| **total** | {p.flops.total / 1e12:.3f} | {total} |")
    return "\n".join(lines)
