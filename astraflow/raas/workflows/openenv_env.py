"""``openenv``: an OpenEnv environment stepped by the policy, the environment's reward trained.

OpenEnv (PyPI ``openenv``, the ``openenv`` extra) serves an environment over HTTP and
WebSocket (``reset``, ``step``, ``state``). For each task the node runs ``n`` episodes at
once, each with its own session of OpenEnv's ``GenericEnvClient`` (plain JSON actions and
observations: no environment package is imported) and its own episode of the node's agent
endpoint (``episodes.EpisodeEndpoint``), where every call is recorded token for token:

1. ``reset(seed=..., **reset)``: the task's ``payload["reset"]`` (a mapping) over the
   workflow's ``reset`` option; ``seed`` defaults to ``payload["seed"]``, else a number
   drawn from the task's prompt id, so the ``n`` episodes of a task face the same problem;
2. the observation's ``observation_field`` (default ``prompt``) is a user message, the
   policy answers through the endpoint (``model``: the task's policy), and the answer is
   the action ``{action_field: text}`` (default ``message``);
3. until the environment says ``done`` or after ``max_turns`` actions.

The episode's reward is the sum of the rewards the environment returned (its own scorer):
the model's output reaches the environment only as an action, and nothing it writes sets
the reward. Which server: ``base_url`` (one the topology names, e.g. a container's
``http://host:8000``), or ``app`` (``package.module:attr``, an ASGI app or a factory of one,
as OpenEnv's ``create_app`` makes) that the node serves on a free localhost port, once, in
its own process.

An episode that fails (the server refuses, a malformed call, ``timeout_s``) runs the group
again, up to ``attempts`` times in all; then the task is dead-lettered with the reasons.

Options (``astraflow.config.options.OpenEnvOptions``, where each has its default):
``base_url`` or ``app``, ``reset`` (a mapping), ``action_field``, ``observation_field``,
``system_prompt``, ``max_turns``, ``timeout_s``, ``attempts``, ``endpoint``
(``EndpointLimits``), and the sampling defaults
(``max_new_tokens``, ``temperature``, ``top_p``, ``seed``).
"""

from __future__ import annotations

import asyncio
import importlib
import socket
import threading
import time
from contextlib import ExitStack
from typing import Any

from astraflow.config.options import OpenEnvOptions, RequestSamplingOptions
from astraflow.raas.engine import Engine
from astraflow.raas.workflows.base import TaskError
from astraflow.raas.workflows.episodes import EpisodeEndpoint, GroupFailed, with_attempts
from astraflow.raas.workflows.inputs import parse_payload, pick_engine
from astraflow.raas.workflows.registry import register_workflow
from astraflow.wire.records import Sequence, Task

INSTALL = "python3 -m pip install 'astraflow[openenv]'"


