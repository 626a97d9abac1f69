"""cohortrl's GRPO against TRL's GRPOTrainer, side by side on identical work (issue #9).

    .venv/bin/python benchmarks/vs_trl.py                    # every workload, 2 rounds x 4 steps, the check
    .venv/bin/python benchmarks/vs_trl.py --quick            # smoke test: tiny model, 1 round x 2 steps
    .venv/bin/python benchmarks/vs_trl.py --models smollm2 --rounds 3 --steps 5

TRL runs in its own virtual environment (``<repo>/.venv-trl`` unless ``--trl-venv PATH``), created on the first
run with the torch, transformers and peft versions of ours and TRL ``TRL_VERSION``, so neither library's dependencies
leak into the other. Each library's steps run in a worker subprocess of this file (``--worker trl|cohortrl
--job JOB.json``) under its own venv; the TRL worker imports nothing from cohortrl. The rounds alternate
TRL, cohortrl, TRL, cohortrl, ... per model; the first step of every worker is a warm-up, reported but left out
of the medians. The same run measures this machine's fp32 matmul peak (median of 2048³ products, same threads)
for cohortrl's training throughput, and checks that both libraries compute the same loss and gradient norm
from the same weights and the same fixed batch (``SETTINGS`` and ``PHASE_NOTES`` say what is aligned and how
each phase is timed). The report goes to ``benchmarks/results/vs_trl.md``.

Workloads (``WORKLOADS``; each says what it trains and its β): ``tiny``, a random Llama of 15.7M parameters with
SmolLM2's tokenizer (49,152 vocabulary), 4 prompts x G 8 x 64 tokens, and ``smollm2``, SmolLM2-135M-Instruct, 2
prompts x G 4 x 48 tokens, both full fine-tuning (the ones TRL was first measured on here); ``smollm2-lora``,
SmolLM2-135M-Instruct with a LoRA adapter (r 16, alpha 32, dropout 0, on every projection: cohortrl's default
``model.lora.target_modules``), 4 prompts x G 8 x 32 tokens (issue #51's LoRA case). β is 0.04 in all three; with
LoRA the KL reference is, in both libraries, the base model with the adapter disabled. Completions are forced to
that length in both libraries (EOS suppressed), so the work per step is fixed. Not part of the test suite: minutes
on a CPU, and the timings need a quiet machine.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import platform
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

# Module level: stdlib only. The TRL worker runs this file under the TRL venv, which has no cohortrl; torch,
# transformers, trl and cohortrl are imported inside the functions that need them.

REPO = Path(__file__).resolve().parent.parent
TRL_VERSION = "1.16.0"  # the worker times TRL's private methods (_generate, ...): bump only after re-reading them
RESULT_MARK = "VS_TRL_RESULT "  # prefixes the worker's JSON line, so library chatter on stdout cannot be mistaken for it
SYSTEM_PROMPT = "Be brief."
SMOLLM2 = "smollm2-135m-instruct"

# cohortrl's default `model.lora.target_modules`: every projection of a Llama-family layer.
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# P prompts x G responses x T forced completion tokens per step; the weights (`model`), what is trained (`lora`:
# None for every weight, else the adapter) and the KL coefficient β (`beta`) of each workload.
WORKLOADS = {
    "tiny": {"model": "tiny", "prompts": 4, "group": 8, "tokens": 64, "lora": None, "beta": 0.04,
             "about": "tiny random Llama (hidden 256, 3 layers, 15.7M params) with SmolLM2's tokenizer"},
    "smollm2": {"model": "smollm2", "prompts": 2, "group": 4, "tokens": 48, "lora": None, "beta": 0.04,
                "about": "SmolLM2-135M-Instruct"},
    # The LoRA case of issue #51, as an independent harness measured it.
    "smollm2-lora": {"model": "smollm2", "prompts": 4, "group": 8, "tokens": 32, "beta": 0.04,
                     "lora": {"r": 16, "alpha": 32, "dropout": 0.0, "target_modules": LORA_TARGETS},
                     "about": "SmolLM2-135M-Instruct with a LoRA adapter (r 16, alpha 32) on every projection"},
}
# The tiny model: 49,152·256 tied embedding + 3 layers of (4·256² attention + 3·256·1024 MLP) ≈ 15.73M.
TINY_SHAPE = {"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 3, "num_attention_heads": 4,
              "num_key_value_heads": 4, "max_position_embeddings": 2048}
PHASES = ("generate", "score", "reference", "fwd_bwd", "optimizer")
PHASE_LABELS = {
    "generate": "generate (s)", "score": "score rewards (s)", "reference": "reference log-probs (s)",
    "fwd_bwd": "forward + backward (s)", "optimizer": "optimiser: clip + AdamW (s)", "other": "other (s)",
}
PHASE_NOTES = """\
| phase | TRL 1.16 (wrapped in the worker) | cohortrl (its own step metrics) |
|---|---|---|
| step | `on_step_begin` → `on_step_end` callbacks: `training_step` (generation included, through `_prepare_inputs`), clipping, `optimizer.step`, LR scheduler, `zero_grad`; not the dataloader fetch or logging | `trainer.step()` wall time (`time/step`); not the metrics log (the worker calls `step()`, not `train()`) |
| generate | `_generate`: chat template + tokenise, `model.generate`, decode | `time/generate`: chat template + tokenise, prefill, its own decoding loop, decode |
| score rewards | `_calculate_rewards` | `time/score` |
| reference log-probs | `_get_per_token_logps_and_entropies` called with the reference model (with PEFT: with the policy while its adapter is disabled) | `time/reference` |
| forward + backward | `compute_loss` + `accelerator.backward` | `time/train` − `time/optimizer` (token weights, forward, loss, backward) |
| optimiser | `_clip_grad_norm` + `_get_grad_norm` + `on_pre_optimizer_step` → `on_optimizer_step` (`optimizer.step`) | `time/optimizer`: `clip_grad_norm_`, finiteness check, `AdamW.step`, scheduler step |
| other | step − the phases above (advantages, metrics, Python overhead) | the same |
| completion tokens | sum of `completion_mask` of the step's batch | `response_length_mean` × P·G |
| peak RSS | `resource.getrusage(RUSAGE_SELF).ru_maxrss` at the end of the worker (whole process: both models, optimiser state, allocator) | the same |
"""


# ---------------------------------------------------------------------------------------------- shared
def prompt_rows() -> list[dict]:
    """81 prompts of the same token length (single digits are single tokens in SmolLM2's vocabulary), so no
    prompt is ever left-padded: equal shapes in both libraries whatever prompts a step draws."""
    return [{"prompt": f"What is {a} * {b}?", "answer": str(a * b)} for a in range(1, 10) for b in range(1, 10)]


def digit_share(prompts, completions, **columns) -> list[float]:
    """Reward: the share of a completion's characters that are digits. Cheap, identical in both libraries, and
    it varies between random completions (so advantages are not all zero). TRL passes chat completions as
    lists of messages; cohortrl passes strings."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [sum(ch.isdigit() for ch in t) / max(1, len(t)) for t in texts]


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def grad_norm(model) -> float:
    """Total L2 norm of the gradients, accumulated in float64 (the same code for both libraries)."""
    import torch

    total = sum(p.grad.double().pow(2).sum() for p in model.parameters() if p.grad is not None)
    return float(torch.as_tensor(total).sqrt())


def lora_config(lora: dict):
    """PEFT's ``LoraConfig`` for a workload's adapter, as cohortrl builds it from ``model.lora``
    (``build_policy`` in trainers/setup.py) and as TRL gets it (``peft_config=``)."""
    from peft import LoraConfig

    return LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                      target_modules=list(lora["target_modules"]), task_type="CAUSAL_LM")


