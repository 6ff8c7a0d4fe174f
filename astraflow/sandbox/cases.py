"""A function of untrusted code called on test inputs inside one sandboxed process
(``run_function``), and its outputs compared with expected values outside it
(``check_cases``): the expected values never enter the sandbox, so printing cannot fake a
pass."""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from astraflow.sandbox.runner import SandboxLimits, SandboxResult, run_sandboxed


# --- functions against test cases --------------------------------------------------------
@dataclass
class CaseResult:
    """One call of the function: ``ok`` with its JSON-normalised ``value``, or ``error``."""

    ok: bool
    value: Any = None
    error: str = ""


@dataclass
class FunctionRun:
    """Outcome of ``run_function``: the sandbox result and one entry per input (``None``
    where the process ended before that call finished)."""

    result: SandboxResult
    cases: list[CaseResult | None]


def normalise(value: Any) -> Any:
    """``value`` as it comes back from the sandbox (a JSON round trip: tuples become lists).
    Raises ``TypeError``/``ValueError`` for values JSON cannot hold."""
    return json.loads(json.dumps(value))


def run_function(
    code: str, func: str, inputs: Sequence[Sequence[Any]], **limits: Any
) -> FunctionRun:
    """Define ``code`` in one sandboxed process and call ``func(*args)`` for each of
    ``inputs`` (JSON-able argument lists) in order. Each call's return value comes back
    JSON-normalised; an exception is that call's ``error``. All calls share the limits of
    the process, so a call that exhausts them leaves the later ones ``None``. ``limits``:
    keyword arguments of ``run_python``."""
    payload = json.dumps([list(args) for args in inputs]).encode()
    nonce = secrets.token_hex(12)
    opts = dict(limits)
    lim = SandboxLimits(
        **{k: opts.pop(k) for k in list(opts) if k in SandboxLimits.__dataclass_fields__}
    )
    result = run_sandboxed(
        code,
        payload,
        "function",
        func,
        nonce,
        lim,
        opts.pop("namespaces", None),
        opts.pop("audit", True),
        opts.pop("python", None),
        opts.pop("drop_user", True),
    )
    if opts:
        raise TypeError(f"unknown sandbox options: {sorted(opts)}")
    cases: list[CaseResult | None] = [None] * len(inputs)
    user_lines = []
    for line in result.stdout.split("\n"):
        if not line.startswith(nonce + " "):
            user_lines.append(line)
            continue
        try:
            rec = json.loads(line[len(nonce) + 1 :])
            i, kind, value = rec
        except (ValueError, TypeError):
            continue
        if not isinstance(i, int) or not 0 <= i < len(cases):
            continue
        if kind == "ok":
            cases[i] = CaseResult(True, value)
        else:
            cases[i] = CaseResult(False, None, f"{kind}: {value}" if kind != "error" else value)
    result.stdout = "\n".join(user_lines).strip("\n")
    return FunctionRun(result, cases)


@dataclass
class CaseReport:
    """Outcome of ``check_cases``: ``passed[i]`` for each case."""

    passed: list[bool]
    run: FunctionRun

    @property
    def fraction(self) -> float:
        return sum(self.passed) / len(self.passed) if self.passed else 0.0

    @property
    def all_passed(self) -> bool:
        return bool(self.passed) and all(self.passed)


def check_cases(
    code: str, func: str, cases: Sequence[tuple[Sequence[Any], Any]], **limits: Any
) -> CaseReport:
    """Run ``func`` from ``code`` on each case's arguments in the sandbox; a case passes
    when the call returned a value equal to the expected one (both JSON-normalised, so a
    tuple equals a list). The expected values stay outside the sandbox."""
    run = run_function(code, func, [args for args, _ in cases], **limits)
    passed = []
    for (_, expected), got in zip(cases, run.cases):
        try:
            want = normalise(expected)
        except (TypeError, ValueError):
            passed.append(False)
            continue
        passed.append(got is not None and got.ok and got.value == want)
    return CaseReport(passed, run)
