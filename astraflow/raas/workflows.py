"""Workflows: how a task becomes trajectories.

A workflow is one class with ``run(task, engines, n) -> list[Sequence]``; it may call any
of the engines (one per policy) as often as it likes. Every returned ``Sequence`` holds
``token_ids`` = prompt + everything after it, with ``loss_mask`` 1 only on tokens the
policy generated; tokens the policy did not generate (prompt, tool output) have
``loss_mask`` 0, ``logprobs`` 0.0 and ``versions`` -1.

Register a workflow class by name with ``@register_workflow("name")``; the RaaS node looks
up ``task.workflow`` in the registry and builds it with the options it was given for that
name (``make_workflow(name, **options)``).

A payload that cannot be used raises ``TaskError``: the node dead-letters the task.
"""

from __future__ import annotations

import json
import math
import random
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from astraflow.chat import PromptError, engine_chat
from astraflow.raas.calc import CalcError, calculate
from astraflow.raas.engine import Engine, Generation, SamplingParams
from astraflow.records import Sequence, Task
from astraflow.tasks.rewards import make_reward

Checker = Callable[[str, str], float]


class TaskError(ValueError):
    """A task this workflow cannot run (bad payload, unknown policy ...): dead-lettered."""


@runtime_checkable
class Workflow(Protocol):
    name: str

    def run(self, task: Task, engines: dict[str, Engine], n: int) -> list[Sequence]: ...


class BatchWorkflow(Workflow, Protocol):
    """A workflow that can also roll out several tasks at once: ``run_batch`` gives, per
    task and in order, its sequences or the exception that task raised (a bad payload fails
    its own task only). Each generation phase of the tasks is one ``generate`` call, so a
    node that takes several tasks per transaction (``--tasks-per-transaction``) runs the
    model on bigger batches: fewer, fuller forward passes."""

    def run_batch(
        self, tasks: list[Task], engines: dict[str, Engine], n: int
    ) -> list[list[Sequence] | Exception]: ...


WORKFLOWS: dict[str, type] = {}


def register_workflow(name: str) -> Callable[[type], type]:
    """Class decorator: make a workflow class available under ``name``."""

    def wrap(cls: type) -> type:
        cls.name = name
        WORKFLOWS[name] = cls
        return cls

    return wrap


def load_builtin_workflows() -> dict[str, type]:
    """Every shipped workflow, registered: those of other modules register themselves when
    imported, which happens here (on use: they import this module)."""
    import importlib

    for module in ("astraflow.raas.codegen", "astraflow.raas.verify"):
        importlib.import_module(module)
    return WORKFLOWS


def make_workflow(name: str, **options: Any) -> Workflow:
    """An instance of the workflow registered as ``name``; raises ``TaskError`` if none."""
    load_builtin_workflows()
    cls = WORKFLOWS.get(name)
    if cls is None:
        raise TaskError(f"unknown workflow {name!r} (known: {sorted(WORKFLOWS)})")
    return cls(**options)


# --- helpers -----------------------------------------------------------------------------
def default_checker() -> Checker:
    """``astraflow.tasks.check_answer`` when it exists, else exact stripped match."""
    try:
        from astraflow.tasks import check_answer  # type: ignore[attr-defined]

        return check_answer
    except ImportError:
        return exact_match


def exact_match(completion: str, answer: str) -> float:
    return 1.0 if completion.strip() == str(answer).strip() else 0.0


def parse_payload(task: Task, required: tuple[str, ...] = ()) -> dict[str, Any]:
    try:
        payload = json.loads(task.payload)
    except (TypeError, ValueError) as e:
        raise TaskError(f"payload is not JSON: {e}") from None
    if not isinstance(payload, dict):
        raise TaskError("payload must be a JSON object")
    for key in required:
        if key not in payload:
            raise TaskError(f"payload has no {key!r}")
        if not isinstance(payload[key], str | int | float) or isinstance(payload[key], bool):
            raise TaskError(f"payload[{key!r}] must be a string or number")
    return payload


