"""The OpenAI-compatible endpoint a RaaS node serves its agent programs, on localhost.

Each episode has its own root, ``http://127.0.0.1:PORT/ep/<episode id>/v1``, handed to its
program as the OpenAI base URL, so every request is attributed to its episode without the
program knowing about AstraFlow:

- ``POST /v1/chat/completions``: ``model`` (a policy the node serves: one program can drive
  several policies), ``messages``, ``tools``, ``n``, ``temperature``, ``top_p``,
  ``max_tokens`` (or ``max_completion_tokens``), ``stop``; tool calls the model writes come
  back as ``message.tool_calls`` (``astraflow.raas.agent.chat``);
- ``POST /v1/completions``: ``prompt`` as text or token ids, the same sampling keys, and
  ``logprobs`` to get each token's log-probability back;
- ``GET /v1/models``: the policies;
- ``POST /ep/<id>/reward`` (or ``/v1/reward``): ``{"reward": x}`` or ``{"rewards":
  {policy: x}}`` ends the episode with that reward, for a trusted program only (403
  otherwise: the episode goes on, scored by the workflow).

A command's episode answers only calls that carry its key (``Authorization: Bearer``, what
the ``openai`` client sends from ``OPENAI_API_KEY``): knowing another episode's URL opens
nothing. ``EndpointLimits`` bound a call's body, ``n`` and ``max_tokens``, an episode's
concurrent calls and the endpoint's connections; a call past one gets a 4xx naming the
limit and (but for the connection limit) ends its episode with the reason.

Answers come from the node's engines (torch, vLLM): concurrent requests to one engine
share its ``generate`` calls (``astraflow.raas.agent.batching``); every request is recorded
token for token in the episode's ``EpisodeTrajectory``. A malformed call (unknown model, bad
messages, a bad parameter) gets an OpenAI-style error and ends the episode with the
reason; a request to an episode that has ended gets 410.
"""

from __future__ import annotations

import hmac
import json
import logging
import secrets
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from pydantic import ConfigDict

from astraflow.config.options import AgentEndpointOptions, RequestSamplingOptions, SamplingOptions
from astraflow.models.chat import engine_chat
from astraflow.raas.agent.batching import Coalescer
from astraflow.raas.agent.chat import (
    MessageError,
    check_messages,
    check_tools,
    parse_tool_calls,
)
from astraflow.raas.agent.journal import LOGGED_ROUTES, EpisodeLog, generations
from astraflow.raas.agent.program import Access
from astraflow.raas.agent.trajectory import EpisodeTrajectory
from astraflow.raas.engine import Engine, Generation, SamplingParams
from astraflow.raas.workflows.inputs import engine_tokenizer
from astraflow.wire.records import EpisodeCall

log = logging.getLogger("astraflow.raas.agent")


class EpisodeEnded(Exception):
    """A request to an episode that has ended."""


class EndpointLimits(AgentEndpointOptions):
    """What one call and one episode may ask of the endpoint (the workflow's
    ``endpoint:`` settings, declared with their defaults and checks in
    ``AgentEndpointOptions``)."""

    model_config = ConfigDict(**AgentEndpointOptions.model_config, frozen=True)

    @classmethod
    def from_options(cls, options: AgentEndpointOptions | Mapping[str, Any] | None
                     ) -> EndpointLimits:
        """The limits a workflow's ``endpoint`` option sets (unset keys: the defaults)."""
        if isinstance(options, AgentEndpointOptions):
            return cls(**options.model_dump())
        return cls(**dict(options or {}))

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * 2**20)


@dataclass
class Episode:
    """One run of an agent program: its engines, its trajectory, how it ended."""

    id: str
    engines: dict[str, Engine]
    trajectory: EpisodeTrajectory
    # the workflow's sampling: what a request that sets no max_tokens, temperature, top_p
    # samples with, and its seed
    defaults: RequestSamplingOptions = field(default_factory=RequestSamplingOptions)
    reward: float | dict[str, float] | None = None
    failure: str | None = None  # why the episode ended early (a malformed call ...)
    ended: bool = False
    last_answer: str = ""  # the newest assistant text: what a reward function scores
    # with a workflow seed, request k samples from (seed, f"{key}:{k}", choice, version):
    # an episode repeats, and the episodes of a task differ (key: task, sample, attempt)
    key: str = ""
    requests: int = 0
    # the key every call must carry (None: none, for a function in the node's process)
    api_key: str | None = None
    trusted: bool = False  # may post its reward
    limits: EndpointLimits = field(default_factory=EndpointLimits)
    active: int = 0  # calls being answered now
    log: EpisodeLog | None = None  # its durable log (astraflow.raas.agent.journal)
    # how a request reaches an engine (the server's Coalescer of it); None: directly
    coalescers: Mapping[str, Coalescer] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def generate(self, policy: str, prompt: list[int],
                 params: SamplingParams) -> list[Generation]:
        c = self.coalescers.get(policy)
        if c is not None:
            return c.generate(prompt, params)
        (gens,) = self.engines[policy].generate([prompt], params)
        return gens

    def fail(self, reason: str) -> None:
        """End the episode with ``reason`` (the first reason stays)."""
        with self.lock:
            if self.failure is None:
                self.failure = reason
            self.ended = True