def adapter_fingerprint(model) -> str:
    """SHA-256 of a PEFT model's adapter weights (PEFT's own state dict: names without the adapter's name, in
    sorted order, with their float32 bytes), so two processes can show they hold the same adapter."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(model)
    digest = hashlib.sha256()
    for name in sorted(state):
        digest.update(name.encode())
        digest.update(state[name].detach().float().contiguous().numpy().tobytes())
    return digest.hexdigest()


def load_adapter(model, path: str) -> str:
    """Overwrite a PEFT model's adapter with the check's saved one; returns the loaded adapter's fingerprint."""
    import torch
    from peft import set_peft_model_state_dict

    loaded = set_peft_model_state_dict(model, torch.load(path))
    if loaded.unexpected_keys:
        raise RuntimeError(f"the check's adapter has weights this model lacks: {loaded.unexpected_keys[:3]}")
    return adapter_fingerprint(model)


def emit(result: dict) -> None:
    print(RESULT_MARK + json.dumps(result), flush=True)


class PhaseClock:
    """Per-step phase times for a library whose step we do not own: wrap its methods, then close each step."""

    def __init__(self):
        self.current: dict[str, float] = defaultdict(float)
        self.marks: dict[str, float] = {}

    def wrap(self, obj, name: str, phase: str, when=None) -> None:
        """Time ``obj.name`` (as an instance attribute) into ``phase``; only calls where ``when(*args)`` holds."""
        fn = getattr(obj, name)

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if when is not None and not when(*args, **kwargs):
                return fn(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.current[phase] += time.perf_counter() - t0

        setattr(obj, name, timed)

    def take(self) -> dict[str, float]:
        phases, self.current = dict(self.current), defaultdict(float)
        return phases


# ---------------------------------------------------------------------------------------------- TRL worker
def trl_trainer(job: dict, run_dir: str, steps: int):
    """TRL's GRPOTrainer with every setting aligned to cohortrl's (see ``SETTINGS``)."""
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(job["threads"])
    w = job["workload"]
    args = GRPOConfig(
        output_dir=run_dir, report_to="none", save_strategy="no", logging_steps=10**9, disable_tqdm=True,
        use_cpu=True, seed=job["seed"], data_seed=job["seed"], max_steps=steps,
        bf16=False, fp16=False,  # TRL defaults bf16 to True when fp16 is off
        gradient_checkpointing=False,  # TRL's default is True
        per_device_train_batch_size=w["prompts"] * w["group"], gradient_accumulation_steps=1,
        num_generations=w["group"], max_completion_length=w["tokens"],
        temperature=1.0, top_p=1.0, top_k=0,
        generation_kwargs={"min_new_tokens": w["tokens"]},  # EOS suppressed: every completion has T tokens
        beta=job["beta"], num_iterations=1, epsilon=0.2, loss_type="grpo", scale_rewards="group",
        use_bias_correction_kl=False,  # TRL's default multiplies the KL term by the (differentiable) ratio
        learning_rate=job["lr"], lr_scheduler_type="constant",  # TRL's default decays linearly
        weight_decay=0.0, max_grad_norm=1.0, model_init_kwargs={"dtype": "float32"},
    )
    rows = [{"prompt": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": r["prompt"]}],
             "answer": r["answer"]} for r in job["rows"]]
    peft = {"peft_config": lora_config(w["lora"])} if w["lora"] else {}
    return GRPOTrainer(model=job["model_dir"], reward_funcs=digit_share, args=args, train_dataset=Dataset.from_list(rows),
                       **peft)


def trl_bench(job: dict) -> dict:
    import peft
    import torch
    import transformers
    import trl
    from transformers import TrainerCallback

    t0 = time.perf_counter()
    run_dir = tempfile.mkdtemp(prefix="vs-trl-")
    trainer = trl_trainer(job, run_dir, job["steps"])
    setup_s = time.perf_counter() - t0
    clock, steps, tokens = PhaseClock(), [], []
    clock.wrap(trainer, "_generate", "generate")
    clock.wrap(trainer, "_calculate_rewards", "score")
    # With PEFT, TRL has no reference model: the reference pass is the policy's, run with its adapter disabled.
    adapter_layer = None
    if job["workload"]["lora"]:
        from peft.tuners.tuners_utils import BaseTunerLayer

        adapter_layer = next(m for m in trainer.model.modules() if isinstance(m, BaseTunerLayer))
    clock.wrap(trainer, "_get_per_token_logps_and_entropies", "reference",
               when=lambda model, *a, **k: model is trainer.ref_model
               or (adapter_layer is not None and adapter_layer.disable_adapters))
    clock.wrap(trainer, "compute_loss", "fwd_bwd")
    clock.wrap(trainer.accelerator, "backward", "fwd_bwd")
    clock.wrap(trainer, "_clip_grad_norm", "optimizer")
    clock.wrap(trainer, "_get_grad_norm", "optimizer")
    generate_and_score = trainer._generate_and_score_completions

    def counted(*args, **kwargs):
        out = generate_and_score(*args, **kwargs)
        tokens.append(int(out["completion_mask"].sum()))
        return out

    trainer._generate_and_score_completions = counted

    class StepTimes(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            clock.take()  # drop anything timed between steps
            clock.marks["step"] = time.perf_counter()

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            clock.marks["optimizer"] = time.perf_counter()

        def on_optimizer_step(self, args, state, control, **kwargs):
            clock.current["optimizer"] += time.perf_counter() - clock.marks["optimizer"]

        def on_step_end(self, args, state, control, **kwargs):
            steps.append({"step_s": time.perf_counter() - clock.marks["step"], **clock.take()})

    trainer.add_callback(StepTimes())
    trainer.train()
    shutil.rmtree(run_dir, ignore_errors=True)
    for row, n in zip(steps, tokens):
        row["tokens"] = n
    probe = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": job["rows"][0]["prompt"]}]
    if "cohortrl" in sys.modules:
        raise RuntimeError("the TRL worker imported cohortrl")
    return {
        "library": "trl", "setup_s": setup_s, "steps": steps, "peak_rss_mb": peak_rss_mb(),
        "probe_prompt_ids": list(trainer._tokenize_prompts([probe])[0][0]),
        "threads": torch.get_num_threads(), "optimizer": type(trainer.optimizer.optimizer).__name__
        + (" (fused)" if trainer.optimizer.optimizer.defaults.get("fused") else ""),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__,
                     "peft": peft.__version__},
    }


def trl_check(job: dict) -> dict:
    """TRL's loss and gradient norm on the fixed batch: ``_generate_and_score_completions`` builds the inputs
    from the batch's ids and rewards (generation and the reward functions replaced by the batch), then the
    batch's reference log-probs replace TRL's own and ``compute_loss`` + backward run as in ``training_step``."""
    import torch

    batch = torch.load(job["batch"])
    B = len(batch["completion_ids"])
    run_dir = tempfile.mkdtemp(prefix="vs-trl-check-")
    trainer = trl_trainer(job, run_dir, 1)
    adapter = load_adapter(trainer.model, job["adapter"]) if job["workload"]["lora"] else None
    prompt_ids = [batch["prompt_ids"][i].tolist() for i in range(B)]
    completions = trainer.processing_class.batch_decode(batch["completion_ids"], skip_special_tokens=True)
    trainer._generate = lambda prompts: (prompt_ids, batch["completion_ids"], None,
                                         [[{"role": "assistant", "content": c}] for c in completions], None, {}, None, None)
    trainer._calculate_rewards = lambda *args: batch["rewards"].unsqueeze(1).clone()
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop, which we do not run
    rows = [{"prompt": [{"role": "user", "content": "(fixed batch)"}], "answer": ""}] * B
    inputs = trainer._generate_and_score_completions(rows)
    T = inputs["completion_ids"].shape[1]
    inputs["ref_per_token_logps"] = batch["ref_logp"][:, :T]
    loss = trainer.compute_loss(trainer.model, inputs)
    trainer.accelerator.backward(loss)
    shutil.rmtree(run_dir, ignore_errors=True)
    return {"loss": loss.item(), "grad_norm": grad_norm(trainer.model), "advantages": inputs["advantages"].tolist(),
            "adapter": adapter}


# ---------------------------------------------------------------------------------------------- cohortrl worker
def cohortrl_config(job: dict) -> dict:
    w = job["workload"]
    return {
        "model": {"name": job["model_dir"], "dtype": "float32", "system_prompt": SYSTEM_PROMPT,
                  "lora": {"enabled": True, **w["lora"]} if w["lora"] else {"enabled": False}},
        "data": {"eval_size": 0, "max_prompt_tokens": 512},
        # EOS suppressed until T tokens: every completion has exactly T tokens, as in TRL below.
        "sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": w["tokens"], "min_new_tokens": w["tokens"]},
        "algorithm": {
            "name": "grpo", "estimator": "grpo", "group_size": w["group"], "prompts_per_step": w["prompts"],
            "beta": job["beta"], "kl_estimator": "k3", "policy_loss": "clip", "clip_low": 0.2, "clip_high": 0.2,
            "aggregation": "seq-mean-token-mean", "epochs": 1, "minibatches": 1, "micro_batch_size": 0,
            "eps": 1e-4,  # TRL divides by std + 1e-4
        },
        "optim": {"lr": job["lr"], "weight_decay": 0.0, "max_grad_norm": 1.0, "schedule": "constant", "warmup_steps": 0},
        "train": {"steps": job["steps"], "seed": job["seed"], "threads": job["threads"], "progress": False, "device": "cpu"},
        "eval": {"before": False, "n_prompts": 0},
    }


