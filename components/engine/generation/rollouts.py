"""`Rollouts`: what an engine's `sample` returns and every later step reads, with the group layout it owns.

Rows are prompt-major: group k (one prompt's G completions) is rows k*G .. k*G+G-1. Prompts are left-padded and
position ids follow the attention mask (`positions_from_mask`), so log-probs recomputed over a rollout for the loss
match the distribution its tokens were drawn from. In a multi-turn episode the completion is everything after the
prompt: the model's turns and the tokens a tool or environment wrote between them, which stay in the context but out
of the loss (`model_mask`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, Self

import torch

Message = Mapping[str, object]  # a chat message: role, content and, for a tool's answer, its name


@dataclass(frozen=True)
class Episode:
    """One row's conversation after its prompt, built once when it ended (a single turn is the episode of one turn).

    `ids`, `model_mask` and `sampling_logp` hold every token after the prompt: the model's turns (mask 1, with the
    log-prob the sampler drew each with) and what a tool or environment answered between them (mask 0, log-prob 0).
    """

    messages: tuple[Message, ...]  # the model's turns (`assistant`) and the answers between them, in order
    ids: tuple[int, ...]
    model_mask: tuple[int, ...]
    sampling_logp: tuple[float, ...]
    turns: int  # model turns
    ended_with_eos: bool  # the model's last turn ended with EOS (not cut off mid-turn)
    tool_calls: int = 0
    tool_errors: int = 0
    reward: float | None = None  # the environment's reward (asked of it, or `grpo.episode.cut_reward`, when cut)
    cut: str | None = None  # the limit that ended it ("turns", "tokens"), or "environment error: ..."

    @property
    def answer(self) -> str:
        """The model's last turn: what rewards read as the completion."""
        return next((str(m["content"]) for m in reversed(self.messages) if m["role"] == "assistant"), "")

    @property
    def model_tokens(self) -> int:
        """Tokens the model wrote (EOS included)."""
        return sum(self.model_mask)

    @property
    def environment_tokens(self) -> int:
        """Tokens a tool or the environment wrote between the model's turns."""
        return len(self.ids) - self.model_tokens


