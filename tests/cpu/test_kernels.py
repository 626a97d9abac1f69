"""oneDNN linear layers (cohortrl/cpu/kernels.py): the same function as PyTorch's F.linear, values and gradients, to
float rounding; everything it does not handle goes to F.linear untouched; only the models a context is given are
switched, for its duration, and F.linear itself never is. The fast path's one switch (cohortrl/cpu/__init__.py)."""

import pytest
import torch
import torch.nn.functional as F

from cohortrl.cpu import kernels
from cohortrl.config import Config, ConfigError
from cohortrl import cpu
from cohortrl.cpu.kernels import (OneDNNLinear, decoding_weights, linear_kernels, onednn_available, onednn_linear,
                                 resolve_cpu_linear)
from cohortrl.models import load_model
from cohortrl.rollout.hf import Sampling, _linear_product, generate, response_logprobs

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="this PyTorch build has no oneDNN linear op")
ROWS = [{"prompt": "What is 1 + 2?"}, {"prompt": "What is 3 * 3? Answer briefly please."}]


@needs_onednn
@pytest.mark.parametrize("shape", [(8, 48), (3, 5, 48), (2, 1, 48)])
@pytest.mark.parametrize("bias", [True, False])
def test_values_and_gradients_equal_pytorchs_linear(shape, bias):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g, requires_grad=True)
    w = torch.randn(40, 48, generator=g, requires_grad=True)
    b = torch.randn(40, generator=g, requires_grad=True) if bias else None
    upstream = torch.randn(*shape[:-1], 40, generator=g)

    def run(fn):
        for t in (x, w, b):
            if t is not None:
                t.grad = None
        y = fn(x, w, b)
        (y * upstream).sum().backward()
        return y.detach(), x.grad, w.grad, None if b is None else b.grad

    ours, theirs = run(onednn_linear), run(F.linear)
    assert ours[0].shape == theirs[0].shape
    for a, e in zip(ours, theirs):
        if e is not None:
            torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)


@needs_onednn
def test_the_oneDNN_path_is_taken_for_plain_fp32_cpu_tensors(monkeypatch):
    calls = []
    real = kernels._onednn
    monkeypatch.setattr(kernels, "_onednn", lambda *a: calls.append(a[0].shape) or real(*a))
    x, w = torch.randn(4, 8), torch.randn(6, 8)
    onednn_linear(x, w)  # no grad wanted: one oneDNN product
    x.requires_grad_(True)
    onednn_linear(x, w).sum().backward()  # forward and the input gradient
    assert calls == [(4, 8), (4, 8), (4, 6)]


@pytest.mark.parametrize("case", ["bf16", "vector", "non_plain_tensor"])
def test_what_oneDNN_does_not_take_goes_to_pytorch_unchanged(case, monkeypatch):
    monkeypatch.setattr(kernels, "_onednn", lambda *a: pytest.fail("oneDNN must not be called"))
    x, w = torch.randn(4, 8), torch.randn(6, 8)
    if case == "bf16":
        x, w = x.bfloat16(), w.bfloat16()
    elif case == "vector":
        x = x[0]
    else:
        class Tagged(torch.Tensor):  # a tensor subclass (as DTensor is) keeps its own dispatch
            pass
        w = w.as_subclass(Tagged)
    assert torch.equal(onednn_linear(x, w), F.linear(x, w))


def test_only_the_given_models_are_switched_for_the_contexts_duration_and_contexts_nest():
    a, b = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU()), torch.nn.Linear(3, 2)
    original = F.linear
    with linear_kernels("onednn", a, None):
        assert type(a[0]) is OneDNNLinear and isinstance(a[0], torch.nn.Linear)
        assert type(b) is torch.nn.Linear  # not given: PyTorch's kernel
        assert F.linear is original
        with linear_kernels("onednn", a, b):
            assert type(a[0]) is OneDNNLinear and type(b) is OneDNNLinear
        assert type(a[0]) is OneDNNLinear and type(b) is torch.nn.Linear  # the inner exit undoes only its own
        assert set(a.state_dict()) == {"0.weight", "0.bias"}
    assert type(a[0]) is torch.nn.Linear
    with pytest.raises(RuntimeError, match="boom"), linear_kernels("onednn", a):
        raise RuntimeError("boom")
    assert type(a[0]) is torch.nn.Linear
    with linear_kernels("aten", a):
        assert type(a[0]) is torch.nn.Linear
    with pytest.raises(ValueError, match="unknown linear kernel"), linear_kernels("mkl"):
        pass


