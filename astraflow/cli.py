"""The ``astraflow`` command."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import time
from collections.abc import Callable

from astraflow.broker import BrokerError, EmbeddedBroker
from astraflow.errors import AstraflowError
from astraflow.kafka.config import KafkaConfig
from astraflow.topology import Topology, TopologyError, load_topology

Handler = Callable[[argparse.Namespace], int]


def kafka_config(args: argparse.Namespace) -> KafkaConfig:
    """The topology's Kafka config, ``--bootstrap`` applied, then made effective
    (``ASTRAFLOW_BOOTSTRAP`` wins, else the embedded broker)."""
    topology: Topology | None = getattr(args, "loaded_topology", None)
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
    import os

    if os.environ.get("ASTRAFLOW_BOOTSTRAP"):
        print(
            f"ASTRAFLOW_BOOTSTRAP={os.environ['ASTRAFLOW_BOOTSTRAP']}: using that cluster, "
            "no embedded broker started"
        )
        return 0
    broker = EmbeddedBroker()
    before = broker.status()
    st = broker.start(port=args.port)
    if before.running:
        print(f"already running: {st.describe()}")
    else:
        print(st.describe())
    return 0


def cmd_broker_stop(args: argparse.Namespace) -> int:
    broker = EmbeddedBroker()
    if args.purge:
        broker.destroy()
        print(f"embedded broker stopped and its state removed ({broker.state})")
    elif broker.stop():
        print("embedded broker stopped")
    else:
        print("embedded broker was not running")
    return 0


def cmd_broker_status(args: argparse.Namespace) -> int:
    st = EmbeddedBroker().status()
    print(st.describe())
    return 0 if st.running else 3


def cmd_broker_logs(args: argparse.Namespace) -> int:
    broker = EmbeddedBroker()
    print(broker.tail(args.lines))
    if args.follow:
        with open(broker.log_file) as f:
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
    return 0


# --- topics and lag ----------------------------------------------------------------------
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
    prefix = f"{args.loaded_topology.run}." if args.loaded_topology else ""
    for name in sorted(topics):
        if name.startswith("__") or not name.startswith(prefix):
            continue
        print(f"{name}  ({len(topics[name].partitions)} partitions)")
    return 0


def cmd_topics_describe(args: argparse.Namespace) -> int:
    from astraflow.kafka.clients import make_admin
    from astraflow.kafka.topics import describe_topic

    config = kafka_config(args)
    name = args.topic
    if args.loaded_topology and not name.startswith(f"{args.loaded_topology.run}."):
        name = args.loaded_topology.full_name(name)
    print(json.dumps(describe_topic(make_admin(config), name), indent=2))
    return 0


def cmd_lag(args: argparse.Namespace) -> int:
    from astraflow.kafka.lag import LagReader, format_lag_table

    config = kafka_config(args)
    pairs: list[tuple[str, list[str]]] = []
    topo: Topology | None = args.loaded_topology
    if args.group:
        topics = args.topic or []
        if topo:
            topics = [t if t.startswith(f"{topo.run}.") else topo.full_name(t) for t in topics]
        if not topics:
            print(
                "astraflow lag: --group needs --topic (or a --topology naming the group's "
                "processor)",
                file=sys.stderr,
            )
            return 2
        pairs.append((args.group, topics))
    elif topo:
        for name, spec in topo.processors.items():
            pairs.append((topo.group_of(name), [topo.full_name(t) for t in spec.inputs]))
    else:
        print("astraflow lag: give --topology FILE, or --group G --topic T", file=sys.stderr)
        return 2
    reader = LagReader(config)
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
    from astraflow.kafka.runtime import ProcessorRuntime

    topo: Topology = args.loaded_topology
    runtime = ProcessorRuntime(topo, args.name, instance=args.instance, config=kafka_config(args))

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
    parser = argparse.ArgumentParser(
        prog="astraflow",
        description="Asynchronous dataflow RL over Apache Kafka.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument(
        "--debug", action="store_true", help="debug logging, and a traceback with any error"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def with_topology(p: argparse.ArgumentParser, required: bool) -> None:
        p.add_argument(
            "--topology",
            "-t",
            required=required,
            metavar="FILE",
            help="topology YAML (topic prefix, Kafka settings)",
        )
        p.add_argument(
            "--bootstrap",
            help="bootstrap servers (overrides the topology; ASTRAFLOW_BOOTSTRAP overrides both)",
        )

    broker = sub.add_parser("broker", help="the embedded single-node Apache Kafka broker")
    bsub = broker.add_subparsers(dest="action", required=True, metavar="ACTION")
    p = bsub.add_parser("start", help="start it (fetching the jars on first use)")
    p.add_argument("--port", type=int, default=None, help="listener port (default 19092)")
    p.set_defaults(func=cmd_broker_start)
    p = bsub.add_parser("stop", help="stop it")
    p.add_argument("--purge", action="store_true", help="also delete its data and logs")
    p.set_defaults(func=cmd_broker_stop)
    bsub.add_parser("status", help="is it running, and where").set_defaults(func=cmd_broker_status)
    p = bsub.add_parser("logs", help="print its log")
    p.add_argument("-n", "--lines", type=int, default=50)
    p.add_argument("-f", "--follow", action="store_true")
    p.set_defaults(func=cmd_broker_logs)

    topics = sub.add_parser("topics", help="create and inspect a run's topics")
    tsub = topics.add_subparsers(dest="action", required=True, metavar="ACTION")
    p = tsub.add_parser("apply", help="create or update the topics of a topology (idempotent)")
    p.add_argument("topology", metavar="FILE")
    p.add_argument("--bootstrap")
    p.set_defaults(func=cmd_topics_apply)
    p = tsub.add_parser("list", help="list topics (of one run with --topology)")
    with_topology(p, required=False)
    p.set_defaults(func=cmd_topics_list)
    p = tsub.add_parser("describe", help="partitions and configs of a topic")
    p.add_argument("topic")
    with_topology(p, required=False)
    p.set_defaults(func=cmd_topics_describe)

    p = sub.add_parser("lag", help="consumer-group lag per partition")
    with_topology(p, required=False)
    p.add_argument("--group", "-g", help="one consumer group (default: every processor's)")
    p.add_argument("--topic", action="append", help="topic of --group (repeatable)")
    p.set_defaults(func=cmd_lag)

    proc = sub.add_parser("processor", help="run stream processors")
    psub = proc.add_subparsers(dest="action", required=True, metavar="ACTION")
    p = psub.add_parser("run", help="run one processor of a topology until SIGTERM")
    p.add_argument("name")
    with_topology(p, required=True)
    p.add_argument(
        "--instance",
        help="instance id, unique per running copy (default: $ASTRAFLOW_INSTANCE or the host name)",
    )
    p.set_defaults(func=cmd_processor_run)
    p = psub.add_parser("list", help="processor kinds, or a topology's processors")
    with_topology(p, required=False)
    p.set_defaults(func=cmd_processor_list)

    for register in _extension_registrars():
        register(sub)
    return parser


# component command groups; each module keeps its heavy imports (torch) inside handlers
_EXTENSIONS = (
    "astraflow.weights.cli",
    "astraflow.trainer.cli",
    "astraflow.model",
    "astraflow.roles",  # model init-role: adds to the `model` group, so after astraflow.model
    "astraflow.feeder",
    "astraflow.raas.cli",
    "astraflow.evaluator",
    "astraflow.tasks.generate",
    "astraflow.launcher",
)


def _extension_registrars() -> list[Callable[[argparse._SubParsersAction], None]]:
    import importlib

    return [importlib.import_module(name).register for name in _EXTENSIONS]


def main(argv: list[str] | None = None) -> int:
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
        path = getattr(args, "topology", None)
        if isinstance(path, str) and path:
            args.loaded_topology = load_topology(path)
        else:
            args.loaded_topology = None
        return args.func(args)
    except (TopologyError, BrokerError, AstraflowError) as e:
        if args.debug:
            raise
        print(f"astraflow: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
