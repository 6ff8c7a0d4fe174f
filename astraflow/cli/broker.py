"""``astraflow broker start|stop|status|logs|secure-config``: the embedded broker or cluster."""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from astraflow.broker.embedded import EmbeddedBroker, parse_remote_listener
from astraflow.cli.args import (
    add_cluster_options,
    add_command,
    add_group,
)
from astraflow.errors import AstraflowError


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


def register(subparsers: Any) -> None:
    """Add the ``broker`` command group to ``astraflow``."""
    _add_broker(subparsers)
