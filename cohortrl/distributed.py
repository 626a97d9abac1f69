"""Data parallelism under ``torchrun``, with PyTorch's own engine (DDP), and the few collectives the trainer needs.

``torchrun --nproc-per-node N -m cohortrl train CONFIG`` starts N copies of the trainer. Each reads the same
prompt stream and takes its share of the step's P prompts (P / N whole groups: a prompt's G responses stay on
one rank, so group statistics are local and exact). Everything that is a statistic of the whole batch is
computed on the gathered batch, so the update does not depend on N:

* advantages: the estimator runs on the gathered rewards and response masks (batch-std scaling,
  REINFORCE++ whitening and any user estimator see the global batch), each rank keeps its rows;
* loss aggregation: the token weights (``token_weights``) come from the gathered loss mask, so token-mean
  divides by the global token count; DDP averages gradients over ranks, so each rank's loss is scaled by N;
* metrics: rewards, accuracy, zero-variance counts and lengths are gathered; loss sums are all-reduced.

Sampling is made independent of N by seeding each group's generation from (seed, step, global group index).
A 1-process and a 2-process run with the same config therefore compute the same update
(``tests/test_distributed.py`` checks the parameters after a step with gloo on CPU).

Without ``torchrun`` (no ``WORLD_SIZE`` in the environment) ``Dist`` is the single-process identity and the
trainer runs as it always did. Algorithms never import this module.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch


def micro_batch_positions(n: int, micro_batch_size: int) -> list[torch.Tensor]:
    """Positions 0..n-1 split into micro-batches of ``micro_batch_size`` (0: one batch)."""
    return list(torch.arange(n).split(micro_batch_size or n))


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    launched: bool = False  # started by torchrun (even with one process): the distributed code path
    strategy: str = "ddp"  # ddp: a replica per rank; fsdp: FSDP2, parameters sharded over ranks

    @property
    def sharded(self) -> bool:
        return self.launched and self.strategy == "fsdp"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # ------------------------------------------------------------------ sharding the step's groups
    def local_groups(self, n_groups: int) -> range:
        """The global indices of the groups this rank generates and trains on."""
        per_rank = n_groups // self.world
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)

    def local_rows(self, x_B: torch.Tensor, group_size: int, length: int | None = None) -> torch.Tensor:
        """This rank's rows of a gathered (B, ...) tensor, optionally cut to its own padded length."""
        groups = self.local_groups(x_B.shape[0] // group_size)
        x = x_B[groups.start * group_size : groups.stop * group_size]
        return x[:, :length] if length is not None else x

    def local_share(self, rows_all: torch.Tensor, weights_all: torch.Tensor, n_groups: int, group_size: int,
                    width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of a minibatch chosen over the whole batch of ``n_groups`` groups: its rows among the
        global ``rows_all``, as positions in its own rows, and their (b, T) token weights, cut to its own padded
        ``width`` and scaled by the number of processes (DDP averages gradients over ranks, so each rank's
        weights are its share of the global sum). One process: everything, unchanged."""
        if not self.launched or self.world == 1:
            return rows_all, weights_all
        groups = self.local_groups(n_groups)
        first, stop = groups.start * group_size, groups.stop * group_size
        mine = (rows_all >= first) & (rows_all < stop)
        return rows_all[mine] - first, weights_all[mine][:, :width] * self.world

    def micro_batch_share(self, rows_all: torch.Tensor, weights_all: torch.Tensor, n_groups: int, group_size: int,
                          width: int, micro_batch_size: int) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], int]:
        """This rank's micro-batches of a minibatch chosen over the whole batch: its rows and their token weights
        (``local_share``), each micro-batch's positions among them (``micro_batch_positions``), and how many
        zero-weight micro-batches it runs after those (``padding_micro_batches``). One process: every row, no
        padding."""
        rows, weights_BT = self.local_share(rows_all, weights_all, n_groups, group_size, width)
        positions = micro_batch_positions(len(rows), micro_batch_size) if len(rows) else []
        return rows, weights_BT, positions, self.padding_micro_batches(len(positions))

    def padding_micro_batches(self, n: int) -> int:
        """How many zero-weight micro-batches this rank runs after its ``n``: a rank with no rows in a minibatch
        still joins the gradient all-reduce (one), and under FSDP2 every rank runs as many forwards as the busiest
        (each forward gathers every layer's shards)."""
        runs = max(n, 1)
        if self.sharded:
            runs = self.max_int(runs)
        return runs - n

    # ------------------------------------------------------------------ collectives (identity on one process)
    def gather_rows(self, x_B: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's (b, ...) rows in rank order; a second dimension is right-padded with 0 to
        the longest rank's (response lengths differ between ranks)."""
        if not self.launched or self.world == 1:
            return x_B
        import torch.distributed as dist

        if x_B.dim() >= 2:
            width = torch.tensor([x_B.shape[1]])
            dist.all_reduce(width, op=dist.ReduceOp.MAX)
            x_B = torch.nn.functional.pad(x_B, (0, int(width) - x_B.shape[1]))
        parts = [torch.empty_like(x_B) for _ in range(self.world)]
        dist.all_gather(parts, x_B.contiguous())
        return torch.cat(parts)

    def gather_list(self, values: list) -> list:
        """Concatenate every rank's Python list in rank order."""
        if not self.launched or self.world == 1:
            return values
        import torch.distributed as dist

        parts: list = [None] * self.world
        dist.all_gather_object(parts, values)
        return [v for part in parts for v in part]

    def sum(self, values: dict[str, float]) -> dict[str, float]:
        """Every value summed over ranks (same keys on every rank)."""
        if not self.launched or self.world == 1:
            return values
        import torch.distributed as dist

        keys = sorted(values)
        t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
        dist.all_reduce(t)
        return dict(zip(keys, t.tolist()))

    def broadcast(self, obj):
        """Rank 0's ``obj`` on every rank."""
        if not self.launched or self.world == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def max_int(self, n: int) -> int:
        """The largest ``n`` over ranks."""
        if not self.launched or self.world == 1:
            return n
        import torch.distributed as dist

        t = torch.tensor([n])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t)

    def barrier(self) -> None:
        if self.launched and self.world > 1:
            import torch.distributed as dist

            dist.barrier()

    # ------------------------------------------------------------------ the model
    def load(self, load):
        """``load()`` -> (model, tokenizer), on every rank, except under FSDP2 with several processes: there rank 0
        alone loads (the whole model, on the host) and hands the others its architecture, configs and tokenizer,
        from which they build the model on the meta device (no memory). ``wrap`` then sends rank 0's weights into
        every rank's shards."""
        if not self.sharded or self.world == 1:
            return load()
        import torch.distributed as dist

        model = tokenizer = None
        if self.is_main:
            model, tokenizer = load()
        box = [(type(model), model.config, model.generation_config, next(model.parameters()).dtype, tokenizer)
               if self.is_main else None]
        dist.broadcast_object_list(box, src=0)
        if self.is_main:
            return model, tokenizer
        cls, config, generation_config, dtype, tokenizer = box[0]
        with torch.device("meta"):
            model = cls(config).to(dtype)
        model.generation_config = generation_config
        return model.eval(), tokenizer

    def wrap(self, model, device: torch.device | None = None):
        """The module the update runs forward/backward through: ``model`` itself on one process; DDP around it
        (generation, the reference and saving keep using the plain ``model``, which shares its parameters);
        or, with FSDP2, ``model`` itself, sharded in place (each decoder layer, then the root) with this rank's
        shards on ``device``, filled from rank 0's weights (``shard_from_rank0``): no rank but 0 ever holds the
        whole model, and rank 0 only on the host."""
        if self.sharded:
            shard_from_rank0(model, device or next(model.parameters()).device, self.is_main)
            return model
        if not self.launched or self.world == 1:
            return model
        from torch.nn.parallel import DistributedDataParallel

        # broadcast_buffers=False: buffers (rotary frequencies) never change, and broadcasting them would make
        # every forward a collective, which ranks with different micro-batch counts could not match.
        device = next(model.parameters()).device
        device_ids = [device] if device.type == "cuda" else None  # the model's GPU, or None on a CPU
        return DistributedDataParallel(model, device_ids=device_ids, broadcast_buffers=False)

    @contextlib.contextmanager
    def no_sync(self, modules: list, sync: bool):
        """Accumulate gradients locally unless ``sync`` (the last micro-batch before an optimiser step); the
        forward passes must run inside too (DDP prepares its all-reduce in the forward)."""
        with contextlib.ExitStack() as stack:
            for module in modules if self.launched else []:
                if self.sharded:
                    for m in _fsdp_modules(module):
                        m.set_requires_gradient_sync(sync, recurse=False)
                elif not sync and hasattr(module, "no_sync"):
                    stack.enter_context(module.no_sync())
            yield

    @contextlib.contextmanager
    def gathered(self, model):
        """With FSDP2: every shard all-gathered once, and kept, for work that runs a different number of forward
        passes on each rank (generation stops when a rank's groups are done; rank 0 alone evaluates). Layer by
        layer, each forward would be a collective the ranks could not match, and keeping them in step would
        gather the whole model again for every decoded token (docs/distributed.md, "Eight GPUs")."""
        if not self.sharded:
            yield
            return
        modules = _fsdp_modules(model)
        for m in modules:
            m.unshard()
            m.set_reshard_after_forward(False, recurse=False)
        try:
            yield
        finally:
            for m in modules:
                m.reshard()
                m.set_reshard_after_forward(True, recurse=False)

    # ------------------------------------------------------------------ state: whole tensors (the model's on rank 0)
    def full_state(self, model, trainable_only: bool) -> dict[str, torch.Tensor]:
        """Parameters by name as whole CPU tensors on rank 0, which writes checkpoints; ``{}`` on the other ranks
        (call on every rank: with FSDP2 each tensor is all-gathered from the shards, one at a time, and only rank 0
        keeps a host copy)."""
        names = [name for name, p in model.named_parameters() if p.requires_grad or not trainable_only]
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            # cpu_offload with full_state_dict: rank 0 alone gets the tensors, the others an empty dict.
            state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            return {name: state[name] for name in names if name in state}
        if not self.is_main:
            return {}
        params = dict(model.named_parameters())
        return {name: params[name].detach().cpu().clone() for name in names}

    def optimizer_state(self, model, optimizer) -> dict:
        if not self.sharded:
            return optimizer.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load_optimizer_state(self, model, optimizer, state: dict) -> None:
        """The optimiser's whole state (``optimizer_state``'s) loaded; under FSDP2, rank 0's, sent one tensor at a
        time, each rank keeping its shard (the other ranks' ``state`` is not read: ``read_state``)."""
        if not self.sharded:
            optimizer.load_state_dict(state)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(model, optimizer, optim_state_dict=state if self.is_main else {},
                                 options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))

    def load_parameters(self, model, saved: dict[str, torch.Tensor]) -> None:
        """Copy whole tensors into the parameters of the same names; under FSDP2, rank 0's, sent one tensor at a
        time, each rank keeping its shard (the other ranks' ``saved`` is not read: ``read_state``)."""
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            # strict=False: ``saved`` holds the trainable parameters only (a LoRA adapter); the caller checked the names
            set_model_state_dict(model, saved if self.is_main else {},
                                 options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False))
            return
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, value in saved.items():
                params[name].copy_(value)

    def read_state(self, read, tensors: tuple[str, ...]) -> dict:
        """``read()`` (a checkpoint's state) on every rank, except under FSDP2 with several processes: there rank 0
        alone reads it and sends the other ranks every entry but those named in ``tensors`` (the whole weights and
        optimiser state, which ``load_parameters`` and ``load_optimizer_state`` then send from rank 0 into the
        shards, one tensor at a time); of those they get the keys alone, values None, enough to check names. An
        error in ``read`` is raised on every rank. Under DDP every rank reads it: each holds a whole replica."""
        if not self.sharded or self.world == 1:
            return read()
        state = sent = None
        if self.is_main:
            try:
                state = read()
                sent = {key: dict.fromkeys(value) if key in tensors else value for key, value in state.items()}
            except Exception as e:  # the other ranks must not wait for a state that will not come
                sent = e
        received = self.broadcast(sent)
        if isinstance(received, Exception):
            raise received
        return state if self.is_main else received

    def close(self) -> None:
        if self.launched:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


def shard(model) -> None:
    """FSDP2 (``fully_shard``) on each decoder layer, then on the whole (base) model: a layer's parameters are
    gathered just before it runs and freed after, so no rank ever holds every layer at once. A model in bf16 /
    fp16 (``model.dtype``) is sharded with ``mixed_precision_policy``: its trainable parameters kept in float32
    (each rank's shard is the master copy the optimiser steps), computed in the model's dtype."""
    from torch.distributed.fsdp import fully_shard

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    layer_types = set(getattr(base, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in layer_types]
    if not layers:
        raise ValueError(f"train.strategy=fsdp: no decoder layers ({sorted(layer_types) or 'none declared'}) found in {type(base).__name__}")
    policy = mixed_precision_policy(model)
    if policy.param_dtype is not None:
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.to(torch.float32)
    for layer in layers:
        fully_shard(layer, mp_policy=policy)
    # The root is the transformers model itself, not a PEFT wrapper around it: generation calls it directly,
    # and FSDP2 takes the first sharded module that runs as the root of its lazy initialisation.
    fully_shard(base, mp_policy=policy)


def shard_from_rank0(model, device: torch.device, main: bool) -> None:
    """``shard`` a model whose weights only rank 0 (``main``) holds (on the host; the others' are on the meta
    device, ``Dist.load``), the way PyTorch documents for models that do not fit one device: every rank shards
    it on the meta device, allocates its own shards on ``device`` and receives them from rank 0's whole
    tensors (``set_model_state_dict`` with ``broadcast_from_rank0``: one tensor at a time). Buffers (rotary
    frequencies, not in the state dict) are broadcast whole. Rank 0's host copy is freed when this returns."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    full = model.state_dict() if main else {}
    buffers = {name: b.clone() for name, b in model.named_buffers()} if main else {}
    _to_meta(model)  # before sharding: fully_shard would move a whole host model to the device first
    shard(model)
    model.to_empty(device=device)
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    with torch.no_grad():
        for name, b in model.named_buffers():
            if main:
                b.copy_(buffers[name])
            dist.broadcast(b, src=0)


def _to_meta(model) -> None:
    """``model``'s parameters and buffers moved to the meta device, keeping tied parameters tied (``Module.to``
    makes a new parameter for each module that holds one: an embedding tied to the LM head would come apart)."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    model.to("meta")
    for first, *others in names.values():
        for name in others:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, model.get_parameter(first))