def pick_engine(task: Task, engines: Mapping[str, Engine], index: int = 0) -> Engine:
    """The engine of ``task.policies[index]``, or the only engine when none are named."""
    if task.policies:
        if index >= len(task.policies):
            raise TaskError(f"task names {len(task.policies)} policies, workflow needs {index + 1}")
        name = task.policies[index]
        if name not in engines:
            raise TaskError(f"no engine for policy {name!r} on this node (have {sorted(engines)})")
        return engines[name]
    if len(engines) == 1:
        return next(iter(engines.values()))
    raise TaskError(f"task names no policy and this node has {len(engines)} engines")


class SequenceBuilder:
    """Accumulates one trajectory: prompt, generated pieces and non-trained pieces."""

    def __init__(self, policy: str, prompt_ids: list[int], sample_index: int):
        self.policy = policy
        self.sample_index = sample_index
        self.token_ids = list(prompt_ids)
        self.loss_mask = [0] * len(prompt_ids)
        self.logprobs = [0.0] * len(prompt_ids)
        self.versions = [-1] * len(prompt_ids)
        self.finish_reason = "length"
        self.meta: dict[str, str] = {}

    def add_generated(self, g: Generation) -> None:
        self.token_ids += g.token_ids
        self.loss_mask += [1] * len(g.token_ids)
        self.logprobs += list(g.logprobs)
        self.versions += list(g.versions)
        self.finish_reason = g.finish_reason

    def add_external(self, token_ids: list[int]) -> None:
        self.token_ids += token_ids
        self.loss_mask += [0] * len(token_ids)
        self.logprobs += [0.0] * len(token_ids)
        self.versions += [-1] * len(token_ids)

    def build(self, reward: float) -> Sequence:
        return Sequence(
            policy=self.policy,
            token_ids=self.token_ids,
            loss_mask=self.loss_mask,
            logprobs=self.logprobs,
            versions=self.versions,
            reward=float(reward),
            sample_index=self.sample_index,
            finish_reason=self.finish_reason,
            meta=self.meta,
        )


def role_sequence(
    policy: str,
    role: str,
    prompt_ids: list[int],
    gen: Generation,
    index: int,
    reward: float,
    **meta: str,
) -> Sequence:
    """The trajectory of one generation ``gen`` after ``prompt_ids``, for ``role`` of a
    multi-policy workflow, with ``meta``."""
    b = SequenceBuilder(policy, prompt_ids, index)
    b.add_generated(gen)
    b.meta.update(meta)
    s = b.build(reward)
    s.role = role
    return s


@dataclass
class Latency:
    """A seeded, possibly long-tailed delay: ``const``, ``lognormal`` or ``pareto``.

    ``lognormal``: median ``median_s``, shape ``sigma``. ``pareto``: minimum ``scale_s``,
    tail index ``alpha`` (smaller: heavier tail). Every draw is capped at ``max_s``.
    """

    dist: str = "lognormal"
    median_s: float = 0.05
    sigma: float = 1.0
    scale_s: float = 0.02
    alpha: float = 1.5
    max_s: float = 30.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.dist not in ("const", "lognormal", "pareto"):
            raise ValueError(f"latency dist must be const, lognormal or pareto, not {self.dist!r}")
        self._rng = random.Random(self.seed)

    @classmethod
    def from_option(cls, value: Any) -> Latency | None:
        if value is None or isinstance(value, Latency):
            return value
        if isinstance(value, int | float):
            return cls(dist="const", median_s=float(value))
        if isinstance(value, Mapping):
            return cls(**value)
        raise ValueError(f"latency must be seconds or a mapping, not {value!r}")

    def draw(self) -> float:
        if self.dist == "const":
            s = self.median_s
        elif self.dist == "lognormal":
            s = self._rng.lognormvariate(math.log(max(self.median_s, 1e-9)), self.sigma)
        else:
            s = self.scale_s * self._rng.paretovariate(self.alpha)
        return min(max(s, 0.0), self.max_s)


def _sampling(options: Mapping[str, Any], engine: Engine, n: int, **extra: Any) -> SamplingParams:
    stop_ids = tuple(options.get("stop_token_ids") or ())
    if not stop_ids and engine.eos_token_id is not None:
        stop_ids = (engine.eos_token_id,)
    return SamplingParams(
        max_new_tokens=int(options.get("max_new_tokens", 64)),
        temperature=float(options.get("temperature", 1.0)),
        top_p=float(options.get("top_p", 1.0)),
        n=n,
        stop_token_ids=stop_ids,
        seed=options.get("seed"),
        **extra,
    )


