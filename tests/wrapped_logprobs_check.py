"""``torchrun --nproc-per-node N tests/wrapped_logprobs_check.py ddp|fsdp``: each rank scores its own batch through
the wrapped tiny model (DDP, or FSDP2 sharding it) with ``distributed.forward_inside``, and checks against an
unwrapped copy of the same model: the same log-probs and entropies, the same gradients as one process averaging
both ranks' losses (what DDP and FSDP2 compute), and no (B, T, V) logits anywhere in the wrapped forward or
backward. It also checks that calling the wrapped model directly does build them (so the detector can see
them). Runs where ``train.device: auto`` would (the GPU when there is one: ``scripts/gpu_smoke.sh`` runs it
there under one process). Prints ``rank R ok`` when every check passed."""

import copy
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from cohortrl.distributed import forward_inside, from_env, process_device, shard
from cohortrl.models import load_model
from cohortrl.rollout.hf import micro_batched_logprobs, response_logprobs

B, TP, T = 4, 5, 6


class LogitsSpy(TorchDispatchMode):
    """Records the shape of every op's output that is a (B, T, V) tensor with T > 1: a batch's logits (the chunked
    head's (n, 1, V) views of a chunk, in its entropy's product, are not)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.seen = vocab, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dim() == 3 and t.shape[1] > 1 and t.shape[-1] == self.vocab:
                self.seen.append((str(func), tuple(t.shape)))
        return out


def batch(rank: int, vocab: int):
    """[left-padded prompt | right-padded response] of rank ``rank``: every row's prompt distinct, the first two
    rows sharing theirs (a group), padding on both sides."""
    g = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(3, vocab, (B, TP + T), generator=g)
    ids[1, :TP] = ids[0, :TP]
    mask = torch.ones(B, TP + T, dtype=torch.long)
    mask[2, :2] = 0  # a shorter prompt
    mask[3, TP + 3:] = 0  # a response that ended early
    ids[mask == 0] = 0
    return ids, mask, ids[:, TP:].clone()


def loss_of(logp):
    return (logp * torch.linspace(0.5, 1.5, logp.shape[1])).sum()


def main(strategy: str) -> None:
    group, device = from_env(strategy), process_device("auto")
    rank = group.rank
    model, _ = load_model("tiny-llama", seed=3)
    model.to(device).train()
    plain = copy.deepcopy(model)
    V = model.config.vocab_size
    batches = [tuple(t.to(device) for t in batch(r, V)) for r in range(group.world)]

    # One process: each rank's batch through the unwrapped model, gradients averaged over the ranks' losses.
    expected = [response_logprobs(plain, *b, with_entropy=True) for b in batches]
    sum(loss_of(logp) for logp, _ in expected).div(len(batches)).backward()
    want_grads = {n: p.grad for n, p in plain.named_parameters()}

    if strategy == "ddp":
        wrapped = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device] if device.type == "cuda" else None, broadcast_buffers=False)
    else:
        shard(model)
        wrapped = model
    ids, mask, response = batches[rank]
    spy = LogitsSpy(V)
    with spy:
        logp, entropy = forward_inside(wrapped, response_logprobs, input_ids=ids, attention_mask=mask,
                                       response_ids=response, with_entropy=True, share_prompts=strategy == "ddp")
        loss_of(logp).backward()
    assert not spy.seen, f"(B, T, V) logits built under {strategy}: {spy.seen[:3]}"
    torch.testing.assert_close(logp, expected[rank][0], rtol=0, atol=1e-6)
    torch.testing.assert_close(entropy, expected[rank][1], rtol=0, atol=1e-6)
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        torch.testing.assert_close(grad, want_grads[name], rtol=1e-4, atol=1e-6, msg=name)

    with torch.no_grad(), LogitsSpy(V) as spy:  # the old and reference log-probs: micro-batches in one forward
        logp = forward_inside(wrapped, micro_batched_logprobs, input_ids=ids, attention_mask=mask, response_ids=response,
                              micro_batches=list(torch.arange(B).split(3)), temperature=1.0)
    assert not spy.seen, f"(B, T, V) logits built under {strategy} without gradient: {spy.seen[:3]}"
    torch.testing.assert_close(logp, expected[rank][0].detach(), rtol=0, atol=1e-6)

    with torch.no_grad(), LogitsSpy(V) as spy:  # the wrapped model called as it is: full logits (the detector sees them)
        response_logprobs(wrapped, ids, mask, response, share_prompts=False)
    assert spy.seen, "the logits detector saw nothing in the wrapped model's own forward"
    print(f"rank {rank} ok", flush=True)
    group.close()


if __name__ == "__main__":
    main(sys.argv[1])
