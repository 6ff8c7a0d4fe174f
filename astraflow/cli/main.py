"""The ``astraflow`` command."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from confluent_kafka import KafkaError, KafkaException

from astraflow.broker.embedded import BrokerError, EmbeddedBroker, parse_remote_listener
from astraflow.cli.args import (
    add_cluster_options,
    add_command,
    add_group,
    add_run_options,
    examples_epilog,
    fill,
)
from astraflow.config.topology import (  # with_overrides: also for cli.replay
    Topology,
    TopologyError,
    load_topology,
    with_overrides,
)
from astraflow.errors import AstraflowError
from astraflow.kafka.access import EXIT_REFUSED, KafkaAccessError, refusal
from astraflow.kafka.config import KafkaConfig

Handler = Callable[[argparse.Namespace], int]


def kafka_config(args: argparse.Namespace, base: KafkaConfig | None = None) -> KafkaConfig:
    """The topology's Kafka config (or ``base``: a pool's), ``--bootstrap`` applied, then
    made effective (``ASTRAFLOW_BOOTSTRAP`` wins, else the embedded broker)."""
    topology: Topology | None = getattr(args, "loaded_topology", None)
    if base is None:
        base = topology.kafka if topology else KafkaConfig()
    if getattr(args, "bootstrap", None):
        base = base.model_copy(update={"bootstrap_servers": args.bootstrap})
    return base.effective()


def stop_on_signals(stop: Callable[[], None], log: logging.Logger, doing: str) -> None:
    """On SIGTERM or SIGINT, log what the component still does (``doing``) and ``stop()``."""

    def on_signal(signum, _frame):
        log.info("signal %d: %s", signum, doing)
        stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)


# --- broker ------------------------------------------------------------------------------
def cmd_broker_start(args: argparse.Namespace) -> int:
    if os.environ.get("ASTRAFLOW_BOOTSTRAP"):
        print(
            f"ASTRAFLOW_BOOTSTRAP={os.environ['ASTRAFLOW_BOOTSTRAP']}: using that cluster, "
            "no embedded broker started"
        )
        return 0
    if args.brokers > 1 or args.racks:
        return _start_cluster(args)
    broker = EmbeddedBroker()
    before = broker.status()
    st = broker.start(port=args.port, remote_listener=args.remote_listener,
                      secure=True if args.secure else None)
    if before.running:
        print(f"already running: {st.describe()}")
    else:
        print(st.describe())
    return 0


def _start_cluster(args: argparse.Namespace) -> int:
    """``broker start --brokers N``: the embedded cluster (``astraflow.broker.cluster``)."""
    from astraflow.broker.cluster import DEFAULT_CLUSTER_PORT, EmbeddedCluster, parse_racks

    if args.secure or args.remote_listener:
        flag = "--secure" if args.secure else "--remote-listener"
        raise AstraflowError(f"{flag} is available on the single embedded broker only, "
                             "not with --brokers")
    cluster = EmbeddedCluster(size=args.brokers, racks=parse_racks(args.racks))
    running = all(cluster.pid(i) is not None for i in cluster.node_ids)
    st = cluster.start(timeout=args.timeout, base_port=args.port or DEFAULT_CLUSTER_PORT)
    print(("already running: " if running else "") + st.describe())
    return 0


def cmd_broker_secure_config(args: argparse.Namespace) -> int:
    """``astraflow broker secure-config``: a secured Kafka's files, never a password shown."""
    from pathlib import Path

    from astraflow.broker.secure import write_cluster_config

    write_cluster_config(Path(args.out), args.host, args.port, args.controller_port,
                         args.data, weights_keys=args.weights_keys)
    return 0


def cmd_broker_stop(args: argparse.Namespace) -> int:
    from astraflow.broker.cluster import EmbeddedCluster

    broker, cluster = EmbeddedBroker(), EmbeddedCluster.recorded()
    for name, kafka in (("embedded broker", broker), ("embedded cluster", cluster)):
        if args.purge:
            existed = kafka.state.exists()
            kafka.destroy()
            if existed:
                print(f"{name} stopped and its state removed ({kafka.state})")
        elif kafka.stop():
            print(f"{name} stopped")
        elif name == "embedded broker" or cluster.info_file.exists():
            print(f"{name} was not running")
    return 0


def cmd_broker_status(args: argparse.Namespace) -> int:
    from astraflow.broker.cluster import EmbeddedCluster

    st = EmbeddedBroker().status()
    print(st.describe())
    cluster = EmbeddedCluster.recorded()
    if not cluster.info_file.exists():
        return 0 if st.running else 3
    cst = cluster.status()
    print(cst.describe())
    return 0 if st.running or cst.running else 3