def cohortrl_bench(job: dict) -> dict:
    import peft
    import torch
    import transformers

    from cohortrl.rollout.hf import encode_prompts
    from cohortrl.trainers import make_trainer

    t0 = time.perf_counter()
    run_dir = tempfile.mkdtemp(prefix="vs-cohortrl-")
    trainer = make_trainer(cohortrl_config(job), run_dir, train_dataset=job["rows"], reward_funcs=[digit_share])
    setup_s = time.perf_counter() - t0
    B, steps = job["workload"]["prompts"] * job["workload"]["group"], []
    for _ in range(job["steps"]):
        m = trainer.step()
        trainer.step_count += 1
        steps.append({
            "step_s": m["time/step"], "generate": m["time/generate"], "score": m["time/score"],
            "reference": m["time/reference"], "fwd_bwd": m["time/train"] - m["time/optimizer"],
            "optimizer": m["time/optimizer"], "tokens": round(m["response_length_mean"] * B),
            "reused": m["rollout_forward_reused"],
        })
    trainer.close()
    shutil.rmtree(run_dir, ignore_errors=True)
    model = trainer.model
    embedding, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    probe_ids, _, _ = encode_prompts(trainer.tokenizer, [job["rows"][0]["prompt"]], SYSTEM_PROMPT, 512, "reject")
    return {
        "library": "cohortrl", "setup_s": setup_s, "steps": steps, "peak_rss_mb": peak_rss_mb(),
        "probe_prompt_ids": probe_ids[0].tolist(), "threads": torch.get_num_threads(),
        "optimizer": type(trainer.optimizer).__name__ + (" (fused)" if trainer.optimizer.defaults.get("fused") else ""),
        "params": {"total": sum(p.numel() for p in model.parameters()), "embedding": embedding.numel(),
                   "head": head.numel(), "tied": head.data_ptr() == embedding.data_ptr()},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__},
    }