class CallError(Exception):
    """A request the endpoint refuses: its HTTP status and message, and whether it ends
    the episode (a malformed call or a limit does; a refused reward does not)."""

    def __init__(self, status: int, message: str, ends_episode: bool = True):
        super().__init__(message)
        self.status = status
        self.ends_episode = ends_episode


def _sampling(ep: Episode, body: Mapping[str, Any], engine: Engine) -> SamplingParams:
    """The request's sampling parameters over the workflow's defaults."""
    d = ep.defaults
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else list(stop or [])
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    eos = getattr(engine, "eos_token_id", None)
    with ep.lock:
        ep.requests += 1
        key = f"{ep.key or ep.id}:{ep.requests}"
    try:
        n = int(body["n"]) if body.get("n") is not None else 1
        new_tokens = int(max_tokens if max_tokens is not None else d.max_new_tokens)
    except (TypeError, ValueError) as e:
        raise CallError(400, f"bad sampling parameter: {e}") from None
    lim = ep.limits
    if not 1 <= n <= lim.max_n:
        raise CallError(400, f"limit: n={n} is outside 1..{lim.max_n} (endpoint.max_n)")
    if not 1 <= new_tokens <= lim.max_tokens:
        raise CallError(400, f"limit: max_tokens={new_tokens} is outside "
                             f"1..{lim.max_tokens} (endpoint.max_tokens)")
    try:
        return SamplingParams(
            n=n,
            max_new_tokens=new_tokens,
            temperature=float(body["temperature"] if body.get("temperature") is not None
                              else d.temperature),
            top_p=float(body["top_p"] if body.get("top_p") is not None else d.top_p),
            stop=tuple(str(s) for s in stop),
            stop_token_ids=(eos,) if eos is not None else (),
            seed=d.seed,
            keys=(key,) if d.seed is not None else None,
        )
    except (TypeError, ValueError) as e:
        raise CallError(400, f"bad sampling parameter: {e}") from None


def _engine(ep: Episode, body: Mapping[str, Any]) -> tuple[str, Engine]:
    model = body.get("model")
    if model not in ep.engines:
        raise CallError(404, f"model {model!r}: this node serves {', '.join(sorted(ep.engines))}")
    return str(model), ep.engines[model]


def _text(engine: Engine, token_ids: list[int]) -> str:
    """The answer's text: its tokens decoded, the end-of-turn token left out."""
    eos = getattr(engine, "eos_token_id", None)
    if token_ids and token_ids[-1] == eos:
        token_ids = token_ids[:-1]
    return engine.decode(token_ids)


def chat_completion(ep: Episode, body: Mapping[str, Any]) -> dict[str, Any]:
    """``/v1/chat/completions`` for episode ``ep``: generated, recorded, in OpenAI's format."""
    policy, engine = _engine(ep, body)
    try:
        messages = check_messages(body.get("messages"))
        tools = check_tools(body.get("tools"))
        # a conversation this episode answered goes on from its sampled tokens
        prompt = ep.trajectory.chat_prompt(policy, engine_tokenizer(engine),
                                           engine_chat(engine), messages, tools)
    except MessageError as e:
        raise CallError(400, str(e)) from None
    params = _sampling(ep, body, engine)
    gens = ep.generate(policy, prompt, params)
    choices = []
    for i, g in enumerate(gens):
        text = _text(engine, g.token_ids)
        content, calls = parse_tool_calls(text) if tools else (text, [])
        # OpenAI's convention: null content only beside tool calls
        message: dict[str, Any] = {"role": "assistant",
                                   "content": (content or None) if calls else content}
        if calls:
            message["tool_calls"] = calls
        reason = "tool_calls" if calls else ("stop" if g.finish_reason == "stop" else "length")
        choices.append({"index": i, "message": message, "finish_reason": reason,
                        "logprobs": None})
    _record(ep, policy, prompt, gens, choices[0]["message"]["content"] or "")
    ep.trajectory.remember(policy, messages, tools, prompt, gens,
                           [c["message"] for c in choices])
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
            "created": int(time.time()), "model": policy, "choices": choices,
            "usage": _usage(prompt, gens)}


