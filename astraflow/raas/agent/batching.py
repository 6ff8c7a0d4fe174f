"""Requests of concurrent episodes to one engine, sent as one ``generate`` call.

The ``n`` episodes of a task (and the tasks of other workflows' calls) reach the endpoint
at about the same time, each with one prompt; an engine computes a batch of prompts in
little more time than one. ``Coalescer.generate`` queues its request; the first caller
waits ``window_s`` for others (when other episodes are open), then takes everything
queued, groups the requests whose sampling parameters are equal (seeded requests keep
each its own key) and makes one ``generate`` call per group, while later requests queue
for the next round.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from concurrent.futures import Future

from astraflow.raas.engine import Engine, Generation, SamplingParams


class Coalescer:
    """One engine's request queue (module docstring)."""

    def __init__(self, engine: Engine, window_s: float = 0.005):
        self.engine = engine
        self.window_s = window_s
        self._lock = threading.Lock()
        self._queue: list[tuple[list[int], SamplingParams, Future]] = []
        self._leading = False
        self.episodes = 0  # open episodes that use the engine: alone, one waits for none
        self.calls = 0  # generate calls made, and the prompts they carried
        self.prompts = 0

    def generate(self, prompt: list[int], params: SamplingParams) -> list[Generation]:
        """The ``params.n`` generations of ``prompt``, computed in a batch with the
        requests queued beside it."""
        done: Future = Future()
        with self._lock:
            self._queue.append((prompt, params, done))
            lead = not self._leading
            self._leading = True
        if lead:
            if self.episodes > 1:
                time.sleep(self.window_s)
            while True:
                with self._lock:
                    batch, self._queue = self._queue, []
                    if not batch:
                        self._leading = False
                        break
                self._run(batch)
        return done.result()

    def _run(self, batch: list[tuple[list[int], SamplingParams, Future]]) -> None:
        groups: dict[str, list[tuple[list[int], SamplingParams, Future]]] = {}
        for req in batch:
            groups.setdefault(repr(dataclasses.replace(req[1], keys=None)), []).append(req)
        for reqs in groups.values():
            params = reqs[0][1]
            if params.keys is not None:  # each request's own key, in prompt order
                params = dataclasses.replace(params, keys=tuple(k for _, p, _ in reqs
                                                                for k in (p.keys or ("",))))
            try:
                out = self.engine.generate([p for p, _, _ in reqs], params)
            except Exception as e:  # noqa: BLE001 - every request of the call hears of it
                for _, _, f in reqs:
                    f.set_exception(e)
                continue
            self.calls += 1
            self.prompts += len(reqs)
            for (_, _, f), gens in zip(reqs, out):
                f.set_result(gens)


__all__ = ["Coalescer"]
