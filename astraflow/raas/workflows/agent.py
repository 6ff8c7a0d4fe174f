"""``agent``: any agent program as a rollout workflow (``astraflow.raas.agent``).

For each task the node runs ``n`` episodes of the user's program at once, each with the
task as the model is to be shown it and its own OpenAI base URL and key on the node's
endpoint; every request the program makes is answered by the node's engines (``model``:
the policy) and recorded token for token. The ``n`` episodes' sequences form the task's
``TrajectoryGroup``, trained like any other workflow's.

**Who decides the reward.** A command is untrusted by default: what it does is steered by
model output, so it gets only the payload keys named in ``show`` (``prompt``, ``messages``,
``tools``: never the reference answer, tests or hidden fields), and its episode's reward is
the workflow's ``reward`` on what the model sampled: the last assistant message the
endpoint returned. A reward the program prints, returns or posts is ignored (counted in
``agent/ignored_rewards``). With ``trusted: true`` the program is harness code the
topology vouches for: it gets the whole payload and ``ASTRAFLOW_REWARD_URL``, and the
reward it reports for its own episode wins (``{"reward": x}``, or ``{"rewards": {policy:
x}}`` for a program that drives several policies), else the workflow's reward function on
its ``answer``. A ``function`` program runs inside the node and is trusted by definition.

An episode that times out, crashes, makes a malformed call or one past the endpoint's
limits, makes no call or ends without a reward is run again, up to ``attempts`` times in
all; a task with an episode that still fails goes to the dead-letter topic with the
reasons, and the node goes on. The failures of attempts that were retried are counted in
the group's metrics (``agent/failed_attempts``, by kind).

Options (``astraflow.config.options.AgentOptions``, where each has its default):
``command`` (a list, or a string split as a shell would; ``python`` means the node's
interpreter) or ``function`` (``"package.module:function"``), ``timeout_s``,
``attempts``, ``reward`` (a reward spec of ``astraflow.tasks.rewards``; needed for an
untrusted program), ``trusted``, ``show`` (the payload keys an untrusted program
gets), ``limits`` (``{cpu_s, mem_mb, max_procs, network, isolate}`` for a command's jail),
``endpoint`` (``EndpointLimits``), ``resume`` (``replay``: with an ``episodes`` topic,
every call is logged and a task taken over from a node that died replays its episodes'
calls, ``astraflow.raas.agent.journal``; ``restart``: they start again),
``env`` (more environment for a command), and the
sampling options every workflow takes, the defaults of a request that sets none
(``max_new_tokens``, ``temperature``, ``top_p``, ``seed``).
"""

from __future__ import annotations

import logging
import statistics
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from astraflow.config.options import AgentOptions, RequestSamplingOptions
from astraflow.raas.agent.journal import EpisodeJournal, EpisodeLog
from astraflow.raas.agent.program import AgentProgram, Outcome
from astraflow.raas.agent.server import AgentServer, EndpointLimits, Episode
from astraflow.raas.engine import Engine
from astraflow.raas.workflows.base import Checker, TaskError
from astraflow.raas.workflows.episodes import shorten
from astraflow.raas.workflows.inputs import parse_payload
from astraflow.raas.workflows.registry import register_workflow
from astraflow.raas.workflows.scoring import Scorer
from astraflow.wire.records import EpisodeCall, Sequence, Task

log = logging.getLogger("astraflow.raas.agent")

FAILURE_KINDS = ("timeout", "exit", "malformed", "no_request", "no_reward", "other")


