"""Episodes on the node's agent endpoint for workflows whose harness runs in the node.

An environment from an ecosystem (a verifiers environment, an OpenEnv client) is trusted
harness code: it runs in the node's process and drives the policy through the OpenAI API.
``EpisodeEndpoint`` gives it what the ``agent`` workflow gives a ``function`` program: one
endpoint (``AgentServer``) started on first use, and per episode a base URL whose every
call is recorded token for token (``Episode.trajectory``); ``episode()`` opens one and
closes it however the harness ends.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from astraflow.config.options import AgentEndpointOptions, SamplingOptions
from astraflow.raas.agent.program import API_KEY, Access
from astraflow.raas.agent.server import AgentServer, EndpointLimits, Episode
from astraflow.raas.engine import Engine
from astraflow.raas.workflows.base import TaskError
from astraflow.wire.records import Sequence


class EpisodeEndpoint:
    """The node's agent endpoint for an in-process harness (module docstring)."""

    def __init__(self, limits: AgentEndpointOptions | None = None):
        self.limits = EndpointLimits.from_options(limits)
        self._server: AgentServer | None = None
        self._lock = threading.Lock()
        # the in-process harness's openai client logs each request at INFO (httpx2): one
        # line per call of every episode would drown the node's own log
        for name in ("httpx", "httpx2"):
            logging.getLogger(name).setLevel(logging.WARNING)

    @property
    def server(self) -> AgentServer:
        """The endpoint, started on first use (one for all of a node's episodes)."""
        with self._lock:
            if self._server is None:
                self._server = AgentServer(limits=self.limits)
            return self._server

    @contextmanager
    def episode(self, engines: dict[str, Engine], sample_index: int,
                defaults: SamplingOptions, key: str) -> Iterator[tuple[Episode, Access]]:
        """An open episode of sample ``sample_index`` and how to reach it (its key the
        placeholder the ``openai`` client insists on: an in-process harness needs none);
        closed on exit. ``defaults``: the sampling defaults of a request that sets none;
        ``key``: what seeds its requests (task, sample, attempt)."""
        server = self.server
        ep = server.open(engines, sample_index, defaults, key=key, keyed=False,
                         trusted=True)
        try:
            access = server.access(ep)
            yield ep, Access(access.base_url, access.key or API_KEY, access.reward_url)
        finally:
            server.close(ep)


def shorten(reason: str, n: int = 240) -> str:
    """``reason`` in about ``n`` characters: its start (its kind) and its end (where a
    traceback names the error)."""
    if len(reason) <= n:
        return reason
    return reason[:n // 3] + " ... " + reason[-(n - n // 3 - 5):]


class GroupFailed(Exception):
    """One attempt at a task's group failed (the reason)."""


def with_attempts(workflow: str, attempts: int,
                  run: Callable[[int], list[Sequence]]) -> list[Sequence]:
    """``run(attempt)`` until one attempt makes the group (``GroupFailed`` is a failed
    one), at most ``attempts`` times; the group's sequences say which attempt made them
    and why the ones before failed. ``TaskError`` with every reason when none did."""
    reasons: list[str] = []
    for attempt in range(attempts):
        try:
            seqs = run(attempt)
        except GroupFailed as e:
            reasons.append(f"attempt {attempt + 1}: {e}")
            continue
        for s in seqs:
            s.meta["episode_attempt"] = str(attempt)
            if reasons:
                s.meta["agent_failures"] = " | ".join(shorten(r) for r in reasons)
        return seqs
    raise TaskError(f"{workflow}: the group failed after {attempts} attempt(s): "
                    + " | ".join(shorten(r) for r in reasons))


__all__ = ["EpisodeEndpoint", "GroupFailed", "shorten", "with_attempts"]
