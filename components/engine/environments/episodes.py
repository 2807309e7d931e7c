"""The episode loop, in one place: the rollout door's `sample` for the model's turns, `step` of each rollout's
environment between them, until every episode ends or meets a limit.

A group's G episodes start from one prompt (their environments' first messages, rendered once), so GRPO still
compares completions of one prompt. The first turn samples G completions per prompt; later turns one per open
episode, from its whole context. The completion an episode leaves is everything after the prompt: the model's turns
(model_mask 1, with the sampler's log-probs) and what the environment wrote between them (model_mask 0).

Limits: `max_turns` model turns; `max_tokens` tokens after the prompt, model and environment together (TRL's
`max_completion_length` for tool episodes: an answer that would not fit is dropped and the episode ends there); a
tool or environment call's seconds (`timeout_s`). An episode cut at a limit is marked truncated.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from components.engine.environments.chat import ChatFormat
from components.engine.environments.environment import Environment, EnvironmentStep, as_step
from components.engine.models.rollouts import Rollouts, decode_completions, left_pad
from components.engine.rollout.base import RolloutEngine, SamplingParams
from components.errors import StageFailed
from components.user_code import UserCodeError, calling


class EnvironmentFailed(StageFailed):
    """The environment failed on most episodes of a turn, or cannot start one: the stage stops with this line
    (checkpoints kept)."""


@dataclass
class Episode:
    """One rollout's conversation after its prompt, and how it went."""

    messages: list[dict[str, Any]] = field(default_factory=list)  # model turns and the answers between them
    turns: int = 0  # model turns
    tool_calls: int = 0
    tool_errors: int = 0
    reward: float | None = None  # the environment's own, when it gave one
    cut: str | None = None  # the limit that ended it ("turns", "tokens"), or "environment error: ..."
    done: bool = False

    @property
    def answer(self) -> str:
        """The model's last turn: what rewards read as the completion."""
        return next((m["content"] for m in reversed(self.messages) if m["role"] == "assistant"), "")


@dataclass
class _Run:
    """One episode's tokens while it runs."""

    episode: Episode
    environment: Any
    ids: list[int] = field(default_factory=list)
    model: list[int] = field(default_factory=list)
    logp: list[float] = field(default_factory=list)
    ended_with_eos: bool = True


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int = 4
    max_tokens: int = 256
    timeout_s: float = 10.0
    failure_share: float = 0.5  # more than this share of a batch's episodes failing stops the stage


