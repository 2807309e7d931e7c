"""The TRL side of a tool row of benchmarks/grpo_vs_trl.py: TRL's tool loop (`GRPOTrainer(tools=[...])`) playing the
episodes the pipeline plays, laid out token for token as the pipeline lays them out.

- Prompts: the pipeline's first messages of each record (its system message, which describes the tools in the
  pipeline's words where the chat template has no tool format of its own, then the user's question), handed to TRL
  as conversational prompts; TRL renders them with the chat template.
- Chat template: the model's own, with an assistant turn's tool calls rendered as the model writes them
  (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, components/engine/generation/environments/calls.py),
  because TRL refuses a template that does not render a whole tool exchange. A template without a tool format ignores
  the `tools` TRL passes it, as the pipeline's does (the system message carries them).
- Reading calls: a response template for that format (TRL's `add_response_schema` knows none for a plain ChatML
  template), anchored at the template's own generation prompt and ended by its EOS.
- Before training, `check_same_layout` compares what TRL's own code builds (`_tokenize_prompts`,
  `_get_tool_suffix_ids`) with the pipeline's (`ChatFormat.prompt_ids`, `ChatFormat.answer_ids`) and stops the
  benchmark at the first difference.
- `EpisodeCount` counts each step's tokens from TRL's model-token mask (`tool_mask`; 1 on what the model wrote),
  its tool answers (runs of 0) and model turns (runs of 1), never from TRL's logged means.

The tool row's figures in the report (`episode_figures`, `tool_row_report`, `tool_row_lines`) live here too.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

# Renders an assistant message's tool calls after its content, as the model writes them (json.dumps' separators).
CALLS_MACRO = ("{%- macro written_calls(message) -%}{%- for call in message.tool_calls or [] -%}<tool_call>"
               "{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}</tool_call>"
               "{%- endfor -%}{%- endmacro -%}")
CONTENT = "message['content']"


class LayoutDiffers(SystemExit):
    """TRL would see other tokens than the pipeline: the comparison would not be of the same episodes."""


def template_with_calls(template: str) -> str:
    """`template` with each message's tool calls written after its content (the one place it renders a message's
    content); a template that renders content elsewhere, or tool calls already, is refused in one line."""
    if "tool_calls" in template:
        raise LayoutDiffers("the chat template has a tool format of its own: the TRL side of a tool row is written "
                            "for templates that have none (tools in the system message)")
    if template.count(CONTENT) != 1:
        raise LayoutDiffers(f"the chat template renders {CONTENT} {template.count(CONTENT)} times; the TRL side of a "
                            "tool row needs exactly one place to write a turn's tool calls")
    return CALLS_MACRO + template.replace(CONTENT, f"({CONTENT} ~ written_calls(message))")


def calls_response_template(tokenizer: Any) -> dict[str, Any]:
    """A transformers response template that reads the plain call format: the text after the template's generation
    prompt, `<tool_call>JSON</tool_call>` blocks as calls, the rest up to EOS as content."""
    user = [{"role": "user", "content": "x"}]
    with_prompt = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    without = tokenizer.apply_chat_template(user, tokenize=False)
    if not with_prompt.startswith(without) or with_prompt == without:
        raise LayoutDiffers("the chat template has no generation prompt to anchor a response parser at")
    return {"defaults": {"role": "assistant"}, "start_anchor": with_prompt[len(without):],
            "fields": {"tool_calls": {"open": "<tool_call>", "close_pattern": r"</tool_call>\s*", "repeats": True,
                                      "content": "json", "transform": {"type": "function", "function": "{content}"}},
                       "content": {"close_pattern": re.escape(tokenizer.eos_token) + r"\s*", "content": "text"}}}


def for_trl(tokenizer: Any) -> Any:
    """`tokenizer` (a copy the pipeline never reads) made ready for TRL's tool loop: the template with calls and the
    response template; TRL's own checks of both must pass."""
    from trl.chat_template_utils import is_chat_template_prefix_preserving, supports_tool_calling

    tokenizer.chat_template = template_with_calls(tokenizer.chat_template)
    tokenizer.response_template = calls_response_template(tokenizer)
    if not supports_tool_calling(tokenizer) or not is_chat_template_prefix_preserving(tokenizer):
        raise LayoutDiffers("TRL does not accept the chat template with tool calls written in")
    return tokenizer


def answer_text(messages: Sequence[dict[str, Any]]) -> str:
    """An episode's last model turn as the pipeline's rewards read it: its content, then any calls it made in the
    written format (an episode that ran out of turns while calling a tool)."""
    last = next((m for m in reversed(messages) if m.get("role") == "assistant"), {})
    calls = [c.get("function", c) for c in last.get("tool_calls") or []]
    return (last.get("content") or "") + "".join(
        f"<tool_call>{json.dumps({'name': c['name'], 'arguments': c.get('arguments', {})})}</tool_call>"
        for c in calls)


