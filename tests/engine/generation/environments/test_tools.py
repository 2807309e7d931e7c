"""Tools (components/engine/generation/environments/tools.py, calls.py, builtin.py): schemas from signatures, every way
a call can go wrong becoming a message the model reads and a counted error, the calculator's exact arithmetic."""

from __future__ import annotations

import pytest

from components.config import ConfigError
from components.engine.generation.environments.builtin import calculator
from components.engine.generation.environments.calls import MALFORMED, parse_tool_calls
from components.engine.generation.environments.tools import ToolCall, call_tool, load_tools

FIXTURES = "tests.engine.generation.environments.tool_fixtures"


def test_a_tools_schema_comes_from_its_signature_and_docstring():
    (tool,) = load_tools([f"{FIXTURES}:add"])
    function = tool.schema["function"]
    assert function["name"] == "add" and function["description"] == "Add two integers."
    assert function["parameters"]["properties"] == {"a": {"type": "integer", "description": "the first."},
                                                    "b": {"type": "integer", "description": "the second."}}
    assert function["parameters"]["required"] == ["a", "b"]


@pytest.mark.parametrize("name, message", [
    (f"{FIXTURES}:untyped", r"grpo.tools: '.*untyped' cannot be shown to the model: .*missing a type hint"),
    ("tests.engine.generation.environments.nowhere:add", r"grpo.tools\[0\]: cannot import module"),
    (f"{FIXTURES}:missing", r"grpo.tools\[0\]: .* has no callable 'missing'"),
    ("abacus", r"grpo.tools\[0\]: unknown tool 'abacus'; built-ins are \['calculator'\]"),
])
def test_a_tool_that_cannot_be_used_is_refused_in_one_line_naming_it(name, message):
    with pytest.raises(ConfigError, match=message) as err:
        load_tools([name])
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("call, text", [
    (ToolCall("add", {"a": 2, "b": 3}), "5"),
    (ToolCall("boom", {"x": "?"}), "error: RuntimeError: tool exploded"),
    (ToolCall("exits", {"x": "?"}), "error: SystemExit: 3"),
    (ToolCall("sleepy", {"seconds": 5}), "error: TimeoutError: tool 'sleepy' took longer than 0.2s"),
    (ToolCall("not_text", {"x": "?"}), "error: tool not_text returned dict, not text"),
    (ToolCall("add", {"a": 2}), "error: wrong arguments for add: missing a required argument: 'b'"),
    (ToolCall("nope", {}), "error: no tool named 'nope'; tools: add, boom, exits, not_text, sleepy"),
])
def test_every_failed_call_is_an_error_the_model_reads_never_a_crash(call, text):
    tools = {t.name: t for t in load_tools([f"{FIXTURES}:{n}" for n in ("add", "boom", "exits", "sleepy", "not_text")])}
    result = call_tool(tools, call, timeout_s=0.2)
    assert result.text == text and result.error == text.startswith("error")


def test_tool_calls_are_read_from_the_plain_format_and_a_malformed_one_gets_the_documented_answer():
    turn = ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
            '<tool_call>{"name": "add", "arguments": "{\\"a\\": 3, \\"b\\": 4}"}</tool_call>')
    assert parse_tool_calls(turn).calls == [ToolCall("add", {"a": 1, "b": 2}), ToolCall("add", {"a": 3, "b": 4})]
    assert not parse_tool_calls("The answer is 7.").wants_tools
    broken = parse_tool_calls('<tool_call>{"name": add}</tool_call>')
    assert broken.calls == [] and broken.malformed.startswith("not JSON")
    assert parse_tool_calls('<tool_call>{"arguments": {}}</tool_call>').malformed == "no tool name"
    assert MALFORMED.format(reason="no tool name").startswith("error: malformed tool call (no tool name); write "
                                                               '<tool_call>{"name": "TOOL", "arguments": {...}}')


def test_the_calculator_is_exact_and_runs_no_code():
    assert calculator("347 * 82") == "28454" and calculator("(2 + 3) * 4 / 5") == "4" and calculator("7 / 2") == "3.5"
    for hostile in ('__import__("os").system("true")', "().__class__", "2 ** 10 ** 10", "x + 1"):
        with pytest.raises(ValueError):
            calculator(hostile)