def sharded_frozen_copy(model, dtype: torch.dtype):
    """A frozen copy of an FSDP2-sharded (plain, not PEFT) ``model``, sharded the same way, made shard by shard: the
    copy is built on the meta device (no memory), in ``dtype`` (the model's own before ``shard`` kept its trainable
    shards in float32), sharded, given storage for this rank's shards only, and each shard copied from the
    model's. No rank ever holds the copy whole (``copy.deepcopy`` before sharding would put a second full model
    on every rank). Buffers (rotary frequencies), which FSDP2 leaves whole, are copied whole."""
    originals = dict(model.named_parameters())
    with torch.device("meta"):
        copy = type(model)(model.config)
    copy.to(dtype).eval().requires_grad_(False)
    shard(copy)
    device = next(iter(originals.values())).device
    copy.to_empty(device=device)
    with torch.no_grad():
        for name, p in copy.named_parameters():
            src = originals[name]
            local = src.to_local() if hasattr(src, "to_local") else src
            p.to_local().copy_(local)
        for name, b in copy.named_buffers():
            b.copy_(model.get_buffer(name))
    return copy


def forward_inside(model, fn, **kwargs):
    """``fn(inside, **kwargs)`` run as the forward of the module that DDP or FSDP2 manages in ``model``, where
    ``inside`` is that module as its own forward sees it (``InsideForward``). The wrappers' hooks then run once
    around ``fn``: DDP prepares its gradient all-reduce; FSDP2's root gathers the embedding, final norm and LM
    head (each decoder layer gathers its own when the decoder calls it) and reduces their gradients in backward.
    Code that needs a model's parts rather than its output runs this way under torchrun: ``rollout.hf``'s
    chunked LM head applies the head's weight itself, so it never builds the (B, T, V) logits that calling the
    wrapped model would. A model neither wraps: ``fn(model, **kwargs)``. The keyword arguments travel as the
    forward's (DDP and FSDP2 move their tensors to the model's device)."""
    owner, call = _forward_owner(model)
    if owner is None:
        return fn(model, **kwargs)
    inside = InsideForward(owner)
    # For this call only: the instance attribute hides the class's forward, which ``inside`` still runs.
    owner.forward = lambda **kw: fn(inside, **kw)
    try:
        return call(**kwargs)
    finally:
        del owner.forward


