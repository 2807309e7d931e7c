"""`LinearHead`: a plain linear vocabulary head whose token log-probs and their backward live in one [rows, vocab]
buffer.

Through the head module, `token_logprobs(head(hidden), tokens)` holds the logits and their log-softmax at once in
forward, and in backward the softmax gradient, then its copy padded to oneDNN's row count (`matmul.padded_rows`):
two vocabulary-wide float32 tensors at once, in forward and in backward. Here the product writes the logits
(at the padded rows where oneDNN takes it), the log-softmax overwrites them, backward turns that same buffer into
the gradient in place and runs both products from it. The padded rows hold zero hidden states and get zero
gradient, so they add nothing. The values are the same operations on the same shapes as the module path: equal in
float32, bfloat16 and float64 (tests/engine/generation/fast/test_head.py). The buffer is changed in place by
backward, so a second backward through the same graph raises PyTorch's in-place error instead of reading a gradient
as log-probs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from components.engine.generation.fast.matmul import linear, onednn_product, pad_rows, padded_rows, takes_onednn


class _HeadTokenLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tokens: torch.Tensor,
                with_entropy: bool, onednn: bool):
        rows = len(hidden)
        if onednn and takes_onednn(hidden, weight):
            inputs = pad_rows(hidden, padded_rows(rows))
            buffer = onednn_product(inputs, weight, bias)
        else:
            inputs, buffer, onednn = hidden, torch.nn.functional.linear(hidden, weight, bias), False
        if buffer.dtype in (torch.float16, torch.bfloat16):  # log-probs in at least float32, as token_logprobs
            buffer = buffer.float()
        torch.log_softmax(buffer, dim=-1, out=buffer)
        log_probs = buffer[:rows]
        logp = log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        if with_entropy:  # H = -sum(p * log p), no gradient
            entropy = -torch.bmm(log_probs.exp().unsqueeze(1), log_probs.unsqueeze(2)).view(-1)
        else:
            entropy = buffer.new_empty(0)
        ctx.save_for_backward(buffer, inputs, weight, tokens)
        ctx.mark_non_differentiable(entropy)
        ctx.rows, ctx.onednn, ctx.has_bias = rows, onednn, bias is not None
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: torch.Tensor, _grad_entropy: torch.Tensor):
        buffer, inputs, weight, tokens = ctx.saved_tensors
        rows = ctx.rows
        grad = buffer.exp_()  # the softmax, in the log-softmax's place
        scale = grad_logp.new_zeros(len(grad))
        scale[:rows] = grad_logp  # padded rows: zero gradient
        grad.mul_(-scale.unsqueeze(-1))
        grad[:rows].scatter_add_(-1, tokens.unsqueeze(-1), grad_logp.unsqueeze(-1))
        grad = grad.to(weight.dtype)
        grad_hidden = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_hidden = (onednn_product(grad, weight.t()) if ctx.onednn else grad.mm(weight))[:rows]
        if ctx.needs_input_grad[1]:
            grad_weight = onednn_product(grad.t(), inputs.t()) if ctx.onednn else grad.t().mm(inputs)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad[:rows].sum(0)
        return grad_hidden, grad_weight, grad_bias, None, None, None


@dataclass(frozen=True)
class LinearHead:
    """The vocabulary head `(hidden / temperature) @ weight^T (+ bias)` as a callable (the logits), and its token
    log-probs through one buffer (`token_logprobs`). Hidden states are [rows, in]."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None
    onednn: bool = True  # float32 products on the CPU through oneDNN where `matmul.takes_onednn` says so
    temperature: float = 1.0  # taken on the hidden state: for a head without bias (ModelPieces.vocab_head)

    def _scaled(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden if self.temperature == 1.0 else hidden / self.temperature

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(self._scaled(hidden), self.weight, self.bias, onednn=self.onednn)

    def token_logprobs(self, hidden: torch.Tensor, tokens: torch.Tensor,
                       with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`logprobs.token_logprobs(self(hidden), tokens, with_entropy)`: log-probs [rows] of `tokens` [rows] in
        float32 (and entropies, no gradient), holding one [rows, vocab] buffer in forward and backward."""
        logp, entropy = _HeadTokenLogProbs.apply(self._scaled(hidden), self.weight, self.bias, tokens, with_entropy,
                                                 self.onednn)
        return logp, (entropy if with_entropy else None)
