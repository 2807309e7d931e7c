"""The registered model answers OpenAI-style chat requests as training laid out and read its episodes: a tiny Llama with
a chat-templated tokenizer, logged as registration logs it (a real MLflow store) and loaded with
`mlflow.pyfunc.load_model`. The real model calling the calculator through `mlflow models serve` is in
tests/stages/test_real_model.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from components.config import config_from_dict, read_params
from tests.engine.generation.environments.chat_fixtures import CHATML, HERMES, chat_tokenizer

from conftest import committed_params

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "347 * 82"}}</tool_call>'
USER = "What is 347 * 82? Reply with just the number."


@pytest.fixture
def store(tmp_path, mlflow_store, monkeypatch) -> str:
    """A SQLite MLflow store whose artifacts (./mlruns) land in the test's folder."""
    monkeypatch.chdir(tmp_path)
    return mlflow_store


def _config(tools: list[str]):
    raw = read_params(committed_params())
    raw["prompt"] = {**raw["prompt"], "template": "{prompt} Reply with just the number.", "chat_template": "always",
                     "system": "Answer briefly."}
    raw["grpo"] = {**raw["grpo"], "tools": tools}
    raw["model"] = {**raw["model"], "name_or_path": "a-chat-model"}  # episodes need one (a tiny chat-templated one)
    raw["register"] = {**raw["register"], "model_name": "tiny-chat"}
    return config_from_dict(raw)


def _served(tmp_path: Path, template: str, tools: list[str]):
    """(config, tokenizer, the loaded pyfunc, its python model): a tiny Llama logged as registration logs it."""
    import mlflow
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from components.tracking.registered_model import PIP_REQUIREMENTS, log_completion_model, serving_config

    tokenizer = chat_tokenizer(template)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, intermediate_size=32,
                                         max_position_embeddings=2048, tie_word_embeddings=True))
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    cfg = _config(tools)
    with mlflow.start_run():
        info = log_completion_model(model_dir, serving_config(cfg, tokenizer), PIP_REQUIREMENTS)
    loaded = mlflow.pyfunc.load_model(info.model_uri)
    return cfg, tokenizer, loaded, loaded.unwrap_python_model()


@pytest.mark.parametrize("template", [CHATML, HERMES], ids=["tools-in-system-message", "native-tool-format"])
def test_a_chat_request_is_laid_out_token_for_token_as_training_laid_out_its_episodes(tmp_path, store, template):
    from components.engine.generation.environments.chat import ChatFormat
    from components.engine.generation.environments.spec import episode_spec

    cfg, tokenizer, _, served = _served(tmp_path, template, ["calculator"])
    spec = episode_spec(cfg)
    chat = spec.chat(tokenizer)
    assert chat.native_tools == (template == HERMES)
    record = {"id": "r", "prompt": "What is 347 * 82?"}

    def served_ids(messages, tools=None):
        return served.chat_ids(served.requests.episode_messages(messages),
                               served.requests.offered_tools(tools, served.tools))

    # The first turn: the trained system message and tools (none named in the request), the user's question.
    first = chat.prompt_ids(spec.first_messages(chat)(record))
    assert served_ids([{"role": "user", "content": USER}]) == first
    assert served_ids([{"role": "user", "content": USER}], [t.schema for t in spec.tools]) == first
    # After a call: the call as OpenAI sends it (arguments as JSON text, the tool message naming only its call's id)
    # is laid out as SFT's worked conversations and GRPO's episodes are.
    worked = [{"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "347 * 82"}}}]},
              {"role": "tool", "name": "calculator", "content": "28454"}]
    openai = [{"role": "user", "content": USER},
              {"role": "assistant", "content": None, "tool_calls": [
                  {"id": "call_1", "type": "function",
                   "function": {"name": "calculator", "arguments": '{"expression": "347 * 82"}'}}]},
              {"role": "tool", "tool_call_id": "call_1", "content": "28454"}]
    assert served_ids(openai) == spec.conversation(tokenizer)(record, worked)[0]
    text = tokenizer.decode(served_ids(openai))
    assert CALL in text and "28454" in text and text.rstrip("\n").endswith("<|im_start|>assistant")
    # `tools: []` offers none; a request's own system message replaces the trained one.
    plain = ChatFormat(tokenizer)
    assert served_ids([{"role": "user", "content": USER}], []) == plain.prompt_ids(
        [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": USER}])
    assert "Be terse." in tokenizer.decode(served_ids([{"role": "system", "content": "Be terse."},
                                                      {"role": "user", "content": USER}], []))


def test_the_answer_is_openais_chat_completion_and_prompts_are_answered_as_before(tmp_path, store):
    import pandas as pd
    from mlflow.exceptions import MlflowException

    _, _, loaded, served = _served(tmp_path, CHATML, ["calculator"])
    tools = served.tools
    assert [t["function"]["name"] for t in tools] == ["calculator"]  # recorded at registration

    called = served.reply(CALL, True, tools, (40, 20))
    assert called["object"] == "chat.completion" and called["model"] == "tiny-chat"
    choice = called["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "calculator", "arguments": '{"expression": "347 * 82"}'}
    assert called["usage"] == {"prompt_tokens": 40, "completion_tokens": 20, "total_tokens": 60}
    answered = served.reply("28454", True, tools, (60, 6))["choices"][0]
    assert answered == {"index": 0, "message": {"role": "assistant", "content": "28454"}, "finish_reason": "stop"}
    # No tools offered, half a turn, or a call that cannot be read: the text as written.
    assert served.reply(CALL, True, None, (1, 1))["choices"][0]["message"] == {"role": "assistant", "content": CALL}
    assert served.reply(CALL, False, tools, (1, 1))["choices"][0]["finish_reason"] == "length"
    broken = '<tool_call>{"name": "calculator", "arguments": </tool_call>'
    assert served.reply(broken, True, tools, (1, 1))["choices"][0]["message"]["content"] == broken

    # Through the pyfunc (the schema MLflow enforces): a conversation in, one chat completion out.
    reply = loaded.predict({"messages": [{"role": "user", "content": USER}], "max_tokens": 5})
    assert reply["object"] == "chat.completion" and reply["choices"][0]["message"]["role"] == "assistant"
    first = served.chat_ids(served.requests.episode_messages([{"role": "user", "content": USER}]), tools)
    assert reply["usage"]["prompt_tokens"] == len(first) and 1 <= reply["usage"]["completion_tokens"] <= 5
    # What the registered model answered before: one completion per prompt, formatted as in training.
    completions = loaded.predict(pd.DataFrame({"prompt": ["What is 3 * 4?", "What is 5 * 6?"]}))
    assert isinstance(completions, list) and len(completions) == 2 and all(isinstance(c, str) for c in completions)
    # A request the model cannot answer: one line naming the field.
    for request, message in [({"messages": [{"role": "robot", "content": "hi"}]}, r"messages\[0\]: an object whose"),
                             ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}]},
                              "the last message is the assistant's"),
                             ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"name": "x"}]}, "tools: "),
                             ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens: ")]:
        with pytest.raises(MlflowException, match=message) as refused:
            loaded.predict(request)
        assert refused.value.error_code == "INVALID_PARAMETER_VALUE"  # `mlflow models serve`: HTTP 400
    with pytest.raises(MlflowException, match="one conversation"):
        loaded.predict(pd.DataFrame({"messages": [[{"role": "user", "content": "a"}]] * 2}))


