"""``verifiers``: a verifiers environment's own rollout and rubric as a rollout workflow.

The node loads the environment its options name (``environment``: an installed
environment's id or ``package.module:function``; ``args``: its arguments;
``astraflow.tasks.verifiers_data``) once, and for each task runs the environment's own
``rollout`` ``n`` times at once, each against an episode of the node's agent endpoint
(``episodes.EpisodeEndpoint``): single-turn, multi-turn and tool environments alike speak
the OpenAI chat API to it, and every call is recorded token for token. The environment's
rubric then scores the ``n`` states as a group (``score_group``: its group-level reward
functions see the whole group) and each episode's reward is the rubric's ``reward``; its
per-function scores are kept in the sequences' meta and averaged in the group's metrics
(``verifiers/<function>``).

The task's payload comes from the feeder's ``verifiers:ENV:SPLIT`` dataset and picks a row
of the environment's dataset; the environment is the one these options name (a payload of
another environment is dead-lettered): what runs in the node is decided by its topology,
never by a record. The environment is trusted harness code, as a ``function`` agent program
is: it runs in the node's process.

A group whose rollout raises, times out (``timeout_s``), ends with an error in its state
or makes a malformed call is run again, up to ``attempts`` times in all; then the task goes
to the dead-letter topic with the reasons. An error the model's own output caused (an empty
or invalid response, a tool call that does not parse or fails where the environment stops
on it) is no failure: the episode is scored as the model left it
(``verifiers/model_errors``: the share of such episodes).

Options (``astraflow.config.options.VerifiersOptions``, where each has its default):
``environment``, ``args``, ``timeout_s``, ``attempts``, ``endpoint`` (``EndpointLimits``),
and the sampling defaults of a request that sets none
(``max_new_tokens``, ``temperature``, ``top_p``, ``seed``). The environment's own
``sampling_args`` are sent with each request (but ``n``: one choice per rollout).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import threading
from contextlib import ExitStack
from typing import Any

from astraflow.config.options import RequestSamplingOptions, VerifiersOptions
from astraflow.raas.engine import Engine
from astraflow.raas.workflows.base import TaskError
from astraflow.raas.workflows.episodes import EpisodeEndpoint, GroupFailed, with_attempts
from astraflow.raas.workflows.inputs import parse_payload, pick_engine
from astraflow.raas.workflows.registry import register_workflow
from astraflow.tasks.verifiers_data import PREFIX, VerifiersError, load_environment, row_input
from astraflow.wire.records import Sequence, Task

METRIC_META = "vf_metric:"  # a sequence meta key holding one rubric function's score
# a sequence meta key naming the error the model's output ended its episode with
MODEL_ERROR_META = "vf_model_error"


@register_workflow("verifiers")
class VerifiersWorkflow:
    """See the module docstring."""

    name = "verifiers"

    Options = VerifiersOptions

    def __init__(self, options: VerifiersOptions):
        self.options = options
        self.environment = options.environment
        self.args = dict(options.args or {})
        self.env = load_environment(self.environment, self.args)  # fails at start, not per task
        self.timeout_s = options.timeout_s
        self.attempts = options.attempts
        self.endpoint = EpisodeEndpoint(options.endpoint)
        self.defaults = RequestSamplingOptions.of(options)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_lock = threading.Lock()

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        """The one event loop every rollout of this environment runs on, in a thread of its
        own: an environment may keep async clients (a judge's, a sandbox's) made on its
        first loop, which a fresh loop per task could not use."""
        with self._loop_lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                threading.Thread(target=self._loop.run_forever, daemon=True,
                                 name="verifiers-loop").start()
            return self._loop

    def run(self, task: Task, engines: dict[str, Engine], n: int) -> list[Sequence]:
        payload = parse_payload(task)
        ref = payload.get(PREFIX)
        if not isinstance(ref, dict):
            raise TaskError(f"verifiers: the payload names no row ({PREFIX!r}: feed a "
                            f"{PREFIX}:ENV:SPLIT dataset)")
        if ref.get("env") != self.environment or dict(ref.get("args") or {}) != self.args:
            raise TaskError(f"verifiers: the task is a row of {ref.get('env')!r} "
                            f"{ref.get('args') or {}}, this node runs {self.environment!r} "
                            f"{self.args}")
        try:
            row = row_input(self.env, ref)
        except VerifiersError as e:
            raise TaskError(str(e)) from None
        engine = pick_engine(task, engines)
        return with_attempts("verifiers", self.attempts, lambda attempt: (
            asyncio.run_coroutine_threadsafe(
                self._group(row, engines, engine.policy, n, f"{task.task_id}:{attempt}"),
                self._event_loop()).result()))

    async def _group(self, row: dict[str, Any], engines: dict[str, Engine], policy: str,
                     n: int, key: str) -> list[Sequence]:
        """One attempt at the task's ``n`` rollouts, scored as a group."""
        from openai import AsyncOpenAI
        from verifiers.clients import OpenAIChatCompletionsClient

        sampling = {k: v for k, v in dict(self.env.sampling_args or {}).items() if k != "n"}
        if not sampling.get("extra_body"):
            sampling.pop("extra_body", None)
        with ExitStack() as stack:
            opened = [stack.enter_context(self.endpoint.episode(engines, j, self.defaults,
                                                                f"{key}:{j}"))
                      for j in range(n)]
            clients = [AsyncOpenAI(base_url=access.base_url, api_key=access.key,
                                   max_retries=0, timeout=self.timeout_s)
                       for _, access in opened]
            try:
                states = await asyncio.wait_for(asyncio.gather(*(
                    self.env.rollout(json.loads(json.dumps(row, default=str)),
                                     OpenAIChatCompletionsClient(c), policy, dict(sampling))
                    for c in clients)), self.timeout_s)
                for (ep, _), state in zip(opened, states):
                    why = _episode_failure(ep, state)
                    if why is not None:
                        raise GroupFailed(why)
                await self.env.rubric.score_group(states)
            except TimeoutError:
                raise GroupFailed(f"timeout: the group ran past {self.timeout_s:g} s") from None
            except GroupFailed:
                raise
            except Exception as e:  # the environment's own code failed
                raise GroupFailed(f"{type(e).__name__}: {e}") from e
            finally:
                for c in clients:
                    await c.close()
        out: list[Sequence] = []
        for (ep, _), state in zip(opened, states):
            meta = {"episode_requests": str(ep.trajectory.stats.requests)}
            if state.get("error") is not None:  # the model's own (_episode_failure)
                meta[MODEL_ERROR_META] = type(state["error"]).__name__
            for name, value in dict(state.get("metrics") or {}).items():
                meta[METRIC_META + str(name)] = repr(float(value))
            out.extend(ep.trajectory.build(float(state["reward"]), meta))
        return out

    def group_metrics(self, seqs: list[Sequence]) -> dict[str, float]:
        """Each rubric function's mean score over the task's episodes
        (``verifiers/<function>``), and the requests per episode."""
        episodes = {s.sample_index: s.meta for s in seqs}
        scores: dict[str, list[float]] = {}
        for meta in episodes.values():
            for k, v in meta.items():
                if k.startswith(METRIC_META):
                    scores.setdefault(k[len(METRIC_META):], []).append(float(v))
        requests = [float(m.get("episode_requests", "0")) for m in episodes.values()]
        errors = [float(MODEL_ERROR_META in m) for m in episodes.values()]
        return {**{f"verifiers/{k}": statistics.fmean(v) for k, v in scores.items()},
                "verifiers/requests_per_episode": statistics.fmean(requests) if requests
                else 0.0,
                "verifiers/model_errors": statistics.fmean(errors) if errors else 0.0}


def _episode_failure(ep: Any, state: dict[str, Any]) -> str | None:
    """Why an episode cannot be used, so that its group is run again; None when it can.
    An error the model's own output caused (an empty or invalid response; a tool call that
    does not parse or whose tool fails, where the environment stops on it) is not a
    failure: the episode ends as the model left it and the rubric scores it like any
    answer (0 for each of verifiers' own rubrics on an unanswered state), so the model
    learns from it. Any other error (the endpoint, the environment's infrastructure) is."""
    import verifiers as vf

    if ep.failure is not None:
        return ep.failure
    error = state.get("error")
    if error is not None and not isinstance(error, (vf.InvalidModelResponseError,
                                                    vf.ToolError)):
        return f"the rollout ended with an error: {error!r}"
    if not ep.trajectory.sequences:
        return "no_request: the environment made no call to the endpoint"
    return None



__all__ = ["VerifiersWorkflow"]
