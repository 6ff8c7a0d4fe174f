"""The evaluator's decisions without a broker or a model: which held-out tasks it scores
(a dataset's first ``size`` rows, else the synthetic eval split at its levels), and which
points of an earlier ``eval run --history`` curve it keeps (only those of the same run,
policy and ``every``; a missing or broken file starts afresh)."""

from __future__ import annotations

import json

import pytest

from astraflow.config.components import EvalSettings
from astraflow.eval.evaluator import _curve_so_far, held_out_tasks, write_curve
from astraflow.tasks.arithmetic import eval_problems, train_problems


def settings(**extra) -> EvalSettings:
    return EvalSettings(policy="actor", model="m", **extra)


def test_the_synthetic_held_out_tasks_are_the_eval_split_at_the_levels_asked():
    tasks = held_out_tasks(settings(size=30, levels="2,3"))
    assert len(tasks) == 30 and {t.level for t in tasks} <= {2, 3}
    assert tasks == eval_problems(levels=[2, 3], n=30)  # the fixed held-out sample
    trained_on = {p.prompt for p in train_problems((2, 3), n=2000)}
    assert not trained_on & {t.prompt for t in tasks}


def test_a_dataset_gives_its_first_size_rows_through_its_field_mapping(tmp_path):
    rows = [{"q": f"{i}+1=", "a": str(i + 1)} for i in range(10)]
    path = tmp_path / "held.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tasks = held_out_tasks(settings(size=4, dataset={
        "path": str(path), "prompt_field": "q", "answer_field": "a"}))
    assert [(t["prompt"], t["answer"]) for t in tasks] == [
        ("0+1=", "1"), ("1+1=", "2"), ("2+1=", "3"), ("3+1=", "4")]


def test_a_history_curve_resumes_only_for_the_same_run_policy_and_every(tmp_path):
    out = tmp_path / "curves" / "actor.json"
    write_curve(str(out), "r1", "actor", 5, [(0, 0.25), (5, 0.5)], png=False)
    assert json.loads(out.read_text())["curve"] == [{"version": 0, "accuracy": 0.25},
                                                    {"version": 5, "accuracy": 0.5}]
    assert not out.with_name(out.name + ".tmp").exists()  # replaced whole
    assert _curve_so_far(str(out), 5, "r1", "actor") == [(0, 0.25), (5, 0.5)]
    assert _curve_so_far(str(out), 10, "r1", "actor") == []  # other versions are due
    assert _curve_so_far(str(out), 5, "r2", "actor") == []
    assert _curve_so_far(str(out), 5, "r1", "critic") == []


@pytest.mark.parametrize("content", [None, "{not json", "[1, 2]"])
def test_a_missing_or_broken_curve_starts_afresh(tmp_path, content):
    out = tmp_path / "actor.json"
    if content is not None:
        out.write_text(content)
    assert _curve_so_far(str(out), 5, "r1", "actor") == []
