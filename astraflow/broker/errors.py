"""The embedded broker's error: what a user can fix, said in one line."""

from __future__ import annotations


class BrokerError(RuntimeError):
    """The embedded broker cannot be assembled, started or reached."""


__all__ = ["BrokerError"]