# --- single turn -------------------------------------------------------------------------
def _prompt_task(
    task: Task, engines: Mapping[str, Engine]
) -> tuple[dict[str, Any], Engine, list[int]]:
    """``(payload, engine, prompt token ids)`` of a prompt/answer task, the prompt built by
    the engine's chat format (``astraflow.chat``); ``TaskError`` if unusable."""
    payload = parse_payload(task, ("answer",))
    engine = pick_engine(task, engines)
    try:
        prompt_ids = engine_chat(engine).prompt_ids(engine_tokenizer(engine), payload)
    except PromptError as e:
        raise TaskError(str(e)) from None
    return payload, engine, prompt_ids


def engine_tokenizer(engine: Engine) -> Any:
    """The engine's tokenizer, or an adapter over its ``encode`` for engines without one."""
    tok = getattr(engine, "tokenizer", None)
    return tok if tok is not None else _EncodeOnly(engine)


class _EncodeOnly:
    chat_template = None

    def __init__(self, engine: Engine):
        self.engine = engine

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.engine.encode(text)


class Scorer:
    """A workflow's reward: the registry's ``reward`` spec (``astraflow.tasks.rewards``),
    else ``checker(completion, answer)``, else the default numeric check."""

    def __init__(self, reward: Any = None, checker: Checker | None = None):
        self.reward = make_reward(reward) if reward is not None else None
        self.checker = checker

    def __call__(self, completion: str, payload: Mapping[str, Any]) -> float:
        if self.reward is not None:
            return self.reward(completion, payload)
        return (self.checker or default_checker())(completion, str(payload["answer"]))


@register_workflow("single_turn")
class SingleTurn:
    """One prompt (``payload["prompt"]`` or ``payload["messages"]``, formatted by the
    engine's chat format), ``n`` samples, reward = the ``reward`` spec or the checker.

    Options: ``max_new_tokens``, ``temperature``, ``top_p``, ``seed``, ``reward`` (a name
    or mapping from ``astraflow.tasks.rewards``), ``checker`` (a callable ``(completion,
    answer)``; default ``astraflow.tasks.check_answer``), ``env_latency`` (seconds or a
    ``Latency`` mapping: extra delay per rollout, to mimic a slow environment).
    """

    name = "single_turn"

    def __init__(self, checker: Checker | None = None, env_latency: Any = None,
                 reward: Any = None, **sampling: Any):
        self.score = Scorer(reward, checker)
        self.env_latency = Latency.from_option(env_latency)
        self.sampling = sampling

    def run(self, task: Task, engines: dict[str, Engine], n: int) -> list[Sequence]:
        return unbatched(self.run_batch([task], engines, n))

    def run_batch(
        self, tasks: list[Task], engines: dict[str, Engine], n: int
    ) -> list[list[Sequence] | Exception]:
        results, ready = prepare_each(tasks, lambda t: _prompt_task(t, engines))
        by_engine: dict[int, list[tuple[int, dict[str, Any], Engine, list[int]]]] = {}
        for i, (payload, engine, prompt_ids) in ready:
            by_engine.setdefault(id(engine), []).append((i, payload, engine, prompt_ids))
        for live in by_engine.values():
            engine = live[0][2]
            gens = engine.generate([p for *_, p in live], _sampling(self.sampling, engine, n))
            for (i, payload, _, prompt_ids), samples in zip(live, gens):
                out = []
                for j, g in enumerate(samples):
                    b = SequenceBuilder(engine.policy, prompt_ids, j)
                    b.add_generated(g)
                    out.append(b.build(self.score(engine.decode(g.token_ids), payload)))
                results[i] = out
        if self.env_latency is not None and by_engine:
            # the tasks' environments run side by side: the batch waits for the slowest
            time.sleep(max(self.env_latency.draw() for _ in tasks))
        return results


def prepare_each(
    tasks: list[Task], prepare: Callable[[Task], Any]
) -> tuple[list[list[Sequence] | Exception], list[tuple[int, Any]]]:
    """``prepare`` every task of a batch: the batch's results, holding the exception of
    each task that raised one (the others start empty), and ``(index, prepared)`` of the
    tasks that are ready to roll out."""
    results: list[list[Sequence] | Exception] = [[] for _ in tasks]
    ready = []
    for i, task in enumerate(tasks):
        try:
            ready.append((i, prepare(task)))
        except Exception as e:  # noqa: BLE001 - this task fails, the others go on
            results[i] = e
    return results, ready