def test_a_linear_subclass_keeps_its_own_forward():
    class Scaled(torch.nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    m = torch.nn.Sequential(Scaled(4, 3))
    with linear_kernels("onednn", m):
        assert type(m[0]) is Scaled


@needs_onednn
def test_code_applying_a_layers_weight_itself_follows_that_layers_kernel(monkeypatch):
    """rollout/hf.py's chunked LM head multiplies by the head's weight itself: it takes the layer's own product,
    so it runs on oneDNN exactly when the layer does, whatever other models are switched (no process-wide state)."""
    calls = []
    real = kernels._onednn
    monkeypatch.setattr(kernels, "_onednn", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(4, 8)
    m, other = torch.nn.Linear(8, 6), torch.nn.Linear(8, 6)
    assert _linear_product(m) is F.linear
    with linear_kernels("onednn", m):
        assert _linear_product(m) is onednn_linear and _linear_product(other) is F.linear  # other: not given
        torch.testing.assert_close(_linear_product(m)(x, m.weight, m.bias), F.linear(x, m.weight, m.bias),
                                   rtol=1e-5, atol=1e-5)
        other(x)
    assert calls == [1]
    assert _linear_product(m) is F.linear


def test_the_fast_path_is_one_switch_and_falls_back_for_models_it_does_not_compute(monkeypatch, caplog):
    import logging

    from cohortrl.config import TrainConfig

    monkeypatch.setattr(kernels, "onednn_available", lambda: True)
    llama, _ = load_model("tiny-llama", seed=0)
    assert cpu.linear_kernel(TrainConfig(), "cpu", llama) == "onednn"
    assert cpu.linear_kernel(TrainConfig(), "cuda", llama) == "aten"
    assert cpu.linear_kernel(TrainConfig(cpu_fast_path="off"), "cpu", llama) == "aten"
    assert cpu.linear_kernel(TrainConfig(cpu_linear="aten"), "cpu", llama) == "aten"
    assert cpu.build(TrainConfig(cpu_fast_path="off"), "cpu", llama) is None  # no object: nothing of it runs
    assert cpu.build(TrainConfig(cpu_linear="aten", cpu_allocator="system"), "cpu", llama) is None
    assert cpu.build(TrainConfig(cpu_allocator="system"), "cpu", llama).linear == "onednn"
    half = llama.to(torch.bfloat16)  # fp32 only: a bf16 model falls back, once, at INFO, with the reason
    with caplog.at_level(logging.INFO, logger="cohortrl"):
        assert cpu.linear_kernel(TrainConfig(), "cpu", half) == "aten"
        assert cpu.linear_kernel(TrainConfig(), "cpu", half) == "aten"
    said = [r for r in caplog.records if "CPU fast path" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO and "torch.bfloat16" in said[0].getMessage()
    assert cpu.linear_kernel(TrainConfig(cpu_linear="onednn"), "cpu", half) == "onednn"  # asked for by name


def test_the_config_refuses_a_part_of_the_fast_path_with_the_fast_path_off():
    assert Config.from_dict({"train": {"cpu_fast_path": "off", "cpu_linear": "aten"}}).train.cpu_fast_path == "off"
    for key, value in (("cpu_linear", "onednn"), ("cpu_allocator", "retain")):
        with pytest.raises(ConfigError, match=f"train.{key}.*cpu_fast_path=off"):
            Config.from_dict({"train": {"cpu_fast_path": "off", key: value}})
    with pytest.raises(ConfigError, match="cpu_fast_path"):
        Config.from_dict({"train": {"cpu_fast_path": "on"}})


def test_auto_picks_oneDNN_on_a_CPU_only_and_a_missing_oneDNN_is_an_error(monkeypatch):
    assert resolve_cpu_linear("auto", "cuda") == "aten"
    assert resolve_cpu_linear("onednn", "cuda:0") == "aten"
    assert resolve_cpu_linear("aten", "cpu") == "aten"
    monkeypatch.setattr(kernels, "onednn_available", lambda: True)
    assert resolve_cpu_linear("auto", "cpu") == "onednn"
    monkeypatch.setattr(kernels, "onednn_available", lambda: False)
    assert resolve_cpu_linear("auto", "cpu") == "aten"
    with pytest.raises(RuntimeError, match="train.cpu_linear=aten"):
        resolve_cpu_linear("onednn", "cpu")


def test_the_config_names_the_allowed_kernels():
    assert Config.from_dict({"train": {"cpu_linear": "aten"}}).train.cpu_linear == "aten"
    with pytest.raises(ConfigError, match="cpu_linear"):
        Config.from_dict({"train": {"cpu_linear": "mkl"}})


def _lora(model):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))


@needs_onednn
@pytest.mark.parametrize("lora", [False, True])
def test_a_models_logprobs_and_gradients_agree_under_both_kernels(lora):
    model, tok = load_model("tiny-llama", seed=3)
    if lora:
        model = _lora(model)
    torch.manual_seed(0)
    rollout, _ = generate(model, tok, ROWS, 3, Sampling(temperature=1.0, max_new_tokens=10))
    ids, mask = rollout.input_ids(), rollout.attention_mask()
    model.train()

    def run(kind):
        model.zero_grad()
        with linear_kernels(kind, model):
            logp, entropy = response_logprobs(model, ids, mask, rollout.response_ids, temperature=0.7, with_entropy=True)
            weights = torch.linspace(-1.0, 2.0, logp.numel()).view_as(logp) * rollout.response_mask
            (logp * weights).sum().backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        return logp.detach(), entropy, grads

    ours, theirs = run("onednn"), run("aten")
    m = rollout.response_mask.bool()
    torch.testing.assert_close(ours[0][m], theirs[0][m], rtol=0, atol=1e-5)
    torch.testing.assert_close(ours[1][m], theirs[1][m], rtol=0, atol=1e-5)
    assert theirs[2].norm() > 0
    assert ((ours[2] - theirs[2]).norm() / theirs[2].norm()).item() < 1e-5


@needs_onednn
def test_sampling_under_oneDNN_draws_the_same_tokens():
    # The same seed, the same distribution to float rounding: the same samples (a flip needs a uniform draw
    # within ~1e-6 of a CDF boundary).
    model, tok = load_model("tiny-llama", seed=4)
    out = {}
    for kind in ("aten", "onednn"):
        torch.manual_seed(0)
        with linear_kernels(kind, model):  # on oneDNN, the run's fast path decodes with the lean decoder
            out[kind], _ = generate(model, tok, ROWS, 3, Sampling(temperature=1.0, max_new_tokens=16),
                                    fast_path=cpu.FastPath(kind, "system"))
    assert torch.equal(out["aten"].response_ids, out["onednn"].response_ids)


@needs_onednn
def test_decoding_lays_the_weights_out_once_uses_them_for_its_row_count_and_frees_them(monkeypatch):
    model, _ = load_model("tiny-llama", seed=5)
    n_linear = len({id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)})  # the head is tied
    head = model.get_output_embeddings().weight
    used = []
    real = kernels._onednn
    monkeypatch.setattr(kernels, "_onednn", lambda x, w, b: used.append(w.is_mkldnn) or real(x, w, b))
    x8, x3 = torch.randn(8, 1, head.shape[1]), torch.randn(3, head.shape[1])
    lm_head = model.get_output_embeddings()

    def laid_out() -> int:  # the layout is kept on each layer, nowhere else
        return sum("decoding_layout" in m.__dict__ for m in model.modules())

    with torch.no_grad():
        with decoding_weights(model, 8):  # outside the oneDNN kernel: nothing is laid out
            assert laid_out() == 0
        with linear_kernels("onednn", model), decoding_weights(model, 8):
            assert laid_out() == n_linear
            with decoding_weights(model, 8):  # nested (evaluation inside a step): the outer layout stays
                assert laid_out() == n_linear
            got8, got3 = lm_head(x8), lm_head(x3)
        assert laid_out() == 0
    assert used == [True, False]  # the blocked layout for 8 rows only
    torch.testing.assert_close(got8, x8 @ head.t(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got3, x3 @ head.t(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("flags, units", [("fpu avx2 avx512f avx512_bf16", True), ("fpu amx_tile amx_bf16", True),
                                          ("fpu avx2 avx512f", False), (None, False)])
def test_bf16_units_are_read_from_the_cpus_flags_where_pytorch_cannot_say(monkeypatch, flags, units):
    """PyTorch before 2.9 has no torch.cpu.get_capabilities: the flags of /proc/cpuinfo decide (none: no units)."""
    from cohortrl import machine

    monkeypatch.delattr(torch.cpu, "get_capabilities", raising=False)
    monkeypatch.setattr(machine, "cpuinfo", lambda: {} if flags is None else {"vendor_id": "GenuineIntel", "flags": flags})
    assert kernels.cpu_has_bf16_units() is units
