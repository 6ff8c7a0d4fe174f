"""Held-out evaluation from the weights topic: ``astraflow eval run``.

Follows ``weights.<policy>``, rebuilds every ``--every``-th version bit-exactly through the
weight engine, scores greedy answers on the held-out split and publishes the accuracy as a
``ComponentStatus`` (kind ``evaluator``, metric ``eval/accuracy``) on ``status``.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from confluent_kafka import KafkaException

from astraflow.kafka.loop import kafka_error, transient
from astraflow.metrics import StatusSink
from astraflow.weights.signing import split_trusted, verifier_for

log = logging.getLogger("astraflow.eval.evaluator")


_EXAMPLES = [
    "astraflow eval run -t topology/default.yaml --policy actor --model runs/default/model",
    "astraflow eval run -t topology/default.yaml --model runs/default/model --once",
    "astraflow eval run -t topology/solver-verifier.yaml --policy verifier "
    "--model runs/solver-verifier/verifier --role verifier --blind",
]


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``eval`` command group (``eval run``) to ``subparsers``."""
    from astraflow.cli.args import add_command, add_group, add_run_options

    verbs = add_group(subparsers, "eval", help="held-out evaluation of published weight versions",
                      dest="eval_command", examples=_EXAMPLES[:1])
    r = add_command(
        verbs, "run", help="evaluate every N-th version as it is published",
        description="Follow weights.<policy>, rebuild every --every-th version bit-exactly, "
        "score greedy answers on the held-out prompts and publish the accuracy on "
        "<run>.status (metric eval/accuracy).",
        examples=_EXAMPLES)
    add_run_options(r)
    r.add_argument("--policy", default="actor", help="policy name (default actor)")
    r.add_argument("--model", required=True, metavar="PATH", help="the policy's base model dir")
    r.add_argument("--every", type=int, default=5, metavar="N", help="evaluate versions k*N")
    r.add_argument("--once", action="store_true", help="evaluate the latest version and exit")
    r.add_argument("--history", metavar="OUT.json",
                   help="evaluate every --every-th version already published, write the "
                   "accuracy-versus-version curve to OUT.json (and OUT.png) and exit; nothing "
                   "is published (`astraflow replay eval`)")
    r.add_argument("--public-key", metavar="FILE", help="verify the weights with this public "
                   "key (PEM): a manifest it did not sign is refused (default: "
                   "$ASTRAFLOW_WEIGHTS_PUBLIC_KEY, else the topology's weight_signing)")
    r.add_argument("--levels", default="1,2", help="synthetic arithmetic levels (no --dataset)")
    r.add_argument("--dataset", metavar="FILE", help="held-out .jsonl/.parquet file (default: "
                   "the synthetic arithmetic eval split)")
    r.add_argument("--prompt-field", default=None, help="the dataset's prompt field")
    r.add_argument("--answer-field", default=None, help="the dataset's answer field")
    r.add_argument("--messages-field", default=None, help="a field holding chat messages")
    r.add_argument("--reward", type=reward_arg, default=None, metavar="NAME|JSON",
                   help="reward from astraflow.tasks.rewards (default numeric), e.g. "
                   "exact_match or '{\"name\": \"format\", \"pattern\": \"\\\\d+\"}'")
    r.add_argument("--chat", type=chat_arg, default=None, metavar="JSON",
                   help='prompt format, e.g. \'{"template": "auto", "system_prompt": "..."}\'')
    r.add_argument("--dtype", default=None, help="model dtype (default: as saved)")
    r.add_argument("--size", type=int, default=200, help="held-out prompts")
    r.add_argument("--max-new-tokens", type=int, default=8)
    r.add_argument("--role", default="solver",
                   choices=["solver", "verifier", "selector", "coder", "tester"],
                   help="what accuracy means: answers (solver), verdicts or picks on held-out "
                   "candidate answers (astraflow.roles; a chat model is asked in words), "
                   "held-out code specs passed (coder) or the test generator's mutation "
                   "reward (tester) on the code tasks' held-out split")
    r.add_argument("--blind", action="store_true",
                   help="a verifier that answers first: its own answer, then the candidate "
                   "and its verdict (the compact two-turn format of `model init-role "
                   "--blind`, or in words on a chat model); a chat selector that answers "
                   "and picks the answer its own agrees with (solve_select's blind)")
    r.add_argument("--agreement", action="store_true",
                   help="with --blind on a chat model: the verdict is the agreement of the "
                   "verifier's own answer with the candidate (solve_verify's agreement)")
    r.add_argument("--corrective", action="store_true",
                   help="a chat verifier or selector that replies with the correct answer: "
                   "its verdict is agreement with the candidate, its pick the answer it "
                   "repeats (solve_verify's and solve_select's corrective format)")
    r.set_defaults(func=cmd_eval_run)
    return subparsers.choices["eval"]