@dataclass(frozen=True)
class ToolRowInputs:
    """What `GRPOTrainer` is given for a tool row, and the pipeline's layout it must reproduce."""

    rows: list[dict[str, Any]]  # the dataset: conversational `prompt`, the raw prompt for rewards, the record's fields
    tools: list[Callable[..., Any]]
    tokenizer: Any  # TRL's copy (`for_trl`)
    chat: Any  # the pipeline's ChatFormat over its own tokenizer
    first_messages: Callable[[dict[str, Any]], list[dict[str, Any]]]


def tool_row_inputs(cfg: Any, records: Sequence[dict[str, Any]], tokenizer: Any, trl_tokenizer: Any) -> ToolRowInputs:
    """The pipeline's episode spec of `cfg` (`grpo.tools`) turned into TRL's inputs."""
    from components.engine.generation.environments.spec import episode_spec

    spec = episode_spec(cfg)
    if spec is None or spec.factory is not None:
        raise SystemExit("the TRL side of a tool row needs grpo.tools (TRL's environments are not compared)")
    chat = spec.chat(tokenizer)
    first = spec.first_messages(chat)
    rows = [{**{k: v for k, v in r.items() if k != "id"}, "prompt": first(r), "raw_prompt": r["prompt"]}
            for r in records]
    return ToolRowInputs(rows, [t.function for t in spec.tools], for_trl(trl_tokenizer), chat, first)


def check_same_layout(trainer: Any, inputs: ToolRowInputs, records: Sequence[dict[str, Any]],
                      answers: Sequence[str] = ("28454", "error: ValueError: not arithmetic")) -> dict[str, Any]:
    """TRL's prompt ids (`_tokenize_prompts`) and a tool answer's ids (`_get_tool_suffix_ids`) equal the pipeline's
    for `records` and `answers`; raises `LayoutDiffers` naming the first difference, else says what was compared."""
    trl_ids, _, _ = trainer._tokenize_prompts([inputs.first_messages(r) for r in records])
    for record, theirs in zip(records, trl_ids, strict=True):
        ours = inputs.chat.prompt_ids(inputs.first_messages(record))
        if list(theirs) != list(ours):
            raise LayoutDiffers(f"record {record.get('id')!r}: TRL's prompt has {len(theirs)} tokens, the pipeline's "
                                f"{len(ours)}; they differ from token {_first_difference(list(theirs), ours)}")
    name = trainer.tools[0].__name__
    for text in answers:
        message = [{"role": "tool", "name": name, "content": text}]
        theirs, ours = trainer._get_tool_suffix_ids(message), inputs.chat.answer_ids(message)
        if list(theirs) != list(ours):
            raise LayoutDiffers(f"a tool answer {text!r}: TRL lays out {theirs}, the pipeline {ours}")
    return {"prompts_compared": len(records), "answers_compared": len(answers),
            "prompt_tokens": [len(ids) for ids in trl_ids]}


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def runs(mask: Sequence[int], value: int) -> int:
    """How many maximal runs of `value` the mask has (model turns: runs of 1; tool answers: runs of 0)."""
    return sum(1 for i, m in enumerate(mask) if m == value and (i == 0 or mask[i - 1] != value))


def mask_counts(completion_ids: Sequence[Sequence[int]], tool_mask: Sequence[Sequence[int]] | None) -> dict[str, float]:
    """One step's counts from TRL's completions (each row's ids after its prompt, unpadded) and model-token mask
    (None: a single turn, every token the model's): model tokens, every token, tool answers, model turns, and the
    episodes in which the model wrote again after a tool answered."""
    masks = [list(m) for m in tool_mask] if tool_mask is not None else [[1] * len(ids) for ids in completion_ids]
    if [len(m) for m in masks] != [len(ids) for ids in completion_ids]:
        raise ValueError("TRL's tool mask does not cover its completions")
    return {"model_tokens": float(sum(sum(m) for m in masks)),
            "episode_tokens": float(sum(len(ids) for ids in completion_ids)),
            "tool_answers": float(sum(runs(m, 0) for m in masks)), "turns": float(sum(runs(m, 1) for m in masks)),
            "answered_after_tool": float(sum(1 for m in masks if 0 in m and 1 in m[m.index(0):]))}


