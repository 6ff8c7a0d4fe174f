"""Task sources: synthetic arithmetic, local datasets, and the math answer checker.

Every task is a JSON payload with at least ``prompt``, ``answer`` and ``level`` (0 for
dataset tasks); ``make_task`` wraps a payload into an ``astraflow.wire.records.Task``.
"""

from astraflow.tasks.arithmetic import (
    LEVELS,
    ArithProblem,
    arithmetic_problems,
    carry_slip_answer,
    eval_problems,
    generate_problem,
    split_of,
    train_problems,
    with_carry_slips,
)
from astraflow.tasks.base import make_task, payload_of, prompt_id, task_from_payload
from astraflow.tasks.check import check_answer, extract_final_number, normalize_answer
from astraflow.tasks.datasets import load_dataset_file

__all__ = [
    "LEVELS",
    "ArithProblem",
    "arithmetic_problems",
    "carry_slip_answer",
    "check_answer",
    "eval_problems",
    "extract_final_number",
    "generate_problem",
    "load_dataset_file",
    "make_task",
    "normalize_answer",
    "payload_of",
    "prompt_id",
    "split_of",
    "task_from_payload",
    "train_problems",
    "with_carry_slips",
]
