"""The one way to score what `Generation.run` played: training (and so the sample tables and the dry run), SFT's
stop check, the evaluate stage, the held-out probe and pass@k all call `score`.

Every reward reads one column set wherever it runs: the records' own columns with `group_index`
(`records.reward_columns`), the episodes' columns (`Reading.columns`: the whole episode, the environment's reward,
the tool calls) and each completion's token length, the model's tokens (`completion_token_lengths`, which DAPO's
`overlong_penalty` reads). So a reward that trains also scores held-out rows, and no caller builds columns of its
own (tests/engine/generation/test_scoring.py checks both).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from components.data.records import reward_columns
from components.engine.generation.rollouts import Rollouts
from components.engine.generation.service import Reading
from components.engine.rewards.rewards import RewardModel, RewardResult


@dataclass
class Completions:
    """What rewards, metrics and tables read of played rows (prompt-major): texts as rewards read them, the episodes'
    reward columns, what a person reads, and per completion its model tokens, all its tokens after the prompt and
    whether it ended by itself."""

    texts: list[str] = field(default_factory=list)
    columns: dict[str, list[Any]] = field(default_factory=dict)
    transcripts: list[str] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)  # model tokens
    episode_lengths: list[int] = field(default_factory=list)  # every token after the prompt
    ended: list[bool] = field(default_factory=list)

    @classmethod
    def of(cls, rollouts: Rollouts, reading: Reading) -> Completions:
        """The rows of one `Generation.run` and its `Generation.read`."""
        episodes = rollouts.episodes
        return cls(list(reading.texts), {k: list(v) for k, v in reading.columns.items()}, list(reading.transcripts),
                   [e.model_tokens for e in episodes], [len(e.ids) for e in episodes],
                   [bool(x) for x in ~rollouts.truncated])

    def extend(self, other: Completions) -> None:
        """Append `other`'s rows (the next batch of records)."""
        self.texts += other.texts
        self.transcripts += other.transcripts
        for key, values in other.columns.items():
            self.columns.setdefault(key, []).extend(values)
        self.lengths += other.lengths
        self.episode_lengths += other.episode_lengths
        self.ended += other.ended


def reward_inputs(records: Sequence[dict[str, Any]], completions: Completions,
                  per_record: int = 1) -> tuple[list[str], list[str], dict[str, list[Any]]]:
    """(prompts, texts, columns) as every reward is called with them: `per_record` completions of each record, in
    record order."""
    if len(completions.texts) != len(records) * per_record or len(completions.lengths) != len(completions.texts):
        raise ValueError(f"{len(completions.texts)} completions ({len(completions.lengths)} lengths) for "
                         f"{len(records)} records x {per_record}")
    columns = {**reward_columns(list(records), per_record), **completions.columns,
               "completion_token_lengths": list(completions.lengths)}
    return [r["prompt"] for r in records for _ in range(per_record)], completions.texts, columns


def score(rewards: RewardModel, records: Sequence[dict[str, Any]], completions: Completions,
          per_record: int = 1) -> RewardResult:
    """`rewards` over `per_record` played completions of each record, with the one column set."""
    return rewards(*reward_inputs(records, completions, per_record))
