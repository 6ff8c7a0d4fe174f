"""``astraflow raas run``: one RaaS node of a pool.

``register(subparsers)`` adds the ``raas`` command group; ``astraflow.cli.main`` wires it in.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any

from astraflow.cli.args import Option, add_command, add_group, add_run_options, add_table


def _speed(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a fraction above 0 and at most 1")
    return value


def _kv(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name or not value:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name, value


def _workflow_option(text: str) -> tuple[str, dict[str, Any]]:
    name, value = _kv(text)
    try:
        opts = json.loads(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{name}: not JSON: {e}") from None
    if not isinstance(opts, dict):
        raise argparse.ArgumentTypeError(f"{name}: expected a JSON object")
    return name, opts


def _chat_option(text: str) -> tuple[str, Any]:
    from astraflow.models.chat import ChatFormat

    name, value = _workflow_option(text)
    try:
        return name, ChatFormat.from_options(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{name}: {e}") from None


def _check_workflows(options: dict[str, dict[str, Any]]) -> None:
    """Build every configured workflow once, so bad options fail at start, not per task."""
    from astraflow.raas.workflows import make_workflow

    for name, opts in options.items():
        try:
            make_workflow(name, **opts)
        except Exception as e:  # noqa: BLE001 - reported as one line naming the workflow
            raise SystemExit(f"astraflow raas run: --workflow-options {name}: {e}") from None


ENGINES = ("torch", "vllm", "openai")
TORCH_OPTIONS = ("device", "dtype", "prefix_cache_mib")


def _engine_options(text: str) -> dict[str, Any]:
    try:
        opts = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(opts, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return opts


def check_engine_options(kind: str, options: dict[str, Any]) -> None:
    """``ValueError`` naming the first option ``kind``'s engine does not know (nothing is
    loaded or imported from vLLM here)."""
    if kind == "torch":
        for key in options:
            if key not in TORCH_OPTIONS:
                raise ValueError(f"unknown torch engine option {key!r} "
                                 f"(known: {', '.join(TORCH_OPTIONS)})")
    elif kind == "vllm":
        from astraflow.raas.vllm_engine import VLLMOptions

        VLLMOptions.from_dict(options)
    elif kind == "openai":
        from astraflow.raas.openai_engine import OpenAIOptions

        OpenAIOptions.from_dict(options)
    else:
        raise ValueError(f"unknown engine {kind!r} (known: {', '.join(ENGINES)})")


def load_engine(args: argparse.Namespace, policy: str, path: str) -> Any:
    """The engine of ``policy`` from ``args.engine`` and ``args.engine_options``; the
    ``--device``/``--dtype``/``--prefix-cache-mib`` flags are defaults the options
    override."""
    opts = dict(args.engine_options or {})
    if args.engine == "vllm":
        from astraflow.raas.vllm_engine import load_vllm_engine

        if args.dtype and "dtype" not in opts:
            opts["dtype"] = args.dtype
        return load_vllm_engine(path, policy, **opts)
    if args.engine == "openai":
        from astraflow.raas.openai_engine import load_openai_engine

        return load_openai_engine(path, policy, **opts)
    from astraflow.raas.engine import load_torch_engine

    mib = float(opts.get("prefix_cache_mib", args.prefix_cache_mib))
    return load_torch_engine(path, policy, device=opts.get("device", args.device),
                             dtype=opts.get("dtype", args.dtype),
                             prefix_cache_bytes=int(mib * 2**20))


def node_options(args: argparse.Namespace) -> Any:
    """The ``NodeOptions`` of parsed ``raas run`` flags (``--workflow-options`` not checked
    here: ``cmd_raas_run`` builds each workflow once first)."""
    from astraflow.raas.node import NodeOptions

    return NodeOptions(
        pool=args.pool,
        instance=args.instance,
        n_samples=args.n_samples,
        tasks_per_transaction=args.tasks_per_transaction,
        session_timeout_ms=args.session_timeout_ms,
        speed=args.speed,
        follow_weights=not args.no_follow_weights,
        workflow_options=dict(args.workflow_options or []),
    )


def node_rack(args: argparse.Namespace) -> str | None:
    """The node's own rack: ``--rack``, else ``$ASTRAFLOW_RACK``, else None (the pool's
    ``rack`` from the topology then applies); ``ValueError`` naming the flag or variable
    for a bad name."""
    from astraflow.kafka.config import RACK_ENV, check_rack

    if args.rack is not None:
        return check_rack(args.rack, "--rack")
    env = os.environ.get(RACK_ENV)
    return check_rack(env, RACK_ENV) if env else None


def cmd_raas_run(args: argparse.Namespace) -> int:
    try:  # before the imports below (torch): a bad name fails at once
        rack = node_rack(args)
    except ValueError as e:
        print(f"astraflow raas run: {e}", file=sys.stderr)
        return 2
    from astraflow.cli.main import kafka_config, stop_on_signals
    from astraflow.config.topology import load_topology
    from astraflow.models.errors import ModelError
    from astraflow.models.share import ensure_model
    from astraflow.raas.node import RaaSNode
    from astraflow.raas.vllm_engine import VLLMNotInstalled

    log = logging.getLogger("astraflow.raas")
    try:
        check_engine_options(args.engine, dict(args.engine_options or {}))
    except ValueError as e:
        print(f"astraflow raas run: --engine-options: {e}", file=sys.stderr)
        return 2
    topo = args.loaded_topology = (
        getattr(args, "loaded_topology", None) or load_topology(args.topology)
    )
    # the pool's `kafka:` and rack applied, then the pool's own credentials
    config = kafka_config(args, topo.component_kafka(f"pool.{args.pool}",
                                                     topo.pool_kafka(args.pool, rack)))
    workflow_options = dict(args.workflow_options or [])
    _check_workflows(workflow_options)
    chats = dict(args.chat or [])
    unknown = sorted(set(chats) - {p for p, _ in args.policy_model})
    if unknown:
        raise SystemExit(f"astraflow raas run: --chat {unknown[0]}: no such --policy-model")
    engines = {}
    for policy, path in args.policy_model:
        if policy in engines:
            print(f"astraflow raas run: policy {policy!r} given twice", file=sys.stderr)
            return 2
        try:
            if args.engine != "openai":  # a missing local model comes from the weight stream
                path = str(ensure_model(path, config, topo, policy))
            engines[policy] = load_engine(args, policy, path)
        except (VLLMNotInstalled, ModelError, ValueError) as e:
            print(f"astraflow raas run: policy {policy!r}: {e}", file=sys.stderr)
            return 2
        if policy in chats:
            engines[policy].chat = chats[policy]
        log.info("policy %s: %s engine on %s (version %d)", policy, args.engine, path,
                 engines[policy].version)
    node = RaaSNode(topo, engines, node_options(args), config=config)

    stop_on_signals(node.stop, log, "finishing the current task, then leaving the group")
    c = node.run()
    print(
        f"{node.component_id}: consumed {c.consumed}, produced {c.produced}, "
        f"dead-lettered {c.dead_lettered}, {c.transactions} transactions, "
        f"{c.gen_tokens} tokens generated"
    )
    return 0


_EXAMPLES = [
    "astraflow raas run -t topology/default.yaml --pool local --policy-model "
    "actor=runs/default/model",
    "astraflow raas run -t topology/smollm2.yaml --pool local --instance gpu-0 "
    "--policy-model actor=models/smollm2 --engine vllm",
    "astraflow raas run -t topology/solver-verifier.yaml --pool local "
    "--policy-model solver=DIR1 --policy-model verifier=DIR2",
]

_NODE: list[Option] = [
    (("--policy-model", "--model"), dict(
        required=True, action="append", type=_kv, metavar="POLICY=PATH",
        help="a local transformers model directory per policy (repeatable)")),
    (("--chat",), dict(
        action="append", type=_chat_option, metavar="POLICY=JSON",
        help='prompt format of a policy (astraflow.models.chat), e.g. actor=\'{"template": "auto", '
        '"system_prompt": "Answer with the number only."}\' (repeatable)')),
    (("--pool",), dict(default="default", help="pool name (its settings under pools: of the "
                       "topology); the nodes join group <run>.raas, or <run>.raas.<pool> for "
                       "a pool with share_tasks: false")),
    (("--instance",), dict(help="instance id, unique per running node (default: "
                           "$ASTRAFLOW_INSTANCE or host name)")),
    (("--rack",), dict(help="the node's rack or region: every consumer of the node sets "
                       "client.rack to it and fetches from the replica in that rack, on "
                       "brokers with RackAwareReplicaSelector (default: $ASTRAFLOW_RACK, "
                       "else the pool's rack in the topology)")),
    (("--n-samples",), dict(type=int, default=4, metavar="N", help="samples per task")),
    (("--tasks-per-transaction",), dict(type=int, default=1, metavar="K")),
    (("--session-timeout-ms",), dict(type=int, default=10_000)),
    (("--speed",), dict(type=_speed, default=1.0, metavar="F", help="run at this fraction of "
                        "the node's speed (0 < F <= 1): each rollout batch is followed by a "
                        "pause of (1/F - 1) times its duration (unequal pools in tests and "
                        "benches)")),
    (("--no-follow-weights",), dict(action="store_true", help="keep the initial weights; do "
                                    "not follow weights.<policy>")),
    (("--workflow-options",), dict(
        action="append", type=_workflow_option, metavar="NAME=JSON",
        help='options of one workflow, e.g. tool_calc=\'{"max_turns": 3, "tool_latency": '
        '{"dist": "pareto", "scale_s": 0.05, "alpha": 1.2}}\' (repeatable)')),
]

_ENGINE: list[Option] = [
    (("--engine",), dict(
        choices=ENGINES, default="torch",
        help="rollout engine of the node's policies: torch (in-tree), vllm (vLLM in this "
        "process; needs `bash scripts/vllm-env`), openai (an OpenAI-compatible server)")),
    (("--engine-options",), dict(
        type=_engine_options, metavar="JSON",
        help='engine options as a JSON object, e.g. \'{"max_model_len": 1024, "cpus": 2}\' '
        "(vllm) or '{\"base_url\": \"http://127.0.0.1:8000/v1\"}' (openai); an unknown key "
        "fails at start")),
    (("--device",), dict(default="cpu", help="torch device (torch engine)")),
    (("--dtype",), dict(default=None, help="model dtype (default: as saved)")),
    (("--prefix-cache-mib",), dict(
        type=float, default=256.0, metavar="MIB",
        help="keys/values of earlier generations kept per policy for prompts that continue "
        "them (multi-turn workflows); 0 turns it off")),
]


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``raas`` command group to ``subparsers`` (from ``add_subparsers``)."""
    verbs = add_group(subparsers, "raas", help="rollout-as-a-service nodes",
                      dest="raas_command", examples=_EXAMPLES[:1])
    run = add_command(
        verbs, "run",
        help="run one RaaS node: consume tasks, produce trajectory groups until SIGTERM",
        description="Join the pool's consumer group on <run>.tasks, run each task's workflow "
        "against the node's policy engines, and produce its trajectory group to "
        "<run>.trajectories.raw; follow weights.<policy> to keep each policy current.",
        examples=_EXAMPLES,
    )
    add_run_options(run)
    add_table(run, None, _NODE)
    add_table(run, "engine", _ENGINE)
    run.set_defaults(func=cmd_raas_run)
    return subparsers.choices["raas"]