def cmd_broker_logs(args: argparse.Namespace) -> int:
    from astraflow.broker.cluster import EmbeddedCluster

    cluster = EmbeddedCluster.recorded()
    if args.node is not None:
        if not cluster.info_file.exists():
            raise AstraflowError(f"--node {args.node}: the embedded cluster ({cluster.state}) "
                                 "has no state: `astraflow broker start --brokers N` first")
        if args.node not in cluster.node_ids:
            raise AstraflowError(f"--node {args.node}: the embedded cluster "
                                 f"({cluster.state}) has nodes {cluster.node_ids}")
        log_file = cluster.log_file(args.node)
        print(cluster.tail(args.lines, args.node))
    elif cluster.running_bootstrap() and not EmbeddedBroker().status().running:
        print(cluster.tail(args.lines))  # every node's; -f takes --node
        return 0
    else:
        log_file = EmbeddedBroker().log_file
        print(EmbeddedBroker().tail(args.lines))
    if args.follow:
        _follow(log_file)
    return 0


def _follow(path) -> None:
    """Print the lines appended to ``path`` until Ctrl-C."""
    with open(path) as f:
        f.seek(0, 2)
        try:
            while True:
                line = f.readline()
                if line:
                    print(line, end="")
                else:
                    time.sleep(0.5)
        except KeyboardInterrupt:
            pass


# --- topics and groups -------------------------------------------------------------------
def run_name(args: argparse.Namespace) -> str | None:
    """The run a command works on: the loaded topology's (``--run`` applied), else ``--run``
    or ``$ASTRAFLOW_RUN`` alone (commands whose topology is optional), else ``None``."""
    topo: Topology | None = getattr(args, "loaded_topology", None)
    if topo is not None:
        return topo.run
    return getattr(args, "run", None) or os.environ.get("ASTRAFLOW_RUN") or None


def _full_name(run: str | None, topic: str) -> str:
    """``topic`` with the run prefix, unless it has it already (or there is no run)."""
    return topic if run is None or topic.startswith(f"{run}.") else f"{run}.{topic}"


def cmd_topics_apply(args: argparse.Namespace) -> int:
    from astraflow.kafka.clients import make_admin
    from astraflow.kafka.topics import apply_topics

    topo: Topology = args.loaded_topology
    config = kafka_config(args)
    changes = apply_topics(make_admin(config), topo.resolved_topics())
    for c in changes:
        print(f"{c.action:9}  {c.topic}" + (f"  ({c.detail})" if c.detail else ""))
    print(f"{len(changes)} topics of run {topo.run!r} on {config.bootstrap_servers}")
    return 0


def cmd_topics_list(args: argparse.Namespace) -> int:
    from astraflow.kafka.clients import make_admin

    config = kafka_config(args)
    topics = make_admin(config).list_topics(timeout=10).topics
    run = run_name(args)
    prefix = f"{run}." if run else ""
    for name in sorted(topics):
        if name.startswith("__") or not name.startswith(prefix):
            continue
        print(f"{name}  ({len(topics[name].partitions)} partitions)")
    return 0


def cmd_topics_describe(args: argparse.Namespace) -> int:
    from astraflow.kafka.clients import make_admin
    from astraflow.kafka.topics import describe_topic

    config = kafka_config(args)
    name = _full_name(run_name(args), args.topic)
    print(json.dumps(describe_topic(make_admin(config), name), indent=2))
    return 0


def cmd_groups_lag(args: argparse.Namespace) -> int:
    from astraflow.kafka.lag import LagReader, format_lag_table

    pairs: list[tuple[str, list[str]]] = []
    topo: Topology | None = args.loaded_topology
    if args.group:
        topics = [_full_name(run_name(args), t) for t in args.topic or []]
        if not topics:
            raise AstraflowError(
                "groups lag: --group needs --topic (or a --topology naming the group's "
                "processor)"
            )
        pairs.append((args.group, topics))
    elif topo:  # every group: processors, RaaS pools, trainers
        for _, group, inputs in topo.consumer_groups():
            pairs.append((group, [topo.full_name(t) for t in inputs]))
    else:
        raise AstraflowError("groups lag: give --topology FILE, or --group G --topic T")
    reader = LagReader(kafka_config(args))
    rows = []
    try:
        for group, topics in pairs:
            rows += reader.lag(group, topics)
    finally:
        reader.close()
    print(format_lag_table(rows))
    return 0


