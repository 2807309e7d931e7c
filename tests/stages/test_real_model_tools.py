"""A tool-trained real pretrained model through the pipeline: the calculator example on SmolLM2-135M-Instruct,
shrunk, from the GGUF converted once per test run (conftest.py's smollm2_base, shared with
tests/stages/test_real_model.py; this test was there, and is a file of its own so the two workers of `make test`
each take one of these long files): a tool-trained model answering OpenAI-style chat requests with its calls in
`tool_calls`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml
from test_real_model import _merge, served

from components.config import config_from_dict, read_params
from components.data.paths import Paths

from conftest import ROOT, committed_params

pytestmark = pytest.mark.slow

CALCULATOR = ROOT / "configs" / "examples" / "smollm2_calculator.yaml"


def test_tool_episodes_train_evaluate_and_register_on_the_real_model(tmp_path, smollm2_base, mlflow_store):
    """The calculator example, shrunk: SFT on worked tool conversations (only the model's turns learned), GRPO over
    episodes (the calculator's answers in the context, out of the loss; per-step tool metrics), held-out evaluation
    playing episodes, a model card that names the tool (its import path, schema and source hash), and the registered
    model serving the calculator's calls (`served_tool_calls`)."""
    import csv

    from components.stages.evaluate import evaluate
    from components.stages.grpo import train_grpo
    from components.stages.prepare import prepare
    from components.stages.register import register
    from components.stages.sft import train_sft

    raw = _merge(_merge(read_params(committed_params()), yaml.safe_load(CALCULATOR.read_text())), {
        # 6 SFT steps of 4 conversations at 3e-4: the format learned (the warm start calls the tool)
        "task": {"n_sft": 8, "n_train": 16, "n_heldout": 4},
        "sft": {"epochs": 3, "batch_size": 4, "learning_rate": 3e-4, "stop_at_reward": None},
        "grpo": {"steps": 2, "prompts_per_step": 2, "group_size": 2, "max_completion_length": 72,
                 "checkpoint_every": 0, "log_every": 1},
        "evaluate": {"max_new_tokens": 72, "batch_size": 4, "every": 0, "bootstrap_samples": 100},
        "register": {"model_name": "smollm2-tools-test", "require_improvement": False},
        "reports": {"samples_every": 1},
        "threads": 1})  # one torch thread a worker, as SMALL in test_real_model.py says
    cfg, paths = config_from_dict(raw), Paths(root=tmp_path)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))  # the run's params, as registered
    prepare(cfg, paths)
    import shutil

    shutil.copytree(smollm2_base, paths.base_model)
    sft = train_sft(cfg, paths)
    assert sft["enabled"] and sft["examples"] == 8
    summary = train_grpo(cfg, paths)
    assert summary["steps"] == 2
    rows = list(csv.DictReader((paths.plots / "grpo_steps.csv").open()))
    assert {"turns_per_episode", "tool_calls_per_episode", "tool_errors_per_episode",
            "episodes_cut_frac"} <= set(rows[0])
    assert all(1.0 <= float(r["turns_per_episode"]) <= 3.0 for r in rows)
    assert float(rows[0]["tool_calls_per_episode"]) > 0, "the warm start never called the calculator"
    report = evaluate(cfg, paths)
    assert report["n"] == 4
    predictions = [json.loads(line) for line in (paths.eval_dir / "predictions.jsonl").read_text().splitlines()]
    assert any("[tool/calculator]" in p["candidate_completion"] for p in predictions)
    register(cfg, paths)
    from mlflow.tracking import MlflowClient

    card = MlflowClient().get_model_version("smollm2-tools-test", "1").description
    assert "Episodes with tools: `calculator` (source sha256 `" in card
    assert ("  - `calculator` (`components.engine.generation.environments.builtin:calculator`): Evaluate an "
            "arithmetic") in card
    assert "Serving: answers OpenAI-style chat requests (`messages`, `tools`)" in card
    served_tool_calls(tmp_path, predictions)


def served_tool_calls(tmp_path: Path, predictions: list[dict]) -> None:
    """The registered adapter, loaded by `mlflow.pyfunc.load_model` and served by `mlflow models serve`, answers an
    OpenAI-style request listing the calculator with its call in `tool_calls`, and the calculator's result with the
    answer in `content`: the same turns the pipeline's own greedy held-out episode wrote for that question."""
    import mlflow

    from components.engine.generation.environments.builtin import calculator
    from components.engine.generation.environments.calls import parse_tool_calls
    from components.engine.generation.environments.tools import load_tools

    # A held-out episode of the evaluation (greedy): one call, the calculator's result, the answer.
    episodes = [p["candidate_completion"].split("\n") for p in predictions]
    shape = ["[assistant] <tool_call>", "[tool/calculator] ", "[assistant] "]
    lines, episode = next(((lines, p) for lines, p in zip(episodes, predictions) if len(lines) == 3 and all(
        line.startswith(start) for line, start in zip(lines, shape)) and "<tool_call>" not in lines[2]),
        (None, None))
    assert episode, [p["candidate_completion"] for p in predictions]
    [written_call] = parse_tool_calls(lines[0].removeprefix("[assistant] ")).calls
    written_answer = lines[2].removeprefix("[assistant] ")
    tools = [t.schema for t in load_tools(["calculator"])]
    question = [{"role": "user", "content": f"{episode['prompt']} Reply with just the number."}]

    def follow_up(reply: dict) -> dict:
        """The conversation with the model's call and the calculator's answer to it, as an OpenAI client sends it."""
        message = reply["choices"][0]["message"]
        [call] = message["tool_calls"]
        result = calculator(**json.loads(call["function"]["arguments"]))
        return {"messages": question + [message, {"role": "tool", "tool_call_id": call["id"], "content": result}],
                "tools": tools}

    model = mlflow.pyfunc.load_model("models:/smollm2-tools-test@champion")
    called = model.predict({"messages": question, "tools": tools})
    assert called["choices"][0]["finish_reason"] == "tool_calls", called
    [call] = called["choices"][0]["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "calculator"
    assert json.loads(call["function"]["arguments"]) == written_call.arguments, (called, lines)
    answered = model.predict(follow_up(called))
    message = answered["choices"][0]["message"]
    assert answered["choices"][0]["finish_reason"] == "stop" and "tool_calls" not in message, answered
    assert message["content"] == written_answer, (answered, lines)
    del model  # the served copy below holds its own

    with served(tmp_path, "models:/smollm2-tools-test@champion", os.environ["MLFLOW_TRACKING_URI"]) as post:
        over_http = post({"messages": question})  # no `tools`: the ones it was trained with
        assert over_http["object"] == "chat.completion" and over_http["choices"][0]["finish_reason"] == "tool_calls"
        assert [c["function"] for c in over_http["choices"][0]["message"]["tool_calls"]] == [call["function"]]
        assert post(follow_up(over_http))["choices"][0]["message"] == message