def cohortrl_check(job: dict) -> dict:
    """cohortrl's loss and gradient norm on the fixed batch, from its public pieces composed as its update
    does (``update`` in trainers/step.py): response log-probs, the configured advantage estimator, policy loss
    and KL, weighted by ``token_weights`` of the configured aggregation."""
    import torch

    from cohortrl.algorithms import get_advantage_estimator, get_policy_loss, kl_penalty
    from cohortrl.config import Config
    from cohortrl.models import load_model
    from cohortrl.rollout.hf import response_logprobs
    from cohortrl.algorithms import token_weights
    from cohortrl.trainers.setup import build_policy

    torch.set_num_threads(job["threads"])
    config = Config.from_dict(cohortrl_config(job))
    a = config.algorithm
    batch = torch.load(job["batch"])
    model, tokenizer = load_model(job["model_dir"], dtype="float32")
    model, _ = build_policy(config.model, job["seed"], model, tokenizer)  # the adapter, if any; training mode
    adapter = load_adapter(model, job["adapter"]) if job["workload"]["lora"] else None
    lengths = [len(ids) for ids in batch["completion_ids"]]
    T = max(lengths)
    response_mask = torch.tensor([[1] * n + [0] * (T - n) for n in lengths])
    response_ids = torch.tensor([ids + [tokenizer.pad_token_id] * (T - len(ids)) for ids in batch["completion_ids"]])
    input_ids = torch.cat([batch["prompt_ids"], response_ids], dim=1)
    attention_mask = torch.cat([torch.ones_like(batch["prompt_ids"]), response_mask], dim=1)
    logp, _ = response_logprobs(model, input_ids, attention_mask, response_ids, temperature=1.0)
    advantages = get_advantage_estimator(a.estimator)(
        rewards=batch["rewards"], response_mask=response_mask, group_size=job["workload"]["group"], eps=a.eps)
    loss_BT, _ = get_policy_loss(a.policy_loss)(
        logp=logp, old_logp=logp.detach(), advantages=advantages, response_mask=response_mask,
        clip_low=a.clip_low, clip_high=a.clip_high, dual_clip=a.dual_clip)
    loss_BT = loss_BT + a.beta * kl_penalty(logp, batch["ref_logp"][:, :T], a.kl_estimator)
    w = token_weights(response_mask, a.aggregation, job["workload"]["tokens"])
    loss = torch.where(w != 0, w * loss_BT, 0.0).sum()
    loss.backward()
    return {"loss": loss.item(), "grad_norm": grad_norm(model), "advantages": advantages[:, 0].tolist(), "adapter": adapter}


WORKERS = {("trl", "bench"): trl_bench, ("trl", "check"): trl_check,
           ("cohortrl", "bench"): cohortrl_bench, ("cohortrl", "check"): cohortrl_check}


# ---------------------------------------------------------------------------------------------- parent
def ensure_trl_venv(path: Path) -> Path:
    """The TRL venv's python; the venv is created (or completed) with our torch, transformers and peft versions."""
    from importlib.metadata import version

    python = path / "bin" / "python"
    pins = [f"torch=={version('torch').split('+')[0]}", f"transformers=={version('transformers')}", f"trl=={TRL_VERSION}",
            f"peft=={version('peft')}"]  # TRL's LoRA (peft_config=) is PEFT's, the same version as cohortrl's
    probe = ("import torch, transformers, trl, peft; "
             "print(torch.__version__.split('+')[0], transformers.__version__, trl.__version__, peft.__version__)")
    if python.exists():
        out = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, env=worker_env(None, 1))
        if out.returncode == 0 and out.stdout.split() == [p.split("==")[1] for p in pins]:
            return python
    else:
        print(f"creating the TRL venv in {path}", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    print(f"installing {' '.join(pins)} into {path}", flush=True)
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", *pins], check=True, env=worker_env(None, 1))
    return python


def worker_env(pythonpath: str | None, threads: int) -> dict:
    """The environment of a worker: cohortrl's sees this repository first; TRL's sees no PYTHONPATH at all."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    return env


def run_worker(python: Path, library: str, job: dict, work: Path) -> dict:
    job_path = work / f"job-{library}-{job['mode']}.json"
    job_path.write_text(json.dumps(job))
    pythonpath = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p) if library == "cohortrl" else None
    cmd = [str(python), str(Path(__file__).resolve()), "--worker", library, "--job", str(job_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=worker_env(pythonpath, job["threads"]))
    lines = [line for line in out.stdout.splitlines() if line.startswith(RESULT_MARK)]
    if out.returncode != 0 or not lines:
        sys.exit(f"{library} worker ({job['mode']}, {Path(job['model_dir']).name}) failed:\n{out.stderr[-4000:]}")
    return json.loads(lines[-1][len(RESULT_MARK):])


def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as a transformers directory (cohortrl's cached conversion of the embedded GGUF)."""
    sys.path.insert(0, str(REPO))
    from cohortrl.models import cohortrl_home, load_model

    path = cohortrl_home() / "models" / SMOLLM2
    if not (path / "config.json").exists():
        load_model(SMOLLM2)  # converts and caches it
    return path


def build_tiny_model(directory: Path, tokenizer_dir: Path, seed: int) -> Path:
    """The tiny random Llama (weights fixed by ``seed``) with SmolLM2's tokenizer, saved for both libraries."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(vocab_size=len(tokenizer), tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **TINY_SHAPE)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def check_batch(model_dir: Path, rows: list[dict], group: int, path: Path, seed: int) -> dict:
    """A fixed batch for the equivalence check, from plain transformers (neither library): 2 prompts x G, the
    chat-templated prompts (equal lengths: no left padding), random completions of unequal lengths (so the
    per-sequence mean differs from the token mean), rewards with spread in the first group and none in the
    second (a zero-variance group), and reference log-probs = the model's own + N(0, 0.5²) noise (so the KL term
    and its gradient are far from 0)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    chats = [[{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": r["prompt"]}] for r in rows[:2]]
    prompt_ids = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
                  for c in chats for _ in range(group)]
    if len({len(p) for p in prompt_ids}) != 1:
        raise ValueError("check prompts must have equal token lengths (no left padding)")
    B, T = len(prompt_ids), 24
    lengths = [T - (3 * i) % 13 for i in range(B)]
    # Ordinary tokens only: ids below 100 hold SmolLM2's special tokens (EOS, pad, chat markers).
    completion_ids = [torch.randint(100, len(tokenizer), (n,), generator=g).tolist() for n in lengths]
    rewards = torch.cat([torch.rand(group, generator=g), torch.ones(group)])
    ids = torch.tensor([p + c + [tokenizer.pad_token_id] * (T - len(c)) for p, c in zip(prompt_ids, completion_ids)])
    mask = torch.tensor([[1] * len(p) + [1] * len(c) + [0] * (T - len(c)) for p, c in zip(prompt_ids, completion_ids)])
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits[:, -T - 1 : -1].float()
    logp = logits.log_softmax(-1).gather(-1, ids[:, -T:].unsqueeze(-1)).squeeze(-1)
    response_mask = mask[:, -T:].bool()
    ref_logp = torch.where(response_mask, logp + 0.5 * torch.randn(logp.shape, generator=g), 0.0)
    batch = {"prompt_ids": torch.tensor(prompt_ids), "completion_ids": completion_ids, "rewards": rewards, "ref_logp": ref_logp}
    torch.save(batch, path)
    return {"B": B, "prompt_tokens": len(prompt_ids[0]), "completion_lengths": lengths}


def check_adapter(model_dir: Path, lora: dict, path: Path, seed: int) -> str:
    """The adapter both workers load for the check (saved as PEFT's state dict), so both start from the same
    weights; returns its fingerprint. ``lora_A`` from PEFT's own initialisation under ``seed``; ``lora_B`` drawn
    from N(0, 0.02²) instead of PEFT's zeros, so the adapter changes the model's output and ``lora_A``'s gradient
    is not zero (with ``lora_B`` = 0 the check would compare only ``lora_B``'s gradient, and the base model's
    loss)."""
    import torch
    from peft import get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), lora_config(lora))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.copy_(0.02 * torch.randn(param.shape, generator=g))
    torch.save(get_peft_model_state_dict(model), path)
    return adapter_fingerprint(model)


