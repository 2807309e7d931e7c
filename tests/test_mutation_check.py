"""Every hand-written mutation in tests/mutation_check.py still applies to the code (exactly one match)."""

from tests.mutation_check import MUTATIONS, unmatched


def test_every_mutation_applies_to_exactly_one_place():
    assert unmatched(MUTATIONS) == []


def test_a_mutation_whose_text_is_gone_is_reported():
    gone = [("gone", "components/engine/grpo/objectives.py", "this text is in no file", "x")]
    assert unmatched(gone) == ["gone: components/engine/grpo/objectives.py has 0 matches"]
