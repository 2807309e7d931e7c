"""`Rollouts` (components/engine/generation/rollouts.py): the row layout it owns, padding and stacking, by hand."""

import pytest
import torch

from components.engine.generation.rollouts import Turn, concat_rollouts, left_pad


def _rollouts(group_size: int = 2) -> Turn:
    prompts = torch.tensor([[0, 5], [0, 5], [7, 6], [7, 6]])
    completions = torch.tensor([[3, 2, 0], [4, 4, 4], [3, 2, 0], [9, 2, 0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 0], [1, 1, 0]])
    return Turn(prompts, (prompts != 0).long(), completions, mask, torch.tensor([False, True, False, False]),
                    group_size, torch.rand(4, 3))


def test_the_group_layout_is_asked_of_the_rollouts():
    rollouts = _rollouts()
    assert (rollouts.num_groups == 2 and rollouts.group_rows([1]) == [2, 3]
            and rollouts.group_rows([1, 0]) == [2, 3, 0, 1])
    assert rollouts.by_group(torch.arange(4.0)).tolist() == [[0.0, 1.0], [2.0, 3.0]]
    kept = rollouts.select_groups([1])
    assert kept.group_size == 2 and kept.prompt_ids.tolist() == [[7, 6], [7, 6]]
    assert rollouts.select([0, 1, 2, 3]) is rollouts  # all rows in order: no copy
    assert rollouts.completion_lengths() == [2, 3, 2, 2]


def test_rollouts_are_never_written_to():
    rollouts = _rollouts()
    with pytest.raises(AttributeError):
        rollouts.group_size = 4  # type: ignore[misc]


def test_left_pad_is_a_tokenizers_left_padding():
    ids, mask = left_pad([[5, 6, 7], [8], []], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8], [0, 0, 0]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 0, 0]]
    assert ids.dtype == mask.dtype == torch.long


def test_concat_re_pads_prompts_on_the_left_and_completions_on_the_right():
    wide = _rollouts()
    narrow = Turn(torch.tensor([[4], [4]]), torch.tensor([[1], [1]]), torch.tensor([[3], [2]]),
                  torch.tensor([[1], [1]]), torch.tensor([False, False]), 2, torch.rand(2, 1))
    both = concat_rollouts([wide, narrow], pad_id=0)
    assert both.group_size == 2 and len(both) == 6
    assert both.prompt_ids[4:].tolist() == [[0, 4], [0, 4]] and both.prompt_mask[4:].tolist() == [[0, 1], [0, 1]]
    assert both.completion_ids[4:].tolist() == [[3, 0, 0], [2, 0, 0]]
    assert both.completion_mask[4:].tolist() == [[1, 0, 0], [1, 0, 0]]
    with pytest.raises(ValueError, match="group sizes"):
        concat_rollouts([wide, Turn(*[getattr(narrow, f) for f in ("prompt_ids", "prompt_mask", "completion_ids",
                                                                   "completion_mask", "truncated")], 1)], 0)


def test_trimmed_drops_completion_columns_that_are_padding_in_every_row():
    rollouts = _rollouts()
    padded = concat_rollouts([rollouts, Turn(rollouts.prompt_ids[:2], rollouts.prompt_mask[:2],
                                             torch.zeros(2, 5, dtype=torch.long),
                                             torch.zeros(2, 5, dtype=torch.long),
                                             torch.zeros(2, dtype=torch.bool), 2, torch.zeros(2, 5))], 0)
    assert padded.completion_ids.shape[1] == 5 and padded.trimmed().completion_ids.shape[1] == 3


def test_distinct_fraction_counts_rows_that_differ_in_prompt_or_in_completion_up_to_eos():
    prompts = torch.tensor([[0, 5], [0, 5], [0, 5], [7, 6]])
    prompt_mask = torch.tensor([[0, 1], [0, 1], [0, 1], [1, 1]])
    # rows 0 and 1 equal up to EOS (2) and differ only in padding after it; row 2 another answer; row 3 another prompt
    completions = torch.tensor([[3, 2, 0], [3, 2, 9], [4, 2, 0], [3, 2, 0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 1, 0], [1, 1, 0]])
    rollout = Turn(prompts, prompt_mask, completions, mask, torch.zeros(4, dtype=torch.bool))
    assert rollout.distinct_fraction() == 3 / 4
    assert rollout.select([0, 2, 3]).distinct_fraction() == 1.0


def test_played_rows_always_carry_their_episodes_through_select_and_concat():
    """`Rollouts` (what `Generation.run` returns) hold one episode a row, kept row for row by `select`, `map` and
    `concat_rollouts`; an engine's `Turn` has none, and the two are never stacked together."""
    from components.engine.generation.rollouts import Episode, Rollouts

    turn = _rollouts()
    episodes = [Episode((), (k,), (1,), (0.0,), 1, True) for k in range(len(turn))]
    played = Rollouts.played(turn, episodes)
    assert played.select([3, 0]).episodes == (episodes[3], episodes[0])
    assert played.select([3, 0]).completion_ids.tolist() == turn.select([3, 0]).completion_ids.tolist()
    assert played.map(torch.clone).episodes == tuple(episodes)
    assert concat_rollouts([played, played.select([2, 3])], 0).episodes == (*episodes, episodes[2], episodes[3])
    with pytest.raises(ValueError, match="played"):
        concat_rollouts([played, turn], 0)
    with pytest.raises(ValueError, match="4 rows with 3 episodes"):
        Rollouts.played(turn, episodes[:3])
    assert not hasattr(turn, "episodes")