def matmul_peak_gflops(threads: int, n: int = 2048, repeats: int = 9) -> dict:
    """Median fp32 GFLOP/s of n³ matmuls (2n³ FLOPs each) on ``threads`` threads, in this process."""
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return {"gflops": 2 * n**3 / statistics.median(times) / 1e9, "n": n, "repeats": repeats}


def summarise(results: list[dict]) -> dict:
    """Medians over the timed steps (every worker's first step is its warm-up) of one library's workers."""
    timed = [s for r in results for s in r["steps"][1:]]
    out = {"n": len(timed), "step_s": statistics.median(s["step_s"] for s in timed),
           "tokens": statistics.median(s["tokens"] for s in timed),
           "tokens_per_s": statistics.median(s["tokens"] / s["step_s"] for s in timed),
           "peak_rss_mb": max(r["peak_rss_mb"] for r in results), "setup_s": statistics.median(r["setup_s"] for r in results),
           "warmup_s": [r["steps"][0]["step_s"] for r in results],
           "step_list": [[s["step_s"] for s in r["steps"][1:]] for r in results]}
    for phase in PHASES:
        out[phase] = statistics.median(s.get(phase, 0.0) for s in timed)
    out["other"] = statistics.median(s["step_s"] - sum(s.get(p, 0.0) for p in PHASES) for s in timed)
    return out


def training_flops(cohortrl_result: dict, workload: dict, prompt_tokens: int) -> tuple[float, float, str, bool]:
    """FLOPs of one update (forward + backward) by 6·N·positions, as (model FLOPs, executed FLOPs, formula,
    whether the update reused decoding's forward).

    Model FLOPs: the body's N_body weights see every position of every row's [prompt | completion]; the LM head
    (V·d weights) sees only the T + 1 positions that predict completion tokens (any implementation needs those).
    Executed: what cohortrl's update runs. Each group's prompt goes through once (shared prompts), so the body sees
    P·Tp + B·T positions. When the update reuses decoding's forward (``train.reuse_rollout_forward``, reported
    by the trainer per step) it runs only the backward, 4·N per position: the forward's 2·N ran during
    generation and is timed there. The embedding lookup is no matmul; attention's score and value products are
    left out (small at these lengths)."""
    p = cohortrl_result["params"]
    reused = all(s["reused"] for s in cohortrl_result["steps"])
    n_body = p["total"] - p["embedding"] - (0 if p["tied"] else p["head"])
    P, B, T = workload["prompts"], workload["prompts"] * workload["group"], workload["tokens"]
    head = 6 * p["head"] * B * (T + 1)
    model_flops = 6 * n_body * B * (prompt_tokens + T) + head
    per = 4 if reused else 6
    executed = per * n_body * (P * prompt_tokens + B * T) + per * p["head"] * B * (T if reused else T + 1)
    formula = (f"model FLOPs 6·N_body·B·(Tp+T) + 6·N_head·B·(T+1) = 6·{n_body / 1e6:.1f}M·{B}·({prompt_tokens}+{T}) + "
               f"6·{p['head'] / 1e6:.1f}M·{B}·{T + 1} = {model_flops / 1e9:.1f} GFLOP per update "
               f"(N_body: all {p['total'] / 1e6:.1f}M parameters less the {p['embedding'] / 1e6:.1f}M embedding"
               f"{'' if p['tied'] else ' and the LM head'}; N_head = V·d{', tied to the embedding' if p['tied'] else ''}); "
               + (f"executed by the update, which reused decoding's forward (backward only, each group's prompt once): "
                  f"4·N_body·(P·Tp + B·T) + 4·N_head·B·T = 4·{n_body / 1e6:.1f}M·({P}·{prompt_tokens} + {B}·{T}) + … = "
                  f"{executed / 1e9:.1f} GFLOP" if reused else
                  f"executed, each group's prompt once: 6·N_body·(P·Tp + B·T) + 6·N_head·B·(T+1) = "
                  f"6·{n_body / 1e6:.1f}M·({P}·{prompt_tokens} + {B}·{T}) + … = {executed / 1e9:.1f} GFLOP"))
    return model_flops, executed, formula, reused


# ---------------------------------------------------------------------------------------------- report
def seconds(values, spec: str = "{:.2f}") -> str:
    return ", ".join(spec.format(v) for v in values)


def ratio(ours, theirs) -> str:
    return f"{ours / theirs:.2f}x" if theirs else "-"


def results_table(trl: dict, ours: dict) -> list[str]:
    lines = ["| per step (median over timed steps) | TRL | cohortrl | cohortrl / TRL |", "|---|---:|---:|---:|"]

    def row(label, key, spec="{:.2f}"):
        lines.append(f"| {label} | {spec.format(trl[key])} | {spec.format(ours[key])} | {ratio(ours[key], trl[key])} |")

    row("wall time (s)", "step_s")
    row("completion tokens per step", "tokens", "{:.0f}")
    row("completion tokens / s", "tokens_per_s", "{:.1f}")
    for phase in (*PHASES, "other"):
        row(f"  {PHASE_LABELS[phase]}", phase)
    row("peak RSS (MB, max over workers)", "peak_rss_mb", "{:.0f}")
    row("setup: load model(s), build trainer (s)", "setup_s")
    lines.append(f"| timed steps (warm-up steps excluded) | {trl['n']} | {ours['n']} | |")
    return lines


