"""The ``astraflow`` command: the parser made of every command module's ``register``, and
``main``, which runs one command and turns an error a user can fix into one line."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from confluent_kafka import KafkaError, KafkaException

from astraflow.broker.embedded import BrokerError
from astraflow.cli.args import (
    examples_epilog,
    fill,
)
from astraflow.cli.context import kafka_config, load_run_topology
from astraflow.config.topology import TopologyError
from astraflow.errors import AstraflowError
from astraflow.kafka.access import EXIT_REFUSED, KafkaAccessError, refusal

Handler = Callable[[argparse.Namespace], int]


def build_parser() -> argparse.ArgumentParser:
    """The whole ``astraflow <noun> <verb>`` tree: the global options, then each command
    module's of ``_EXTENSIONS`` (one module a noun)."""
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
    for register in _extension_registrars():
        register(sub)
    return parser


# the command modules, one a noun, in the order `astraflow --help` lists them; each keeps
# its heavy imports (torch) inside its handlers
_EXTENSIONS = (
    "astraflow.cli.broker",
    "astraflow.cli.topics",  # topics, and groups
    "astraflow.cli.processor",
    "astraflow.cli.weights",
    "astraflow.cli.trainer",
    "astraflow.cli.model",
    "astraflow.cli.model_role",  # model init-role: adds to the `model` group, so after models.cli
    "astraflow.cli.model_export",  # model export: adds to the `model` group too
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
