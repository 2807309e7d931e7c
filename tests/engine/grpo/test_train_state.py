"""A checkpoint keeps the run's state, never its wall-clock figures: two runs that differ only in timing
write byte-identical checkpoints, so two clones resume from the same bytes."""

from __future__ import annotations

import torch

from components.engine.generation.engines.base import SpecialTokens
from components.engine.generation.engines.hf import HFEngine
from components.engine.grpo.policy import Policy
from components.engine.grpo.train_state import save_training_state
from components.engine.parallel.distributed import DistContext


def _history(seconds: float) -> list[dict[str, float]]:
    """The step record the grpo stage logs, with every timing it has ever carried set to `seconds`."""
    timings = {"step_seconds": seconds, "completions_per_s": 8 / seconds, "time/generation": seconds,
               "time/reward": seconds, "time/reference": seconds, "time/policy": seconds,
               "time/policy_forward": seconds, "time/policy_backward": seconds, "time/optimizer": seconds,
               "time/a_timing_added_later": seconds}
    return [{"step": 1.0, "loss": 0.25, "reward_mean": 0.5, **timings}]


def _checkpoint_bytes(root, seconds: float) -> dict[str, bytes]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    policy = Policy.of(None, model, HFEngine(model, SpecialTokens(eos_id=1, pad_id=0)), with_reference=False)
    save_training_state(root, 1, "hash", policy, optimizer, False, _history(seconds),
                        torch.Generator().manual_seed(1), DistContext(), lambda: model)
    return {p.name: p.read_bytes() for p in (root / "step-0000001").iterdir()}


def test_checkpoints_do_not_depend_on_step_timings(tmp_path):
    first, second = _checkpoint_bytes(tmp_path / "a", 0.5), _checkpoint_bytes(tmp_path / "b", 7.25)
    assert set(first) == {"model.safetensors", "state.pt", "meta.json"}
    assert first == second
    saved = torch.load(tmp_path / "a" / "step-0000001" / "state.pt", weights_only=True)
    assert saved["history"] == [{"step": 1.0, "loss": 0.25, "reward_mean": 0.5}]