def workload_settings(models: dict) -> dict[str, str]:
    """The settings table's rows that differ between workloads (what is trained, β and the reference), one row
    per distinct setting, naming the workloads it holds for."""
    rows = {"fine_tuning": defaultdict(list), "kl": defaultdict(list)}
    for name, m in models.items():
        lora, beta = m["workload"]["lora"], m["beta"]
        if lora:
            targets = ", ".join(lora["target_modules"])
            trl_ft = (f"LoRA: `peft_config=LoraConfig(r={lora['r']}, lora_alpha={lora['alpha']}, "
                      f"lora_dropout={lora['dropout']}, target_modules=[{targets}], task_type=\"CAUSAL_LM\")`")
            ours_ft = (f"LoRA (`model.lora`: enabled, r {lora['r']}, alpha {lora['alpha']}, dropout {lora['dropout']}, "
                       f"target_modules [{targets}]): the same PEFT `LoraConfig`")
            # Timed runs start from each library's own PEFT initialisation; the check loads one shared adapter.
            trl_ft += "; PEFT's initial adapter (B = 0: the model starts as the base)"
            ours_ft += "; PEFT's initial adapter (B = 0)"
            reference = "the policy with its adapter disabled (the base weights)"
        else:
            trl_ft, ours_ft = "full (no PEFT)", "full (`model.lora.enabled: false`)"
            reference = "a frozen copy of the initial model"
        rows["fine_tuning"][trl_ft, ours_ft].append(name)
        rows["kl"][(f"`beta={beta}`, k3 in the loss, `use_bias_correction_kl=False` (TRL's default multiplies it by "
                    f"the ratio); reference: {reference}"), f"`beta: {beta}`, `kl_estimator: k3`; reference: {reference}"
                   ].append(name)
    label = {"fine_tuning": "fine-tuning", "kl": "KL"}
    return {key: "\n".join(f"| {label[key]} ({', '.join(names)}) | {trl} | {ours} |" for (trl, ours), names in by.items())
            for key, by in rows.items()}


