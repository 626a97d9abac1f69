"""Training in bfloat16: full fine-tuning at a realistic learning rate moves the weights (AdamW on float32 master
copies; on bf16 weights directly, updates of ~1e-5 round away), the master copies survive a checkpoint in
float32; activation checkpointing gives the loss and gradients of the plain forward."""

import pytest
import torch

from cohortrl.config import LoraConfig, ModelConfig, OptimConfig
from cohortrl.models import load_model
from cohortrl.trainers.loop import float32_matmul_precision
from cohortrl.trainers.setup import MasterWeightAdamW, build_optimizer, build_policy
from cohortrl.trainers.sft import SFTTrainer
from tests.trainers.test_sft import sft_config


def test_bf16_full_fine_tuning_at_lr_1e_5_moves_the_weights(tmp_path):
    """Ten SFT steps at lr 1e-5 on bf16 weights: AdamW moves each weight by about lr per step, 1e-4 in all,
    less than the spacing of bf16 numbers between 0.01 and 0.05 (2^-14 to 2^-12: 6e-5 to 2.4e-4). Applied to the
    bf16 weights directly, every such update rounds away (0% of them changed, measured); accumulated in
    float32 master copies, most of them (70% measured) have moved by the tenth step."""
    cfg = sft_config(model={"dtype": "bfloat16"}, optim={"lr": 1e-5}, train={"steps": 10, "progress": False})
    trainer = SFTTrainer(cfg, tmp_path / "run")
    assert isinstance(trainer.optimizer, MasterWeightAdamW)
    start = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    for _ in range(10):
        trainer.step()
    changed = total = 0
    for name, p in trainer.model.named_parameters():
        assert p.dtype == torch.bfloat16  # the model itself stays in bf16
        magnitude = start[name].float().abs()
        mid = (magnitude >= 0.01) & (magnitude < 0.05)
        changed += ((p.detach() != start[name]) & mid).sum().item()
        total += mid.sum().item()
        master = trainer.optimizer.state[p]["master"]
        assert master.dtype == torch.float32
        assert torch.equal(master.to(torch.bfloat16), p.detach())  # the model holds the master, rounded
    assert total > 10_000 and changed / total > 0.5, (changed, total)


def test_master_copies_are_checkpointed_in_float32():
    """torch's ``load_state_dict`` casts a state tensor to its parameter's dtype; the master copies (and the
    moments) must come back in float32, unrounded, or a resumed run would start from bf16-rounded masters."""
    model, _ = load_model("tiny-llama", dtype="bfloat16")
    optimizer = build_optimizer(model, OptimConfig(lr=1e-3))
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.01)
    optimizer.step()
    saved = optimizer.state_dict()
    again = build_optimizer(model, OptimConfig(lr=1e-3))
    again.load_state_dict(saved)
    for p in model.parameters():
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert again.state[p][key].dtype == torch.float32, key
            assert torch.equal(again.state[p][key], optimizer.state[p][key]), key
    assert any(not torch.equal(optimizer.state[p]["master"].to(torch.bfloat16).float(), optimizer.state[p]["master"])
               for p in model.parameters())  # the masters hold more than bf16 can: a cast would lose it


def test_float32_training_keeps_plain_adamw():
    model, _ = load_model("tiny-llama")
    assert type(build_optimizer(model, OptimConfig())) is torch.optim.AdamW


def test_activation_checkpointing_recomputes_each_layer_and_gives_the_same_loss_and_gradients():
    """``train.activation_checkpointing``: each decoder layer's forward runs again in the backward (its MLP counted), and
    the loss and every gradient equal the plain forward's to float rounding. With LoRA too (the adapter's
    gradients must pass layers whose inputs, the frozen embeddings, need no gradient)."""
    torch.manual_seed(0)
    ids = torch.randint(3, 100, (2, 12))
    for lora in (False, True):
        results = []
        for checkpointing in (False, True):
            torch.manual_seed(1)  # the same initial adapter
            model, _ = build_policy(ModelConfig(name="tiny-llama", lora=LoraConfig(enabled=lora, r=4)), seed=0,
                                    activation_checkpointing=checkpointing)
            layers = [m for m in model.modules() if type(m).__name__ == "LlamaDecoderLayer"]
            calls = []
            for layer in layers:
                layer.mlp.register_forward_pre_hook(lambda *_: calls.append(1))  # inside the checkpointed forward
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
            assert grads and all(g is not None for g in grads.values())
            results.append((loss.item(), grads, len(calls), len(layers)))
        (loss0, grads0, calls0, n), (loss1, grads1, calls1, _) = results
        assert calls0 == n and calls1 == 2 * n, (lora, calls0, calls1, n)
        assert loss1 == pytest.approx(loss0, rel=1e-6)
        for name in grads0:
            torch.testing.assert_close(grads1[name], grads0[name], rtol=1e-5, atol=1e-7, msg=name)


def test_tf32_is_set_on_a_gpu_only():
    assert float32_matmul_precision(torch.device("cuda", 0), tf32=True) == "high"
    assert float32_matmul_precision(torch.device("cuda"), tf32=False) == "highest"
    assert float32_matmul_precision(torch.device("cpu"), tf32=True) is None


def test_both_trainers_turn_activation_checkpointing_on_from_the_config(tmp_path, addition_jsonl):
    from tests.trainers.test_grpo import tiny_config

    from cohortrl.trainers.grpo import GRPOTrainer

    for on in (False, True):
        sft = SFTTrainer(sft_config(train={"activation_checkpointing": on}), tmp_path / f"sft{on}")
        grpo = GRPOTrainer(tiny_config(addition_jsonl, train={"activation_checkpointing": on}), tmp_path / f"grpo{on}")
        assert sft.model.is_gradient_checkpointing == grpo.model.is_gradient_checkpointing == on
        sft.close()
        grpo.close()