class InsideForward:
    """A module as its own forward sees it (``forward_inside``): calling it runs the module's forward without
    the wrappers' hooks, which have run once around the whole call; every other attribute is the module's.
    It shows no modules: ``rollout.hf`` falls back to the wrapped model's full logits when it finds FSDP2
    modules, since outside the root's forward the LM head's weight is a shard; inside, it is whole."""

    def __init__(self, module):
        self._module = module
        self.forward = type(module).forward.__get__(module)  # the class's forward: no hooks, no instance override

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._module, name)

    def modules(self):
        return iter(())


def _forward_owner(model):
    """(the module whose forward DDP's or FSDP2's hooks surround, what to call to run them), or (None, None)
    for a model neither wraps. FSDP2's is the outermost sharded module (``shard``'s root, inside a PEFT
    wrapper), called directly as generation calls it."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        return model.module, model
    sharded = _fsdp_modules(model)
    return (sharded[0], sharded[0]) if sharded else (None, None)


def mixed_precision_policy(model):
    """FSDP2's ``MixedPrecisionPolicy`` for a model whose weights are in a 16-bit dtype: parameters all-gathered
    in that dtype for the forward and backward, gradients reduced over ranks in float32 (a bf16 sum over many
    ranks loses the low bits each rank contributes). For a float32 model, FSDP2's default: no casts."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    low = {p.dtype for p in model.parameters()} & {torch.bfloat16, torch.float16}
    if not low:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=low.pop(), reduce_dtype=torch.float32)


