"""An OpenEnv environment that poses an arithmetic problem and scores the answer.

Written against OpenEnv's server API (``openenv.core.env_server``: an ``Environment`` with
``reset``/``step``/``state``, served by ``create_app`` over HTTP and WebSocket), so the
``openenv`` workflow's client path runs against a real OpenEnv server with no container:
``reset(seed=...)`` draws the problem (``astraflow.tasks.arithmetic``'s generator: the
same seed, the same problem), the observation's ``prompt`` asks it; each ``step`` takes the
model's ``message``, and the episode ends at the first number given, or after
``MAX_TRIES`` messages without one (the observation then asks again). The reward is this
environment's own scorer, ``score``: 1 when the message's first number is the answer.

Serve it with ``uvicorn astraflow.envs.openenv_arith:app --port 8011`` (or let the
``openenv`` workflow start it in the node: ``app: astraflow.envs.openenv_arith:app``).
"""

from __future__ import annotations

import random
import re
from typing import Any
from uuid import uuid4

from openenv.core.env_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

MAX_TRIES = 2
_NUMBER = re.compile(r"-?\d+")


class ArithAction(Action):
    """The model's message."""

    message: str = Field(default="", description="the model's reply")


class ArithObservation(Observation):
    """What the model is shown: the problem, or a request to answer it with a number."""

    prompt: str = Field(default="", description="the text for the model")
    answer: str | None = Field(default=None, description="the reference, once done")


def problem(seed: int) -> tuple[str, str]:
    """``(question, answer)`` of ``seed``: a sum or difference of two numbers below 50."""
    rng = random.Random(seed)
    a, b = rng.randint(0, 49), rng.randint(0, 49)
    op = rng.choice("+-")
    return f"{a}{op}{b}=", str(a + b if op == "+" else a - b)


def score(message: str, answer: str) -> float:
    """This environment's scorer: 1.0 when ``message``'s first number is ``answer``."""
    m = _NUMBER.search(message)
    return 1.0 if m is not None and m.group() == answer else 0.0


class ArithEnvironment(Environment):
    """One episode: a problem from ``reset``'s seed, answered in at most ``MAX_TRIES``."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self.question, self.answer = problem(0)

    def reset(self, seed: int | None = None, episode_id: str | None = None,
              **kwargs: Any) -> ArithObservation:
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        self.question, self.answer = problem(seed if seed is not None else 0)
        return ArithObservation(prompt=self.question, done=False, reward=0.0)

    def step(self, action: ArithAction, timeout_s: float | None = None,
             **kwargs: Any) -> ArithObservation:
        self._state.step_count += 1
        answered = _NUMBER.search(action.message) is not None
        if answered or self._state.step_count >= MAX_TRIES:
            return ArithObservation(prompt="", done=True, answer=self.answer,
                                    reward=score(action.message, self.answer))
        return ArithObservation(prompt=f"Answer {self.question} with a number.", done=False,
                                reward=0.0)

    @property
    def state(self) -> State:
        return self._state


app = create_app(ArithEnvironment, ArithAction, ArithObservation, env_name="arith",
                 max_concurrent_envs=64)

