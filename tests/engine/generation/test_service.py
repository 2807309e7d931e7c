"""The one generation service (components/engine/generation/service.py): no caller branches on episodes, the
engine is sized from the rows it will decode, and each metric means one thing in training and evaluation."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from components.engine.generation.engines.base import SamplingParams
from tests.engine.generation.environments.chat_fixtures import chat_tokenizer
from tests.engine.generation.environments.test_episodes import CALL, ScriptedEngine, _runner

from conftest import ROOT, committed_params

ROOM = ROOT / "components" / "engine" / "generation"
# the service, its scoring and the plays it runs; the record that carries episodes
SERVICE = (ROOM / "service.py", ROOM / "scoring.py", ROOM / "environments", ROOM / "rollouts.py")
EPISODE_NAMES = {"episodes", "episode_spec", "EpisodeSpec", "Episodes", "SingleTurn"}
# Reading the tools/environment settings in a condition outside the service: only to validate the config, to check
# the user's code before launch (imported only when there is some) or to describe the registered model (its card and
# the tools it serves), never to choose how to generate.
CONFIG_CONDITIONS = {"components/stages/cli.py", "pipelines/params_io.py", "components/tracking/model_card.py",
                     "components/stages/register.py", "components/tracking/registered_model.py"}
CONFIG = ROOT / "components" / "config"


def _conditions(tree: ast.AST) -> list[ast.AST]:
    tests: list[ast.AST] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.IfExp, ast.While)):
            tests.append(node.test)
        elif isinstance(node, ast.comprehension):
            tests += node.ifs
    return tests


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | \
        {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}


def test_no_code_outside_the_service_branches_on_episodes():
    """Single turns and episodes are one path: outside the service, its scoring, the environments and the record
    carrying episodes no condition asks whether rows are episodes, and no module names the plays or the episode spec.
    (That no module outside the engines package imports a concrete engine is an import-linter contract:
    tests/test_layers.py.)"""
    offences = []
    for path in sorted([*(ROOT / "components").rglob("*.py"), *(ROOT / "pipelines").rglob("*.py")]):
        if any(path.is_relative_to(place) for place in SERVICE):
            continue
        tree = ast.parse(path.read_text())
        where = str(path.relative_to(ROOT))
        for test in _conditions(tree):
            names = _names(test)
            if names & EPISODE_NAMES:
                offences.append(f"{where}:{test.lineno} branches on {sorted(names & EPISODE_NAMES)}")
            if {"tools", "environment"} & names and "grpo" in names | {"g"} and where not in CONFIG_CONDITIONS \
                    and not path.is_relative_to(CONFIG):
                offences.append(f"{where}:{test.lineno} branches on grpo.tools/environment")
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and {a.name for a in node.names} & (EPISODE_NAMES - {"episodes"}):
                offences.append(f"{where}:{node.lineno} imports {sorted({a.name for a in node.names})}")
    assert not offences, "\n".join(offences)


def test_the_rule_catches_a_branch(tmp_path):
    """The scan above finds the kind of line it forbids."""
    tree = ast.parse("if rollouts.episodes is not None:\n    pass\nx = 1 if spec else 2\n")
    assert any(_names(t) & EPISODE_NAMES for t in _conditions(tree))


def _tool_run(tmp_path: Path):
    """A saved tiny Llama with a chat template, and a run's config offering it the calculator."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from components.config import load_config

    tokenizer = chat_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=1024))
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    cfg = load_config(committed_params(), [f"model.name_or_path={tmp_path / 'model'}", "grpo.tools=[calculator]",
                                              "prompt.chat_template=always",
                                              "grpo.max_completion_length=40", "grpo.kl_beta=0", "threads=1"])
    return cfg, tmp_path / "model"