def held_elements(model) -> tuple[int, int]:
    """(parameter elements this rank holds, elements in the whole model): equal unless FSDP2 sharded it, when
    each parameter is a DTensor whose local shard is this rank's part."""
    held = total = 0
    for p in model.parameters():
        total += p.numel()
        held += p.to_local().numel() if hasattr(p, "to_local") else p.numel()
    return held, total


def _fsdp_modules(model) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def process_group_backend(cuda: bool) -> str:
    """The backend string of the process group: gloo alone without a GPU; with one, gloo for CPU tensors and
    NCCL for CUDA tensors. NCCL serves only CUDA tensors, and the trainer's own collectives (gathered rows,
    summed metrics, the largest micro-batch count, the objects) are on small CPU tensors; DDP's and FSDP2's
    gradients and shards, on the GPU, go through NCCL."""
    return "cpu:gloo,cuda:nccl" if cuda else "gloo"


def from_env(strategy: str = "ddp", timeout_s: float = 1800.0) -> Dist:
    """A ``Dist`` for this process: torchrun's (initialising the process group, ``process_group_backend``, with
    collectives that wait at most ``timeout_s`` for the other ranks) when ``WORLD_SIZE`` is set, else the
    single-process identity."""
    if "WORLD_SIZE" not in os.environ:
        return Dist()
    import datetime

    import torch.distributed as dist

    if not dist.is_initialized():
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(process_group_backend(cuda), timeout=datetime.timedelta(seconds=timeout_s))
    return Dist(rank=dist.get_rank(), world=dist.get_world_size(), launched=True, strategy=strategy)