@dataclass(frozen=True)
class Turn:
    """Rows of tokens with everything a loss needs: what an engine draws in a turn (`RolloutEngine.sample`,
    `Decoding.turn`), or rows to score (SFT's demonstrations, a self-check's); never written to (a change makes a new
    one). `Rollouts` are played rows: these, each with its episode."""

    prompt_ids: torch.Tensor  # [N, P] left-padded
    prompt_mask: torch.Tensor  # [N, P]
    completion_ids: torch.Tensor  # [N, T] right-padded with the pad token after EOS
    completion_mask: torch.Tensor  # [N, T] 1 on tokens up to and including EOS
    truncated: torch.Tensor  # [N] bool: no EOS within the budget
    group_size: int = 1  # G completions per prompt: the layout of the rows
    sampling_logp: torch.Tensor | None = None  # [N, T] each drawn token's log-prob as the sampler saw it (0 elsewhere)
    model_mask: torch.Tensor | None = None  # [N, T] 1 on the tokens the model wrote (None: every completion token)

    def __len__(self) -> int:
        return self.prompt_ids.shape[0]

    def token_fields(self) -> dict[str, Any]:
        """The rows' fields as `Turn` has them (a played row's episode left out)."""
        return {f.name: getattr(self, f.name) for f in fields(Turn)}

    @property
    def written(self) -> torch.Tensor:
        """[N, T] bool: the completion tokens the model wrote (the only ones a loss may see)."""
        real = self.completion_mask.bool()
        return real if self.model_mask is None else real & self.model_mask.bool()

    # ---- the group layout: every consumer asks here
    @property
    def num_groups(self) -> int:
        return len(self) // self.group_size

    def group_rows(self, groups: Iterable[int]) -> list[int]:
        """The rows of the given groups, in order."""
        return [k * self.group_size + j for k in groups for j in range(self.group_size)]

    def by_group(self, values: torch.Tensor) -> torch.Tensor:
        """A row per group: [N] -> [N / G, G]."""
        return values.view(-1, self.group_size)

    def group_of_row(self, row: int) -> int:
        return row // self.group_size

    # ---- new rows from these (of the same type: played rows keep their episodes)
    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Self:
        """Every tensor through `fn` (device, copies; `select` for rows)."""
        def maybe(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else fn(t)

        return replace(self, prompt_ids=fn(self.prompt_ids), prompt_mask=fn(self.prompt_mask),
                       completion_ids=fn(self.completion_ids), completion_mask=fn(self.completion_mask),
                       truncated=fn(self.truncated), sampling_logp=maybe(self.sampling_logp),
                       model_mask=maybe(self.model_mask))

    def clone(self) -> Self:
        """Fresh copies; made outside `torch.inference_mode`, they are ordinary tensors autograd can save."""
        return self.map(torch.clone)

    def select(self, rows: Sequence[int]) -> Self:
        """The given rows (same padding widths); itself when they are all rows in order (no copies)."""
        if list(rows) == list(range(len(self))):
            return self
        return self.map(lambda t: t[list(rows)])

    def select_groups(self, groups: Sequence[int]) -> Self:
        """The rows of the given groups (whole groups keep the layout)."""
        return self.select(self.group_rows(groups))

    def trimmed(self) -> Self:
        """Without trailing completion columns that are padding in every row (decoding in lockstep runs past a
        group's EOS)."""
        used = self.completion_mask.any(0).nonzero()
        width = int(used[-1]) + 1 if len(used) else 0
        return replace(self, completion_ids=self.completion_ids[:, :width],
                       completion_mask=self.completion_mask[:, :width],
                       sampling_logp=None if self.sampling_logp is None else self.sampling_logp[:, :width],
                       model_mask=None if self.model_mask is None else self.model_mask[:, :width])

    # ---- views
    @property
    def input_ids(self) -> torch.Tensor:
        return torch.cat([self.prompt_ids, self.completion_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        return torch.cat([self.prompt_mask, self.completion_mask], dim=1)

    def completion_lengths(self) -> list[int]:
        """Tokens of each completion the model wrote (EOS included; in an episode, every turn's)."""
        return [int(x) for x in self.written.sum(-1)]

    def distinct_fraction(self) -> float:
        """Distinct (prompt, completion) rows over all rows: `1.0` when no completion repeats another of its group.
        Low values mean the groups collapsed onto a few answers (little left to compare, and cheap steps)."""
        if not len(self):
            return 0.0
        rows = torch.cat([self.prompt_ids * self.prompt_mask, self.completion_ids * self.completion_mask], dim=1)
        return torch.unique(rows, dim=0).shape[0] / len(self)


@dataclass(frozen=True)
class Rollouts(Turn):
    """Played rows (`Generation.run`): an engine's turns answered by the play, each row with its episode (a single
    turn is the episode of one turn). Training, evaluation and the tables read these."""

    episodes: tuple[Episode, ...] = field(kw_only=True)  # per row, its episode

    def __post_init__(self) -> None:
        if len(self.episodes) != len(self):
            raise ValueError(f"rollouts of {len(self)} rows with {len(self.episodes)} episodes: one a row")

    @classmethod
    def played(cls, turn: Turn, episodes: Sequence[Episode]) -> Rollouts:
        """`turn`'s rows, each with its episode."""
        return cls(**turn.token_fields(), episodes=tuple(episodes))

    def select(self, rows: Sequence[int]) -> Rollouts:
        if list(rows) == list(range(len(self))):
            return self
        return Rollouts.played(Turn(**self.token_fields()).select(rows), [self.episodes[r] for r in rows])


def positions_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Position ids that skip left padding: 0 at each row's first real token."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int,
             device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Token id lists -> (ids [B, P] left-padded with `pad_id`, mask [B, P]): a tokenizer's left padding."""
    width = max((len(p) for p in prompts), default=0)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        if len(prompt):
            ids[row, width - len(prompt):] = torch.tensor(list(prompt), dtype=torch.long)
            mask[row, width - len(prompt):] = 1
    return ids.to(device), mask.to(device)


def encode_prompts(tokenizer, texts: Sequence[str]) -> list[list[int]]:
    """Prompt texts -> token ids as the model reads them (no special tokens added: templates carry their own).

    Tokenised as one padded batch, as Hugging Face's batch call does: the tokenizer then holds that padding setting,
    and a tokenizer saved with a model writes it out, so saved models are the same however their prompts were
    encoded."""
    if not texts:
        return []
    batch = tokenizer(list(texts), padding=True, add_special_tokens=False)
    return [[t for t, real in zip(ids, mask) if real] for ids, mask in zip(batch.input_ids, batch.attention_mask)]


def concat_rollouts(parts: Sequence[Turn], pad_id: int) -> Turn:
    """Stack rows of one group size and different widths: prompts re-padded on the left, completions on the right;
    played rows (`Rollouts`) keep their episodes."""
    if len(parts) == 1:
        return parts[0]
    sizes = {r.group_size for r in parts}
    if len(sizes) != 1:
        raise ValueError(f"concat_rollouts: rollouts of different group sizes {sorted(sizes)}")
    p_width = max(r.prompt_ids.shape[1] for r in parts)
    c_width = max(r.completion_ids.shape[1] for r in parts)

    def left(t: torch.Tensor, width: int, value: int) -> torch.Tensor:
        return torch.nn.functional.pad(t, (width - t.shape[1], 0), value=value)

    def right(t: torch.Tensor, width: int, value: int) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)

    sampled = [r.sampling_logp is not None for r in parts]
    if any(sampled) and not all(sampled):  # a part lost its sampler log-probs: say so, not a silent on-policy check
        raise ValueError("concat_rollouts: some rollouts carry the sampler's log-probs and some do not")
    played = {isinstance(r, Rollouts) for r in parts}
    if len(played) != 1:
        raise ValueError("concat_rollouts: some rollouts are played (episodes) and some are not")
    masked = any(r.model_mask is not None for r in parts)
    rows = Turn(prompt_ids=torch.cat([left(r.prompt_ids, p_width, pad_id) for r in parts]),
                prompt_mask=torch.cat([left(r.prompt_mask, p_width, 0) for r in parts]),
                completion_ids=torch.cat([right(r.completion_ids, c_width, pad_id) for r in parts]),
                completion_mask=torch.cat([right(r.completion_mask, c_width, 0) for r in parts]),
                truncated=torch.cat([r.truncated for r in parts]), group_size=sizes.pop(),
                sampling_logp=torch.cat([right(r.sampling_logp, c_width, 0) for r in parts])
                if all(sampled) else None,
                model_mask=torch.cat([right(r.completion_mask if r.model_mask is None else r.model_mask,
                                            c_width, 0) for r in parts]) if masked else None)
    return Rollouts.played(rows, [e for r in parts for e in r.episodes]) if played.pop() else rows


def decode_completions(tokenizer, rollouts: Rollouts) -> list[str]:
    """Completion text before EOS (special tokens dropped)."""
    eos_id = tokenizer.eos_token_id
    texts = []
    for row in rollouts.completion_ids.tolist():
        if eos_id in row:
            row = row[: row.index(eos_id)]
        texts.append(tokenizer.decode(row, skip_special_tokens=True))
    return texts
