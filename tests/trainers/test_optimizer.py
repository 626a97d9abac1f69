"""The optimiser: fused AdamW on plain CPU tensors, the same update as the reference implementation; its state
allocated before the first step."""

import copy

import pytest
import torch

from cohortrl.config import OptimConfig
from cohortrl.trainers.setup import allocate_optimizer_state, build_optimizer, build_scheduler


def test_fused_adamw_takes_the_same_steps_as_the_plain_one():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1)
    fused = build_optimizer(model, cfg)
    assert fused.param_groups[0]["fused"] is True
    twin = [p.detach().clone().requires_grad_() for p in model.parameters()]
    start = [p.detach().clone() for p in model.parameters()]
    plain = torch.optim.AdamW(twin, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay, foreach=False)
    for step in range(3):
        for p, q in zip(model.parameters(), twin):
            p.grad = torch.cos(p.detach() * (step + 1))
            q.grad = torch.cos(q.detach() * (step + 1))
        fused.step()
        plain.step()
    for p, q in zip(model.parameters(), twin):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=1e-6)
    assert all(not torch.equal(p.detach(), s) for p, s in zip(model.parameters(), start))  # the steps moved them


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_state_allocated_up_front_is_the_state_a_first_step_starts_from(fused, weight_decay):
    """allocate_optimizer_state creates AdamW's state before any step without moving a weight, and three
    steps from there give bit-identical weights and state to three steps from lazily created state."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    model[0].bias.requires_grad_(False)  # a frozen parameter gets no state
    twin = copy.deepcopy(model)
    cfg = OptimConfig(lr=1e-2, weight_decay=weight_decay)
    early, lazy = build_optimizer(model, cfg), build_optimizer(twin, cfg)
    for opt in (early, lazy):
        opt.param_groups[0]["fused"] = fused
    scheduler = build_scheduler(early, cfg, total_updates=3)  # the trainer builds its scheduler first
    start = [p.detach().clone() for p in model.parameters()]
    allocate_optimizer_state(early)
    assert all(torch.equal(p.detach(), s) for p, s in zip(model.parameters(), start))
    assert all(p.grad is None for p in model.parameters())
    trained = [p for p in model.parameters() if p.requires_grad]
    assert set(early.state) == set(trained) and model[0].bias not in early.state
    for p in trained:
        state = early.state[p]
        assert float(state["step"]) == 0 and not state["exp_avg"].any() and not state["exp_avg_sq"].any()
    assert early.param_groups[0]["lr"] == cfg.lr
    for step in range(3):
        for m in (model, twin):
            for p in m.parameters():
                if p.requires_grad:
                    p.grad = torch.cos(p.detach() * (step + 1))
        early.step()
        scheduler.step()
        lazy.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p.detach(), q.detach())
    for p, q in zip(trained, [q for q in twin.parameters() if q.requires_grad]):
        for key, value in lazy.state[q].items():
            assert torch.equal(torch.as_tensor(early.state[p][key]), torch.as_tensor(value)), key
    assert not torch.equal(model[1].weight.detach(), start[2])  # the steps moved it



def _one_model_update(max_grad_norm):
    """One AdamW step of a small linear model through ``optimizer_step``: (model, optimizer, the gradient's norm
    before the step, finite, the logged norms)."""
    from cohortrl.trainers.setup import Optimised
    from cohortrl.trainers.setup import optimizer_step

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    trained = [Optimised("grad_norm", list(model.parameters()), optimizer, scheduler)]
    loss = (model(torch.randn(5, 4)) ** 2).sum() * 100  # a gradient far above the clipping threshold below
    loss.backward()
    norm = torch.cat([p.grad.flatten() for p in model.parameters()]).norm().item()
    finite, norms = optimizer_step(trained, loss.item(), max_grad_norm)
    return model, optimizer, norm, finite, norms


@pytest.mark.parametrize("max_grad_norm", [None, 1.0])
def test_the_optimiser_step_frees_the_gradients_and_clips_only_when_asked(max_grad_norm):
    """Gradients are freed (None, not zeros) once the step has used them; the logged norm is the gradient's own,
    before clipping; ``max_grad_norm=None`` clips nothing, 1.0 scales the gradient the moments see to norm 1."""
    model, optimizer, norm, finite, norms = _one_model_update(max_grad_norm)
    assert finite and norm > 10 and norms["grad_norm"] == pytest.approx(norm, rel=1e-5)
    assert all(p.grad is None for p in model.parameters())
    exp_avg = torch.cat([optimizer.state[p]["exp_avg"].flatten() for p in model.parameters()])
    seen = (exp_avg / 0.1).norm().item()  # AdamW's first moment after one step: (1 − β1)·g, β1 = 0.9
    assert seen == pytest.approx(norm if max_grad_norm is None else 1.0, rel=1e-4)


def test_the_optim_section_reaches_adamw_over_the_trainable_parameters_only():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model[0].requires_grad_(False)
    optimizer = build_optimizer(model, OptimConfig(lr=3e-3, betas=[0.8, 0.95], weight_decay=0.05))
    (group,) = optimizer.param_groups
    assert (group["lr"], group["betas"], group["weight_decay"]) == (3e-3, (0.8, 0.95), 0.05)
    assert [id(p) for p in group["params"]] == [id(p) for p in model[1].parameters()]


def test_allocating_again_leaves_a_stepped_optimisers_state_alone():
    """A second call (a trainer whose optimiser already has state) must not take a zero-gradient step with it:
    AdamW would decay its moments and the step counter would go back to 0."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = build_optimizer(model, OptimConfig(lr=1e-2))
    allocate_optimizer_state(optimizer)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    before = copy.deepcopy(optimizer.state_dict()["state"])
    weights = [p.detach().clone() for p in model.parameters()]
    allocate_optimizer_state(optimizer)
    after = optimizer.state_dict()["state"]
    for i in before:
        for key in before[i]:
            assert torch.equal(before[i][key], after[i][key]), (i, key)
    assert after[0]["step"].item() == 1
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))


def test_allocating_with_a_tensor_learning_rate_keeps_it():
    """torch lets AdamW's learning rate be a tensor (``lr=torch.tensor(...)``): it is set to 0 in place of the
    same kind for the allocating step, then put back."""
    model = torch.nn.Linear(4, 2)
    lr = torch.tensor(1e-2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)
    weights = [p.detach().clone() for p in model.parameters()]
    allocate_optimizer_state(optimizer)
    assert optimizer.param_groups[0]["lr"] is lr and lr.item() == pytest.approx(1e-2)
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
    assert all(s["step"].item() == 0 and not s["exp_avg"].any() for s in optimizer.state.values())


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_a_decayed_schedule_stays_at_zero_past_its_last_update(schedule):
    """Progress is capped at 1: past ``total_updates`` linear decay would turn negative and cosine rise again."""
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=1.0)
    scheduler = build_scheduler(optimizer, OptimConfig(lr=1.0, warmup_steps=1, schedule=schedule), total_updates=3)
    factors = []
    for _ in range(6):
        factors.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert factors == pytest.approx([1.0, 1.0, 0.5, 0.0, 0.0, 0.0], abs=1e-12)


def test_a_decay_over_one_update_reaches_zero_after_it():
    """total_updates − warmup = 1: the one decaying update runs at the full LR, the next would run at 0."""
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=1.0)
    scheduler = build_scheduler(optimizer, OptimConfig(lr=1.0, warmup_steps=2, schedule="linear"), total_updates=3)
    factors = []
    for _ in range(4):
        factors.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert factors == pytest.approx([0.5, 1.0, 1.0, 0.0], abs=1e-12)
