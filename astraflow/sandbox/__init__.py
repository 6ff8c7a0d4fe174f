"""Run untrusted Python code in a separate, limited process.

``runner``: ``run_python`` and the layers it enforces (the module docstring says which and
what is not enforced); ``child``: what the sandboxed interpreter runs first; ``cases``:
``run_function`` / ``check_cases``, a function of the code called on test inputs.
"""

from astraflow.sandbox.cases import (
    CaseReport,
    CaseResult,
    FunctionRun,
    check_cases,
    normalise,
    run_function,
)
from astraflow.sandbox.runner import (
    STATUSES,
    SandboxError,
    SandboxLimits,
    SandboxResult,
    interpreter_and_user,
    namespace_prefix,
    run_python,
)

__all__ = [
    "STATUSES",
    "CaseReport",
    "CaseResult",
    "FunctionRun",
    "SandboxError",
    "SandboxLimits",
    "SandboxResult",
    "check_cases",
    "interpreter_and_user",
    "namespace_prefix",
    "normalise",
    "run_function",
    "run_python",
]
