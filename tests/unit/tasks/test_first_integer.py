"""The ``first_integer`` reward: the first number of a completion against the answer."""

from __future__ import annotations

import pytest

from astraflow.tasks.rewards import REWARDS, RewardError, make_reward


@pytest.mark.parametrize("completion,answer,want", [
    ("82", "82", 1.0),
    (" 82<|im_end|>", "82", 1.0),
    ("82 is the sum of 37 and 45", "82", 1.0),
    ("The answer is 82.", "82", 1.0),
    ("82.0", "82", 1.0),
    ("37+45=82", "82", 0.0),  # its first number is 37
    ("8.2", "82", 0.0),
    ("83", "82", 0.0),
    ("", "82", 0.0),
    ("no number", "82", 0.0),
    ("<|im_end|>82", "82", 0.0),  # after the end of the sequence
    ("1,234 apples", "1234", 1.0),
    ("12,13", "12", 1.0),  # a comma between numbers is no thousands separator
    ("-5", "-5", 1.0),
    ("10-5 = 5", "5", 0.0),  # its first number is 10
    ("x2 is 82", "82", 1.0),  # "2" continues a word
])
def test_first_integer_scores_the_first_number_by_value(completion, answer, want):
    assert make_reward("first_integer")(completion, {"answer": answer}) == want


def test_first_integer_is_registered_and_needs_a_numeric_answer():
    assert "first_integer" in REWARDS
    reward = make_reward("first_integer")
    with pytest.raises(RewardError, match="the answer 'eighty' is not a number"):
        reward("80", {"answer": "eighty"})
    with pytest.raises(RewardError, match="no 'answer'"):
        reward("80", {})
