"""This CPU's rates for the planner's CPU time (``cohortrl plan`` measures them at plan time): the kinds of work a
step does, timed at the model's shapes, decoding's with the decoder's own operations."""

from __future__ import annotations

from dataclasses import replace

from cohortrl.planner import DTYPE_BYTES, ModelShape, Pass, attention_flops, backward_flops, kv_cache_bytes


def measure_cpu_rates(m: ModelShape, threads: int, rows: int, *, ops, context: int, rank: int = 16,
                      repeats: int = 3, decode_dtype: str = "fp32", record: bool = False) -> dict[str, float]:
    """This CPU's rates (``planner.CPU_RATES``) for the kinds of work a step does, on ``threads``
    torch threads, in fp32 but for decoding's products, which are in ``decode_dtype`` (the lean decoder's,
    ``RunSpec.decode_dtype``). ``ops``: what a decoding step runs (``trainers.setup.decoding_step_ops``: the
    decoder's laid-out products and its attention, and generation's loop), so that decoding's probes time the
    decoder's own kernels. ``record``: decoding records for the update (``RunSpec.reuse_rollout_forward``).

    - ``decode`` (FLOP/s): ``rows`` × h by h × f products (one row per sequence) over as many distinct h × f
      weights as the model's linear layers hold (at most DECODE_PROBE_BYTES of them; :func:`decode_probe`), each
      laid out and multiplied as the decoder does (``ops``): a decoding step reads every weight once for a few
      rows, so its rate is set by how fast the weights stream from memory, not by the arithmetic, and a probe on
      one cache-resident weight overstates it several times;
    - ``attention_bytes`` (bytes/s): decoding's attention (``ops.attention``) for ``rows`` rows over a KV cache of
      ``context`` columns per layer, as many layers as the model has (at most ATTENTION_PROBE_BYTES;
      :func:`attention_probe`), as the KV-cache bytes read per second: each step reads every row's keys and values
      for a few FLOPs per value, so bandwidth sets its rate, far below the products';
    - ``layer`` (FLOP/s): forward and backward, under autograd, of two transformers Llama layers of the model's
      shape (full fine-tuning, 2 sequences of 256 tokens): prefill, scoring and the update, where the products run
      on many rows and beside them the norms, rotary embedding, attention's softmax, SwiGLU and autograd's
      bookkeeping, which a bare product leaves out (a bare 2048-row product runs about 1.6 × faster here);
    - ``thin`` (FLOP/s): 2048 rows through a rank-``rank`` pair of products (f → r, r → f), LoRA's adapters' shapes;
    - ``step_s`` and ``layer_step_s`` (seconds per decoding step, and per layer and decoding step): what
      generation spends on a step besides its products and its attention (:func:`step_overhead`).

    Timed in the process's CPU time (``time.process_time``), not wall time: on a shared machine the wall clock
    also counts the time other processes held the cores; × ``threads`` gives the rate of undisturbed threads
    (with more than one, threads that spin while they wait for each other make it an underestimate). Each rate
    is the best of ``repeats`` timings."""
    import time

    import torch
    import transformers

    F = torch.nn.functional
    h, f = m.hidden_size, m.intermediate_size
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x, weights = decode_probe(m, rows, decode_dtype, ops)
        dtype = torch_dtype(decode_dtype)
        q, keys, values, key_bias, length = attention_probe(m, rows, context, ops)
        scale = m.d ** -0.5
        dy, down, up, a = torch.randn(2048, f), torch.randn(rank, f), torch.randn(f, rank), torch.randn(2048, rank)
        probe = replace(m, num_layers=2, vocab_size=256)  # two layers, a token vocabulary too small to matter
        block = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=probe.vocab_size, hidden_size=h, intermediate_size=f, num_hidden_layers=probe.num_layers,
            num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads, head_dim=m.d,
            tie_word_embeddings=True))
        ids = torch.randint(0, probe.vocab_size, (2, 256))

        def train_block():
            block(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits.sum().backward()

        work = {  # name: (the amount its rate counts, FLOPs or bytes; the work)
            "decode": (2 * rows * h * f * len(weights), lambda: [ops.product(x, w, None, dtype) for w in weights]),
            "attention_bytes": (sum(t.nbytes for t in (*keys, *values)),
                                lambda: [ops.attention(q, k, v, key_bias, scale, length) for k, v in zip(keys, values)]),
            "layer": (training_flops(probe, *ids.shape), train_block),
            "thin": (2 * 2 * 2048 * f * rank, lambda: (F.linear(dy, down), F.linear(a, up))),
        }
        rates = {}
        for name, (amount, job) in work.items():
            job()  # first touch: allocation and kernel selection
            reps = max(1, int(TIMED_AMOUNT // amount))  # or one pass over the probe's data, per timing
            best = float("inf")
            for _ in range(repeats):
                start = time.process_time()
                for _ in range(reps):
                    job()
                best = min(best, (time.process_time() - start) / reps)
            rates[name] = amount / best * threads
        rates["step_s"], rates["layer_step_s"] = step_overhead(m, rows, decode_dtype, ops, record, repeats, threads,
                                                               rates)
        return rates
    finally:
        torch.set_num_threads(previous)


def step_overhead(m: ModelShape, rows: int, dtype: str, ops, record: bool, repeats: int, threads: int,
                  rates: dict[str, float]) -> tuple[float, float]:
    """(step_s, layer_step_s): the CPU seconds a decoding step spends besides its products and its attention, as
    a part per step (the embedding, the final norm, the sampler over the vocabulary, the recording's per-step
    work, the loop's own tensor ops and Python) and a part per layer (RMSNorms, rotary embedding, KV-cache
    writes, casts, SiLU, the records' writes, each op's dispatch), for ``rows`` rows.

    Timed through generation's own loop (``ops.generate``: ``rollout.hf.generate_ids`` on the lean decoder, its
    products in ``dtype``, recording where ``record``, the run's sampler) on a random model of the shape with
    1 + PROBE_LAYERS layers, then with its first layer only: per step, the difference of a call of MANY_STEPS
    steps and one of FEW_STEPS (what a call does once, laying out the weights and building the decoder,
    cancels), less the products at ``rates["decode"]`` and the attention at ``rates["attention_bytes"]`` as the
    planner counts them; the layers' part is the difference of the two models per layer. The head's
    V × h weight, read after the layers at every step, keeps the layers' weights from staying in the cache
    between steps, as in the full model. Not included: the tools' per-step work and stop strings' decoding
    (the probe has neither), prefill, and ended rows leaving the products (no row ends). Seconds are CPU time
    / ``threads``, like the rates; with more than one thread that understates the single-threaded parts.
    Each part is at least 0."""
    import time

    import torch
    import transformers

    h, V = m.hidden_size, m.vocab_size
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=V, hidden_size=h, intermediate_size=m.intermediate_size, num_hidden_layers=1 + PROBE_LAYERS,
        num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads, head_dim=m.d,
        tie_word_embeddings=m.tie_embeddings)).eval()
    torch_type = torch_dtype(dtype)

    def seconds(steps: int) -> float:
        best = float("inf")
        for _ in range(repeats):
            start = time.process_time()
            ops.generate(model, rows, steps, torch_type, record)
            best = min(best, time.process_time() - start)
        return best / threads

    def modelled(layers: int) -> float:
        """The seconds of one step's products and attention (step t from 0 attends t + 1 columns), as planned."""
        products = (2 * layers * m.layer_params + 2 * h * V) * rows / rates["decode"]
        columns = rows * (FEW_STEPS + MANY_STEPS + 1) / 2
        return products + kv_cache_bytes(replace(m, num_layers=layers), columns, "fp32") / rates["attention_bytes"]

    def per_step(layers: int) -> float:
        ops.generate(model, rows, FEW_STEPS, torch_type, record)  # first touch: allocation, kernel selection
        return (seconds(MANY_STEPS) - seconds(FEW_STEPS)) / (MANY_STEPS - FEW_STEPS) - modelled(layers)

    deep = per_step(1 + PROBE_LAYERS)
    del model.model.layers[1:]  # the same weights, one layer: the step's fixed part
    shallow = per_step(1)
    layer = max(0.0, (deep - shallow) / PROBE_LAYERS)
    return max(0.0, shallow - layer), layer


def decode_probe(m: ModelShape, rows: int, dtype: str, ops) -> tuple:
    """The decoding probe's operands: ``rows`` × h fp32 inputs (the decoder's products cast them to their dtype) and
    as many distinct f × h weights as the model's linear layers hold, at most DECODE_PROBE_BYTES of them in
    ``dtype`` (fp32 or bf16: bf16 weights stream at half fp32's bytes), each as the decoder holds it
    (``ops.laid_out``: oneDNN's layout for ``rows``-row products)."""
    import torch

    size, h, f = DTYPE_BYTES[dtype], m.hidden_size, m.intermediate_size
    linear_bytes = (m.num_layers * m.layer_matrix_params + m.vocab_size * h) * size
    n_weights = max(1, int(min(linear_bytes, DECODE_PROBE_BYTES) // (h * f * size)))
    # one source in the weights' dtype, refilled for each weight: no temporary (a cast) freed between the laid-out
    # weights, which would leave heap holes that keep the probe resident after it returns
    source = torch.empty(f, h, dtype=torch_dtype(dtype))
    return torch.randn(rows, h), [ops.laid_out(source.normal_(), rows, source.dtype) for _ in range(n_weights)]


def attention_probe(m: ModelShape, rows: int, context: int, ops) -> tuple:
    """The attention probe's operands, as a decoding step holds them (``cpu/decoder.LlamaDecoder``): ``rows`` rows'
    queries (rows, a, d), per layer their keys and values (rows, k, context, d) in fp32 where the decoder keeps its
    cache (``ops.cache_zeros``: maps of their own, returned to the OS when freed), no key masked (bias 0),
    and the columns attended to. As many layers as the model has while they fit in ATTENTION_PROBE_BYTES (a step
    reads every layer's cache once, so from far more bytes than the last-level cache holds), and fewer columns
    than ``context`` when a single layer would not."""
    import torch

    k, d = m.num_kv_heads, m.d
    column = kv_cache_bytes(replace(m, num_layers=1), rows, "fp32")  # one column of one layer, every row
    length = max(1, min(context, ATTENTION_PROBE_BYTES // column))
    layers = max(1, min(m.num_layers, ATTENTION_PROBE_BYTES // (column * length)))
    keys = [ops.cache_zeros((rows, k, length, d), torch.float32).normal_() for _ in range(layers)]
    values = [ops.cache_zeros((rows, k, length, d), torch.float32).normal_() for _ in range(layers)]
    return torch.randn(rows, m.num_heads, d), keys, values, torch.zeros(rows * k, 1, length), length


def torch_dtype(dtype: str):
    """The planner's dtype name (``fp32``, ``bf16``) as torch's (this module imports torch only when it measures)."""
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]


def training_flops(m: ModelShape, sequences: int, seq_len: int) -> float:
    """Forward and backward of ``sequences`` whole sequences, full fine-tuning, logits on every position."""
    tokens = sequences * seq_len
    p = Pass(2 * m.num_layers * m.layer_params * tokens, attention_flops(m, sequences * seq_len * (seq_len + 1) / 2),
             2 * m.hidden_size * m.vocab_size * tokens)
    return p.total + backward_flops(p, lora=False, head_trained=True)


# What one timing of a probe repeats its work for: about 2 GFLOP, or 2 GB read.
TIMED_AMOUNT = 2e9
# The decoding probe's weights: the model's own size up to this (the size of a 135M-parameter model in fp32);
# past the last-level cache the rate no longer depends on it.
DECODE_PROBE_BYTES = 2**29
# The step overhead's probe (step_overhead): its model's layers beyond the first, and the two lengths of generation
# whose difference is timed (short: the attention stays a small part of it).
PROBE_LAYERS = 3
FEW_STEPS, MANY_STEPS = 4, 20
# The attention probe's KV cache: the model's layers up to this; past the last-level cache the rate per byte no
# longer depends on it.
ATTENTION_PROBE_BYTES = 2**28
