"""The one way to generate: training, held-out evaluation, pass@k, SFT's stop check, sample tables and the dry run
all call `Generation` (verl's agent loop and nanochat's `Engine.generate` are the models).

Every row is an episode: the engine samples the model's turn, the row's play (environments/episodes.py) answers it, and
a row that goes on gets the answer appended to its running cache (`Decoding.extend`): a group's prompt is encoded once
per call, a conversation once in all. A single turn is the play that ends after the first turn. Which play and engine
run is decided where the service is built (`for_run`, `for_evaluation`), never by its callers.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from components.config import PipelineConfig
from components.engine.generation.engines.base import RolloutEngine, SamplingParams
from components.engine.generation.engines.choose import evaluation_engine
from components.engine.generation.environments.episodes import (
    EnvironmentFailed,
    EpisodeLimits,
    Play,
    Row,
    SingleTurn,
    failed,
    finish,
    take_turn,
)
from components.engine.generation.environments.spec import episode_spec
from components.engine.generation.rollouts import Episode, Message, Rollouts, Turn, left_pad
from components.engine.models.prompting import PromptFormatter
from components.rollout_engines import engine_settings


@dataclass(frozen=True)
class Reading:
    """What rewards, metrics and tables see of rollouts, row for row."""

    texts: list[str]  # each row's completion as rewards read it (an episode's last model turn)
    columns: dict[str, list[Any]]  # the episodes' own reward columns (none for single turns)
    transcripts: list[str]  # what a person reads (a single turn: its text; an episode: every message by role)
    endings: list[str]  # how each ended, in words (EOS, a limit, the environment, an environment error)


class Generation:
    """`engine` generates, `play` answers; `run` returns rollouts carrying their frozen episodes."""

    def __init__(self, engine: RolloutEngine, play: Play, tokenizer: Any):
        self.engine, self.play, self.tokenizer = engine, play, tokenizer

    @classmethod
    def single_turn(cls, engine: RolloutEngine, tokenizer: Any,
                    format_prompt: Callable[[dict[str, Any]], str]) -> Generation:
        """Single turns of `format_prompt(record)`, as long as the sampling parameters allow (hand-built policies)."""
        return cls(engine, SingleTurn(tokenizer, format_prompt, EpisodeLimits(max_turns=1)), tokenizer)

    def with_engine(self, engine: RolloutEngine) -> Generation:
        return Generation(engine, self.play, self.tokenizer)

    def longest_row(self, records: Sequence[dict[str, Any]], budget: int) -> int:
        """The most tokens a row of `records` can hold: its prompt (tool schemas and system message included) and
        the `budget` after it (the model's turns and the answers). Engines are sized from it."""
        return self.play.longest_prompt(records) + budget

    def run(self, records: Sequence[dict[str, Any]], params: SamplingParams,
            generator: torch.Generator | None = None) -> Rollouts:
        """`params.n` rows of each record, prompt-major, each played to its end; `params.max_new_tokens` is each
        row's token budget after its prompt (the model's turns and the answers together), the only one."""
        budget = params.max_new_tokens
        prompts, rows = self.play.start(records, params.n)
        decoding = self.engine.start(prompts, continuing=self.play.limits.max_turns > 1)
        first = sampled = decoding.turn(params, generator)
        playing = list(range(len(rows)))
        while True:
            self._take_turns([rows[i] for i in playing], sampled, budget)
            going = [k for k, i in enumerate(playing) if not rows[i].done]
            if not going:
                break
            room = max(budget - len(rows[playing[k]].ids) for k in going)
            decoding.extend(going, [rows[playing[k]].answer for k in going], room)
            playing = [playing[k] for k in going]
            sampled = decoding.turn(dataclasses.replace(params, n=1, max_new_tokens=room), generator)
        episodes = tuple(finish(self.play, row) for row in rows)
        if all(e.turns <= 1 for e in episodes):  # nothing was appended: the first turn is the whole rollout
            return Rollouts.played(first, episodes)
        return self._rollouts(prompts, episodes, params.n, first.completion_ids.device)

    def read(self, rollouts: Rollouts) -> Reading:
        episodes = rollouts.episodes
        texts = [e.answer for e in episodes]
        return Reading(texts, self.play.columns(episodes), [self.play.transcript(e) for e in episodes],
                       [self.play.ending(e) for e in episodes])

    def _take_turns(self, rows: list[Row], sampled: Turn, budget: int) -> None:
        eos = self.tokenizer.eos_token_id
        lengths = sampled.completion_mask.sum(-1).tolist()
        ids = sampled.completion_ids.tolist()
        logp = sampled.sampling_logp.tolist() if sampled.sampling_logp is not None else None

        def decode(tokens: list[int]) -> str:
            return self.tokenizer.decode(tokens, skip_special_tokens=True)

        for k, row in enumerate(rows):
            n = lengths[k]
            take_turn(self.play, row, ids[k][:n], logp[k][:n] if logp is not None else [0.0] * n, eos, decode, budget)
        reasons = failed(rows)
        share = self.play.limits.failure_share
        if rows and len(reasons) > share * len(rows):
            raise EnvironmentFailed(f"{self.play.describe} failed on {len(reasons)} of {len(rows)} episodes in one "
                                    f"turn (more than {share:.0%}); the first: {reasons[0]}")

    def _rollouts(self, prompts: list[list[int]], episodes: tuple[Episode, ...], n: int,
                  device: torch.device) -> Rollouts:
        pad = self.tokenizer.pad_token_id
        prompt_ids, prompt_mask = left_pad([prompts[row // n] for row in range(len(episodes))], pad, device)
        width = max((len(e.ids) for e in episodes), default=0)

        def grid(values: Callable[[Episode], Sequence[float | int]], fill: float | int,
                 dtype: torch.dtype) -> torch.Tensor:
            rows = [list(values(e)) + [fill] * (width - len(e.ids)) for e in episodes]
            return torch.tensor(rows, dtype=dtype, device=device).view(-1, width)

        truncated = torch.tensor([e.cut is not None or not e.ended_with_eos for e in episodes], dtype=torch.bool,
                                 device=device)
        return Rollouts(prompt_ids, prompt_mask, grid(lambda e: e.ids, pad, torch.long),
                        grid(lambda e: [1] * len(e.ids), 0, torch.long), truncated, n,
                        grid(lambda e: e.sampling_logp, 0.0, torch.float32),
                        grid(lambda e: e.model_mask, 0, torch.long), episodes=episodes)


def play_of(cfg: PipelineConfig, tokenizer: Any) -> Play:
    """The run's play: its episodes (`grpo.tools`, `grpo.environment`) or single turns, `max_tokens` after each
    prompt."""
    spec = episode_spec(cfg)
    if spec is not None:
        return spec.play(tokenizer)
    limits = EpisodeLimits(max_turns=1, cut_reward=cfg.grpo.episode.cut_reward)
    return SingleTurn(tokenizer, PromptFormatter(cfg.prompt, tokenizer), limits)


_EVALUATION_GENERATIONS: weakref.WeakKeyDictionary[Any, tuple[tuple[Any, ...], Generation]] = \
    weakref.WeakKeyDictionary()


def for_evaluation(cfg: PipelineConfig, model: Any, tokenizer: Any, max_new_tokens: int,
                   records: Sequence[dict[str, Any]], stop_together: Callable[[bool], bool] | None = None
                   ) -> Generation:
    """Generation of held-out evaluation, pass@k and SFT's stop check over `model` as it is now: the prompt-once
    engine where its self-check on rows as long as `records`' passes (`choose.evaluation_engine`), the plain one
    otherwise or for a sharded model (`stop_together`).

    Built once per model and records: the held-out probe and SFT's stop check ask again with the same model, records
    and settings at every check, and sizing the engine reads every record's prompt (an environment's play resets
    one environment per record for it)."""
    key = (cfg, tokenizer, max_new_tokens, records, stop_together)
    cached = _EVALUATION_GENERATIONS.get(model)
    if cached is not None and len(cached[0]) == len(key) and all(a is b for a, b in zip(cached[0], key)):
        return cached[1]
    play = play_of(cfg, tokenizer)
    longest = play.longest_prompt(records) + max_new_tokens if records else max_new_tokens
    engine = evaluation_engine(model, tokenizer, max_new_tokens, longest, engine_settings(cfg.grpo),
                               stop_together=stop_together)
    generation = Generation(engine, play, tokenizer)
    _EVALUATION_GENERATIONS[model] = (key, generation)
    return generation


def conversation_encoder(cfg: PipelineConfig, tokenizer: Any) -> Callable[[dict[str, Any], list[Message]],
                                                                        tuple[list[int], list[int]]] | None:
    """How SFT lays out a worked conversation (a record's first messages, then assistant turns and the answers
    between them) as (ids, model mask), token for token as the run's episodes are; None without episodes."""
    spec = episode_spec(cfg)
    return spec.conversation(tokenizer) if spec is not None else None
