"""Half-precision full fine-tuning trains through float32 master weights (`MasterWeightAdamW`): the update a
float32 AdamW would make, rounded into the half-precision weights, instead of updates rounded away."""

from __future__ import annotations

import torch

from components.engine.models.optim import MasterWeightAdamW, make_optimizer


def _model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(0.5, 1.0)  # one binade: a bfloat16 step there is 2^-8
    return model.to(dtype)


def _steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, grads: list[list[torch.Tensor]]) -> None:
    for step in grads:
        optimizer.zero_grad(set_to_none=True)
        for p, g in zip(model.parameters(), step):
            p.grad = g.to(p.dtype)
        optimizer.step()


def _grads(model: torch.nn.Module, steps: int) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [[torch.randn(p.shape, generator=gen).bfloat16() for p in model.parameters()] for _ in range(steps)]


def test_bfloat16_weights_get_the_float32_update_rounded_once():
    half, full = _model(torch.bfloat16), _model(torch.bfloat16).float()
    grads = _grads(half, 8)
    ours = make_optimizer(half, 1e-3, 0.01, torch.device("cpu"))
    assert isinstance(ours, MasterWeightAdamW)
    _steps(half, ours, grads)
    reference = torch.optim.AdamW(full.parameters(), lr=1e-3, weight_decay=0.01, fused=True)
    _steps(full, reference, grads)
    for master, p, expected in zip(ours.masters, half.parameters(), full.parameters()):
        assert master.dtype == torch.float32 and p.dtype == torch.bfloat16
        torch.testing.assert_close(master, expected, atol=1e-7, rtol=1e-6)
        assert torch.equal(p, expected.detach().bfloat16())
    # plain AdamW over the bfloat16 weights rounds these updates (1e-3, under half a step) away
    plain_model = _model(torch.bfloat16)
    start = [p.detach().clone() for p in plain_model.parameters()]
    _steps(plain_model, torch.optim.AdamW(plain_model.parameters(), lr=1e-3, weight_decay=0.01), grads)
    moved_plain = sum(int((p != s).sum()) for p, s in zip(plain_model.parameters(), start))
    moved_ours = sum(int((p != s).sum()) for p, s in zip(half.parameters(), start))
    total = sum(s.numel() for s in start)
    assert moved_plain < 0.05 * total < moved_ours, (moved_plain, moved_ours, total)


def test_float32_weights_and_lora_adapters_keep_plain_adamw():
    assert type(make_optimizer(_model(torch.float32), 1e-3, 0.0, torch.device("cpu"))) is torch.optim.AdamW


def test_a_resumed_optimizer_continues_from_the_float32_masters():
    grads = _grads(_model(torch.bfloat16), 6)
    straight = _model(torch.bfloat16)
    opt = make_optimizer(straight, 1e-3, 0.0, torch.device("cpu"))
    _steps(straight, opt, grads)

    first = _model(torch.bfloat16)
    opt = make_optimizer(first, 1e-3, 0.0, torch.device("cpu"))
    _steps(first, opt, grads[:3])
    saved_weights, saved_state = [p.detach().clone() for p in first.parameters()], opt.state_dict()
    resumed = _model(torch.bfloat16)
    with torch.no_grad():
        for p, w in zip(resumed.parameters(), saved_weights):
            p.copy_(w)
    opt = make_optimizer(resumed, 1e-3, 0.0, torch.device("cpu"))
    opt.load_state_dict(saved_state)
    _steps(resumed, opt, grads[3:])
    for a, b in zip(resumed.parameters(), straight.parameters()):
        assert torch.equal(a, b)
