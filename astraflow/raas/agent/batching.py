"""Requests of concurrent episodes to one engine, served in arrival order, in batches.

The ``n`` episodes of a task (and the tasks of other workflows' calls) reach the endpoint
at about the same time, each with one prompt; an engine computes a batch of prompts in
little more time than one. ``Coalescer.generate`` queues its request and waits for its
answer; one generation loop per engine (a thread of the node's own) makes the ``generate``
calls: each call carries the oldest waiting request and every waiting request whose
sampling parameters equal its own (seeded requests keep each its own key). A request is
therefore never behind a call whose requests all arrived after it, and no caller serves
anyone else's requests. When fewer requests wait than episodes are open, the loop waits
``window_s`` for the others to arrive before a call.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

from astraflow.raas.engine import Engine, Generation, SamplingParams


@dataclass
class _Request:
    prompt: list[int]
    params: SamplingParams
    done: Future = field(default_factory=Future)

    @property
    def shares(self) -> str:
        """What a request must equal to share a call: its parameters but for the keys."""
        return repr(dataclasses.replace(self.params, keys=None))


class Coalescer:
    """One engine's request queue and generation loop (module docstring)."""

    def __init__(self, engine: Engine, window_s: float = 0.005):
        self.engine = engine
        self.window_s = window_s
        self._cond = threading.Condition()
        self._queue: deque[_Request] = deque()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.episodes = 0  # open episodes that use the engine: alone, one waits for none
        self.calls = 0  # generate calls made, and the prompts they carried
        self.prompts = 0

    def generate(self, prompt: list[int], params: SamplingParams) -> list[Generation]:
        """The ``params.n`` generations of ``prompt``, computed in a batch with the
        requests that share its call."""
        req = _Request(list(prompt), params)
        with self._cond:
            if self._closed:
                raise RuntimeError("the endpoint has stopped")
            self._queue.append(req)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, daemon=True,
                                                name="agent-generate")
                self._thread.start()
            self._cond.notify()
        return req.done.result()

    def close(self) -> None:
        """Stop the loop once the queue is empty."""
        with self._cond:
            self._closed = True
            self._cond.notify()

    def _next(self) -> list[_Request] | None:
        """The next call's requests (None: closed and nothing left)."""
        with self._cond:
            while not self._queue:
                if self._closed:
                    return None
                self._cond.wait()
        if self.episodes > 1 and len(self._queue) < self.episodes and self.window_s > 0:
            time.sleep(self.window_s)  # the other episodes' requests are on their way
        with self._cond:
            shares = self._queue[0].shares
            batch = [r for r in self._queue if r.shares == shares]
            self._queue = deque(r for r in self._queue if r.shares != shares)
        return batch

    def _loop(self) -> None:
        while (batch := self._next()) is not None:
            self._run(batch)

    def _run(self, reqs: list[_Request]) -> None:
        params = reqs[0].params
        if params.keys is not None:  # each request's own key, in prompt order
            params = dataclasses.replace(params, keys=tuple(k for r in reqs
                                                            for k in (r.params.keys or ("",))))
        try:
            out = self.engine.generate([r.prompt for r in reqs], params)
        except Exception as e:  # noqa: BLE001 - every request of the call hears of it
            for r in reqs:
                r.done.set_exception(e)
            return
        self.calls += 1
        self.prompts += len(reqs)
        for r, gens in zip(reqs, out):
            r.done.set_result(gens)


__all__ = ["Coalescer"]