def completion(ep: Episode, body: Mapping[str, Any]) -> dict[str, Any]:
    """``/v1/completions``: ``prompt`` text (encoded as is) or token ids."""
    policy, engine = _engine(ep, body)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        ids = list(engine.encode(prompt))
    elif isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = list(prompt)
    else:
        raise CallError(400, "prompt must be a string or a non-empty list of token ids")
    if not ids:
        raise CallError(400, "prompt encodes to no tokens")
    params = _sampling(ep, body, engine)
    gens = ep.generate(policy, ids, params)
    choices = []
    for i, g in enumerate(gens):
        choice: dict[str, Any] = {"index": i, "text": engine.decode(g.token_ids),
                                  "finish_reason": g.finish_reason, "logprobs": None}
        if body.get("logprobs") is not None:
            choice["logprobs"] = {"tokens": [engine.decode([t]) for t in g.token_ids],
                                  "token_ids": list(g.token_ids),
                                  "token_logprobs": list(g.logprobs)}
        choices.append(choice)
    _record(ep, policy, ids, gens, choices[0]["text"])
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
            "created": int(time.time()), "model": policy, "choices": choices,
            "usage": _usage(ids, gens)}


# the call this handler thread recorded last: what the episode's log appends
_last = threading.local()


def _record(ep: Episode, policy: str, prompt: list[int], gens: list, answer: str) -> None:
    with ep.lock:
        if ep.ended:  # it ended while this request generated: nothing of it is kept
            raise EpisodeEnded(ep.id)
        ep.trajectory.record(policy, prompt, gens)
        ep.last_answer = answer
    _last.call = (policy, prompt, gens)


def answer(ep: Episode, route: str, body: Mapping[str, Any],
           fn: Any) -> dict[str, Any]:
    """``fn``'s answer to a call of ``ep``: from its log while the call is the next logged
    one (recorded as first sampled), else live, logged before it returns."""
    if ep.log is None or route not in LOGGED_ROUTES:
        return fn(ep, body)
    logged = ep.log.take(route, body)
    if logged is not None:
        return replayed(ep, route, body, logged)
    _last.call = None
    out = fn(ep, body)
    policy, prompt, gens = _last.call
    ep.log.append(route, body, policy, prompt, gens, out)
    return out


def replayed(ep: Episode, route: str, body: Mapping[str, Any],
             logged: EpisodeCall) -> dict[str, Any]:
    """A logged call's answer, its tokens recorded in ``ep`` as when they were sampled."""
    gens, out, prompt = generations(logged), json.loads(logged.response), list(logged.prompt_ids)
    with ep.lock:  # a seeded call after the replay is keyed as it was the first time
        ep.requests += 1
    if route == "v1/chat/completions":
        try:
            messages = check_messages(body.get("messages"))
            tools = check_tools(body.get("tools"))
        except MessageError as e:  # cannot be: the same body was answered before
            raise CallError(400, str(e)) from None
        replies = [c["message"] for c in out["choices"]]
        _record(ep, logged.policy, prompt, gens, replies[0].get("content") or "")
        ep.trajectory.remember(logged.policy, messages, tools, prompt, gens, replies)
    else:
        _record(ep, logged.policy, prompt, gens, out["choices"][0]["text"])
    return out


def _usage(prompt: list[int], gens: list) -> dict[str, int]:
    done = sum(len(g.token_ids) for g in gens)
    return {"prompt_tokens": len(prompt), "completion_tokens": done,
            "total_tokens": len(prompt) + done}


def take_reward(ep: Episode, body: Mapping[str, Any]) -> dict[str, Any]:
    """``/reward``: ends a trusted program's episode with its reward (one number, or one
    per policy); refused, the episode going on, for any other."""
    if not ep.trusted:
        raise CallError(403, "this program is not trusted to report its reward (the "
                             "workflow's trusted: false): the workflow scores the episode",
                        ends_episode=False)
    if isinstance(body.get("rewards"), Mapping):
        rewards = body["rewards"]
        bad = [p for p, r in rewards.items() if p not in ep.engines
               or not isinstance(r, int | float) or isinstance(r, bool)]
        if bad:
            raise CallError(400, f"rewards: {bad[0]!r} is not a served policy with a number")
        reward: float | dict[str, float] = {str(p): float(r) for p, r in rewards.items()}
    elif isinstance(body.get("reward"), int | float) and not isinstance(body["reward"], bool):
        reward = float(body["reward"])
    else:
        raise CallError(400, 'give {"reward": number} or {"rewards": {policy: number}}')
    with ep.lock:
        ep.reward = reward
        ep.ended = True
    return {"ok": True}