def unbatched(results: list[list[Sequence] | Exception]) -> list[Sequence]:
    """The one result of a one-task ``run_batch``: its sequences, or its exception raised."""
    (out,) = results
    if isinstance(out, Exception):
        raise out
    return out


# --- multi-turn tool use -----------------------------------------------------------------
_CALL = re.compile(r"<calc>(.*?)</calc>", re.S)


@register_workflow("tool_calc")
class ToolCalc:
    """Multi-turn tool use with a calculator.

    The model may write ``<calc>EXPR</calc>``; generation stops there, the workflow
    evaluates EXPR with the safe parser (``astraflow.raas.calc``) and appends
    ``<result>VALUE</result>`` (or ``<result>error: ...</result>``) as tokens the policy did
    not generate (loss_mask 0, versions -1, logprobs 0), then lets the model continue, for
    at most ``max_turns`` model turns. The reward is checker(text of the last model turn,
    answer). The ``n`` samples run as one batch per turn; a turn's tool calls run
    concurrently, so the turn waits for the slowest ``tool_latency`` draw.

    Options: as ``single_turn`` plus ``max_turns`` (default 4) and ``tool_latency``
    (seconds or a ``Latency`` mapping, e.g. ``{"dist": "pareto", "scale_s": 0.05,
    "alpha": 1.2, "seed": 0}``).
    """

    name = "tool_calc"
    open_tag, close_tag = "<calc>", "</calc>"

    def __init__(
        self,
        checker: Checker | None = None,
        max_turns: int = 4,
        tool_latency: Any = None,
        env_latency: Any = None,
        reward: Any = None,
        **sampling: Any,
    ):
        if max_turns < 1:
            raise ValueError("max_turns must be at least 1")
        self.score = Scorer(reward, checker)
        self.max_turns = max_turns
        self.tool_latency = Latency.from_option(tool_latency)
        self.env_latency = Latency.from_option(env_latency)
        self.sampling = sampling

    def run(self, task: Task, engines: dict[str, Engine], n: int) -> list[Sequence]:
        payload, engine, prompt_ids = _prompt_task(task, engines)
        params = _sampling(self.sampling, engine, 1, stop=(self.close_tag,))
        seqs = [SequenceBuilder(engine.policy, prompt_ids, j) for j in range(n)]
        last_text = [""] * n
        calls = [0] * n
        active = list(range(n))
        for turn in range(self.max_turns):
            gens = engine.generate([seqs[j].token_ids for j in active], params)
            still: list[int] = []
            delays: list[float] = []
            for j, (g,) in zip(active, gens):
                seqs[j].add_generated(g)
                text = engine.decode(g.token_ids)
                last_text[j] = text
                call = _last_call(text) if g.finish_reason == "stop" else None
                if call is None or turn == self.max_turns - 1:
                    continue
                calls[j] += 1
                try:
                    result = calculate(call)
                except CalcError as e:
                    result = f"error: {e}"
                seqs[j].add_external(engine.encode(f"<result>{result}</result>"))
                if self.tool_latency is not None:
                    delays.append(self.tool_latency.draw())
                still.append(j)
            if delays:
                time.sleep(max(delays))
            active = still
            if not active:
                break
        if self.env_latency is not None:
            time.sleep(self.env_latency.draw())
        out = []
        for j, b in enumerate(seqs):
            b.meta["tool_calls"] = str(calls[j])
            out.append(b.build(self.score(last_text[j], payload)))
        return out


def _last_call(text: str) -> str | None:
    found = _CALL.findall(text)
    return found[-1] if found else None


__all__ = [
    "WORKFLOWS",
    "BatchWorkflow",
    "Latency",
    "SequenceBuilder",
    "Scorer",
    "SingleTurn",
    "TaskError",
    "ToolCalc",
    "Workflow",
    "default_checker",
    "engine_tokenizer",
    "exact_match",
    "load_builtin_workflows",
    "make_workflow",
    "prepare_each",
    "register_workflow",
    "role_sequence",
    "unbatched",
]
