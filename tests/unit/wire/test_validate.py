"""Semantic checks of decoded records (no broker): what makes a record senseless."""

from __future__ import annotations

import dataclasses

import pytest

from astraflow.wire.records import Batch, Sequence, Task, TrajectoryGroup
from astraflow.wire.validate import (
    InvalidRecord,
    batch_problem,
    check_record,
    group_problem,
    sequence_problem,
    task_problem,
)


def seq(**kw) -> Sequence:
    base = dict(policy="actor", token_ids=[5, 6, 7, 8], loss_mask=[0, 0, 1, 1],
                logprobs=[0.0, 0.0, -0.5, -1.25], versions=[-1, -1, 3, 3], reward=1.0,
                sample_index=0, finish_reason="stop")
    return Sequence(**{**base, **kw})


def group(*seqs: Sequence, rewards=None) -> TrajectoryGroup:
    seqs = seqs or (seq(), seq(sample_index=1, reward=0.0))
    return TrajectoryGroup(group_id="g", prompt_id="p", task_id="t", workflow="single_turn",
                           source="s", raas_id="r", pool="local", sequences=list(seqs),
                           rewards=[s.reward for s in seqs] if rewards is None else rewards)


def test_sensible_records_pass():
    batch = Batch(policy="actor", batch_id="b", groups=[group()])
    task = Task(task_id="t", prompt_id="p", workflow="single_turn", payload="{}", source="s")
    # no finder names a problem, so check_record lets each through
    assert [sequence_problem(seq()), group_problem(group()), batch_problem(batch),
            task_problem(task)] == [None, None, None, None]
    for record in (seq(), group(), batch, task):
        assert check_record(record) is None


@pytest.mark.parametrize("record, reason", [
    (seq(logprobs=[0.0, -1.0]), "logprobs (2) and versions (4) differ in length"),
    (seq(token_ids=[], loss_mask=[], logprobs=[], versions=[]), "no token ids"),
    (seq(reward=float("nan")), "reward is nan"),
    (seq(reward=float("inf")), "reward is inf"),
    (seq(token_ids=[5, -6, 7, 8]), "a negative token id"),
    (seq(loss_mask=[0, 0, 2, 1]), "loss_mask values other than 0 and 1"),
    (seq(logprobs=[0.0, 0.0, 0.5, -1.0]), "not finite or is above 0"),
    (seq(logprobs=[0.0, 0.0, float("nan"), -1.0]), "not finite or is above 0"),
    (seq(versions=[-1, -2, 3, 3]), "a version below -1"),
    (seq(versions=[-1, -1, -1, 3]), "a trained token (loss_mask 1) without the version"),
    (group(rewards=[1.0]), "1 rewards for 2 sequences"),
    (group(seq(), rewards=[float("nan")]), "a reward that is not finite"),
    (dataclasses.replace(group(), sequences=[], rewards=[]), "an empty group"),
    (group(seq(), seq(versions=[0])), "sequence 1: token_ids (4)"),
    (Batch(policy="actor", batch_id="b", groups=[]), "an empty batch"),
    (Batch(policy="actor", batch_id="b", groups=[group(rewards=[1.0, 2.0, 3.0])]),
     "group g: 3 rewards for 2 sequences"),
    (Task(task_id="", prompt_id="p", workflow="single_turn", payload="{}", source="s"),
     "a task needs a task_id"),
])
def test_senseless_records_are_refused_with_the_reason(record, reason):
    with pytest.raises(InvalidRecord, match=f"^{type(record).__name__}: .*") as e:
        check_record(record)
    assert reason in str(e.value)