@register_workflow("openenv")
class OpenEnvWorkflow:
    """See the module docstring."""

    name = "openenv"

    Options = OpenEnvOptions

    def __init__(self, options: OpenEnvOptions):
        try:
            from openenv.core import GenericEnvClient
        except ImportError:
            raise ValueError(f"openenv: the workflow needs the openenv package: {INSTALL}") \
                from None
        self.options = options
        self._client_cls = GenericEnvClient
        self._server: _LocalServer | None = (_LocalServer(options.app)
                                             if options.app is not None else None)
        self.base_url = options.base_url or self._server.base_url  # type: ignore[union-attr]
        self.reset = dict(options.reset or {})
        self.action_field = options.action_field
        self.observation_field = options.observation_field
        self.system_prompt = options.system_prompt
        self.max_turns = options.max_turns
        self.timeout_s = options.timeout_s
        self.attempts = options.attempts
        self.endpoint = EpisodeEndpoint(options.endpoint)
        self.defaults = RequestSamplingOptions.of(options)

    def run(self, task: Task, engines: dict[str, Engine], n: int) -> list[Sequence]:
        payload = parse_payload(task)
        extra = payload.get("reset") or {}
        if not isinstance(extra, dict):
            raise TaskError("openenv: payload['reset'] must be a mapping")
        seed = payload.get("seed")
        if seed is None:
            seed = int((task.prompt_id or task.task_id).encode().hex()[:12] or "0", 16) % 2**31
        reset = {**self.reset, "seed": seed, **extra}
        policy = pick_engine(task, engines).policy
        return with_attempts("openenv", self.attempts, lambda attempt: asyncio.run(
            self._group(reset, engines, policy, n, f"{task.task_id}:{attempt}")))

    async def _group(self, reset: dict[str, Any], engines: dict[str, Engine], policy: str,
                     n: int, key: str) -> list[Sequence]:
        with ExitStack() as stack:
            opened = [stack.enter_context(self.endpoint.episode(engines, j, self.defaults,
                                                                f"{key}:{j}"))
                      for j in range(n)]
            try:
                results = await asyncio.wait_for(asyncio.gather(*(
                    self._episode(access, policy, reset) for _, access in opened)),
                    self.timeout_s)
            except TimeoutError:
                raise GroupFailed(f"timeout: the group ran past {self.timeout_s:g} s") from None
            except GroupFailed:
                raise
            except Exception as e:  # the server or the client failed
                raise GroupFailed(f"{type(e).__name__}: {e}") from e
            for ep, _ in opened:
                if ep.failure is not None:
                    raise GroupFailed(ep.failure)
        out: list[Sequence] = []
        for (ep, _), (reward, steps, done) in zip(opened, results):
            out.extend(ep.trajectory.build(reward, {
                "episode_requests": str(ep.trajectory.stats.requests),
                "env_steps": str(steps), "env_done": "1" if done else "0"}))
        return out

    async def _episode(self, access: Any, policy: str,
                       reset: dict[str, Any]) -> tuple[float, int, bool]:
        """One episode: ``(the sum of the environment's rewards, its steps, done)``."""
        from openai import AsyncOpenAI

        llm = AsyncOpenAI(base_url=access.base_url, api_key=access.key, max_retries=0,
                          timeout=self.timeout_s)
        env = self._client_cls(base_url=self.base_url, message_timeout_s=self.timeout_s)
        try:
            async with env:
                result = await env.reset(**reset)
                messages: list[dict[str, Any]] = []
                if self.system_prompt:
                    messages.append({"role": "system", "content": self.system_prompt})
                total, steps = float(result.reward or 0.0), 0
                while not result.done and steps < self.max_turns:
                    messages.append({"role": "user", "content": self._shown(result)})
                    reply = await llm.chat.completions.create(model=policy,
                                                               messages=messages)
                    text = reply.choices[0].message.content or ""
                    messages.append({"role": "assistant", "content": text})
                    result = await env.step({self.action_field: text})
                    steps += 1
                    total += float(result.reward or 0.0)
                if steps == 0:
                    raise GroupFailed("no_request: the environment was done at reset")
                return total, steps, bool(result.done)
        finally:
            await llm.close()

    def _shown(self, result: Any) -> str:
        obs = result.observation if isinstance(result.observation, dict) else {}
        if self.observation_field not in obs:
            raise GroupFailed(f"malformed: the observation has no {self.observation_field!r} "
                          f"(it has {sorted(obs)})")
        return str(obs[self.observation_field])

    def close(self) -> None:
        """Stop the server the node started, if any."""
        if self._server is not None:
            self._server.stop()



class _LocalServer:
    """An OpenEnv app (``package.module:attr``) served by uvicorn on a free localhost port
    in a thread of the node."""

    def __init__(self, spec: str):
        import uvicorn

        module, sep, attr = spec.partition(":")
        if not sep or not module or not attr:
            raise ValueError(f"openenv app {spec!r}: expected 'package.module:attr'")
        try:
            app = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"openenv app {spec!r}: {type(e).__name__}: {e}") from None
        if not hasattr(app, "router") and callable(app):  # a factory of the app
            app = app()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True,
                                       name="openenv-server")
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise ValueError(f"openenv app {spec!r}: the server did not start on "
                                 f"{self.base_url}")
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


__all__ = ["OpenEnvWorkflow"]
