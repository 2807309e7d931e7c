"""One scoring entry: the column set every reward reads, built by hand here; every shipped reward (DAPO's overlong
penalty included) scoring held-out rows; each caller scoring through it on a real model (training's round, the
evaluation's greedy metrics and pass@k, SFT's stop check); and no caller building columns of its own."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from components.config import EvaluateConfig, GRPOConfig, PipelineConfig, RewardSpec
from components.engine.evaluation.task_metrics import TaskMetrics
from components.engine.generation.scoring import Completions, reward_inputs, score
from components.engine.grpo.batch import one_process_round, sampling_params
from components.engine.grpo.policy import Policy
from components.engine.rewards.rewards import BUILTIN_REWARDS, RewardModel

from conftest import tracked_files

ROOT = Path(__file__).resolve().parents[3]
RECORDS = [{"id": 0, "prompt": "1+1=", "answer": "2"}, {"id": 1, "prompt": "2+3=", "answer": "5"}]


def every_column(prompts, completions, answer=(), group_index=(), completion_token_lengths=(), **_):
    """A reward that needs the records' column, the group index and the token lengths: it scores each completion
    by its token length, and fails if any column is missing or short."""
    n = len(completions)
    assert len(answer) == len(group_index) == len(completion_token_lengths) == n, "a column is missing"
    return [float(length) for length in completion_token_lengths]


EVERY_COLUMN = "tests.engine.generation.test_scoring:every_column"
OVERLONG = RewardSpec("overlong_penalty", 1.0, {"max_length": 4, "buffer": 2, "penalty": 1.0})


def test_the_column_set_by_hand():
    played = Completions(texts=["2", "55", "5", "x"], columns={"episode": ["a", "b", "c", "d"]}, lengths=[1, 2, 3, 5])
    prompts, texts, columns = reward_inputs(RECORDS, played, per_record=2)
    assert prompts == ["1+1=", "1+1=", "2+3=", "2+3="] and texts == ["2", "55", "5", "x"]
    assert columns == {"answer": ["2", "2", "5", "5"], "id": [0, 0, 1, 1], "group_index": [0, 0, 1, 1],
                       "episode": ["a", "b", "c", "d"], "completion_token_lengths": [1, 2, 3, 5]}
    # DAPO's soft overlong penalty on those lengths: 0 up to 4 - 2, then -(length - 2) / 2, -1 past 4
    assert score(RewardModel([OVERLONG]), RECORDS, played, per_record=2).total == [0.0, 0.0, -0.5, -1.0]
    with pytest.raises(ValueError, match="4 completions"):
        reward_inputs(RECORDS, played, per_record=1)


SKIPPED = {"judge_model": "needs a classifier directory", "math_verify": "an optional package",
           "environment_reward": "reads an environment's column, not a single turn's",
           "code_execution": "reads the records' tests column"}


@pytest.mark.parametrize("name", [n for n in BUILTIN_REWARDS if n not in SKIPPED])
def test_every_shipped_reward_scores_held_out_rows(name):
    played = Completions(texts=["2", "The answer is 5"], lengths=[1, 4])
    result = score(RewardModel([RewardSpec(name, 1.0)]), RECORDS, played)
    assert len(result.total) == 2


@pytest.fixture(scope="module")
def tiny():
    from components.config import TinyModelConfig
    from components.engine.models.modeling import build_char_tokenizer, build_tiny_model

    tokenizer = build_char_tokenizer(["0123456789+="])
    return build_tiny_model(TinyModelConfig(), tokenizer, seed=0).eval(), tokenizer


def test_training_scores_through_it(tiny):
    """A training round (and so the sample tables and the dry run, which take its ScoredGroups)."""
    model, tokenizer = tiny
    g = GRPOConfig(group_size=2, prompts_per_step=2, max_completion_length=5,
                   rewards=[RewardSpec(EVERY_COLUMN, 1.0), OVERLONG])
    rewards = RewardModel(g.rewards)
    scored = one_process_round(Policy.of(tokenizer, model, with_reference=False), RECORDS, sampling_params(g),
                               rewards, g, torch.Generator().manual_seed(0))(1, [0, 1], 0)[0]
    lengths = scored.rollouts.completion_lengths()
    assert scored.rewards.components[EVERY_COLUMN] == [float(n) for n in lengths]
    assert scored.rewards.components["overlong_penalty"] == [0.0 if n <= 2 else -min(1.0, (n - 2) / 2) for n in lengths]


def test_evaluation_and_pass_at_k_score_through_it(tiny):
    """The evaluate stage and the held-out probe (TaskMetrics), greedy and sampled."""
    model, tokenizer = tiny
    e = EvaluateConfig(max_new_tokens=5, batch_size=2, pass_k_samples=2, correct_at=-10.0,
                       metrics=[EVERY_COLUMN, "overlong_penalty", "pass@2", "completion_length"])
    values, out = TaskMetrics(e, [RewardSpec(EVERY_COLUMN, 1.0), OVERLONG]).per_prompt(model, tokenizer, RECORDS, 0)
    assert values[EVERY_COLUMN] == values["completion_length"] == [float(n) for n in out.lengths]
    assert values["reward"] == [n + (0.0 if n <= 2 else -min(1.0, (n - 2) / 2)) for n in out.lengths]
    assert values["pass@2"] == [1.0, 1.0]


def test_sfts_stop_check_scores_through_it(tiny, tmp_path):
    from components.data.paths import Paths
    from components.data.records import write_jsonl
    from components.stages.sft import WarmStartCheck

    model, tokenizer = tiny
    write_jsonl(Paths(tmp_path).data / "train.jsonl", RECORDS)
    cfg = PipelineConfig()
    cfg.grpo.rewards = [RewardSpec(EVERY_COLUMN, 1.0)]
    cfg.grpo.max_completion_length = 5
    check = WarmStartCheck(cfg, Paths(tmp_path), tokenizer)
    assert 1.0 <= check(model) <= 5.0  # the mean token length of two completions of 1 to 5 tokens


def test_no_caller_builds_reward_columns_of_its_own():
    """Only scoring.py calls `reward_columns`, and nothing but it passes `completion_token_lengths` to rewards."""
    callers = []
    sources = [ROOT / rel for rel in tracked_files() if rel.endswith(".py")  # the project's, not a scratch clone's
               and rel.startswith(("components/", "pipelines/", "benchmarks/"))]
    for path in sources:
        if path.name in ("scoring.py", "records.py", "rewards.py"):
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) == \
                    "reward_columns":
                callers.append(f"{path.relative_to(ROOT)}:{node.lineno}")
            if isinstance(node, ast.Constant) and node.value == "completion_token_lengths":
                callers.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert callers == []
