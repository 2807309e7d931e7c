"""A run's episodes from its config: `grpo.tools` (the pipeline's `ToolEnvironment`) or `grpo.environment` (the
user's factory), the prompt settings and the limits; None when rollouts are single turns. Built once; the play is
made per tokenizer (training, evaluation and SFT's stop check each have theirs)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from components.config import ConfigError, GRPOConfig, PipelineConfig, PromptConfig
from components.data.records import DataError
from components.engine.generation.environments.chat import ChatFormat, conversation_ids
from components.engine.generation.environments.environment import Environment, ToolEnvironment, load_environment_factory
from components.engine.generation.environments.episodes import EpisodeLimits, Episodes
from components.engine.generation.environments.tools import Tool, load_tools, tools_prompt


@dataclass(frozen=True)
class EpisodeSpec:
    """What a run's episodes are made of."""

    tools: tuple[Tool, ...]
    factory: Callable[[], Environment] | None  # the user's environment (None: tools)
    name: str  # what failures name: "tools calculator, ..." or the environment's import path
    prompt: PromptConfig
    limits: EpisodeLimits

    def play(self, tokenizer: Any) -> Episodes:
        """The episodes through `tokenizer`'s chat template; a tokenizer without one is refused in one line."""
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(f"{self.name}: episodes need a model whose tokenizer has a chat template (an episode's "
                              "turns are told apart by it); this model's has none")
        chat = self.chat(tokenizer)
        limits = self.limits
        if self.factory is not None:
            return Episodes(chat, self.factory, limits, self.name)
        first, tools = self.first_messages(chat), self.tools
        return Episodes(chat, lambda: ToolEnvironment(tools, first, limits.timeout_s, tokenizer), limits, self.name)

    def chat(self, tokenizer: Any) -> ChatFormat:
        return ChatFormat(tokenizer, [t.schema for t in self.tools] or None)

    def first_messages(self, chat: ChatFormat) -> Callable[[dict[str, Any]], list[dict[str, Any]]]:
        """An episode's first messages for a record: the environment's (`reset`), or with tools the system message
        (the configured one, and the tools where the template offers them no format of its own) and the record's
        prompt (`prompt.template`) as the user's."""
        if self.factory is not None:
            return lambda record: self.factory().reset(record)
        system = chat.system_text(self.prompt.system, tools_prompt(self.tools))

        def first_messages(record: dict[str, Any]) -> list[dict[str, Any]]:
            try:
                text = self.prompt.template.format(**record)
            except KeyError as err:
                raise DataError(f"prompt.template uses field {err} that record {record.get('id')!r} does not "
                                "have") from err
            return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]

        return first_messages

    def conversation(
            self, tokenizer: Any) -> Callable[[dict[str, Any], list[dict[str, Any]]], tuple[list[int], list[int]]]:
        """(ids, model_mask) of a worked conversation: a record's first messages, then `turns` (assistant turns and
        the answers between them), laid out token for token as an episode is (SFT's warm start on tool use)."""
        chat = self.chat(tokenizer)
        first = self.first_messages(chat)

        def encode(record: dict[str, Any], turns: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
            ids, mask, _ = conversation_ids(chat, first(record) + list(turns))
            return ids, mask

        return encode


def episode_spec(cfg: PipelineConfig) -> EpisodeSpec | None:
    """The run's episodes, or None for single-turn rollouts; tools and environments that cannot be used are refused
    here, before training, in one line naming them."""
    g = cfg.grpo
    if not (g.tools or g.environment):
        return None
    limits = EpisodeLimits(max_turns=g.episode.max_turns, timeout_s=g.episode.timeout_s,
                           cut_reward=g.episode.cut_reward)
    if g.environment:
        return EpisodeSpec((), load_environment_factory(g.environment), g.environment, cfg.prompt, limits)
    return EpisodeSpec(tuple(load_tools(g.tools)), None, "tools " + ", ".join(g.tools), cfg.prompt, limits)


def check_episodes(g: GRPOConfig) -> None:
    """Every configured tool and the environment can be used (imported, typed, built): the stage CLI and the
    pipeline's pre-flight call it, as they do `check_rewards`."""
    if g.environment:
        load_environment_factory(g.environment)
    if g.tools:
        load_tools(g.tools)