def test_the_model_ships_trainings_own_layout_and_parser_needing_only_the_standard_library(tmp_path, store):
    import mlflow

    from components.tracking.registered_model import SERVED_MODULES, SERVED_PACKAGE

    _, _, loaded, _ = _served(tmp_path, CHATML, [])
    local = Path(mlflow.artifacts.download_artifacts(loaded.metadata.get_model_info().model_uri,
                                                     dst_path=str(tmp_path / "logged")))
    shipped = local / "code" / SERVED_PACKAGE
    assert {p.name for p in shipped.glob("*.py")} == {"__init__.py", *SERVED_MODULES}
    for name, source in SERVED_MODULES.items():
        assert (shipped / name).read_bytes() == source.read_bytes(), name
    imports = ", ".join(f"{SERVED_PACKAGE}.{Path(name).stem}" for name in SERVED_MODULES)
    probe = (f"import sys; sys.path.insert(0, sys.argv[1]); import {imports}; import json; "
             "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))")
    loaded_modules = json.loads(subprocess.run([sys.executable, "-I", "-c", probe, str(shipped.parent)], check=True,
                                               capture_output=True, text=True).stdout)
    assert not {"components", "torch", "transformers", "mlflow", "numpy", "pandas"} & set(loaded_modules)
    # No tools trained with: none offered unless the request lists some.
    assert loaded.unwrap_python_model().tools is None


def test_openai_messages_read_as_an_episodes_messages():
    from components.tracking.chat_request import RequestError, episode_messages

    messages = episode_messages([
        {"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "2 * 3?"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c7", "type": "function",
             "function": {"name": "calculator", "arguments": '{"expression": "2*3"}'}}]},
        {"role": "tool", "tool_call_id": "c7", "content": "6"}])
    assert messages == [
        {"role": "user", "content": "What is 2 * 3?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "2*3"}}}]},
        {"role": "tool", "content": "6", "name": "calculator"}]  # named after the call it answers, as in training
    with pytest.raises(RequestError, match=r"messages\[1\].tool_calls\[0\].function.arguments: not JSON"):
        episode_messages([{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
            {"type": "function", "function": {"name": "calculator", "arguments": "{2*3"}}]},
                          {"role": "tool", "content": "6"}])
