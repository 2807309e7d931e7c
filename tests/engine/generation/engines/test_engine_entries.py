"""An engine is one module and one entry: adding one with a setting of its own to a copy of the project touches
components/rollout_engines.py and the new module only, and the copy's config takes its setting by the entry's rule,
its door chooses it, its conformance suite runs it and its dvc.yaml depends on it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import ROOT, committed_params, copy_tracked, run_probe_in

# The engine's settings record and its entry: on when `toy_every` > 0, built over the plain engine.
TOY_RECORD = '''
@dataclass
class ToyCounting:
    """The counting engine's switch."""

    toy_every: int = setting(0, "must be >= 0", lambda v: v >= 0)
    """Count calls through the plain engine when > 0."""


'''
TOY_ENTRY = '    Engine("toy", "toy", ToyCounting, over="hf"),\n'

# Its module: the plain engine's tokens and log-probs, counting the calls that reach it.
TOY_MODULE = '''"""A counting engine over the plain one."""

from __future__ import annotations

from typing import Any

from components.engine.generation.engines.base import EngineRun, SpecialTokens
from components.rollout_engines import ToyCounting


class CountingEngine:
    name = "toy"

    def __init__(self, base: Any):
        self.base, self.calls = base, 0

    def start(self, prompts, continuing=False):
        self.calls += 1
        return self.base.start(prompts, continuing)

    def sample(self, prompts, params, generator=None):
        return self.start(prompts).turn(params, generator)

    def logprobs(self, rollouts, temperature, with_entropy=False):
        self.calls += 1
        return self.base.logprobs(rollouts, temperature, with_entropy)

    def over(self, model: Any) -> CountingEngine:
        return CountingEngine(self.base.over(model))


def build_for_run(base: Any, tokens: SpecialTokens, run: EngineRun, settings: ToyCounting, say=print):
    return CountingEngine(base) if settings.toy_every > 0 else None


def conformance(base: Any, tokens: SpecialTokens, run: EngineRun) -> CountingEngine:
    return CountingEngine(base)
'''

# Run against the copy: the config takes the new key and refuses a bad value by the record's rule, the door builds the
# new engine when it is on (and the prompt-once engine when it is off), and the default's fingerprint does not move.
PROBE = '''
import json, sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
import components
from components.config import ConfigError, default_fingerprint, load_config
from components.engine.generation.engines.base import EngineRun, SamplingParams, SpecialTokens
from components.engine.generation.engines.choose import build_engine
from components.rollout_engines import engine_settings
params = sys.argv[1]
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=24, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
tokens, run = SpecialTokens(eos_id=3, pad_id=0), EngineRun(vocab_size=24, max_length=30, completion_length=4)
on = build_engine(model, tokens, run, engine_settings(load_config(params, ["grpo.toy_every=2"]).grpo))
on.sample([[5, 6, 7]], SamplingParams(n=2, max_new_tokens=4), torch.Generator().manual_seed(0))
off = build_engine(model, tokens, run, engine_settings(load_config(params).grpo))
try:
    load_config(params, ["grpo.toy_every=-1"])
    refused = None
except ConfigError as err:
    refused = str(err)
print(json.dumps({"package": components.__file__, "on": [on.name, on.calls], "off": off.name, "refused": refused,
                  "fingerprint": default_fingerprint(load_config(params))}))
'''


def _add_the_toy_engine(copy: Path) -> list[str]:
    """The toy's record and entry in the copy's registry, its module beside the others; the copy's changed files."""
    registry = copy / "components" / "rollout_engines.py"
    source = registry.read_text()
    records_end = "@dataclass(frozen=True)\nclass Engine:"
    table_end = ")}\n\"\"\"From the fallback"
    assert source.count(records_end) == 1 and source.count(table_end) == 1
    registry.write_text(source.replace(records_end, TOY_RECORD + records_end).replace(table_end, TOY_ENTRY + table_end))
    (copy / "components" / "engine" / "generation" / "engines" / "toy.py").write_text(TOY_MODULE)
    return sorted(str(p.relative_to(copy)) for p in copy.rglob("*") if p.is_file() and (
        not (ROOT / p.relative_to(copy)).exists() or p.read_bytes() != (ROOT / p.relative_to(copy)).read_bytes())
        and p.name != "params.yaml")


def test_an_engine_with_a_setting_of_its_own_is_one_module_and_one_entry(tmp_path):
    copy = copy_tracked(tmp_path / "project")
    assert _add_the_toy_engine(copy) == ["components/engine/generation/engines/toy.py", "components/rollout_engines.py"]
    got = run_probe_in(copy, PROBE, str(committed_params()))  # the copy's code, not this tree's
    assert got["on"] == ["toy", 1] and got["off"] == "prefix_shared"
    assert got["refused"] == "grpo.toy_every: must be >= 0"
    recorded = json.loads((ROOT / "benchmarks" / "results" / "seed_spread.json").read_text())["default_fingerprint"]
    assert got["fingerprint"] == recorded

    # The copy's own checks: the conformance suite runs the toy against the plain engine, dvc.yaml's stages depend on
    # its module, and only the engines package imports it.
    checks = ["tests/engine/generation/engines/test_engines.py", "tests/test_dvc_deps.py", "tests/test_layers.py",
              "-k", "toy or dependency or one_door"]
    env = {**os.environ, "PYTHONPATH": str(copy), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-n", "0", *checks],
                          cwd=copy, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:]
    passed = [line for line in proc.stdout.splitlines() if " PASSED" in line]
    assert sum("toy" in line for line in passed) >= 15, proc.stdout[-3000:]  # every conformance test, every model
    assert sum("is_a_dependency" in line for line in passed) == 7  # each stage of dvc.yaml
    assert any("test_concrete_engines_have_one_door" in line for line in passed)