@register_workflow("agent")
class AgentWorkflow:
    """See the module docstring."""

    name = "agent"

    Options = AgentOptions

    def __init__(self, options: AgentOptions, checker: Checker | None = None):
        self.options = options
        self.resume = options.resume
        self.journal: EpisodeJournal | None = None  # attach() opens it
        self.program = AgentProgram.from_options(options.command, options.function,
                                                 options.limits, options.env)
        self.program.resolve()  # a function that does not import fails at start
        # a function is the node's own code
        self.trusted = options.trusted or options.function is not None
        self.show = tuple(options.show)
        self.timeout_s = options.timeout_s
        self.attempts = options.attempts
        self.score = (Scorer(options.reward, checker)
                      if options.reward is not None or checker else None)
        if not self.trusted and self.score is None:
            raise ValueError("agent reward: an untrusted program's episodes are scored by the "
                             "workflow's reward; set reward: (e.g. exact_match), or trusted: "
                             "true for a program whose own reward is to be used")
        self.endpoint = EndpointLimits.from_options(options.endpoint)
        self.defaults = RequestSamplingOptions.of(options)
        self._server: AgentServer | None = None
        self._server_lock = threading.Lock()

    @property
    def server(self) -> AgentServer:
        """The node's endpoint, started on first use (by one of a task's episodes, which
        start together: one endpoint for all of them)."""
        with self._server_lock:
            if self._server is None:
                self._server = AgentServer(limits=self.endpoint)
            return self._server

    def attach(self, journal: EpisodeJournal | None, raas_id: str) -> None:
        """The node's ``episodes`` journal (None: its topology has no such topic): with
        ``resume: replay`` every call is logged there and a task taken over replays its
        episodes (``astraflow.raas.agent.journal``)."""
        if self.resume != "replay":
            return
        if journal is None:
            log.warning("%s: the topology has no `episodes` topic: an agent task taken over "
                        "from a node that died starts its episodes again (add topics.episodes "
                        "to replay them; resume: restart says this is meant)", raas_id)
        self.journal = journal

    def run(self, task: Task, engines: dict[str, Engine], n: int) -> list[Sequence]:
        payload = parse_payload(task)
        logged = self.journal.logged(task.task_id) if self.journal is not None else {}
        with ThreadPoolExecutor(n, thread_name_prefix="agent") as pool:
            done = list(pool.map(
                lambda j: self._episode(payload, engines, j, task.task_id, logged), range(n)))
        if self.journal is not None:  # made or failed: its calls are not needed again
            self.journal.end(task.task_id)
        failed = [reasons for seqs, reasons in done if seqs is None]
        if failed:
            raise TaskError(f"agent: {len(failed)} of {n} episodes failed after "
                            f"{self.attempts} attempt(s): " + " | ".join(failed[0]))
        return [s for episode, _ in done for s in (episode or [])]

    def group_metrics(self, seqs: list[Sequence]) -> dict[str, float]:
        """A task's figures, from its sequences' ``meta`` (the node puts them in its
        group): attempts that failed before their episode succeeded, by kind; sequences
        per episode; requests stitched into a sequence."""
        episodes = {s.sample_index: s.meta for s in seqs}
        reasons = [r for m in episodes.values()
                   for r in (m.get("agent_failures") or "").split(" | ") if r]
        turns = [float(s.meta.get("turns", "1")) for s in seqs]
        return {"agent/failed_attempts": float(sum(int(m.get("episode_attempt", "0"))
                                                   for m in episodes.values())),
                "agent/ignored_rewards": float(sum(m.get("ignored_reward") == "1"
                                                   for m in episodes.values())),
                **{f"agent/{k}": float(sum(int(m.get(k, "0")) for m in episodes.values()))
                   for k in ("replayed_calls", "replayed_tokens", "replays_diverged")},
                **{f"agent/failed/{k}": float(sum(_kind(r) == k for r in reasons))
                   for k in FAILURE_KINDS},
                "agent/sequences_per_episode": len(seqs) / max(len(episodes), 1),
                "agent/turns_per_sequence": statistics.fmean(turns) if turns else 0.0}

    def _episode(self, payload: dict[str, Any], engines: dict[str, Engine], j: int,
                 task_id: str, logged: dict[str, list[EpisodeCall]] | None = None,
                 ) -> tuple[list[Sequence] | None, list[str]]:
        """Sample ``j``: its sequences (None when every attempt failed) and the reasons of
        the attempts that failed."""
        reasons: list[str] = []
        server = self.server
        shown = payload if self.trusted else {k: payload[k] for k in self.show if k in payload}
        for attempt in range(self.attempts):
            ep = server.open(engines, j, self.defaults, key=f"{task_id}:{j}:{attempt}",
                             keyed=self.program.command is not None, trusted=self.trusted)
            if self.journal is not None:  # the episode's stable identity across nodes
                name = f"{task_id}/{j}/{attempt}"
                ep.log = EpisodeLog(self.journal, name, task_id,
                                    replay=list((logged or {}).get(name, [])))
            try:
                outcome = self.program.run(shown, server.access(ep), self.timeout_s)
            finally:
                server.close(ep)
            reward, reason = self._ended(ep, outcome, payload)
            if reason is None:
                meta = {"episode_attempt": str(attempt),
                        "episode_requests": str(ep.trajectory.stats.requests)}
                if ep.log is not None and (ep.log.replayed_calls or ep.log.diverged):
                    meta.update(replayed_calls=str(ep.log.replayed_calls),
                                replayed_tokens=str(ep.log.replayed_tokens),
                                replays_diverged=str(int(ep.log.diverged)))
                if not self.trusted and _reports_reward(outcome.result):
                    meta["ignored_reward"] = "1"
                if reasons:  # each reason cut short: a meta value stays small
                    meta["agent_failures"] = " | ".join(shorten(r) for r in reasons)
                return ep.trajectory.build(reward, meta), reasons
            reasons.append(f"attempt {attempt + 1}: {reason}")
        return None, reasons

    def _ended(self, ep: Episode, outcome: Outcome,
               payload: dict[str, Any]) -> tuple[Any, str | None]:
        """``(reward, None)``, or ``(None, why the episode failed)``."""
        if ep.failure is not None:
            return None, ep.failure
        if outcome.error is not None:
            return None, outcome.error
        if not ep.trajectory.sequences:
            return None, "no_request: the program made no call to the endpoint"
        if not self.trusted:  # what the model sampled, scored by the workflow alone
            assert self.score is not None
            return self.score(ep.last_answer, payload), None
        result = outcome.result
        if isinstance(result, dict) and isinstance(result.get("rewards"), dict):
            return {str(k): float(v) for k, v in result["rewards"].items()}, None
        if isinstance(result, dict) and isinstance(result.get("reward"), int | float):
            return float(result["reward"]), None
        if isinstance(result, int | float) and not isinstance(result, bool):
            return float(result), None
        if ep.reward is not None:
            return ep.reward, None
        if self.score is not None:
            answer = result.get("answer") if isinstance(result, dict) else None
            return self.score(str(answer if answer is not None else ep.last_answer),
                              payload), None
        return None, ("no_reward: the program returned no reward, posted none, and the "
                      "workflow has no reward function")


def _reports_reward(result: Any) -> bool:
    """Whether a program's result claims a reward (ignored unless it is trusted)."""
    if isinstance(result, dict):
        return "reward" in result or "rewards" in result
    return isinstance(result, int | float) and not isinstance(result, bool)


def _kind(reason: str) -> str:
    """The kind of a failure reason (``FAILURE_KINDS``)."""
    text = reason.split(": ", 1)[-1]
    for prefix, kind in (("timeout", "timeout"), ("exit code", "exit"),
                         ("malformed", "malformed"), ("no_request", "no_request"),
                         ("no_reward", "no_reward")):
        if text.startswith(prefix):
            return kind
    return "other"


__all__ = ["AgentWorkflow"]
