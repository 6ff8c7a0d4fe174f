"""A component's graceful stop: SIGTERM or SIGINT asks its loop to finish what it holds
(the open transaction, the current step or task) and leave, rather than die mid-write."""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable


def stop_on_signals(stop: Callable[[], None], log: logging.Logger, doing: str) -> None:
    """On SIGTERM or SIGINT, log what the component still does (``doing``) and ``stop()``."""

    def on_signal(signum, _frame):
        log.info("signal %d: %s", signum, doing)
        stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