class EpisodeRunner:
    """Runs episodes through an engine. `make_environment()` builds one environment per rollout."""

    def __init__(self, chat: ChatFormat, make_environment: Callable[[], Environment], limits: EpisodeLimits,
                 describe: str = "environment"):
        self.chat, self.make_environment, self.limits, self.describe = chat, make_environment, limits, describe
        self.tokenizer = chat.tokenizer
        self.device: torch.device | None = None  # where the engine puts its rollouts (the episodes' go there too)

    def run(self, engine: RolloutEngine, records: Sequence[dict[str, Any]], params: SamplingParams,
            generator: torch.Generator | None = None) -> Rollouts:
        """`params.n` episodes of each record, prompt-major, as rollouts carrying their episodes."""
        prompts, runs = self._start(records, params.n)
        open_runs = [(i, r) for i, r in enumerate(runs) if not r.episode.done]
        first = True
        while open_runs:
            rows = [r for _, r in open_runs]
            contexts = [prompts[i // params.n] + r.ids for i, r in open_runs]
            budget = max(self.limits.max_tokens - len(r.ids) for r in rows)
            turn_params = dataclasses.replace(params, n=params.n if first else 1,
                                              max_new_tokens=min(params.max_new_tokens, budget))
            sampled = engine.sample(prompts if first else contexts, turn_params, generator)
            self.device = sampled.completion_ids.device
            for row, run in zip(range(len(sampled)), rows):
                self._take_turn(run, sampled, row)
            self._check_failures(rows)
            first = False
            open_runs = [(i, r) for i, r in enumerate(runs) if not r.episode.done]
        return self._rollouts(prompts, runs, params.n)

    def longest_row(self, records: Sequence[dict[str, Any]]) -> int:
        """The most tokens an episode of `records` can hold: its prompt (one `reset` per record) and `max_tokens`."""
        prompts, _ = self._start(records, 1)
        return max((len(p) for p in prompts), default=0) + self.limits.max_tokens

    def _start(self, records: Sequence[dict[str, Any]], n: int) -> tuple[list[list[int]], list[_Run]]:
        """Each record's prompt (its environments' first messages, which must agree within the group) and a run per
        episode."""
        prompts, runs = [], []
        for record in records:
            group = []
            for _ in range(n):
                try:  # the user's code, through the one door (components/user_code.py)
                    with calling(self.describe, "starting an episode", timeout_s=self.limits.timeout_s):
                        environment = self.make_environment()
                        first = environment.reset(record)
                except UserCodeError as err:  # this record cannot be played
                    cause = err.__cause__
                    raise EnvironmentFailed(f"{self.describe}: reset raised {type(cause).__name__}: {cause} "
                                            f"(record {record.get('id')!r})") from err
                group.append((environment, first))
            if any(messages != group[0][1] for _, messages in group):
                raise EnvironmentFailed(f"{self.describe}: reset gave one record's {n} episodes different first "
                                        f"messages (record {record.get('id')!r}); GRPO compares completions of one "
                                        "prompt")
            prompts.append(self.chat.prompt_ids(group[0][1]))
            runs += [_Run(Episode(), environment) for environment, _ in group]
        return prompts, runs

    def _take_turn(self, run: _Run, sampled: Rollouts, row: int) -> None:
        """Append the model's turn; let the environment answer, unless a limit ends the episode first."""
        written = sampled.completion_mask[row].bool()
        ids = sampled.completion_ids[row][written].tolist()[: self.limits.max_tokens - len(run.ids)]
        logp = sampled.sampling_logp[row][written].tolist()[: len(ids)] if sampled.sampling_logp is not None \
            else [0.0] * len(ids)
        run.ids, run.model, run.logp = run.ids + ids, run.model + [1] * len(ids), run.logp + logp
        episode = run.episode
        episode.turns += 1
        text = self.tokenizer.decode([t for t in ids if t != self.tokenizer.eos_token_id], skip_special_tokens=True)
        episode.messages.append({"role": "assistant", "content": text})
        run.ended_with_eos = bool(ids) and ids[-1] == self.tokenizer.eos_token_id
        if not run.ended_with_eos:  # out of tokens mid-turn: the environment is not asked about half a turn
            episode.done, episode.cut = True, "tokens"
            return
        step = self._step(run, text)
        if step is None:
            return
        episode.tool_calls += step.tool_calls
        episode.tool_errors += step.tool_errors
        if step.done or not step.messages:
            episode.done, episode.reward = True, step.reward
            return
        if episode.turns >= self.limits.max_turns:
            episode.done, episode.cut = True, "turns"
            return
        answer = self.chat.answer_ids(step.messages)
        if len(run.ids) + len(answer) >= self.limits.max_tokens:  # no room for the answer and a turn after it
            episode.done, episode.cut = True, "tokens"
            return
        episode.messages += step.messages
        run.ids, run.model, run.logp = run.ids + answer, run.model + [0] * len(answer), run.logp + [0.0] * len(answer)

    def _step(self, run: _Run, text: str) -> EnvironmentStep | None:
        """The environment's answer; None (the episode ended, the failure recorded) when it raises or overruns."""
        try:  # the user's code, through the one door: whatever it raises fails this episode, not the step
            with calling(self.describe, "answering a turn", timeout_s=self.limits.timeout_s):
                return as_step(run.environment.step(text))
        except UserCodeError as err:
            cause = err.__cause__
            run.episode.done, run.episode.cut = True, f"environment error: {type(cause).__name__}: {cause}"
            return None

    def _check_failures(self, runs: Sequence[_Run]) -> None:
        failed = [r.episode.cut for r in runs if (r.episode.cut or "").startswith("environment error")]
        if runs and len(failed) > self.limits.failure_share * len(runs):
            raise EnvironmentFailed(f"{self.describe} failed on {len(failed)} of {len(runs)} episodes in one turn "
                                    f"(more than {self.limits.failure_share:.0%}); the first: {failed[0]}")

    def _rollouts(self, prompts: list[list[int]], runs: list[_Run], n: int) -> Rollouts:
        pad = self.tokenizer.pad_token_id
        prompt_ids, prompt_mask = left_pad([prompts[i // n] for i in range(len(runs))], pad)
        width = max((len(r.ids) for r in runs), default=0)

        def grid(values: Callable[[_Run], list], fill: float | int, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor([values(r) + [fill] * (width - len(r.ids)) for r in runs], dtype=dtype).view(-1, width)

        completion_ids = grid(lambda r: r.ids, pad, torch.long)
        completion_mask = grid(lambda r: [1] * len(r.ids), 0, torch.long)
        truncated = torch.tensor([r.episode.cut is not None or not r.ended_with_eos for r in runs], dtype=torch.bool)
        rollouts = Rollouts(prompt_ids, prompt_mask, completion_ids, completion_mask, truncated, n,
                            grid(lambda r: r.logp, 0.0, torch.float32), grid(lambda r: r.model, 0, torch.long),
                            tuple(r.episode for r in runs))
        return rollouts.map(lambda t: t.to(self.device)) if self.device is not None else rollouts


def reward_inputs(tokenizer: Any, rollouts: Rollouts) -> tuple[list[str], dict[str, list[Any]]]:
    """What rewards read of rollouts: each completion's text and, for episodes, columns about the episode (the model's
    last turn is the completion; `episode` holds every message after the prompt, tool calls and results included;
    `environment_reward`, `tool_calls`, `tool_errors`, `turns`)."""
    if rollouts.episodes is None:
        return decode_completions(tokenizer, rollouts), {}
    episodes = rollouts.episodes
    return [e.answer for e in episodes], {
        "episode": [list(e.messages) for e in episodes], "environment_reward": [e.reward for e in episodes],
        "tool_calls": [e.tool_calls for e in episodes], "tool_errors": [e.tool_errors for e in episodes],
        "turns": [e.turns for e in episodes]}


def transcript(episode: Episode) -> str:
    """An episode as one readable text: each message after the prompt, by role."""
    return "\n".join(f"[{m['role']}{'/' + m['name'] if m.get('name') else ''}] {m['content']}"
                     for m in episode.messages)


def completion_texts(tokenizer: Any, rollouts: Rollouts) -> list[str]:
    """What a person reads of each completion: its text, or an episode's transcript (sample tables, warnings)."""
    if rollouts.episodes is None:
        return decode_completions(tokenizer, rollouts)
    return [transcript(e) for e in rollouts.episodes]