class AgentServer:
    """The endpoint of one node (module docstring): a threading HTTP server on
    127.0.0.1 (``port`` 0: a free one), episodes registered by id."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, window_s: float = 0.005,
                 limits: EndpointLimits | None = None):
        self.episodes: dict[str, Episode] = {}
        self.window_s = window_s  # how long a request waits for others to share its call
        self.limits = limits or EndpointLimits()
        self._coalescers: dict[int, Coalescer] = {}  # by engine
        self._lock = threading.Lock()
        server = self

        class Handler(_Handler):
            agent = server

        self.httpd = _BoundedHTTPServer((host, port), Handler, self.limits.max_connections)
        self.httpd.daemon_threads = True
        self.host, self.port = self.httpd.server_address[:2]
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True,
                                        name="agent-endpoint")
        self._thread.start()
        log.info("agent endpoint on http://%s:%d", self.host, self.port)

    def open(self, engines: dict[str, Engine], sample_index: int,
             defaults: SamplingOptions | Mapping[str, Any] | None = None, key: str = "", *,
             keyed: bool = False, trusted: bool = False) -> Episode:
        """A new episode (sample ``sample_index`` of its task; ``key`` names it in seeded
        sampling) served by ``engines`` with the sampling ``defaults`` (the options set, or
        a mapping of them, over ``RequestSamplingOptions``'s defaults); ``keyed``: its
        calls must carry a key of its own (``access``); ``trusted``: it may post its
        reward."""
        with self._lock:
            coalescers = {p: self._coalescers.setdefault(id(e), Coalescer(e, self.window_s))
                          for p, e in engines.items()}
            for c in set(coalescers.values()):
                c.episodes += 1
        ep = Episode(id=uuid.uuid4().hex, engines=dict(engines),
                     trajectory=EpisodeTrajectory(sample_index),
                     defaults=(RequestSamplingOptions.of(defaults)
                               if isinstance(defaults, SamplingOptions)
                               else RequestSamplingOptions(**dict(defaults or {}))),
                     key=key, coalescers=coalescers, trusted=trusted, limits=self.limits,
                     api_key=secrets.token_urlsafe(32) if keyed else None)
        with self._lock:
            self.episodes[ep.id] = ep
        return ep

    def base_url(self, ep: Episode) -> str:
        """The OpenAI base URL of ``ep`` (its ``/v1`` root)."""
        return f"http://{self.host}:{self.port}/ep/{ep.id}/v1"

    def reward_url(self, ep: Episode) -> str:
        return f"http://{self.host}:{self.port}/ep/{ep.id}/reward"

    def access(self, ep: Episode) -> Access:
        """What ``ep``'s program is given: its URL, its key, its reward URL if trusted."""
        return Access(self.base_url(ep), ep.api_key,
                      self.reward_url(ep) if ep.trusted else None)

    def episode_of(self, path: str) -> Episode | None:
        """The open episode a request path names, if any."""
        parts = [p for p in path.split("?")[0].split("/") if p]
        if len(parts) < 2 or parts[0] != "ep":
            return None
        with self._lock:
            return self.episodes.get(parts[1])

    def close(self, ep: Episode) -> None:
        """End ``ep`` (if it has not) and forget it: later requests get 410."""
        with ep.lock:
            ep.ended = True
        with self._lock:
            if self.episodes.pop(ep.id, None) is not None:
                for c in set(ep.coalescers.values()):
                    c.episodes -= 1

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        for c in set(self._coalescers.values()):
            c.close()

    def handle(self, method: str, path: str, body: Any,
               auth: str | None = None) -> tuple[int, dict[str, Any]]:
        """One request (``auth``: its Authorization header): ``(status, JSON body)``. No
        HTTP here (unit-testable)."""
        parts = [p for p in path.split("?")[0].split("/") if p]
        if len(parts) < 3 or parts[0] != "ep":
            return 404, _error(f"no such path {path}: requests go to /ep/<episode>/v1/...")
        with self._lock:
            ep = self.episodes.get(parts[1])
        if ep is not None and ep.api_key is not None and not hmac.compare_digest(
                (auth or "").encode(), f"Bearer {ep.api_key}".encode()):
            return 401, _error("this episode's key is missing or wrong (OPENAI_API_KEY)")
        if ep is None or ep.ended:
            return 410, _error(f"episode {parts[1]} has ended")
        route = "/".join(parts[2:])
        handlers = {("GET", "v1/models"): lambda e, b: _models(e),
                    ("POST", "v1/chat/completions"): chat_completion,
                    ("POST", "v1/completions"): completion,
                    ("POST", "v1/reward"): take_reward, ("POST", "reward"): take_reward}
        fn = handlers.get((method, route))
        if fn is None:
            return 404, _error(f"{method} {route}: not served (chat/completions, "
                               "completions, models, reward)")
        with ep.lock:
            ep.active += 1
            crowded = ep.active > ep.limits.max_calls
        try:
            if crowded:
                raise CallError(429, f"limit: more than {ep.limits.max_calls} calls of one "
                                     "episode at once (endpoint.max_calls)")
            if method == "POST" and not isinstance(body, Mapping):
                raise CallError(400, "the body must be a JSON object")
            return 200, answer(ep, route, body, fn)
        except CallError as e:
            if e.ends_episode:
                ep.fail(f"malformed call to {route}: {e}")
            return e.status, _error(str(e))
        except EpisodeEnded:
            return 410, _error(f"episode {ep.id} has ended")
        except Exception as e:  # noqa: BLE001 - the engine failed: the episode ends, said
            log.exception("agent endpoint: %s failed", route)
            ep.fail(f"{route} failed: {type(e).__name__}: {e}")
            return 500, _error(f"{type(e).__name__}: {e}")
        finally:
            with ep.lock:
                ep.active -= 1

    def refuse_body(self, path: str, size: int) -> tuple[int, dict[str, Any]]:
        """A body over ``max_body_mb``, refused unread: its episode ends with the reason."""
        message = (f"limit: a body of {size} bytes is over {self.limits.max_body_bytes} "
                   "(endpoint.max_body_mb)")
        ep = self.episode_of(path)
        if ep is not None:
            ep.fail(f"malformed call: {message}")
        return 413, _error(message)


class _BoundedHTTPServer(ThreadingHTTPServer):
    """A threading HTTP server that serves at most ``limit`` connections at once; one
    more gets a 503 and is closed, without a thread."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type, limit: int):
        self._slots = threading.BoundedSemaphore(limit)
        self.limit = limit
        # socketserver's listen backlog is 5: a burst of episodes connecting while the
        # engine holds the cores overflowed it, and their connections were reset
        self.request_queue_size = limit
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            body = json.dumps(_error(f"limit: the endpoint serves {self.limit} connections "
                                     "at once (endpoint.max_connections)")).encode()
            try:
                request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: "
                                b"application/json\r\nConnection: close\r\n"
                                + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def _models(ep: Episode) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": p, "object": "model", "owned_by": "astraflow"}
                                       for p in sorted(ep.engines)]}


def _error(message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "invalid_request_error"}}


class _Handler(BaseHTTPRequestHandler):
    agent: AgentServer
    protocol_version = "HTTP/1.1"
    timeout = 120  # a connection that sends nothing for this long is closed

    def _reply(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self._reply(*self.agent.handle("GET", self.path, None,
                                       self.headers.get("Authorization")))

    def do_POST(self) -> None:  # noqa: N802
        try:
            n = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            n = -1
        if n < 0 or "Transfer-Encoding" in self.headers:
            self.close_connection = True
            self._reply(411, _error("a body needs a Content-Length"))
            return
        if n > self.agent.limits.max_body_bytes:
            self.close_connection = True  # the body stays unread
            self._reply(*self.agent.refuse_body(self.path, n))
            return
        raw = self.rfile.read(n) if n else b""
        try:
            body = json.loads(raw) if raw else {}
        except json.JSONDecodeError as e:
            body = None
            log.debug("agent endpoint: a body that is not JSON: %s", e)
        self._reply(*self.agent.handle("POST", self.path, body,
                                       self.headers.get("Authorization")))

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's
        log.debug("agent endpoint: " + format, *args)


__all__ = ["AgentServer", "CallError", "EndpointLimits", "Episode", "EpisodeEnded",
           "chat_completion",
           "completion", "take_reward"]
