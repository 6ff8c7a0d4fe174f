"""The error of a model that cannot be found, loaded or made."""

from __future__ import annotations

from astraflow.errors import AstraflowError


class ModelError(AstraflowError, RuntimeError):
    """A model directory that is missing, incomplete or unloadable (said in one line)."""


def one_line(e: BaseException) -> str:
    """The first non-empty line of an exception's message (library errors run to pages)."""
    lines = [s.strip() for s in str(e).splitlines() if s.strip()]
    return lines[0] if lines else type(e).__name__


__all__ = ["ModelError", "one_line"]
