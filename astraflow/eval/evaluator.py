"""Held-out evaluation from the weights topic (``astraflow eval run``).

Follows ``weights.<policy>``, rebuilds every ``every_versions``-th version bit-exactly
through the weight engine, scores greedy answers on the held-out split and publishes the
accuracy as a ``ComponentStatus`` (kind ``evaluator``, metric ``eval/accuracy``) on
``status``. What it scores and how often is its ``EvalSettings``
(``astraflow.config.components``): the topology's ``eval:`` with the policy's own over it.
"""

from __future__ import annotations

import json
import logging
import signal
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from confluent_kafka import KafkaException

from astraflow.config.components import EvalSettings
from astraflow.kafka.loop import kafka_error, transient
from astraflow.metrics import StatusSink
from astraflow.models.lora import load_published, wrap
from astraflow.weights.signing import split_trusted, verifier_for

log = logging.getLogger("astraflow.eval.evaluator")


def _levels(s: EvalSettings) -> list[int]:
    return [int(x) for x in s.levels.split(",")]


def chat_format(s: EvalSettings) -> Any:
    """The policy's prompt format (``astraflow.models.chat.ChatFormat``), None when the
    settings set none."""
    from astraflow.models.chat import ChatFormat

    return ChatFormat.from_options(s.chat.model_dump()) if s.chat is not None else None


def held_out_tasks(s: EvalSettings) -> list[Any]:
    """The evaluator's tasks: ``size`` rows of its dataset, else the synthetic eval split."""
    if s.dataset is not None:
        from astraflow.tasks.datasets import load_dataset_file

        d = s.dataset
        return load_dataset_file(d.path, prompt_field=d.prompt_field,
                                 answer_field=d.answer_field,
                                 messages_field=d.messages_field, limit=s.size)
    from astraflow.tasks.arithmetic import eval_problems

    return eval_problems(levels=_levels(s), n=s.size)


def held_out_scorer(s: EvalSettings) -> tuple[Callable[[Any, Any], float], int]:
    """``(score, prompts)``: ``score(model, tokenizer)`` is the held-out accuracy as the
    evaluator with settings ``s`` scores a version (answers for a solver, verdicts or
    picks for a verifier or selector), on ``prompts`` held-out prompts."""
    from astraflow.models.evaluation import evaluate
    from astraflow.tasks.rewards import make_reward

    chat = chat_format(s)
    if s.role in ("coder", "tester"):  # a code_tests policy on a chat model
        from astraflow.models.chat import ChatFormat
        from astraflow.roles.code_scoring import code_role_scorer

        return code_role_scorer(s.role, _levels(s), s.size, chat or ChatFormat(),
                                s.max_new_tokens), s.size
    if s.role != "solver":  # a verifier/selector policy: verdict (pick) accuracy
        return _judge_scorer(s)
    tasks = held_out_tasks(s)
    reward = make_reward(s.reward)

    def score(model: Any, tokenizer: Any) -> float:
        return evaluate(model, tokenizer, tasks, max_new_tokens=s.max_new_tokens,
                        chat=chat, reward=reward)

    return score, len(tasks)


def _judge_scorer(s: EvalSettings) -> tuple[Callable[[Any, Any], float], int]:
    """A verifier's (selector's) held-out accuracy: in the compact formats on a model
    without a chat template (the tiny one), else asked in words about the held-out
    problems (its dataset, else synthetic arithmetic) with known candidates (``blind``:
    the verifier answers each problem before it judges)."""
    from astraflow.models.chat import ChatFormat
    from astraflow.models.examples import task_payload
    from astraflow.roles.chat_scoring import chat_role_scorer
    from astraflow.roles.scoring import role_scorer

    # a blind selector exists in words only
    compact = role_scorer(s.role, _levels(s), s.size, s.max_new_tokens,
                          blind=s.blind and s.role == "verifier")
    chat = chat_format(s) or ChatFormat()
    payloads = [task_payload(t) for t in held_out_tasks(s)]
    in_words = chat_role_scorer(s.role, payloads, chat, s.max_new_tokens,
                                blind=s.blind, corrective=s.corrective,
                                agreement=s.agreement)

    def score(model: Any, tokenizer: Any) -> float:
        use = in_words if chat.uses_template(tokenizer) else compact
        return use(model, tokenizer)

    return score, s.size