def reward_arg(text: str) -> Any:
    """``--reward``: a reward name, or a JSON mapping with its options (checked now)."""
    from astraflow.tasks.rewards import RewardError, make_reward

    spec: Any = text
    if text.lstrip().startswith("{"):
        try:
            spec = json.loads(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    try:
        make_reward(spec)
    except RewardError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return spec


def chat_arg(text: str) -> Any:
    """``--chat``: a JSON mapping for ``astraflow.models.chat.ChatFormat``."""
    from astraflow.models.chat import ChatFormat

    try:
        return ChatFormat.from_options(json.loads(text))
    except (ValueError, TypeError, AttributeError) as e:
        raise argparse.ArgumentTypeError(f"chat: {e}") from None


def held_out_tasks(args: argparse.Namespace) -> list[Any]:
    """The evaluator's tasks: ``--size`` rows of ``--dataset``, else the synthetic eval split."""
    if args.dataset:
        from astraflow.tasks.datasets import load_dataset_file

        return load_dataset_file(args.dataset, prompt_field=args.prompt_field,
                                 answer_field=args.answer_field,
                                 messages_field=args.messages_field, limit=args.size)
    from astraflow.tasks.arithmetic import eval_problems

    return eval_problems(levels=[int(x) for x in args.levels.split(",")], n=args.size)


def held_out_scorer(args: argparse.Namespace) -> tuple[Callable[[Any, Any], float], int]:
    """``(score, prompts)``: ``score(model, tokenizer)`` is the held-out accuracy as ``eval
    run`` with the flags ``args`` scores a version (answers for a solver, verdicts or picks
    for a verifier or selector), on ``prompts`` held-out prompts."""
    from astraflow.models.evaluation import evaluate
    from astraflow.tasks.rewards import make_reward

    if args.blind and args.role not in ("verifier", "selector"):
        raise SystemExit("astraflow eval: --blind is for --role verifier or selector, not "
                         f"{args.role}")
    if args.corrective and args.role not in ("verifier", "selector"):
        raise SystemExit("astraflow eval: --corrective is for --role verifier or selector, "
                         f"not {args.role}")
    if args.corrective and args.blind:
        raise SystemExit("astraflow eval: --blind or --corrective, not both")
    if args.agreement and not args.blind:
        raise SystemExit("astraflow eval: --agreement needs --blind")
    if args.role in ("coder", "tester"):  # a code_tests policy on a chat model
        from astraflow.models.chat import ChatFormat
        from astraflow.roles.code_scoring import code_role_scorer

        return code_role_scorer(args.role, [int(x) for x in args.levels.split(",")],
                                args.size, args.chat or ChatFormat(),
                                args.max_new_tokens), args.size
    if args.role != "solver":  # a verifier/selector policy: verdict (pick) accuracy
        return _judge_scorer(args)
    tasks = held_out_tasks(args)
    reward = make_reward(args.reward)

    def score(model: Any, tokenizer: Any) -> float:
        return evaluate(model, tokenizer, tasks, max_new_tokens=args.max_new_tokens,
                        chat=args.chat, reward=reward)

    return score, len(tasks)


def _judge_scorer(args: argparse.Namespace) -> tuple[Callable[[Any, Any], float], int]:
    """A verifier's (selector's) held-out accuracy: in the compact formats on a model
    without a chat template (the tiny one), else asked in words about the held-out
    problems (``--dataset``, else synthetic arithmetic) with known candidates (``--blind``:
    the verifier answers each problem before it judges)."""
    from astraflow.models.chat import ChatFormat
    from astraflow.models.examples import task_payload
    from astraflow.roles.chat_scoring import chat_role_scorer
    from astraflow.roles.scoring import role_scorer

    # a blind selector exists in words only
    compact = role_scorer(args.role, [int(x) for x in args.levels.split(",")], args.size,
                          args.max_new_tokens, blind=args.blind and args.role == "verifier")
    chat = args.chat or ChatFormat()
    payloads = [task_payload(t) for t in held_out_tasks(args)]
    in_words = chat_role_scorer(args.role, payloads, chat, args.max_new_tokens,
                                blind=args.blind, corrective=args.corrective,
                                agreement=args.agreement)

    def score(model: Any, tokenizer: Any) -> float:
        use = in_words if chat.uses_template(tokenizer) else compact
        return use(model, tokenizer)

    return score, args.size


def cmd_eval_run(args: argparse.Namespace) -> int:
    import torch

    from astraflow.cli.main import kafka_config
    from astraflow.models.loading import load_policy
    from astraflow.models.share import ensure_model

    scorer, n_prompts = held_out_scorer(args)
    topo = args.loaded_topology
    config = kafka_config(args, topo.component_kafka(f"eval.{args.policy}"))
    torch.set_num_threads(1)
    verifier = verifier_for(topo.weight_signing, getattr(args, "public_key", None))
    path = ensure_model(args.model, config, topo, args.policy, verifier=verifier)
    model, tokenizer = load_policy(path, dtype=args.dtype)

    def score() -> float:
        return scorer(model, tokenizer)

    if args.history:
        curve = _history(args, topo, config, model, score, verifier)
        print(f"{len(curve)} versions evaluated: {args.history}")
        return 0
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    _follow(args, topo, config, stop, model, score, n_prompts, verifier)
    return 0


def _history(args, topo, config, model, score, verifier=None) -> list[tuple[int, float]]:
    """Accuracy of every ``--every``-th published version, oldest first (versions whose
    blobs were pruned are skipped, said in the log). With a ``verifier`` (signed weights)
    a manifest it refuses is never used: each refusal is printed with the reason."""
    from astraflow.weights import WeightFollower
    from astraflow.weights.stores.kafka import read_manifests

    topic = topo.full_name(f"weights.{args.policy}")
    manifests, refused = split_trusted(
        [m for m in read_manifests(config, topic) if m.policy == args.policy], verifier)
    for _, why in refused:
        print(f"refused: {why}; not used", flush=True)
    versions = sorted({m.version for m in manifests if m.version % args.every == 0})
    curve = dict(_curve_so_far(args.history, args.every, topo.run, args.policy))
    follower = WeightFollower(policy=args.policy, kafka_config=config, verifier=verifier)
    follower.observe(manifests)  # the trusted ones only
    t0 = time.time()
    try:
        for i, v in enumerate(versions):
            if v in curve:
                continue
            result = _reach(follower, v, args.policy)
            if result is None or result.version != v:
                continue
            model.load_state_dict(follower.state)
            curve[v] = score()
            write_curve(args.history, topo.run, args.policy, args.every, sorted(curve.items()),
                        png=False)
            print(f"eval {args.policy} v{v} accuracy {curve[v]:.4f} ({i + 1}/"
                  f"{len(versions)}, {time.time() - t0:.0f}s)", flush=True)
    finally:
        follower.close()
    write_curve(args.history, topo.run, args.policy, args.every, sorted(curve.items()))
    return sorted(curve.items())


def _curve_so_far(path: str, every: int, run: str, policy: str) -> list[tuple[int, float]]:
    """The points of an earlier ``--history`` run of the same run, policy and ``every``
    into ``path``."""
    from pathlib import Path

    p = Path(path)
    try:
        old = json.loads(p.read_text())
    except (OSError, ValueError):  # none yet, or not a curve: start afresh
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


def _follow(args, topo, config, stop, model, score, n_prompts: int, verifier=None) -> None:
    """Evaluate every ``--every``-th version as it is published (the newest due one),
    waiting out broker outages up to the outage limit."""
    from astraflow.kafka.clients import RecordProducer
    from astraflow.kafka.loop import Outage
    from astraflow.kafka.table import TopicTable
    from astraflow.weights import WeightFollower
    from astraflow.weights.history import manifest_key
    from astraflow.wire.records import WeightManifest

    follower = WeightFollower(policy=args.policy, kafka_config=config, verifier=verifier)
    producer = RecordProducer(config)
    component = f"eval-{args.policy}/{socket.gethostname()}"
    outage = Outage(component, config.bootstrap_servers or "?", config.outage_limit_s,
                    config.outage_log_interval_s)
    topic = topo.full_name(f"weights.{args.policy}")
    # the weights topic as a table of its manifests, read incrementally (it only grows)
    manifests = _answered(outage, stop, lambda: TopicTable.open(
        config, topic, WeightManifest, codec=producer.codec, client_id=f"eval-{args.policy}",
        key=lambda e: manifest_key(e.value) if e.value is not None else None))
    if manifests is not None:
        manifests.on_change(lambda _k, _old, new: new is not None and follower.observe(new))
    done: set[int] = set()
    while manifests is not None and not stop.is_set():
        try:
            manifests.poll(1.0)
            _dead_letter_refused(follower, producer, topo, component)
            versions = sorted({m.version for m in follower.manifests})  # trusted ones
            if args.once:
                if not versions:  # nothing read yet: the topic may still be arriving
                    continue
                wanted = versions[-1:]
            else:
                wanted = [v for v in versions if v % args.every == 0 and v not in done]
            for due in wanted[-1:]:  # the newest due version; older ones are history
                result = _reach(follower, due, args.policy)
                done.update(x for x in wanted if x <= due)
                if result is not None:
                    _report(args, topo, component, producer, result, follower, model, score,
                            n_prompts)
            outage.ok()
        except KafkaException as e:  # the broker is away: wait for it (up to the limit)
            if not transient(kafka_error(e)):
                raise
            outage.failed(str(e))
        if args.once:
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


def _report(args, topo, component, producer, result, follower, model, score,
            n_prompts: int) -> None:
    """Evaluate the follower's version and publish the accuracy on ``status``."""
    v = result.version
    model.load_state_dict(follower.state)
    t0 = time.time()
    acc = score()
    log.info("%s v%d: eval/accuracy %.3f on %d held-out prompts (%.1fs, plan %s)",
             args.policy, v, acc, n_prompts, time.time() - t0, getattr(result, "steps", ""))
    print(f"eval {args.policy} v{v} accuracy {acc:.4f}", flush=True)
    sink = StatusSink(producer, topo.full_name("status"), component, "evaluator", args.policy)
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
