"""This CPU's rates for the planner's CPU time (``cohortrl plan`` measures them at plan time): the three kinds of
work a step does, timed at the model's shapes."""

from __future__ import annotations

from dataclasses import replace

from cohortrl.planner import DTYPE_BYTES, ModelShape, Pass, attention_flops, backward_flops


def measure_cpu_rates(m: ModelShape, threads: int, rows: int, rank: int = 16, repeats: int = 3,
                      decode_dtype: str = "fp32") -> dict[str, float]:
    """This CPU's rates (FLOP/s, as the planner counts FLOPs) for the three kinds of work a step does, on
    ``threads`` torch threads, in fp32 but for decoding's products, which are in ``decode_dtype`` (the lean
    decoder's, ``RunSpec.decode_dtype``):

    - ``decode``: ``rows`` × h by h × f products (one row per sequence) over as many distinct h × f weights as
      the model's linear layers hold (at most DECODE_PROBE_BYTES of them; :func:`decode_probe`): a decoding step
      reads every weight once for a few rows, so its rate is set by how fast the weights stream from memory, not
      by the arithmetic, and a probe on one cache-resident weight overstates it several times;
    - ``layer``: forward and backward, under autograd, of two transformers Llama layers of the model's shape
      (full fine-tuning, 2 sequences of 256 tokens): prefill, scoring and the update, where the products run
      on many rows and beside them the norms, rotary embedding, attention's softmax, SwiGLU and autograd's
      bookkeeping, which a bare product leaves out (a bare 2048-row product runs about 1.6 × faster here);
    - ``thin``: 2048 rows through a rank-``rank`` pair of products (f → r, r → f), LoRA's adapters' shapes.

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
        x, weights = decode_probe(m, rows, decode_dtype)
        dy, down, up, a = torch.randn(2048, f), torch.randn(rank, f), torch.randn(f, rank), torch.randn(2048, rank)
        probe = replace(m, num_layers=2, vocab_size=256)  # two layers, a token vocabulary too small to matter
        block = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=probe.vocab_size, hidden_size=h, intermediate_size=f, num_hidden_layers=probe.num_layers,
            num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads, head_dim=m.d,
            tie_word_embeddings=True))
        ids = torch.randint(0, probe.vocab_size, (2, 256))

        def train_block():
            block(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits.sum().backward()

        products = {  # name: (FLOPs as the planner counts them, the work)
            "decode": (2 * rows * h * f * len(weights), lambda: [F.linear(x, w) for w in weights]),
            "layer": (training_flops(probe, *ids.shape), train_block),
            "thin": (2 * 2 * 2048 * f * rank, lambda: (F.linear(dy, down), F.linear(a, up))),
        }
        rates = {}
        for name, (flops, work) in products.items():
            work()  # first touch: allocation and kernel selection
            reps = max(1, int(2e9 // flops))  # ~2 GFLOP, or one pass over the weights, per timing
            best = float("inf")
            for _ in range(repeats):
                start = time.process_time()
                for _ in range(reps):
                    work()
                best = min(best, (time.process_time() - start) / reps)
            rates[name] = flops / best * threads
        return rates
    finally:
        torch.set_num_threads(previous)


def decode_probe(m: ModelShape, rows: int, dtype: str = "fp32") -> tuple:
    """The decoding probe's operands in ``dtype`` (fp32 or bf16): ``rows`` × h inputs and as many distinct f × h
    weights as the model's linear layers hold, at most DECODE_PROBE_BYTES of them in that dtype (bf16 weights
    stream at half fp32's bytes)."""
    import torch

    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    size, h, f = DTYPE_BYTES[dtype], m.hidden_size, m.intermediate_size
    linear_bytes = (m.num_layers * m.layer_matrix_params + m.vocab_size * h) * size
    n_weights = max(1, int(min(linear_bytes, DECODE_PROBE_BYTES) // (h * f * size)))
    return torch.randn(rows, h).to(torch_dtype), [torch.randn(f, h).to(torch_dtype) for _ in range(n_weights)]


def training_flops(m: ModelShape, sequences: int, seq_len: int) -> float:
    """Forward and backward of ``sequences`` whole sequences, full fine-tuning, logits on every position."""
    tokens = sequences * seq_len
    p = Pass(2 * m.num_layers * m.layer_params * tokens, attention_flops(m, sequences * seq_len * (seq_len + 1) / 2),
             2 * m.hidden_size * m.vocab_size * tokens)
    return p.total + backward_flops(p, lora=False, head_trained=True)


# The decoding probe's weights: the model's own size up to this (the size of a 135M-parameter model in fp32);
# past the last-level cache the rate no longer depends on it.
DECODE_PROBE_BYTES = 2**29