def run_evaluator(s: EvalSettings, topo: Any, config: Any, *, once: bool = False,
                  history: str | None = None, public_key: str | None = None) -> int:
    """Evaluate ``s.policy``'s versions: every ``every_versions``-th one as it is
    published until SIGTERM (``once``: the latest, then return), or (``history``: the
    path of the curve) every one already published, nothing published then. ``config``:
    the evaluator's Kafka client settings; ``public_key``: verify the weights with it."""
    import torch

    from astraflow.models.loading import load_policy
    from astraflow.models.share import ensure_model

    scorer, n_prompts = held_out_scorer(s)
    torch.set_num_threads(1)
    verifier = verifier_for(topo.weight_signing, public_key)
    path = ensure_model(s.model, config, topo, s.policy, verifier=verifier)
    model, tokenizer = load_policy(path, dtype=s.dtype)
    if s.lora is not None:  # versions are adapters on the model
        model = wrap(model, s.lora)

    def score() -> float:
        return scorer(model, tokenizer)

    if history:
        curve = _history(s, history, topo, config, model, score, verifier)
        print(f"{len(curve)} versions evaluated: {history}")
        return 0
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    _follow(s, once, topo, config, stop, model, score, n_prompts, verifier)
    return 0


def _history(s: EvalSettings, out: str, topo, config, model, score,
             verifier=None) -> list[tuple[int, float]]:
    """Accuracy of every ``every_versions``-th published version into the curve at
    ``out``, oldest first (versions whose
    blobs were pruned are skipped, said in the log). With a ``verifier`` (signed weights)
    a manifest it refuses is never used: each refusal is printed with the reason."""
    from astraflow.weights import WeightFollower
    from astraflow.weights.stores.kafka import read_manifests

    policy, every = s.policy, s.every_versions
    topic = topo.full_name(f"weights.{policy}")
    manifests, refused = split_trusted(
        [m for m in read_manifests(config, topic) if m.policy == policy], verifier)
    for _, why in refused:
        print(f"refused: {why}; not used", flush=True)
    versions = sorted({m.version for m in manifests if m.version % every == 0})
    curve = dict(_curve_so_far(out, every, topo.run, policy))
    follower = WeightFollower(policy=policy, kafka_config=config, verifier=verifier)
    follower.observe(manifests)  # the trusted ones only
    t0 = time.time()
    try:
        for i, v in enumerate(versions):
            if v in curve:
                continue
            result = _reach(follower, v, policy)
            if result is None or result.version != v:
                continue
            load_published(model, follower.state)
            curve[v] = score()
            write_curve(out, topo.run, policy, every, sorted(curve.items()), png=False)
            print(f"eval {policy} v{v} accuracy {curve[v]:.4f} ({i + 1}/"
                  f"{len(versions)}, {time.time() - t0:.0f}s)", flush=True)
    finally:
        follower.close()
    write_curve(out, topo.run, policy, every, sorted(curve.items()))
    return sorted(curve.items())


def _curve_so_far(path: str, every: int, run: str, policy: str) -> list[tuple[int, float]]:
    """The points of an earlier history run of the same run, policy and ``every``
    into ``path``."""
    from pathlib import Path

    p = Path(path)
    try:
        old = json.loads(p.read_text())
    except (OSError, ValueError):  # none yet, or not a curve: start afresh
        return []
    if not isinstance(old, dict):  # valid JSON, but not a curve either
        return []
    if (old.get("every"), old.get("run"), old.get("policy")) != (every, run, policy):
        return []
    return [(c["version"], c["accuracy"]) for c in old.get("curve", [])]


def write_curve(path: str, run: str, policy: str, every: int,
                curve: list[tuple[int, float]], png: bool = True) -> None:
    """The accuracy-versus-version curve as JSON at ``path`` and a PNG beside it."""
    from pathlib import Path

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")  # replaced whole: a kill leaves the last one
    tmp.write_text(json.dumps({"run": run, "policy": policy, "every": every, "curve": [
        {"version": v, "accuracy": a} for v, a in curve]}, indent=2))
    tmp.replace(out)
    if not png:
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot([v for v, _ in curve], [a for _, a in curve], "o-", label=f"{policy} held-out")
    ax.set_xlabel("weight version")
    ax.set_ylabel("accuracy")
    ax.set_ylim(0, 1)
    ax.set_title(f"run {run}: every {every}th version")
    fig.savefig(out.with_suffix(".png"), dpi=100, bbox_inches="tight")
    plt.close(fig)


