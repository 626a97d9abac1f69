"""The optimiser: fused AdamW on plain CPU tensors, the same update as the reference implementation."""

import torch

from cohortrl.config import OptimConfig
from cohortrl.trainers.setup import build_optimizer


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