def test_the_engine_is_sized_from_the_longest_episode_row(tmp_path, monkeypatch):
    """A tool run's rows hold the tools' description and the conversation after the prompt: the engine is built
    after the episodes are known, for their longest row, which is longer than the formatted prompt plus the budget."""
    from components.engine.grpo import policy as policy_module
    from components.engine.models.prompting import PromptFormatter, longest_row

    cfg, start = _tool_run(tmp_path)
    records = [{"id": i, "prompt": f"What is {i} * 12?", "answer": str(12 * i)} for i in range(1, 9)]
    built = []
    real_build = policy_module.build_engine

    def recording_build(model, tokens, run, settings, say=print):
        built.append(run)
        return real_build(model, tokens, run, settings, say)

    monkeypatch.setattr(policy_module, "build_engine", recording_build)
    policy, _ = policy_module.build_policy(cfg, start, torch.device("cpu"), records, with_reference=False)
    single_turn = longest_row(policy.tokenizer, PromptFormatter(cfg.prompt, policy.tokenizer), records, 40)
    assert built[0].max_length == policy.generation.longest_row(records, 40) > single_turn + 100  # the tools' schema
    rollouts = policy.sample(records[:2], SamplingParams(n=2, max_new_tokens=40), torch.Generator().manual_seed(0))
    assert rollouts.input_ids.shape[1] <= built[0].max_length


def test_the_longest_prompt_is_read_once_per_run_and_per_evaluation_set(tmp_path, monkeypatch):
    """Sizing an engine reads every record's prompt (a tool or environment play resets one environment per record):
    building the policy reads them once, and the held-out probe and SFT's stop check, which ask for the same
    records' generation at every check, read them at their first check only."""
    from components.engine.generation.environments import episodes
    from components.engine.generation.service import for_evaluation
    from components.engine.grpo.policy import build_policy

    cfg, start = _tool_run(tmp_path)
    records = [{"id": i, "prompt": f"What is {i} * 12?", "answer": str(12 * i)} for i in range(1, 9)]
    reads = []
    real = episodes.Episodes.longest_prompt
    monkeypatch.setattr(episodes.Episodes, "longest_prompt", lambda play, rows: reads.append(len(rows)) or real(
        play, rows))
    policy, _ = build_policy(cfg, start, torch.device("cpu"), records, with_reference=False)
    assert reads == [8]
    heldout = records[:4]
    first = for_evaluation(cfg, policy.model, policy.tokenizer, 40, heldout)
    assert for_evaluation(cfg, policy.model, policy.tokenizer, 40, heldout) is first and reads == [8, 4]
    assert for_evaluation(cfg, policy.model, policy.tokenizer, 20, heldout) is not first  # another budget
    assert reads == [8, 4, 4]


def test_completion_length_counts_the_models_tokens_in_training_and_evaluation():
    """`completion_length` is the model's tokens (EOS included) in the step metrics as in evaluation;
    `episode_length` every token after the prompt and `environment_tokens` the tool's, beside it."""
    from components.stages.grpo_steps import episode_metrics

    tokenizer = chat_tokenizer()
    rollouts = _runner(tokenizer).run(ScriptedEngine(tokenizer, [CALL, "7"]), [{"prompt": "3+4?"}],
                                      SamplingParams(n=2, max_new_tokens=400))
    model_tokens = len(CALL) + 1 + len("7") + 1
    answer = tokenizer("\n<|im_start|>tool\n7<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False).input_ids
    metrics = episode_metrics(rollouts.episodes)
    assert rollouts.completion_lengths() == [model_tokens] * 2 == [e.model_tokens for e in rollouts.episodes]
    assert metrics["episode_length"] == model_tokens + len(answer)
    assert metrics["environment_tokens"] == len(answer)
    assert metrics["episode_model_token_frac"] == pytest.approx(model_tokens / (model_tokens + len(answer)))
    assert metrics["turns_per_episode"] == 2 and metrics["tool_calls_per_episode"] == 1


def test_the_policy_scores_at_the_temperature_the_run_samples_at(tmp_path):
    """`grpo.temperature` is read once, into the policy the run builds: its log-probs, the reference's and the update's
    are taken at it (no caller passes it again)."""
    from components.engine.generation.logprobs import completion_logprobs
    from components.engine.grpo.policy import build_policy

    cfg, start = _tool_run(tmp_path)
    cfg.grpo.temperature = 0.7
    records = [{"id": i, "prompt": f"What is {i} * 12?", "answer": str(12 * i)} for i in range(1, 3)]
    policy, _ = build_policy(cfg, start, torch.device("cpu"), records, with_reference=False)
    rollouts = policy.sample(records, SamplingParams(n=2, max_new_tokens=40, temperature=0.7),
                             torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = policy.logprobs(rollouts)[0]
        at_run, at_one = (completion_logprobs(policy.model, rollouts, t)[0] for t in (0.7, 1.0))
    written = rollouts.written
    torch.testing.assert_close(ours[written], at_run[written], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(ours[written], at_one[written], atol=1e-3)