def write_report(path: Path, args, machine: dict, models: dict, peak: list[dict], check: dict) -> str:
    quick = " — QUICK SMOKE RUN (1 round × 2 steps, tiny model only): not a measurement" if args.quick else ""
    lines = [f"# cohortrl vs TRL: GRPO step time, side by side{quick}", "",
             f"Generated by `benchmarks/vs_trl.py` on {time.strftime('%Y-%m-%d %H:%M')}. Command:", "",
             "    " + " ".join([python_command(), "benchmarks/vs_trl.py", *sys.argv[1:]]), "",
             "## Machine", "",
             f"- CPU: {machine['cpu']}, {machine['cores']} cores visible; {machine['threads']} torch thread(s) per worker "
             f"(`torch.set_num_threads`, OMP_NUM_THREADS)",
             f"- {machine['memory']}; Python {platform.python_version()}, {platform.platform()}",
             f"- cohortrl venv: torch {machine['ours']['torch']}, transformers {machine['ours']['transformers']}, "
             f"peft {machine['ours']['peft']}; TRL venv ({args.trl_venv}): torch {machine['trl']['torch']}, "
             f"transformers {machine['trl']['transformers']}, trl {machine['trl']['trl']}, peft {machine['trl']['peft']}",
             f"- fp32 matmul peak, {peak[0]['n']}³, {args.threads} thread(s) (median of {peak[0]['repeats']}), measured in this "
             f"run: {seconds([p['gflops'] for p in peak], '{:.0f}')} GFLOP/s (before / after the benchmark)", "",
             "## Settings (identical in both libraries)", "",
             SETTINGS.format(lr=args.lr, seed=args.seed, threads=args.threads, **workload_settings(models)), ""]
    for name, m in models.items():
        w, trl, ours = m["workload"], m["trl"], m["cohortrl"]
        lines += [f"## {name}: {w['about']}", "",
                  f"P = {w['prompts']} prompts × G = {w['group']} = {w['prompts'] * w['group']} completions of exactly "
                  f"{w['tokens']} tokens per step; prompts are {m['prompt_tokens']} tokens after the chat template "
                  f"(identical ids in both libraries: {'yes' if m['same_prompt_ids'] else 'NO'}); "
                  f"trains {'a LoRA adapter' if w['lora'] else 'every weight'}, β = {m['beta']} (settings above); "
                  f"{args.rounds} round(s) of TRL then cohortrl, {args.steps} steps per worker (the first a warm-up). "
                  f"Optimiser: TRL {m['trl_optimizer']}, cohortrl {m['cohortrl_optimizer']}.", ""]
        lines += results_table(trl, ours)
        lines += ["", f"Warm-up steps (s): TRL {seconds(trl['warmup_s'])}; "
                      f"cohortrl {seconds(ours['warmup_s'])}. Timed steps per worker (s): "
                      f"TRL {json.dumps([[round(x, 2) for x in r] for r in trl['step_list']])}; "
                      f"cohortrl {json.dumps([[round(x, 2) for x in r] for r in ours['step_list']])}.", ""]
        if "mfu" in m:
            f = m["mfu"]
            credit = ("the prompt sharing and the forward that ran during generation, so it can exceed 100%"
                      if f["reused"] else "the prompt sharing")
            lines += [f"Training throughput of cohortrl: {f['formula']}. Over the whole training phase "
                      f"(`time/train`, {ours['fwd_bwd'] + ours['optimizer']:.2f} s): {f['train_gflops']:.1f} GFLOP/s of model "
                      f"FLOPs = **{f['train_pct']:.0f}%** of the measured matmul peak ({f['peak']:.0f} GFLOP/s); forward + "
                      f"backward alone: {f['fwd_bwd_gflops']:.1f} GFLOP/s = {f['fwd_bwd_pct']:.0f}%. Counting only the FLOPs "
                      f"the update executes: {f['executed_gflops']:.1f} GFLOP/s = **{f['executed_pct']:.0f}%** "
                      f"of the peak over the training phase (the hardware's utilisation; the model-FLOP figure also credits "
                      f"{credit}).", ""]
    lines += ["## Numeric equivalence (same weights, same fixed batch)", "", CHECK_NOTES, "",
              "| model | TRL loss | cohortrl loss | rel. diff | TRL grad norm | cohortrl grad norm | rel. diff | max abs diff of advantages | initial LoRA adapter | within 1e-4 |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for name, c in check.items():
        adapter = "— (full fine-tuning)"
        if "adapter" in c:
            adapter = (f"the same in both (sha256 {c['adapter'][:12]})" if c["same_adapter"] else
                       f"**differs**: saved {c['adapter'][:12]}, TRL {str(c['trl']['adapter'])[:12]}, cohortrl "
                       f"{str(c['cohortrl']['adapter'])[:12]}")
        lines.append(f"| {name} | {c['trl']['loss']:.8g} | {c['cohortrl']['loss']:.8g} | {c['loss_rel']:.1e} | "
                     f"{c['trl']['grad_norm']:.8g} | {c['cohortrl']['grad_norm']:.8g} | {c['grad_rel']:.1e} | "
                     f"{c['adv_diff']:.1e} | {adapter} | {'yes' if c['ok'] else '**NO**'} |")
    if not check:
        lines.append("| (skipped: --no-check) | | | | | | | | | |")
    lines += ["", "## How phases are measured", "", PHASE_NOTES]
    text = "\n".join(lines)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return text


SETTINGS = """\
| setting | TRL `GRPOConfig` | cohortrl config |
|---|---|---|
| weights | the same directory: `from_pretrained` (fp32) | the same directory (`model.name`, fp32) |
| precision | `bf16=False` (TRL's default is bf16 when fp16 is off), `fp16=False` | `model.dtype: float32` |
| gradient checkpointing | `gradient_checkpointing=False` (TRL's default is True) | none |
| generation | `model.generate` (no vLLM, no continuous batching), `use_cpu=True` | its own KV-cache decoding loop, each prompt prefilled once per group (`sampling.backend: hf`, docs/performance.md), `train.device: cpu`; the one-token steps through `cpu/decoder.py` (Llama family, fp32, oneDNN) |
| fp32 linear kernel | PyTorch's default (MKL sgemm) | `train.cpu_linear: auto`: oneDNN (`cohortrl/cpu/kernels.py`); the same function to float rounding |
| CPU allocator | glibc's defaults | `train.cpu_allocator: auto`: freed memory kept in the process (`cohortrl/cpu/memory.py`) |
{fine_tuning}
| prompts | 81 × "What is a * b?" (single digits), system prompt "Be brief.", chat template of the model | the same rows, `model.system_prompt: "Be brief."` |
| sampling | temperature 1.0, top_p 1.0, top_k 0, `generation_kwargs={{"min_new_tokens": T}}` | temperature 1.0, top_p 1.0, top_k 0, `min_new_tokens` = `max_new_tokens` = T |
| batch | `per_device_train_batch_size` = P·G, `num_generations` = G, `gradient_accumulation_steps=1` | `prompts_per_step` = P, `group_size` = G, one micro-batch |
| reward | `digit_share` (share of digit characters), the same function | the same |
| advantages | `scale_rewards="group"`: (r − mean_g) / (std_g + 1e-4), Bessel std | estimator `grpo`, `eps: 1e-4` |
| loss | `loss_type="grpo"`: per-sequence token mean, then mean over sequences | `aggregation: seq-mean-token-mean` |
| clipping | `epsilon=0.2` (`epsilon_high` = epsilon) | `clip_low = clip_high = 0.2` |
{kl}
| updates | `num_iterations=1` (μ = 1, on-policy) | `epochs: 1`, `minibatches: 1` |
| the update's forward | `compute_loss` runs the policy over the batch again | `train.reuse_rollout_forward: true`: the update differentiates the forward decoding ran (`cpu/replay.py`); the same gradient to float rounding |
| optimiser | AdamW (transformers' default `adamw_torch_fused`), lr {lr}, betas (0.9, 0.999), eps 1e-8, weight decay 0, `lr_scheduler_type="constant"` (TRL's default is linear decay), max grad norm 1.0 | `torch.optim.AdamW` (fused), lr {lr}, betas (0.9, 0.999), eps 1e-8, weight decay 0, constant schedule, max grad norm 1.0 |
| seed, threads | seed {seed}, {threads} torch thread(s), one process | seed {seed}, {threads} torch thread(s), one process |
"""

CHECK_NOTES = """\
The batch is built once by plain transformers (neither library): 2 prompts × G completions of random ordinary
tokens with unequal lengths (24 down to 12, so the per-sequence mean matters), rewards with spread in the first
group and all equal in the second, and fixed reference log-probs (the model's own plus N(0, 0.5²) noise, so the
k3 term is far from 0). Prompts have equal token lengths: TRL's training forward passes no position ids, so a
left-padded prompt would see other positions in TRL than during its own generation (cohortrl rebuilds them from
the mask); equal lengths keep that difference out of the check. TRL: `_generate_and_score_completions` on the
batch (generation and reward functions replaced by the batch's ids and rewards; TRL computes the advantages),
the batch's reference log-probs, then `compute_loss` + `accelerator.backward`. cohortrl: `response_logprobs`,
the `grpo` advantage estimator, the `clip` policy loss plus β·k3 `kl_penalty`, weighted by `token_weights` as in
its update. Gradient norms are total L2 norms over all parameters, accumulated in float64; both before any
clipping. With LoRA both start from one adapter, made once in the parent (`lora_A` from PEFT's initialisation,
`lora_B` from N(0, 0.02²) rather than PEFT's zeros, so that the adapter changes the output and `lora_A`'s
gradient is not zero), saved, and loaded by both workers over their own; each worker reports its adapter's
SHA-256, which must equal the saved one for the check to pass; the gradient norm is then over the adapter's
weights (the base is frozen). One update at ratio 1: the policy term of the loss is −mean(A) = 0 in value, so
the loss value checks the advantages and the KL term, and the gradient norm checks the policy-gradient and KL
gradients. The check runs cohortrl's own-forward path; the timed steps differentiate decoding's forward
instead, which `tests/cpu/test_replay.py` checks against that path parameter by parameter."""


# ---------------------------------------------------------------------------------------------- main
def machine_info(threads: int) -> dict:
    from cohortrl.machine import cpuinfo

    cpu = cpuinfo().get("model name")
    meminfo = Path("/proc/meminfo").read_text() if Path("/proc/meminfo").exists() else ""
    mem = re.search(r"MemTotal:\s*(\d+) kB", meminfo)
    return {"cpu": cpu or platform.processor() or "unknown", "cores": os.cpu_count(),
            "memory": f"{int(mem.group(1)) / 2**20:.1f} GiB RAM" if mem else "RAM unknown", "threads": threads}


def python_command() -> str:
    exe = Path(sys.executable)
    return str(exe.relative_to(REPO)) if exe.is_relative_to(REPO) else str(exe)


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=2, help="TRL, cohortrl alternations per model")
    parser.add_argument("--steps", type=int, default=4, help="steps per worker; the first is a warm-up")
    parser.add_argument("--threads", type=int, default=2, help="torch threads in every worker")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--beta", type=float, help="KL coefficient for every workload (default: each workload's own)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trl-venv", type=Path, default=REPO / ".venv-trl", help="TRL's venv (created if missing)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "vs_trl.md")
    parser.add_argument("--no-check", action="store_true", help="skip the numeric equivalence check")
    parser.add_argument("--quick", action="store_true", help="smoke test: tiny model, 1 round x 2 steps")
    parser.add_argument("--worker", choices=["trl", "cohortrl"], help=argparse.SUPPRESS)
    parser.add_argument("--job", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        job = json.loads(args.job.read_text())
        return emit(WORKERS[args.worker, job["mode"]](job))
    if args.quick:
        args.models, args.rounds, args.steps = ["tiny"], 1, 2
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first step of every worker is a warm-up)")

    pythons = {"trl": ensure_trl_venv(args.trl_venv), "cohortrl": Path(sys.executable)}
    machine = machine_info(args.threads)
    peak = [matmul_peak_gflops(args.threads)]
    print(f"fp32 matmul peak: {peak[0]['gflops']:.0f} GFLOP/s", flush=True)
    rows = prompt_rows()
    base = {"threads": args.threads, "seed": args.seed, "lr": args.lr, "rows": rows}
    models, check = {}, {}
    with tempfile.TemporaryDirectory(prefix="vs-trl-") as tmp:
        work = Path(tmp)
        smol = smollm2_dir()
        dirs = {"smollm2": smol}
        if any(WORKLOADS[name]["model"] == "tiny" for name in args.models):
            dirs["tiny"] = build_tiny_model(work / "tiny-llama", smol, args.seed)
        for name in args.models:
            w = WORKLOADS[name]
            model_dir = dirs[w["model"]]
            job = {**base, "model_dir": str(model_dir), "workload": w, "steps": args.steps,
                   "beta": w["beta"] if args.beta is None else args.beta}
            if not args.no_check:
                info = check_batch(model_dir, rows, w["group"], work / f"check-{name}.pt", args.seed)
                cjob = {**job, "mode": "check", "batch": str(work / f"check-{name}.pt")}
                if w["lora"]:
                    cjob["adapter"] = str(work / f"adapter-{name}.pt")
                    info["adapter"] = check_adapter(model_dir, w["lora"], Path(cjob["adapter"]), args.seed)
                got = {lib: run_worker(pythons[lib], lib, cjob, work) for lib in ("trl", "cohortrl")}
                c = {**got, "loss_rel": rel(got["trl"]["loss"], got["cohortrl"]["loss"]),
                     "grad_rel": rel(got["trl"]["grad_norm"], got["cohortrl"]["grad_norm"]),
                     "adv_diff": max(abs(x - y) for x, y in zip(got["trl"]["advantages"], got["cohortrl"]["advantages"])), **info}
                # With LoRA, both workers must hold the adapter that was saved, bit for bit.
                c["same_adapter"] = got["trl"]["adapter"] == got["cohortrl"]["adapter"] == info.get("adapter")
                c["ok"] = c["loss_rel"] < 1e-4 and c["grad_rel"] < 1e-4 and c["same_adapter"]
                check[name] = c
                adapter = (f"; adapter {'identical' if c['same_adapter'] else 'DIFFERS'} in both (sha256 "
                           f"{str(got['trl']['adapter'])[:12]} / {str(got['cohortrl']['adapter'])[:12]})" if w["lora"] else "")
                print(f"[{name}] check: loss TRL {got['trl']['loss']:.8g} cohortrl {got['cohortrl']['loss']:.8g} "
                      f"(rel {c['loss_rel']:.1e}); grad norm TRL {got['trl']['grad_norm']:.8g} cohortrl "
                      f"{got['cohortrl']['grad_norm']:.8g} (rel {c['grad_rel']:.1e}){adapter} -> "
                      f"{'ok' if c['ok'] else 'MISMATCH'}", flush=True)
            results = defaultdict(list)
            for r in range(args.rounds):
                for lib in ("trl", "cohortrl"):
                    out = run_worker(pythons[lib], lib, {**job, "mode": "bench"}, work)
                    results[lib].append(out)
                    if out["threads"] != args.threads:  # a library that resets torch's thread count would skew the race
                        print(f"warning: the {lib} worker ran on {out['threads']} torch threads, not {args.threads}", flush=True)
                    print(f"[{name}] round {r + 1} {lib}: steps (s) {seconds([s['step_s'] for s in out['steps']])}; "
                          f"peak RSS {out['peak_rss_mb']:.0f} MB", flush=True)
            trl_runs, our_runs = results["trl"], results["cohortrl"]
            m = {"workload": w, "beta": job["beta"], "trl": summarise(trl_runs), "cohortrl": summarise(our_runs),
                 "prompt_tokens": len(our_runs[0]["probe_prompt_ids"]),
                 "same_prompt_ids": all(r["probe_prompt_ids"] == our_runs[0]["probe_prompt_ids"] for r in trl_runs + our_runs),
                 "trl_optimizer": trl_runs[0]["optimizer"], "cohortrl_optimizer": our_runs[0]["optimizer"]}
            machine["trl"], machine["ours"] = trl_runs[0]["versions"], our_runs[0]["versions"]
            if name == "smollm2":  # training_flops counts every weight's gradient: full fine-tuning only
                m["flops_result"] = training_flops(our_runs[0], w, m["prompt_tokens"])
            models[name] = m
    peak.append(matmul_peak_gflops(args.threads))
    best = statistics.median(p["gflops"] for p in peak)
    for m in models.values():
        if "flops_result" in m:
            flops, executed, formula, reused = m.pop("flops_result")
            ours = m["cohortrl"]
            train_s = ours["fwd_bwd"] + ours["optimizer"]
            m["mfu"] = {"formula": formula, "peak": best, "reused": reused, "train_gflops": flops / train_s / 1e9,
                        "fwd_bwd_gflops": flops / ours["fwd_bwd"] / 1e9, "executed_gflops": executed / train_s / 1e9}
            m["mfu"]["executed_pct"] = 100 * m["mfu"]["executed_gflops"] / best
            m["mfu"]["train_pct"] = 100 * m["mfu"]["train_gflops"] / best
            m["mfu"]["fwd_bwd_pct"] = 100 * m["mfu"]["fwd_bwd_gflops"] / best
    print(write_report(args.out, args, machine, models, peak, check))
    print(f"\nwrote {args.out}")
    if check and not all(c["ok"] for c in check.values()):
        sys.exit("numeric equivalence check FAILED (see the report)")


if __name__ == "__main__":
    main()
