"""The update's backward through the rollout's own forward: on-policy GRPO (and RFT) without a second forward pass.

With one update per rollout (μ = 1, one minibatch, one micro-batch) the policy that sampled the responses is
the policy the update differentiates, with the same weights. The forward the update would run, every
response token through the model, has then already been run once: token by token, while decoding. The lean
decoder (``cpu/decoder.py``, ``record=True``) keeps what a backward needs from it:

- per layer and per call (the prompt prefix once per distinct prompt, then one call per decoding step): the
  layer's input x, its q/k/v products (rotary not yet applied), the residual after attention and its gate/up
  products;
- per step: the last layer's output, the tokens fed, log Z and the entropy of the logits at the sampling
  temperature, the sampled token's logit, and the logits themselves while they fit (``RECORD_LOGITS_BYTES``).

:meth:`Recording.logprobs` gives the log-probabilities and entropies of the sampled tokens from those (what
``response_logprobs`` computes with a forward). The trainer builds the same loss on them and differentiates it
down to the log-probabilities; :meth:`Recording.backward` continues from there, layer by layer, top to bottom,
over every recorded row at once:

- the linear layers' input and weight gradients as products with all of the batch's rows (the shapes a
  training backward has, and what a CPU runs fastest), from the recorded inputs;
- the cheap non-linear parts recomputed from the recorded values and differentiated by their written-out
  derivatives: RMSNorm (:func:`rms_norm_backward`), SiLU·up (:func:`silu_mul_backward`), the rotary embedding
  (the inverse rotation) and attention (batched products per block of rows, :meth:`Recording._attention_backward`).

Gradients land in ``.grad`` as ``loss.backward()`` would leave them (LoRA adapters, norm weights, biases, a tied
head and embedding included), each parameter's through autograd once and without a copy (:class:`_Handover`),
so its hooks run. The numbers are those
of autograd through transformers' forward to float rounding: the decoding kernels sum in another order than a
training forward does (``tests/cpu/test_replay.py`` checks each parameter's gradient).

A recording of bf16 products (``train.cpu_decode_dtype``) is differentiated as the function decoding computed:
the log-probabilities are decoding's own (π_old is the sampling probability exactly), and each weight's gradient
dyᵀ·x takes the product's input x rounded to bf16, as decoding multiplied it. The input gradients dy·W use the
fp32 weights (the cast's derivative is the identity; bf16 there would round the gradient itself). What it saves is the
update's forward: about a third of its FLOPs (``docs/performance.md``). :meth:`Recording.logprobs_under`
scores the same rows under another model of the architecture (the reference) in one pass.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cohortrl.cpu import kernels
from cohortrl.cpu.decoder import _base_model, _linear_parts, _stacked, _weight_and_bias, computes, paired_qkv, rms_norm, rotate

# Head gradients of at most this many bytes of logits at once (as ``hf.LOGPROB_CHUNK_BYTES``).
CHUNK_BYTES = 32 * 2**20


class Gradients(dict):
    """Parameter → its gradient from this backward, summed here and handed to autograd once per parameter
    (:meth:`deliver`, through :class:`_Handover`): ``.grad`` accumulates and the parameter's hooks run as in
    ``loss.backward()``."""

    def add(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        if param in self:
            self[param] += grad
        else:
            self[param] = grad

    def add_product(self, param: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
        """param's gradient += a·b, in the product itself when there is one already (the head's chunks)."""
        if param in self:
            self[param].addmm_(a, b)
        else:
            self[param] = a @ b

    def deliver(self) -> None:
        if not self:
            return
        params = list(self)
        handed = [self.pop(p) for p in params]  # from here on _Handover's backward is their only holder
        with torch.enable_grad():
            torch.autograd.backward(_Handover.apply(handed, *params))


class _Handover(torch.autograd.Function):
    """A scalar whose backward gives each parameter its precomputed gradient. Handed over this way, from
    inside a backward pass, the gradient tensor has no other owner when it reaches the parameter's
    AccumulateGrad, which then keeps it as ``.grad`` instead of copying it (``torch.autograd.backward(param,
    grad)`` from Python always copies: the caller still holds ``grad``); every hook runs as in
    ``loss.backward()``."""

    @staticmethod
    def forward(ctx, handed: list, *params):
        ctx.handed = handed
        return params[0].new_zeros(())

    @staticmethod
    def backward(ctx, _):
        grads = (None, *ctx.handed)
        ctx.handed.clear()  # the list is also the caller's: it must not keep the tensors alive
        return grads


def linear_backward(module, x_N: torch.Tensor, grad_y_N: torch.Tensor, grads: Gradients) -> torch.Tensor:
    """For y = module(x) on N rows: the gradients of the module's trainable parameters given dL/dy (into
    ``grads``), and dL/dx. A plain ``nn.Linear`` (dx = dy·W, dW = dyᵀ·x, db = Σ dy) or a PEFT LoRA layer (the
    frozen base as that, plus each adapter's s·B·A·x through autograd; its products have rank r)."""
    base, adapters = _linear_parts(module)
    weight = base.weight
    grad_y_N = grad_y_N.contiguous()
    grad_x = kernels.onednn_linear(grad_y_N, weight.detach().t())  # dy·W (a recording exists only on the oneDNN kernel)
    if weight.requires_grad:
        grads.add_product(weight, grad_y_N.t(), x_N)
    if base.bias is not None and base.bias.requires_grad:
        grads.add(base.bias, grad_y_N.sum(0))
    if adapters:
        with torch.enable_grad():
            x = x_N.detach().requires_grad_()
            out = sum(module.lora_B[n](module.lora_A[n](module.lora_dropout[n](x))) * module.scaling[n] for n in adapters)
        torch.autograd.backward(out, grad_y_N)
        grad_x += x.grad
    return grad_x


def rms_norm_backward(x_N: torch.Tensor, norm, grad_y_N: torch.Tensor, grads: Gradients) -> torch.Tensor:
    """For y = rms_norm(x) = x·r·w with r = (mean(x²) + ε)^-½: dL/dx given dL/dy, and dL/dw into ``grads``.
    With x̂ = x·r and g = dL/dy ⊙ w: dx = r·(g − x̂·mean(g ⊙ x̂)), dw = Σ_rows dL/dy ⊙ x̂ (the derivative of
    transformers' LlamaRMSNorm, written out instead of recomputed under autograd)."""
    r = x_N.pow(2).mean(-1, keepdim=True).add_(norm.variance_epsilon).rsqrt_()
    x_hat = x_N * r
    if norm.weight.requires_grad:
        grads.add(norm.weight, (grad_y_N * x_hat).sum(0))
    g = grad_y_N * norm.weight.detach()
    return g.sub_(x_hat.mul_((g * x_hat).mean(-1, keepdim=True))).mul_(r)


def silu_mul_backward(gate_N: torch.Tensor, up_N: torch.Tensor, silu_gate_N: torch.Tensor,
                      grad_act_N: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For act = silu(gate)·up: dL/dgate and dL/dup (each contiguous) given dL/dact and silu(gate), which it
    overwrites: d gate = silu'(gate)·up·dact (aten's own SiLU derivative), d up = silu(gate)·dact."""
    return torch.ops.aten.silu_backward(grad_act_N * up_N, gate_N), silu_gate_N.mul_(grad_act_N)


class Recording:
    """What a recording :class:`~cohortrl.rollout.decoder.LlamaDecoder` kept, for the update's backward.

    Rows: the prefix's U·P rows (distinct prompt u, column j at u·P + j) then each decoding step's B rows
    (step s, row b at U·P + s·B + b). Step s fed token ``fed[s]`` and produced the logits of response token s."""

    def __init__(self, decoder, prefix: tuple | None, prompt_mask_BT: torch.Tensor):
        self.base = decoder.base
        self.H, self.Hkv, self.D = decoder.H, decoder.Hkv, decoder.D
        self.q_order, self.k_order = decoder.q_order, decoder.k_order  # the projections' features, paired for rotary
        self.q_back = torch.argsort(decoder.q_order)  # paired feature order → the projection's own
        self.k_back = torch.argsort(decoder.k_order)
        self.S, self.B = len(decoder.fed), prompt_mask_BT.shape[0]
        n = self.S * self.B  # the steps decoding ran (it may end before its last)
        self.records = [[buffer[: decoder.n_prefix + n] for buffer in layer] for layer in decoder.records]
        self.V = self.base.get_output_embeddings().weight.shape[0]
        self.finals_NH = decoder.finals[:n] if self.S else None  # (S·B, d)
        self.logits_NV = decoder.logits[:n] if decoder.logits is not None else None  # (S·B, V), or recomputed (_logits)
        self.fed = torch.cat(decoder.fed) if self.S else torch.zeros(0, dtype=torch.long)
        self.temperature = decoder.temperature
        self.dtype = decoder.dtype  # the products'
        empty = torch.zeros(0, self.B)
        self.logz_SB = torch.stack(decoder.logz) if self.S else empty  # (S, B) at the temperature
        self.entropy_SB = torch.stack(decoder.entropy) if self.S else empty
        self.target_SB = torch.stack(decoder.target) if self.S else empty  # the sampled tokens' logits / temperature
        self.rotation_d = decoder.rotation[:, : self.S]  # (B, S, 1, D/2)
        if prefix is not None:
            ids_UP, _, self.index_B = prefix
            self.prefix_ids = ids_UP.reshape(-1)
            self.U, self.P = ids_UP.shape
            self.rotation_p, self.allowed_p = decoder.prefix_rotation, decoder.prefix_allowed  # as the prefill ran it
            self.prefix_keep_B = prompt_mask_BT[:, : self.P].bool()
        else:
            self.U = self.P = 0
            self.prefix_ids = torch.zeros(0, dtype=torch.long)
        self.blocks = self._blocks()
        # Rows decoding stopped computing after their end (``LlamaDecoder.end_rows``) were never written. Their
        # q/k/v still enter the attention's batched products, as keys no query reads and queries whose gradient
        # is 0; they must be finite there (0 · NaN is NaN): they are, the decoder's buffers start at zero
        # (``memory.mapped_zeros``). Nothing else of theirs is read (``backward`` computes only the rows the
        # gradient reaches).
        self.dropped = dict(decoder.dropped)  # row -> the first step not computed

    def _multiplied(self, x_N: torch.Tensor) -> torch.Tensor:
        """A product's input as decoding multiplied it: rounded to bf16 in a recording of bf16 products, else x."""
        return x_N if self.dtype == torch.float32 else x_N.to(self.dtype).float()

    # ------------------------------------------------------------------------------------------ log-probs
    def _logits(self, rows) -> torch.Tensor:
        """Decoding's logits (n, V) for step-major rows: kept (the kept tensor itself for a contiguous range of
        rows, which the caller may then overwrite), or recomputed from the final hidden states through the final
        norm and the head when they did not fit (``RECORD_LOGITS_BYTES``), in the products' dtype."""
        if self.logits_NV is not None:
            first, last = int(rows[0]), int(rows[-1]) + 1
            return self.logits_NV[first:last] if last - first == len(rows) else self.logits_NV[rows]
        norm, head = self.base.model.norm, self.base.get_output_embeddings()
        h = rms_norm(self.finals_NH[rows], norm.weight, norm.variance_epsilon)
        if self.dtype == torch.float32:
            return head(h).float()
        weight, bias = _weight_and_bias(head)  # as decoding multiplied it: adapters folded in fp32, then cast
        return F.linear(h.to(self.dtype), weight.to(self.dtype), None if bias is None else bias.to(self.dtype)).float()

    def _check(self, response_ids_BT) -> None:
        if tuple(response_ids_BT.shape) != (self.B, self.S):
            raise ValueError(f"recording of {self.B} rows × {self.S} steps, asked for {tuple(response_ids_BT.shape)}")

    @torch.no_grad()
    def logprobs(self, response_ids_BT, response_mask_BT, temperature: float):
        """Log-probabilities (B, T) of the response tokens and their entropies (B, T) at ``temperature`` (0 on
        positions outside ``response_mask``), as ``response_logprobs``: decoding's own numbers at the sampling
        temperature; at another (RFT's supervised loss is at 1) from the logits, kept or recomputed from the
        final hidden states, a chunk of positions at a time."""
        self._check(response_ids_BT)
        keep = response_mask_BT.bool()
        temperature = float(temperature or 1.0)
        if temperature == self.temperature:
            logp_BT = (self.target_SB - self.logz_SB).t().masked_fill(~keep, 0.0).contiguous()
            return logp_BT, self.entropy_SB.t().masked_fill(~keep, 0.0).contiguous()
        rows = keep.t().reshape(-1).nonzero().squeeze(-1)  # step-major, as the recording's rows
        target_N = response_ids_BT.t().reshape(-1)
        logp_N, entropy_N = torch.zeros(self.S * self.B), torch.zeros(self.S * self.B)
        chunk = max(1, CHUNK_BYTES // (4 * self.V))
        for s in range(0, len(rows), chunk):
            r = rows[s:s + chunk]
            z = self._logits(r) / temperature  # a new tensor: the kept logits stay for the backward
            logz = z.logsumexp(-1)
            logp_N[r] = z.gather(-1, target_N[r, None]).squeeze(-1) - logz
            entropy_N[r] = logz - (z.sub(logz[:, None]).exp_() * z).sum(-1)  # H = log Z − Σ p·z
        return logp_N.view(self.S, self.B).t().contiguous(), entropy_N.view(self.S, self.B).t().contiguous()

    @staticmethod
    def can_score(model) -> bool:
        """Whether :meth:`logprobs_under` computes ``model`` (the lean decoder's models); if not, the reason is
        logged once per model."""
        return computes(model, "the reference's log-probs use plain transformers")

    @torch.no_grad()
    def logprobs_under(self, model, response_ids_BT, response_mask_BT) -> torch.Tensor:
        """Log-probabilities (B, T) of the response tokens under another model of the same architecture (the
        reference), at the recording's temperature, 0 outside ``response_mask``: ``response_logprobs``' numbers,
        computed on the recording's rows in one pass. Every product sees all rows at once (each distinct
        prompt's prefix once, then every row's fed tokens), the attention is the recording's, and the LM head
        runs on the real response positions only, a chunk at a time."""
        self._check(response_ids_BT)
        base = _base_model(model)
        x = F.embedding(torch.cat([self.prefix_ids, self.fed]), base.get_input_embeddings().weight)  # (N, d)
        for layer in base.model.layers:
            attn, mlp, norm = layer.self_attn, layer.mlp, layer.input_layernorm
            h = rms_norm(x, norm.weight, norm.variance_epsilon)
            x = x + attn.o_proj(self._attention(paired_qkv(attn, h, self.q_order, self.k_order))[0])
            norm = layer.post_attention_layernorm
            h = rms_norm(x, norm.weight, norm.variance_epsilon)
            x = x + mlp.down_proj(F.silu(mlp.gate_proj(h)) * mlp.up_proj(h))
        keep_N = response_mask_BT.t().reshape(-1).bool()  # step-major, as the rows
        rows = keep_N.nonzero().squeeze(-1)
        norm, head = base.model.norm, base.get_output_embeddings()
        h = rms_norm(x[self.U * self.P:][rows], norm.weight, norm.variance_epsilon)
        target_N = response_ids_BT.t().reshape(-1)[rows]
        logp_N = torch.zeros(self.S * self.B)
        chunk = max(1, CHUNK_BYTES // (4 * self.V))
        for s in range(0, len(rows), chunk):
            z = head(h[s:s + chunk]).float()
            z = z / self.temperature if self.temperature != 1.0 else z
            logp_N[rows[s:s + chunk]] = z.gather(-1, target_N[s:s + chunk, None]).squeeze(-1) - z.logsumexp(-1)
        return logp_N.view(self.S, self.B).t().contiguous()

    # ------------------------------------------------------------------------------------------ backward
    def _blocks(self) -> list[tuple]:
        """The attention as independent blocks, each (kind, first, last, keys (n, L, M)): the prefix's prompts
        first:last (U prompts × P columns, causal over each prompt's real positions, a padding column seeing
        itself) and the decoding rows first:last (B rows × S steps over their prompt's P prefix columns, then
        their own steps causally), split so that a block's probabilities stay within ``CHUNK_BYTES``."""
        H, U, P, S, B = self.H, self.U, self.P, self.S, self.B
        blocks = []
        n_chunk = max(1, CHUNK_BYTES // (4 * H * max(1, P * P)))
        for u in range(0, U, n_chunk):
            blocks.append(("prefix", u, min(U, u + n_chunk), self.allowed_p[u:u + n_chunk]))
        causal = torch.ones(S, S, dtype=torch.bool).tril()
        n_chunk = max(1, CHUNK_BYTES // (4 * H * max(1, S * (P + S))))
        for b in range(0, B, n_chunk):
            n = min(B, b + n_chunk) - b
            keep = causal.expand(n, S, S)
            if P:
                keep = torch.cat([self.prefix_keep_B[b:b + n, None, :].expand(n, S, P), keep], -1)
            blocks.append(("decode", b, b + n, keep))
        return blocks

    def _rows(self, t_N: torch.Tensor, kind: str, first: int, last: int) -> torch.Tensor:
        """A block's rows of a per-row tensor (N, ·) as a view (n, L, ·): prompts first:last of the prefix, or
        decoding rows first:last over all steps."""
        UP = self.U * self.P
        if kind == "prefix":
            return t_N[first * self.P:last * self.P].view(last - first, self.P, -1)
        return t_N[UP:].view(self.S, self.B, -1)[:, first:last].transpose(0, 1)

    def _heads(self, qkv: torch.Tensor, rotation: torch.Tensor):
        """qkv (n, L, ·) → q (n, H, L, D) and k, v (n, Hkv, L, D), q and k rotated, all contiguous."""
        H, Hkv, D = self.H, self.Hkv, self.D
        q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
        q = rotate(q.unflatten(-1, (H, D)), rotation).transpose(1, 2).contiguous()
        k = rotate(k.unflatten(-1, (Hkv, D)), rotation).transpose(1, 2).contiguous()
        return q, k, v.unflatten(-1, (Hkv, D)).transpose(1, 2).contiguous()

    def _block_forward(self, qkv_N: torch.Tensor, block) -> tuple:
        """A block's q (n, H, L, D), keys and values (n, Hkv, M, D) (a decoding block's: its rows' prompt prefix,
        then its own steps), probabilities softmax(q kᵀ / √D) over the allowed keys (n·Hkv, g·L, M) (each KV
        head with its g query heads) and output (n·Hkv, g·L, D) = (n, H, L, D)."""
        kind, first, last, keep = block
        D = self.D
        if kind == "prefix":
            q, k, v = self._heads(self._rows(qkv_N, kind, first, last), self.rotation_p[first:last])
        else:
            q, k, v = self._heads(self._rows(qkv_N, kind, first, last), self.rotation_d[first:last])
            if self.P:
                index = self.index_B[first:last]
                _, k_p, v_p = self._heads(qkv_N[: self.U * self.P].view(self.U, self.P, -1)[index], self.rotation_p[index])
                k, v = torch.cat([k_p, k], 2), torch.cat([v_p, v], 2)
        n, H, L, _ = q.shape
        Hkv, M = k.shape[1], k.shape[2]
        scores = torch.bmm(q.view(n * Hkv, H // Hkv * L, D) * D ** -0.5, k.view(n * Hkv, M, D).transpose(1, 2))
        scores.view(n, Hkv, H // Hkv, L, M).masked_fill_(~keep[:, None, None], float("-inf"))
        probs = scores.softmax(-1)
        return q, k, v, probs, torch.bmm(probs, v.view(n * Hkv, M, D))

    def _attention(self, qkv_N: torch.Tensor, keep_for_backward: bool = False) -> tuple[torch.Tensor, list]:
        """Every row's attention output (N, H·D) from its q/k/v products, as the decoder computed it: the prefix
        causally over its own prompt, each decoding row over its prompt's prefix and its own earlier steps.
        Written out as products (the shapes are small: SDPA's CPU kernel spends more around them). Also, with
        ``keep_for_backward``, the first blocks' values for :meth:`_attention_backward`, as many as have their
        probabilities fit in ``CHUNK_BYTES`` in all (it recomputes the others); else an empty list."""
        H, D = self.H, self.D
        out = qkv_N.new_empty(qkv_N.shape[0], H * D)
        kept, kept_bytes = [], 0
        for block in self.blocks:
            saved = self._block_forward(qkv_N, block)
            o = saved[-1]
            kind, first, last, _ = block
            n = last - first
            self._rows(out, kind, first, last).copy_(o.view(n, H, -1, D).transpose(1, 2).flatten(-2))
            kept_bytes += saved[3].numel() * 4
            if keep_for_backward and kept_bytes <= CHUNK_BYTES:
                kept.append(saved)
        return out, kept

    def _attention_backward(self, qkv_N: torch.Tensor, grad_out_N: torch.Tensor, kept: list) -> torch.Tensor:
        """dL/d qkv_N given dL/d :meth:`_attention`'s output and the blocks it kept. Per block, with P the
        probabilities and O the output:
        dV = Pᵀ dO, dS = P ⊙ (dO Vᵀ − rowsum(dO ⊙ O)), dQ = dS K / √D, dK = dSᵀ Q / √D; a decoding block's
        prefix keys and values pass their gradients to the prefix rows they came from; the rotary embedding's
        gradient is the inverse rotation."""
        H, Hkv, D, U, P = self.H, self.Hkv, self.D, self.U, self.P
        grad_qkv = torch.empty_like(qkv_N)
        grad_prefix_kv = qkv_N.new_zeros(U, Hkv, P, 2, D) if P else None  # from decoding rows, before rotation back
        scale = D ** -0.5
        blocks = self.blocks
        for i in reversed(range(len(blocks))):  # decoding blocks first: they add to the prefix's keys and values
            kind, first, last, _ = blocks[i]
            q, k, v, p, o = kept[i] if i < len(kept) else self._block_forward(qkv_N, blocks[i])
            n, g, L, M = last - first, H // Hkv, q.shape[2], k.shape[2]
            v_ = v.view(n * Hkv, M, D)
            do = self._rows(grad_out_N, kind, first, last).view(n, L, H, D).transpose(1, 2).reshape(n * Hkv, g * L, D)
            dv = torch.bmm(p.transpose(1, 2), do).view(n, Hkv, M, D)
            ds = torch.bmm(do, v_.transpose(1, 2)).sub_((do * o).sum(-1, keepdim=True)).mul_(p)
            dq = torch.bmm(ds, k.view(n * Hkv, M, D)).mul_(scale).view(n, H, L, D)
            dk = torch.bmm(ds.transpose(1, 2), q.view(n * Hkv, g * L, D)).mul_(scale).view(n, Hkv, M, D)
            if kind == "decode":
                rotation = self.rotation_d[first:last]
                if P:
                    grad_prefix_kv.index_add_(0, self.index_B[first:last], torch.stack([dk[:, :, :P], dv[:, :, :P]], 3))
                    dk, dv = dk[:, :, P:], dv[:, :, P:]
            else:
                rotation = self.rotation_p[first:last]
                dk = dk + grad_prefix_kv[first:last, :, :, 0]
                dv = dv + grad_prefix_kv[first:last, :, :, 1]
            back = rotation.conj()  # the rotation's transpose is its inverse
            grad = self._rows(grad_qkv, kind, first, last)  # (n, L, ·), a view
            grad[..., : H * D] = rotate(dq.transpose(1, 2), back).flatten(-2)
            grad[..., H * D:(H + Hkv) * D] = rotate(dk.transpose(1, 2), back).flatten(-2)
            grad[..., (H + Hkv) * D:] = dv.transpose(1, 2).flatten(-2)
        return grad_qkv

    def _qkv_backward(self, attn, h1_N: torch.Tensor, grad_qkv_N: torch.Tensor, grads: Gradients) -> torch.Tensor:
        """dL/dh1 for [q | k | v] = the projections of h1, q and k in the decoder's paired feature order, given
        their gradient; the projections' own gradients into ``grads``. Without adapters, one product for dh1 and
        one for the three weights (k and v are narrow), in the paired order, the weights' rows then put back in
        the projections' own order; with LoRA adapters, each projection through :func:`linear_backward`."""
        sizes = [self.H * self.D, self.Hkv * self.D, self.Hkv * self.D]
        modules, backs = (attn.q_proj, attn.k_proj, attn.v_proj), (self.q_back, self.k_back, None)
        parts = [_linear_parts(m) for m in modules]
        if any(adapters for _, adapters in parts):
            return sum(linear_backward(m, h1_N, g if back is None else g[:, back], grads)
                       for m, g, back in zip(modules, grad_qkv_N.split(sizes, dim=-1), backs))
        bases = [base for base, _ in parts]
        grad_qkv_N = grad_qkv_N.contiguous()
        weight, _ = _stacked(modules, [self.q_order, self.k_order, None])  # as decoding multiplied by it
        grad_h1 = kernels.onednn_linear(grad_qkv_N, weight.t())  # dy·W (a recording exists only on the oneDNN kernel)
        if any(b.weight.requires_grad for b in bases):
            grad_w = grad_qkv_N.t() @ h1_N  # (H·D + 2·Hkv·D, d), rows in the paired order
            for base, g, back in zip(bases, grad_w.split(sizes), backs):
                if base.weight.requires_grad:
                    grads.add(base.weight, g if back is None else g[back])
        if any(b.bias is not None and b.bias.requires_grad for b in bases):
            for base, g, back in zip(bases, grad_qkv_N.sum(0).split(sizes), backs):
                if base.bias is not None and base.bias.requires_grad:
                    grads.add(base.bias, g if back is None else g[back])
        return grad_h1

    def _reached_rows(self, g_SB: torch.Tensor) -> torch.Tensor:
        """The rows (sorted) whose states the loss's gradient reaches: every prefix row, and each decoding row's
        steps up to its last with a nonzero dL/dlogp. A later step's states feed no earlier one (causal
        attention), so the steps after it, the padding after the row's end included, get a gradient of 0."""
        steps = torch.arange(self.S)
        last_B = torch.where(g_SB != 0, steps[:, None], -1).amax(0) if self.S else torch.zeros(0, dtype=torch.long)
        reached_N = (steps[:, None] <= last_B).reshape(-1).nonzero().squeeze(-1)
        return torch.cat([torch.arange(self.U * self.P), self.U * self.P + reached_N])

    @torch.no_grad()
    def backward(self, grad_logp_BT: torch.Tensor, response_ids_BT: torch.Tensor, temperature: float) -> None:
        """Accumulate dL/dθ into the model's ``.grad`` given dL/d logp (B, T) of :meth:`logprobs`' values for
        ``response_ids`` at ``temperature`` (the sampling one, or another as :meth:`logprobs` computed). Uses up the
        recording."""
        self._check(response_ids_BT)
        base = self.base
        temperature = float(temperature or 1.0)
        recorded_logz = temperature == self.temperature  # decoding's log Z is at its own temperature only
        N_prefix = self.U * self.P
        N = N_prefix + self.S * self.B
        g_N = grad_logp_BT.t().reshape(-1).float()
        if not g_N.any():  # nothing to learn from (identical rewards at β = 0, no RFT sample passed): every
            # gradient is exactly 0, which is what autograd would leave in .grad (and AdamW then still steps)
            grads = Gradients({p: torch.zeros_like(p) for p in base.parameters() if p.requires_grad})
            self.records, self.finals_NH, self.logits_NV = [None] * len(self.records), None, None
            grads.deliver()
            return
        # The layers' products run on the rows the gradient reaches only (n of the N recorded); the attention,
        # whose blocks are laid out over all N, gets and gives its gradients as (N, ·), 0 on the others.
        reached = self._reached_rows(g_N.view(self.S, self.B))
        n = len(reached)
        take = (lambda t: t) if n == N else (lambda t: t[reached])  # noqa: E731
        at = torch.full((N,), -1, dtype=torch.long)
        at[reached] = torch.arange(n)  # a recorded row's place among the reached
        grad_x = torch.zeros(n, self.finals_NH.shape[1])
        grads = Gradients()

        # The head: logp = z[target] − log Σ exp z with z = logits / temperature, so dlogp/dlogits = (onehot − p) / temperature.
        target_N = response_ids_BT.t().reshape(-1)
        logz_N = self.logz_SB.reshape(-1)
        rows = g_N.nonzero().squeeze(-1)  # the positions the loss reaches
        norm = base.model.norm
        final = self.finals_NH[rows]
        h = self._multiplied(rms_norm(final, norm.weight.detach(), norm.variance_epsilon))
        head = base.get_output_embeddings()
        grad_h = torch.empty_like(h)
        chunk = max(1, CHUNK_BYTES // (4 * self.V))
        for s in range(0, len(rows), chunk):
            r, g = rows[s:s + chunk], g_N[rows[s:s + chunk]]
            z = self._logits(r)  # used up here: p = exp(z − log Z) in place
            z = z / temperature if temperature != 1.0 else z
            # bf16 logits recomputed by another kernel than decoding's can differ from them in a last bit, which at
            # bf16's spacing moves p: their own log Z keeps p a distribution
            logz = logz_N[r] if recorded_logz and (self.logits_NV is not None or self.dtype == torch.float32) else z.logsumexp(-1)
            grad_logits = z.sub_(logz[:, None]).exp_().mul_(-g[:, None])
            grad_logits.scatter_add_(-1, target_N[r, None], g[:, None])
            if temperature != 1.0:
                grad_logits.div_(temperature)
            grad_h[s:s + chunk] = linear_backward(head, h[s:s + chunk], grad_logits, grads)
        grad_x[at[N_prefix + rows]] = rms_norm_backward(final, norm, grad_h, grads)
        self.finals_NH = self.logits_NV = None

        for i in reversed(range(len(base.model.layers))):
            layer = base.model.layers[i]
            attn, mlp = layer.self_attn, layer.mlp
            x_in, qkv, x_mid, gate_up = self.records[i]
            x_in, x_mid, gate_up = take(x_in), take(x_mid), take(gate_up)
            self.records[i] = None
            # out = x_mid + down(silu(gate) · up), gate, up = gate_proj(h2), up_proj(h2), h2 = norm(x_mid)
            gate, up = gate_up.chunk(2, dim=-1)
            silu_gate = F.silu(gate)
            grad_act = linear_backward(mlp.down_proj, self._multiplied(silu_gate * up), grad_x, grads)
            grad_gate, grad_up = silu_mul_backward(gate, up, silu_gate, grad_act)
            h2 = self._multiplied(rms_norm(x_mid, layer.post_attention_layernorm.weight.detach(),
                                           layer.post_attention_layernorm.variance_epsilon))
            grad_h2 = linear_backward(mlp.gate_proj, h2, grad_gate, grads).add_(linear_backward(mlp.up_proj, h2, grad_up, grads))
            grad_mid = rms_norm_backward(x_mid, layer.post_attention_layernorm, grad_h2, grads).add_(grad_x)
            # x_mid = x_in + o_proj(attention(q, k, v)), q, k, v = projections of h1 = norm(x_in)
            a, kept = self._attention(qkv, keep_for_backward=True)
            grad_a = linear_backward(attn.o_proj, self._multiplied(take(a)), grad_mid, grads)
            if n < N:
                grad_a = grad_a.new_zeros(N, grad_a.shape[1]).index_copy_(0, reached, grad_a)
            grad_qkv = take(self._attention_backward(qkv, grad_a, kept))
            h1 = self._multiplied(rms_norm(x_in, layer.input_layernorm.weight.detach(), layer.input_layernorm.variance_epsilon))
            grad_h1 = self._qkv_backward(attn, h1, grad_qkv, grads)
            grad_x = rms_norm_backward(x_in, layer.input_layernorm, grad_h1, grads).add_(grad_mid)

        module = base.get_input_embeddings()
        embedding = module.weight
        if embedding.requires_grad:  # rows of the tokens fed; added in place to a tied head's gradient
            ids = take(torch.cat([self.prefix_ids, self.fed]))
            if getattr(module, "padding_idx", None) is not None:  # nn.Embedding leaves that row's gradient at 0
                grad_x[ids == module.padding_idx] = 0  # (SmolLM2's padding_idx is <|im_end|>, a real token)
            if embedding not in grads:
                grads[embedding] = torch.zeros_like(embedding)
            grads[embedding].index_add_(0, ids, grad_x)  # into a tied head's gradient: no second (V, d) tensor
        grads.deliver()
