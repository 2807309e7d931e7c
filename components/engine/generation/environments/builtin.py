"""Tools and environments that ship with the pipeline (`grpo.tools: [calculator]`)."""

from __future__ import annotations

import ast
import operator

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
              ast.USub: operator.neg, ast.UAdd: operator.pos}
MAX_DIGITS = 60  # results longer than this are refused (a power tower would hold the step)


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly (integers stay integers).

    Args:
        expression: numbers, + - * / // % ** and parentheses, e.g. "347 * 82".
    """
    tree = ast.parse(expression.strip(), mode="eval")
    return _format(_evaluate(tree.body))


def _evaluate(node: ast.AST) -> int | float:
    """The value of an arithmetic syntax tree: numbers and the operators above only (never `eval`)."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) * max(len(str(abs(left))), 1) > MAX_DIGITS:
            raise ValueError("the result would be too large")
        return _OPERATORS[type(node.op)](left, right)
    raise ValueError(f"not arithmetic: {ast.unparse(node)!r}")


def _format(value: int | float) -> str:
    text = str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)
    if len(text.lstrip("-")) > MAX_DIGITS:
        raise ValueError("the result is too large")
    return text
