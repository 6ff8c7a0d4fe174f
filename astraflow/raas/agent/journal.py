"""An agent episode's durable log: every call, as answered, on the ``episodes`` topic.

Agent episodes are long; a node that dies mid-episode would otherwise leave its task to be
rolled out again from the start, every token sampled anew. So before a call's answer
returns to the program, the endpoint appends the call (``EpisodeCall``: the request's
digest, the prompt, the tokens sampled with their log-probs and versions, the answer as
sent) to the retained ``episodes`` topic, with the idempotent producer and full
acknowledgement, outside the node's task transaction (which a kill aborts). Records are
keyed by task, so a task's calls and its end stay in order on one partition.

A node that takes the task over (its consumer group redelivers it) reads the topic
(``EpisodeJournal.logged``, caught up to the moment of asking) and starts each episode's
program again with the episode's calls to replay (``EpisodeLog``): a call whose request
equals the next logged one gets the logged answer and the logged tokens are recorded, as
first sampled; the first call that differs ends the replay (the program is not
deterministic given the same answers) and the episode goes on live from there. When a
task's group has been made, an ``end`` record lets every reader forget its episodes.

Every node reads every call of the topic (only when a task starts, from where it left
off), and keeps the calls of episodes not yet ended in memory.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from astraflow.kafka.clients import RecordProducer
from astraflow.kafka.config import KafkaConfig
from astraflow.kafka.table import TopicReader
from astraflow.raas.engine import Generation
from astraflow.wire.records import EpisodeCall

log = logging.getLogger("astraflow.raas.agent")

LOGGED_ROUTES = ("v1/chat/completions", "v1/completions")


def request_digest(route: str, body: Mapping[str, Any]) -> str:
    """The sha256 of a request: its route and body as canonical JSON."""
    text = json.dumps({"route": route, "body": body}, sort_keys=True, separators=(",", ":"),
                      default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def generations(call: EpisodeCall) -> list[Generation]:
    """The choices of a logged call, as the engine gave them."""
    return [Generation(prompt_ids=list(call.prompt_ids), token_ids=list(t), logprobs=list(lp),
                       finish_reason=fr, versions=list(v))
            for t, lp, fr, v in zip(call.token_ids, call.logprobs, call.finish_reasons,
                                    call.versions)]


def fold(open_calls: dict[str, list[EpisodeCall]], rec: EpisodeCall | None) -> None:
    """One record into the calls of open episodes: an ``end`` forgets its task's episodes;
    a call at index k replaces the episode's calls from k on (a run that went on live
    after a replay diverged wrote them anew)."""
    if rec is None:
        return
    if rec.kind == "end":
        for k in [k for k, calls in open_calls.items() if calls and calls[0].task_id
                  == rec.task_id]:
            del open_calls[k]
        return
    calls = open_calls.setdefault(rec.episode, [])
    if rec.index <= len(calls):
        calls[rec.index:] = [rec]
    else:  # a gap: an earlier call was never logged, so none after it can be replayed
        log.warning("episodes: call %d of %s without call %d; ignored", rec.index, rec.episode,
                    len(calls))


class EpisodeJournal:
    """The ``episodes`` topic of one node: appending calls, reading the open episodes."""

    def __init__(self, config: KafkaConfig, topic: str, raas_id: str):
        self.config = config
        self.topic = topic
        self.raas_id = raas_id
        # idempotent, acks=all (the project's producer settings), sent at once
        self._producer = RecordProducer(config, **{"linger.ms": 0})
        self._reader: TopicReader[EpisodeCall] | None = None
        self._open: dict[str, list[EpisodeCall]] = {}
        self._lock = threading.Lock()

    def logged(self, task_id: str) -> dict[str, list[EpisodeCall]]:
        """The logged calls of ``task_id``'s open episodes (by any node), by episode, with
        every record written before this call was made read."""
        with self._lock:
            if self._reader is None:
                self._reader = TopicReader(self.config, self.topic, EpisodeCall,
                                           codec=self._producer.codec,
                                           client_id=f"episodes-{self.raas_id}")
            else:
                self._reader.retarget()
            for entry in self._reader.catch_up():
                fold(self._open, entry.value)
            return {k: list(v) for k, v in self._open.items()
                    if v and v[0].task_id == task_id}

    def append(self, rec: EpisodeCall) -> None:
        """Write ``rec`` and wait until the broker has it (raises when it cannot)."""
        self._producer.produce(self.topic, rec, key=rec.task_id)
        self._producer.flush()

    def end(self, task_id: str) -> None:
        """``task_id``'s episodes are over: no reader needs their calls again."""
        self.append(EpisodeCall(episode="", task_id=task_id, kind="end", index=0,
                                raas_id=self.raas_id))

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()


@dataclass
class EpisodeLog:
    """One episode's side of the journal: what it replays, and what it appends."""

    journal: EpisodeJournal
    episode: str
    task_id: str
    replay: list[EpisodeCall] = field(default_factory=list)
    index: int = 0  # the next call's place in the episode
    replayed_calls: int = 0
    replayed_tokens: int = 0
    diverged: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self, route: str, body: Mapping[str, Any]) -> EpisodeCall | None:
        """The logged answer of this request, when it is the next logged call; else None
        (from a request that differs on, the replay is over)."""
        with self.lock:
            if self.index >= len(self.replay):
                return None
            logged = self.replay[self.index]
            if logged.route != route or logged.request_sha256 != request_digest(route, body):
                self.diverged = True
                del self.replay[self.index:]
                return None
            self.index += 1
            self.replayed_calls += 1
            self.replayed_tokens += sum(len(t) for t in logged.token_ids)
            return logged

    def append(self, route: str, body: Mapping[str, Any], policy: str, prompt: list[int],
               gens: list[Generation], answer: Mapping[str, Any]) -> None:
        """Log a call answered live, before its answer goes back."""
        with self.lock:
            index, self.index = self.index, self.index + 1
        self.journal.append(EpisodeCall(
            episode=self.episode, task_id=self.task_id, kind="call", index=index,
            route=route, request_sha256=request_digest(route, body), policy=policy,
            prompt_ids=list(prompt), token_ids=[list(g.token_ids) for g in gens],
            logprobs=[list(g.logprobs) for g in gens],
            versions=[list(g.versions) for g in gens],
            finish_reasons=[g.finish_reason for g in gens],
            response=json.dumps(answer), raas_id=self.journal.raas_id))


__all__ = ["LOGGED_ROUTES", "EpisodeJournal", "EpisodeLog", "fold", "generations",
           "request_digest"]
