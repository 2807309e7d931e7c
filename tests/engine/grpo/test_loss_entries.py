"""A loss is one entry, settings included: adding one with a setting of its own touches components/losses.py only;
`policy_loss` takes the loss object, not each setting; GDPO's per-group step lives in one function with one caller."""

from __future__ import annotations

import ast
import inspect
import json
from pathlib import Path

import pytest

from components.engine.grpo.objectives import policy_loss

from conftest import committed_params, copy_tracked, run_probe_in

ROOT = Path(__file__).resolve().parents[3]

# A loss of its own: a record with one setting (`toy_scale`, default 2, must be > 0), a surrogate that reads it, and
# its entry in the table. Nothing else of the tree changes.
TOY_RECORD = '''
@dataclass
class ToySettings:
    """`loss_type: toy`."""

    toy_scale: float = setting(2.0, "must be > 0", lambda v: v > 0)
    """`loss_type: toy`: the factor on the plain policy gradient."""


def scaled(ratio: Tensor, logp: Tensor, adv: Tensor, s: ToySettings) -> Tensor:
    """-toy_scale * rho * A."""
    return -(ratio * adv) * s.toy_scale


'''
TOY_ENTRY = '    Loss("toy", scaled, token_mean, never_clipped, ToySettings),\n'

# Run against the copy: the config takes the new key and refuses a bad value by the record's rule, build_loss hands
# the entry its record, the loss is -toy_scale * (sum of A over the real tokens) / tokens at ratio 1, and the
# default's fingerprint (the recorded band) does not move.
PROBE = '''
import json, sys, torch
import components
from components.config import ConfigError, default_fingerprint, load_config
from components.engine.grpo.objectives import build_loss, policy_loss
params = sys.argv[1]
cfg = load_config(params, ["grpo.loss_type=toy", "grpo.toy_scale=3", "grpo.kl_beta=0"])
loss = build_loss(cfg.grpo)
logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, -2.2]])
mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
out = policy_loss(logp, logp, torch.tensor([1.0, -2.0]), mask, loss)
try:
    load_config(params, ["grpo.loss_type=toy", "grpo.toy_scale=0"])
    refused = None
except ConfigError as err:
    refused = str(err)
print(json.dumps({"package": components.__file__, "settings": repr(loss.settings), "loss": float(out.loss),
                  "refused": refused, "fingerprint": default_fingerprint(load_config(params))}))
'''


def test_a_loss_with_a_setting_of_its_own_is_one_entry_in_one_module(tmp_path):
    """A copy of components/ where only losses.py gains the toy loss (record, surrogate, entry) trains from the
    config: `grpo.loss_type: toy` and `grpo.toy_scale` are accepted, checked and reach the loss."""
    copy = copy_tracked(tmp_path, under="components") / "components"
    losses = copy / "losses.py"
    source = losses.read_text()
    table = "LOSSES: dict[str, Loss] = {loss.name: loss for loss in (\n"
    end = ")}\n\nLossName"
    assert source.count(table) == 1 and source.count(end) == 1
    source = source.replace(table, TOY_RECORD + table).replace(end, TOY_ENTRY + end)
    losses.write_text(source)
    changed = [str(p.relative_to(copy)) for p in sorted(copy.rglob("*.py"))
               if p.read_text() != (ROOT / "components" / p.relative_to(copy)).read_text()]
    assert changed == ["losses.py"]

    got = run_probe_in(tmp_path, PROBE, str(committed_params()))  # the copy's code, not this tree's
    assert got["settings"] == "ToySettings(toy_scale=3.0)"
    assert got["loss"] == pytest.approx(-3.0 * (1.0 * 2 - 2.0 * 3) / 5)  # ratio 1: -scale * sum(A) / 5 tokens
    assert got["refused"] == "grpo.toy_scale: must be > 0"
    recorded = json.loads((ROOT / "benchmarks" / "results" / "seed_spread.json").read_text())["default_fingerprint"]
    assert got["fingerprint"] == recorded


def test_policy_loss_takes_the_loss_object_not_each_setting():
    parameters = inspect.signature(policy_loss).parameters
    assert len(parameters) <= 8, list(parameters)
    assert "objective" in parameters and not {"epsilon_low", "cispo_max_ratio", "sapo_temperatures"} & set(parameters)


def calls_of(name: str) -> list[tuple[str, str]]:
    """(module, enclosing class.function) of every call of `name` in components/."""
    found = []
    for path in sorted((ROOT / "components").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for scope in ast.walk(tree):
            if not isinstance(scope, ast.ClassDef | ast.Module):
                continue
            for fn in scope.body:
                if not isinstance(fn, ast.FunctionDef):
                    continue
                for node in ast.walk(fn):
                    called = getattr(node, "func", None)
                    if isinstance(node, ast.Call) and getattr(called, "id", getattr(called, "attr", None)) == name:
                        owner = f"{scope.name}." if isinstance(scope, ast.ClassDef) else ""
                        found.append((str(path.relative_to(ROOT)), owner + fn.name))
    return found


def test_gdpo_normalisation_lives_in_one_function_called_from_one_place():
    """GDPO's per-group step (`normalize_then_sum`) and its batch step (`batch_advantages`) are each called once,
    by the loss object; sampling only asks the loss object (`batch.advantage_rewards`)."""
    assert calls_of("normalize_then_sum") == [("components/engine/grpo/objectives.py", "GRPOLoss.advantage_rewards")]
    assert calls_of("batch_advantages") == [("components/engine/grpo/objectives.py", "GRPOLoss.advantages")]
    reads = [path for path in sorted((ROOT / "components").rglob("*.py"))
             if "multi_objective" in path.read_text() and path.parent.name != "config"]
    assert [str(p.relative_to(ROOT)) for p in reads] == ["components/engine/grpo/objectives.py"]
