"""The thread pipeline every encoder and decoder runs its segments through: an ordered map
with a bounded number of segments in flight, and its default thread count.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any


def default_threads() -> int:
    """``min(4, cpu count)``."""
    return max(1, min(4, os.cpu_count() or 1))


def _pipeline(items: Iterable[Any], fn: Callable[[Any], Any], threads: int) -> Iterator[Any]:
    """Ordered map with at most ``4 * threads`` items in flight (inline when threads == 1)."""
    if threads <= 1:
        for it in items:
            yield fn(it)
        return
    window = 4 * threads
    with ThreadPoolExecutor(threads, thread_name_prefix="astraflow-weights") as ex:
        q: deque = deque()
        try:
            for it in items:
                q.append(ex.submit(fn, it))
                if len(q) >= window:
                    yield q.popleft().result()
            while q:
                yield q.popleft().result()
        finally:
            for f in q:
                f.cancel()


__all__ = [
    "default_threads",
]
