"""Test doubles shared by the unit tests: a scripted engine for the workflows, a consumed
record for the transactional loop."""

from __future__ import annotations

from confluent_kafka import KafkaError

from astraflow.raas.engine import Generation


class ScriptedEngine:
    """An Engine whose 'model' replies with scripted texts (one character per token).

    Each prompt gets ``params.n`` replies from ``next_reply`` (by default the front of
    ``replies``). A reply finishes with ``"stop"`` when it holds one of ``params.stop``,
    else ``"length"``. ``prompts`` records every prompt (decoded), ``calls`` the prompt ids
    of each ``generate`` call.
    """

    def __init__(self, policy: str = "actor", replies: list[str] = (), version: int = 0):
        self.policy = policy
        self.replies = list(replies)
        self.version = version
        self.prompts: list[str] = []
        self.calls: list[list[list[int]]] = []

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)

    @property
    def eos_token_id(self) -> int | None:
        return None

    def load_state_dict(self, state, version: int) -> None:
        self.version = version

    def next_reply(self, prompt: str, params) -> str:
        return self.replies.pop(0)

    def generate(self, prompts, params):
        self.calls.append([list(p) for p in prompts])
        out = []
        for p in prompts:
            text = self.decode(p)
            self.prompts.append(text)
            samples = []
            for _ in range(params.n):
                reply = self.next_reply(text, params)
                ids = self.encode(reply)
                stop = any(s in reply for s in params.stop)
                samples.append(
                    Generation(
                        list(p),
                        ids,
                        [-0.5] * len(ids),
                        "stop" if stop else "length",
                        [self.version] * len(ids),
                    )
                )
            out.append(samples)
        return out


class Msg:
    """A consumed record as the loop reads it: where it sits, and its error if any."""

    def __init__(self, topic: str, partition: int, offset: int,
                 error: KafkaError | None = None) -> None:
        self._where, self._error = (topic, partition, offset), error

    def error(self) -> KafkaError | None:
        return self._error

    def topic(self) -> str:
        return self._where[0]

    def partition(self) -> int:
        return self._where[1]

    def offset(self) -> int:
        return self._where[2]