def _follow(s: EvalSettings, once: bool, topo, config, stop, model, score, n_prompts: int,
            verifier=None) -> None:
    """Evaluate every ``every_versions``-th version as it is published (the newest due
    one; ``once``: the latest, then return), waiting out broker outages up to the outage
    limit."""
    from astraflow.kafka.clients import RecordProducer
    from astraflow.kafka.loop import Outage
    from astraflow.kafka.table import TopicTable
    from astraflow.weights import WeightFollower
    from astraflow.weights.manifests import manifest_key
    from astraflow.wire.records import WeightManifest

    follower = WeightFollower(policy=s.policy, kafka_config=config, verifier=verifier)
    producer = RecordProducer(config)
    component = f"eval-{s.policy}/{socket.gethostname()}"
    outage = Outage(component, config.bootstrap_servers or "?", config.outage_limit_s,
                    config.outage_log_interval_s)
    topic = topo.full_name(f"weights.{s.policy}")
    # the weights topic as a table of its manifests, read incrementally (it only grows)
    manifests = _answered(outage, stop, lambda: TopicTable.open(
        config, topic, WeightManifest, codec=producer.codec, client_id=f"eval-{s.policy}",
        key=lambda e: manifest_key(e.value) if e.value is not None else None))
    if manifests is not None:
        manifests.on_change(lambda _k, _old, new: new is not None and follower.observe(new))
    done: set[int] = set()
    while manifests is not None and not stop.is_set():
        try:
            manifests.poll(1.0)
            _dead_letter_refused(follower, producer, topo, component)
            versions = sorted({m.version for m in follower.manifests})  # trusted ones
            if once:
                if not versions:  # nothing read yet: the topic may still be arriving
                    continue
                wanted = versions[-1:]
            else:
                wanted = [v for v in versions if v % s.every_versions == 0 and v not in done]
            for due in wanted[-1:]:  # the newest due version; older ones are history
                result = _reach(follower, due, s.policy)
                done.update(x for x in wanted if x <= due)
                if result is not None:
                    _report(s.policy, topo, component, producer, result, follower, model,
                            score, n_prompts)
            outage.ok()
        except KafkaException as e:  # the broker is away: wait for it (up to the limit)
            if not transient(kafka_error(e)):
                raise
            outage.failed(str(e))
        if once:
            break
        stop.wait(2.0)
    if manifests is not None:
        manifests.close()


def _dead_letter_refused(follower, producer, topo, component: str) -> None:
    """Manifests the follower refused (signed weights) go to ``dlq`` with the reason."""
    from astraflow.wire.records import DeadLetter

    topic = topo.full_name(f"weights.{follower.policy}")
    for m, reason in follower.take_refused():
        producer.produce(topo.full_name("dlq"), DeadLetter(
            source_topic=topic, partition=-1, offset=-1, component_id=component,
            error=f"refused: {reason}", raw=producer.codec.encode(m, topic)))


def _answered(outage, stop, make):
    """``make()``, again while Kafka does not answer; None when stopped first."""
    while not stop.is_set():
        try:
            return make()
        except KafkaException as e:
            if not transient(kafka_error(e)):
                raise
            outage.failed(str(e))
            stop.wait(2.0)
    return None


def _report(policy: str, topo, component, producer, result, follower, model, score,
            n_prompts: int) -> None:
    """Evaluate the follower's version and publish the accuracy on ``status``."""
    v = result.version
    load_published(model, follower.state)
    t0 = time.time()
    acc = score()
    log.info("%s v%d: eval/accuracy %.3f on %d held-out prompts (%.1fs, plan %s)",
             policy, v, acc, n_prompts, time.time() - t0, getattr(result, "steps", ""))
    print(f"eval {policy} v{v} accuracy {acc:.4f}", flush=True)
    sink = StatusSink(producer, topo.full_name("status"), component, "evaluator", policy)
    sink.emit(v, {"eval/accuracy": acc, "eval/version": float(v),
                  "eval/prompts": float(n_prompts)})


def _reach(follower, version: int, policy: str):
    """The follower brought to ``version``, or to the newest reachable version before it
    (its ``UpdateResult``); None when none is reachable (said in the log)."""
    from astraflow.weights import NoPlanError, WeightsError

    try:
        return follower.update_reachable(version)
    except (NoPlanError, WeightsError) as e:
        log.warning("%s v%d: no reachable weights (%s); skipped", policy, version, e)
        return None