# --- processors --------------------------------------------------------------------------
def cmd_processor_run(args: argparse.Namespace) -> int:
    from astraflow.dataflow.runtime import ProcessorRuntime

    topo: Topology = args.loaded_topology
    runtime = ProcessorRuntime(topo, args.name, instance=args.instance, config=kafka_config(
        args, topo.component_kafka(f"processor.{args.name}")))

    stop_on_signals(runtime.stop, logging.getLogger("astraflow"), "finishing the open transaction")
    counters = runtime.run()
    print(
        f"{runtime.component_id}: consumed {counters.consumed}, produced {counters.produced}, "
        f"dead-lettered {counters.dead_lettered}, {counters.transactions} transactions"
    )
    return 0


def cmd_processor_list(args: argparse.Namespace) -> int:
    from astraflow.dataflow import PROCESSOR_KINDS

    topo: Topology | None = args.loaded_topology
    if topo is None:
        for kind, cls in sorted(PROCESSOR_KINDS.items()):
            doc = (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""
            print(f"{kind:20} {doc}")
        return 0
    for name, spec in topo.processors.items():
        print(f"{name:20} {spec.kind:16} {','.join(spec.inputs)} -> {','.join(spec.outputs)}")
    return 0


# --- parser ------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    """The whole ``astraflow <noun> <verb>`` tree: the groups here, then every module's of
    ``_EXTENSIONS``."""
    parser = argparse.ArgumentParser(
        prog="astraflow",
        description=fill(
            "Asynchronous dataflow RL over Apache Kafka. Every command is `astraflow <noun> "
            "<verb>` (`up` and `down` are shortcuts of `run up` and `run down`); those that "
            "work on a run take --topology/-t FILE, --run NAME and --bootstrap SERVERS."
        ),
        epilog=examples_epilog([
            "astraflow up topology/default.yaml             # the whole run, live progress",
            "astraflow topics list -t topology/default.yaml",
            "astraflow trainer run --help                   # every command has examples",
        ]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument(
        "--debug", action="store_true", help="debug logging, and a traceback with any error"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_broker(sub)
    _add_topics(sub)
    _add_groups(sub)
    _add_processor(sub)
    for register in _extension_registrars():
        register(sub)
    return parser


def _remote_listener(text: str) -> tuple[int, str]:
    try:
        return parse_remote_listener(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_broker(sub: Any) -> None:
    verbs = add_group(sub, "broker", help="the embedded Apache Kafka: a single-node broker, "
                      "or a cluster of KRaft nodes (--brokers)",
                      dest="action", examples=["astraflow broker start",
                                               "astraflow broker start --brokers 3",
                                               "astraflow broker stop --purge"])
    _add_broker_start(verbs)
    p = add_command(verbs, "secure-config", help="write the config, CA, certificate and "
                    "passwords of a secured Kafka of its own (docker compose --profile secure)",
                    examples=["astraflow broker secure-config --host kafka-secure --out "
                              "/secrets --weights-keys"])
    p.add_argument("--host", required=True, help="the broker's host name (its certificate "
                   "names it, and it is advertised)")
    p.add_argument("--port", type=int, default=9094, help="SASL_SSL client port (9094)")
    p.add_argument("--controller-port", type=int, default=9095, help="controller port (9095)")
    p.add_argument("--out", required=True, help="where the files go (kept when present)")
    p.add_argument("--data", default="/var/lib/kafka/data", help="the broker's log.dirs")
    p.add_argument("--weights-keys", action="store_true",
                   help="also a weight-signing key pair in OUT/keys")
    p.set_defaults(func=cmd_broker_secure_config)
    p = add_command(verbs, "stop", help="stop it",
                    examples=["astraflow broker stop", "astraflow broker stop --purge"])
    p.add_argument("--purge", action="store_true", help="also delete its data and logs")
    p.set_defaults(func=cmd_broker_stop)
    p = add_command(verbs, "status", help="is it running, and where; a cluster's nodes, "
                    "partition leaders and under-replicated partitions (exit 3: stopped)",
                    examples=["astraflow broker status"])
    p.set_defaults(func=cmd_broker_status)
    p = add_command(verbs, "logs", help="print its log (a cluster's: every node's)",
                    examples=["astraflow broker logs -n 200", "astraflow broker logs -f",
                              "astraflow broker logs --node 2 -f"])
    p.add_argument("-n", "--lines", type=int, default=50, help="last N lines (default 50)")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new lines")
    p.add_argument("--node", type=int, default=None, help="the cluster's node N only")
    p.set_defaults(func=cmd_broker_logs)


def _add_broker_start(verbs: Any) -> None:
    p = add_command(verbs, "start", help="start it (fetching the jars on first use)",
                    examples=["astraflow broker start", "astraflow broker start --port 29092",
                              "astraflow broker start --secure",
                              "astraflow broker start --brokers 3",
                              "astraflow broker start --brokers 3 --racks r1,r2,r3"])
    p.add_argument("--port", type=int, default=None, help="listener port (default 19092; "
                   "with --brokers: node 1's, the next ones count up, default 19192)")
    add_cluster_options(p, "start the embedded cluster, its ports kept across restarts")
    p.add_argument("--timeout", type=float, default=180.0,
                   help="with --brokers: seconds to wait for every node (default 180)")
    p.add_argument("--remote-listener", type=_remote_listener, default=None,
                   metavar="PORT=HOST:PORT",
                   help="a second listener (REMOTE) on 127.0.0.1:PORT that advertises "
                   "HOST:PORT, for clients that reach the broker through a proxy there "
                   "(kept across restarts; docs/operations.md, \"A remote pool over a slow "
                   "link\")")
    p.add_argument("--secure", action="store_true",
                   help="SASL_SSL (SCRAM-SHA-512) with a generated CA, and ACLs enforced "
                   "(nothing allowed without one); prints the CA and the admin credentials "
                   "file (docs/security.md)")
    p.set_defaults(func=cmd_broker_start)


def _add_topics(sub: Any) -> None:
    verbs = add_group(sub, "topics", help="create and inspect a run's topics", dest="action",
                      examples=["astraflow topics apply -t topology/default.yaml",
                                "astraflow topics list -t topology/default.yaml"])
    p = add_command(
        verbs, "apply", help="create or update the topics of a topology (idempotent)",
        description="Create the topology's missing topics, add partitions and set the configs "
        "of existing ones. Running it again changes nothing.",
        examples=["astraflow topics apply -t topology/default.yaml",
                  "astraflow topics apply -t topology/default.yaml --run trial2"
                  "   # a second run's topics",
                  "astraflow topics apply topology/default.yaml   # older spelling"])
    add_run_options(p, positional=True)
    p.set_defaults(func=cmd_topics_apply)
    p = add_command(verbs, "list", help="list topics (of one run with --topology or --run)",
                    examples=["astraflow topics list -t topology/default.yaml",
                              "astraflow topics list --run default",
                              "astraflow topics list   # every run's"])
    add_run_options(p, required=False)
    p.set_defaults(func=cmd_topics_list)
    p = add_command(verbs, "describe", help="partitions and configs of a topic",
                    examples=["astraflow topics describe tasks -t topology/default.yaml",
                              "astraflow topics describe default.weights.actor"])
    p.add_argument("topic", metavar="TOPIC",
                   help="the topic, with its run prefix or without (given a topology or --run)")
    add_run_options(p, required=False)
    p.set_defaults(func=cmd_topics_describe)


_LAG_EXAMPLES = ["astraflow groups lag -t topology/default.yaml   # every group of the run",
                 "astraflow groups lag --group default.batcher --topic default.samples.actor"]


def _add_lag(verbs: Any, name: str, hidden: bool = False) -> None:
    p = add_command(verbs, name, help="consumer-group lag per partition",
                    examples=_LAG_EXAMPLES, hidden=hidden)
    add_run_options(p, required=False)
    p.add_argument("--group", "-g", help="one consumer group (default: every processor's)")
    p.add_argument("--topic", action="append", metavar="TOPIC",
                   help="topic of --group (repeatable; the run prefix is added when missing)")
    p.set_defaults(func=cmd_groups_lag)


def _add_groups(sub: Any) -> None:
    verbs = add_group(sub, "groups", help="consumer groups: how far behind they are",
                      dest="action", examples=_LAG_EXAMPLES)
    _add_lag(verbs, "lag")
    _add_lag(sub, "lag", hidden=True)  # `astraflow lag`, the older spelling


def _add_processor(sub: Any) -> None:
    verbs = add_group(sub, "processor", help="run stream processors", dest="action",
                      examples=["astraflow processor list -t topology/default.yaml",
                                "astraflow processor run batcher -t topology/default.yaml"])
    p = add_command(
        verbs, "run", help="run one processor of a topology until SIGTERM",
        description="Run the processor NAME of the topology in its consumer group, its "
        "outputs and the offsets they came from committed together in Kafka transactions. "
        "Start more copies (each its own --instance) to share its partitions.",
        examples=["astraflow processor run batcher -t topology/default.yaml",
                  "astraflow processor run router -t topology/default.yaml --instance r2"])
    p.add_argument("name", metavar="NAME", help="the processor's name in the topology")
    add_run_options(p)
    p.add_argument(
        "--instance",
        help="instance id, unique per running copy (default: $ASTRAFLOW_INSTANCE or the host name)",
    )
    p.set_defaults(func=cmd_processor_run)
    p = add_command(verbs, "list", help="processor kinds, or a topology's processors",
                    examples=["astraflow processor list", "astraflow processor list -t "
                              "topology/default.yaml"])
    add_run_options(p, required=False, bootstrap=False)
    p.set_defaults(func=cmd_processor_list)


# component command groups; each module keeps its heavy imports (torch) inside handlers
_EXTENSIONS = (
    "astraflow.cli.weights",
    "astraflow.cli.trainer",
    "astraflow.cli.model",
    "astraflow.cli.model_role",  # model init-role: adds to the `model` group, so after models.cli
    "astraflow.cli.feeder",
    "astraflow.cli.raas",
    "astraflow.cli.eval",
    "astraflow.cli.data",
    "astraflow.cli.up",
    "astraflow.cli.runs",  # run list|delete: adds to the `run` group, so after launcher
    "astraflow.cli.plot",  # run plot, and the `plot` shortcut
    "astraflow.cli.topology",
    "astraflow.cli.status",
    "astraflow.cli.replay",
)


def _extension_registrars() -> list[Callable[[argparse._SubParsersAction], None]]:
    import importlib

    return [importlib.import_module(name).register for name in _EXTENSIONS]


def load_run_topology(args: argparse.Namespace) -> Topology | None:
    """The topology of ``--topology`` with ``--run`` (else ``$ASTRAFLOW_RUN``) and
    ``--bootstrap`` applied; ``None`` for a command without one."""
    path = getattr(args, "topology", None)
    if not (isinstance(path, str) and path):
        command = getattr(args, "topology_required", None)
        if command:
            raise AstraflowError(f"{command}: give the topology: --topology FILE")
        return None
    run = getattr(args, "run", None)
    if run is None and hasattr(args, "run"):  # a command with --run: the environment's
        run = os.environ.get("ASTRAFLOW_RUN") or None
    return with_overrides(load_topology(path), run, getattr(args, "bootstrap", None))


@contextmanager
def _exported_run(run: str | None) -> Iterator[None]:
    """``ASTRAFLOW_RUN=run`` while the command runs, so that the processes it starts
    (``up``'s components) work on the same run."""
    if not run:
        yield
        return
    before = os.environ.get("ASTRAFLOW_RUN")
    os.environ["ASTRAFLOW_RUN"] = run
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("ASTRAFLOW_RUN", None)
        else:
            os.environ["ASTRAFLOW_RUN"] = before


def _principal(args: argparse.Namespace) -> str:
    try:
        return kafka_config(args).principal()
    except (AstraflowError, ValueError):
        return "this client"


def _one_line(code: object) -> str:
    text = str(code)
    return text if text.startswith("astraflow") else f"astraflow: {text}"


def main(argv: list[str] | None = None) -> int:
    """Run one ``astraflow`` command; an error a user can fix is one line on stderr, exit 2
    (``--debug``: with its traceback)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose or args.debug else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.debug:  # librdkafka's own lines too (one per reconnect while a broker is away)
        from astraflow.kafka.config import LIBRDKAFKA_LOG

        LIBRDKAFKA_LOG.setLevel(logging.DEBUG)
    try:
        args.loaded_topology = load_run_topology(args)
        with _exported_run(getattr(args, "run", None)):
            return args.func(args)
    except KafkaAccessError as e:  # denied, bad credentials, a certificate: no restart helps
        if args.debug:
            raise
        print(_one_line(e), file=sys.stderr)
        return EXIT_REFUSED
    except (TopologyError, BrokerError, AstraflowError) as e:
        if args.debug:
            raise
        print(f"astraflow: {e}", file=sys.stderr)
        return 2
    except KafkaException as e:  # Kafka refused or did not answer a command's request
        if args.debug:
            raise
        err = e.args[0] if e.args else e
        refused = refusal(err if isinstance(err, KafkaError) else None,
                          _principal(args), "an operation")
        if refused is not None:
            print(_one_line(refused), file=sys.stderr)
            return EXIT_REFUSED
        print(f"astraflow: Kafka at {kafka_config(args).bootstrap_servers}: "
              f"{err.str() if hasattr(err, 'str') else err}", file=sys.stderr)
        return 2
    except SystemExit as e:  # a handler's `raise SystemExit("message")`
        if not isinstance(e.code, str) or args.debug:
            raise
        print(_one_line(e.code), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