@dataclass
class EpisodeCount:
    """Wraps TRL's `_generate`: each call's counts (`mask_counts`) summed until `take`, and one episode's text."""

    tokenizer: Any
    counts: dict[str, float] = field(default_factory=dict)
    sample: str = ""

    def wrap(self, generate: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            out = generate(*args, **kwargs)
            prompt_ids, completion_ids, tool_mask = out[0], out[1], out[2]
            for key, value in mask_counts(completion_ids, tool_mask).items():
                self.counts[key] = self.counts.get(key, 0.0) + value
            if completion_ids:
                self.sample = self.tokenizer.decode(list(prompt_ids[0]) + list(completion_ids[0]))
            return out

        return counted

    def take(self) -> dict[str, float]:
        counts, self.counts = self.counts, {}
        return counts


def episode_figures(steps: list[dict[str, float]]) -> dict[str, float]:
    """Per episode, over the measured steps: every token after the prompt, the model's turns, the tool calls; and
    where the engine counted them from its mask (TRL), the tools' answers and the share of episodes in which the
    model wrote after a tool answered."""
    episodes = sum(s["completions"] for s in steps) or 1.0
    figures = {"episode_tokens_mean": round(sum(s.get("episode_tokens", s["tokens"]) for s in steps) / episodes, 1),
               "turns_per_episode": round(sum(s.get("turns", s["completions"]) for s in steps) / episodes, 3),
               "tool_calls_per_episode": round(sum(s.get("tool_calls", 0.0) for s in steps) / episodes, 3)}
    if all("tool_answers" in s for s in steps):
        figures["tool_answers_per_episode"] = round(sum(s["tool_answers"] for s in steps) / episodes, 3)
        figures["answered_after_tool_frac"] = round(sum(s["answered_after_tool"] for s in steps) / episodes, 3)
    return figures


TOOL_ROW_DIFFERENCES = (
    "TRL renders prompts with the model's chat template plus one macro that writes an assistant turn's tool calls "
    "as the model writes them (TRL refuses a template that renders no tool exchange); prompts and tool answers were "
    "checked token for token against ours before training (`layout`).",
    "TRL reads calls with a transformers response template for the same format; it needs the closing </tool_call>, "
    "where ours also reads a call left open at the end of a turn, and a call it cannot read ends TRL's episode as "
    "an answer, where ours answers it with the call format and lets the model try again.",
    "A failing tool call reads \"{'error': '...'}\" in TRL and \"error: ValueError: ...\" in ours; TRL has no time "
    "limit on a call (ours: grpo.episode.timeout_s).",
    "TRL drops a tool answer that would take the episode past max_completion_length; ours also when the answer "
    "leaves no token for another turn (one token apart).",
    "Tool calls per episode: ours counts every call it answered (its episode records), TRL its tools/call_frequency "
    "metric; TRL's model tokens, tool answers and turns are counted from its tool_mask (1 on the model's tokens).",
)


def tool_row_report(g, engines: dict[str, dict[str, Any]], token_ratio: float, heldout: dict[str, float],
                    notes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A tool row's extras: the tools, what TRL's layout was checked against, one TRL episode as TRL laid it out, the
    issue's targets met or not, and the differences between the two tool loops that the benchmark could not
    remove."""
    ours, trl = engines["ours"], engines["trl"]
    return {"tools": list(g.tools), "max_turns": g.episode.max_turns, "layout": notes["trl"].get("layout"),
            "trl_sample_episode": notes["trl"].get("sample", ""),
            "targets": {"model_tokens_per_s_ratio_at_least_3": token_ratio >= 3,
                        "peak_rss_at_most_half_of_trl": ours["peak_rss_mb"] <= 0.5 * trl["peak_rss_mb"],
                        # the "4 GB" as it writes the figures it cites (this report's MB / 1000)
                        "peak_rss_at_most_4000_mb": ours["peak_rss_mb"] <= 4000,
                        "heldout_ci95_low_at_least_minus_0.05": heldout["ci95_low"] >= -0.05},
            "differences": list(TOOL_ROW_DIFFERENCES)}


def tool_row_lines(r: dict[str, Any]) -> list[str]:
    """A tool row's episode figures (table lines), its targets, TRL's layout check, the differences left and one
    episode of TRL's."""
    o, t = r["engines"]["ours"], r["engines"]["trl"]
    lines = [f"| {label} | {fmt.format(o[key]) if key in o else '-'} | {fmt.format(t[key]) if key in t else '-'} |"
             for label, key, fmt in (("tokens per episode after the prompt (mean)", "episode_tokens_mean", "{:.1f}"),
                                     ("model turns per episode", "turns_per_episode", "{:.2f}"),
                                     ("tool calls per episode", "tool_calls_per_episode", "{:.2f}"),
                                     ("tool answers per episode (TRL's mask)", "tool_answers_per_episode", "{:.2f}"),
                                     ("episodes the model wrote on after a tool answered", "answered_after_tool_frac",
                                      "{:.0%}"))]
    x = r["per_round_model_token_ratios"]
    lines += ["", f"**Model tokens/s, ours / TRL: {r['model_tokens_per_s_ratio']:.2f}x** (median of per-round ratios; "
              f"rounds: {', '.join(f'{v:.2f}' for v in x)}); episodes/s: {r['speedup_vs_trl']:.2f}x. Tools: "
              f"{', '.join(r['tools'])}, up to {r['max_turns']} model turns (TRL: max_tool_calling_iterations "
              f"{r['max_turns'] - 1}).", "",
              "Targets (issue 63): " + "; ".join(f"{name} {'met' if met else 'NOT met'}"
                                                 for name, met in r["targets"].items()) + ".", ""]
    if r.get("layout"):
        lines += [f"TRL's layout checked against ours before training: {r['layout']['prompts_compared']} prompts and "
                  f"{r['layout']['answers_compared']} tool answers, token for token.", ""]
    lines += ["Differences between the two tool loops that the benchmark does not remove:", "",
              *[f"- {d}" for d in r["differences"]], ""]
    if r.get("trl_sample_episode"):
        lines += ["One of TRL's episodes (its last measured step), as TRL laid it out:", "", "```text",
                  r["trl_sample_episode"], "```"]
    return lines
