"""Log-probabilities (and entropies) of chosen tokens from logits, with a lean backward.

`log_softmax(logits).gather(tokens)` under autograd keeps the whole [rows, vocab] log-softmax, fills a
zero gradient of that size, scatters into it and runs the log-softmax backward: five passes over the
largest tensor of a step (64 x 16 x 49,152 floats for SmolLM2). `token_logprobs` keeps the log-softmax
(in place of the logits, which are then free) and its backward is one pass, `-softmax * g` plus `g` at
the chosen token. The entropy, a logged statistic, is a batched dot product of the same log-softmax
with its exponent, without a gradient. (Measured on [800, 49152] float32, 2 cores: log_softmax 46 ms
against 73 ms for logsumexp, which PyTorch composes from five passes; the dot product as `bmm` 17 ms
against 63 ms for multiply-then-sum.)
"""

from __future__ import annotations

import torch


class _TokenLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, tokens: torch.Tensor, with_entropy: bool):
        log_probs = torch.log_softmax(logits, dim=-1)
        logp = log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        if with_entropy:  # H = -sum(p * log p)
            entropy = -torch.bmm(log_probs.exp().unsqueeze(1), log_probs.unsqueeze(2)).view(-1)
        else:
            entropy = logits.new_empty(0)
        ctx.save_for_backward(log_probs, tokens)
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: torch.Tensor, _grad_entropy: torch.Tensor):
        log_probs, tokens = ctx.saved_tensors
        grad = log_probs.exp()  # softmax
        grad.mul_(-grad_logp.unsqueeze(-1))
        grad.scatter_add_(-1, tokens.unsqueeze(-1), grad_logp.unsqueeze(-1))
        return grad, None, None


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor,
                   with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits)[token] for each row of `logits` [..., V] and `tokens` [...], computed in at least
    float32; with `with_entropy`, also each row's entropy in nats (no gradient)."""
    shape = tokens.shape
    flat = logits.reshape(-1, logits.shape[-1])
    if flat.dtype in (torch.float16, torch.bfloat16):
        flat = flat.float()
    logp, entropy = _TokenLogProbs.apply(flat, tokens.reshape(-1), with_entropy)
    return logp.view(shape), (entropy.view(shape) if with_entropy else None)