def resolve_device(setting: str, dist: Dist, key: str = "train.device") -> torch.device:
    """``train.device`` (or the setting under config key ``key``): ``auto`` is the GPU when PyTorch sees one
    (``cuda:LOCAL_RANK`` under torchrun), else the CPU."""
    if setting == "auto":
        setting = "cuda" if torch.cuda.is_available() else "cpu"
    if setting == "cuda" and dist.launched:
        setting = f"cuda:{os.environ.get('LOCAL_RANK', 0)}"
    if setting.startswith("cuda") and not torch.cuda.is_available():
        from cohortrl.config import ConfigError

        raise ConfigError(f"config key {key!r} = {setting!r}: PyTorch sees no CUDA GPU here; use auto or cpu")
    return torch.device(setting)


def process_device(setting: str = "auto", key: str = "train.device") -> torch.device:
    """``resolve_device`` for code that runs without a ``Dist`` (``cohortrl eval``, the ``reward_model`` reward):
    the same choice the trainer makes, with torchrun recognised as ``from_env`` recognises it (``WORLD_SIZE``)."""
    return resolve_device(setting, Dist(launched="WORLD_SIZE" in os.environ), key)


def group_seed(seed: int, step: int, group: int) -> int:
    """The sampling seed of one group: a function of the run's seed, the step and the group's global index,
    never of the number of processes."""
    return (seed * 1_000_003 + step) * 1_000_033 + group
