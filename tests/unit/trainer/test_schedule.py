"""The learning-rate schedule: its values and its settings' errors (the step that uses it:
test_trainer.py)."""

from __future__ import annotations

import math

import pytest

from astraflow.config.sections import TrainerSpec
from astraflow.trainer.schedule import LrSchedule


def test_constant_after_a_linear_warm_up():
    s = LrSchedule(lr=1e-4, warmup_steps=4)
    assert [s.at(i) for i in range(6)] == pytest.approx([2.5e-5, 5e-5, 7.5e-5, 1e-4, 1e-4,
                                                         1e-4])
    assert LrSchedule(lr=3e-5).at(0) == LrSchedule(lr=3e-5).at(10_000) == 3e-5


@pytest.mark.parametrize("decay", ["linear", "cosine"])
def test_a_decay_goes_from_lr_to_final_and_holds_it(decay):
    s = LrSchedule(lr=3e-5, warmup_steps=2, decay=decay, final=1e-5, decay_steps=10)
    assert s.at(2) == pytest.approx(3e-5)  # the warm-up's end is the decay's start
    assert s.at(12) == s.at(500) == pytest.approx(1e-5)
    middle = 2e-5  # both pass the mean of lr and final half-way
    assert s.at(7) == pytest.approx(middle)
    rates = [s.at(i) for i in range(2, 13)]
    assert all(a > b for a, b in zip(rates, rates[1:]))
    # linear falls evenly; cosine starts and ends flat
    first, last = rates[0] - rates[1], rates[-2] - rates[-1]
    if decay == "linear":
        assert first == pytest.approx(last)
    else:
        assert first == pytest.approx(1e-5 * (1 - math.cos(math.pi / 10)))
        assert first == pytest.approx(last) and first < rates[4] - rates[5]


def test_schedule_settings_fail_naming_the_key():
    with pytest.raises(ValueError, match="lr_decay_steps"):
        TrainerSpec(lr_decay="cosine")
    with pytest.raises(ValueError, match="lr_final: not read with lr_decay constant"):
        TrainerSpec(lr_final=1e-6)
    with pytest.raises(ValueError, match="lr_decay"):
        TrainerSpec(lr_decay="step")
    with pytest.raises(ValueError, match="lr_decay_steps"):
        LrSchedule(lr=1e-5, decay="linear")
    with pytest.raises(ValueError, match="lr_decay: 'exp'"):
        LrSchedule(lr=1e-5, decay="exp", decay_steps=3)
    spec = TrainerSpec(lr=3e-5, lr_warmup_steps=5, lr_decay="linear", lr_final=1e-5,
                       lr_decay_steps=100)
    assert spec.lr_decay_steps == 100

