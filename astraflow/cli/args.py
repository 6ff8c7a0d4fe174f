"""Building blocks of the ``astraflow`` command line, shared by every command group.

Every command is ``astraflow <noun> <verb>``; each noun and verb has a description and an
``examples:`` epilog (``add_group``, ``add_command``). A command that works on a run takes
the same three options (``add_run_options``): ``--topology/-t FILE``, ``--run NAME`` (a
second run of the same file: another topic and group prefix) and ``--bootstrap``;
``astraflow.cli.main.main`` loads the topology and applies ``--run`` and ``--bootstrap`` once
for every command. This module imports nothing of AstraFlow, so that any layer's
``register(subparsers)`` may use it.
"""

from __future__ import annotations

import argparse
import textwrap
from collections.abc import Sequence
from typing import Any

EXAMPLES_HEADING = "examples:"
WIDTH = 88

# one option: its flags and the keyword arguments of ``add_argument``
Option = tuple[tuple[str, ...], dict[str, Any]]


def fill(text: str) -> str:
    """``text`` wrapped to ``WIDTH``, paragraph by paragraph (the formatter keeps it raw)."""
    return "\n\n".join(textwrap.fill(" ".join(p.split()), WIDTH) for p in text.split("\n\n"))


def examples_epilog(examples: Sequence[str]) -> str:
    """The ``examples:`` block of a command's ``--help``: one command line each, a trailing
    ``  # note`` kept on its line."""
    return "\n".join([EXAMPLES_HEADING, *(f"  {e}" for e in examples)])


def add_command(
    subparsers: Any,
    name: str,
    *,
    help: str,
    examples: Sequence[str],
    description: str | None = None,
    hidden: bool = False,
) -> argparse.ArgumentParser:
    """A command (noun or verb) under ``subparsers``, its ``--help`` with ``description``
    (default: ``help``) and ``examples``. A ``hidden`` one (an old spelling kept for
    scripts) is left out of its group's list of commands."""
    kwargs: dict[str, Any] = {} if hidden else {"help": help}
    text = description or f"{help[0].upper()}{help[1:]}."
    return subparsers.add_parser(
        name,
        description=fill(text),
        epilog=examples_epilog(examples),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        **kwargs,
    )


def add_group(
    subparsers: Any,
    name: str,
    *,
    help: str,
    examples: Sequence[str],
    dest: str,
    description: str | None = None,
) -> Any:
    """A noun under ``subparsers``; returns the subparsers of its verbs (a verb is
    required; the chosen one lands in ``args.<dest>``)."""
    p = add_command(subparsers, name, help=help, examples=examples, description=description)
    return p.add_subparsers(dest=dest, required=True, metavar="ACTION")


def verbs_of(subparsers: Any, name: str) -> Any:
    """The subparsers of the existing noun ``name`` (to add a verb to another module's
    group), or ``None`` when no such noun exists yet."""
    noun = subparsers.choices.get(name)
    if noun is None:
        return None
    return next(a for a in noun._actions if isinstance(a, argparse._SubParsersAction))


def _node_count(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"a whole number from 1 on, not {text!r}")
    return int(text)


def add_cluster_options(p: argparse.ArgumentParser, what: str) -> None:
    """``--brokers N`` and ``--racks``: the embedded cluster (``astraflow.broker.cluster``);
    ``what``: what ``--brokers`` does in this command."""
    p.add_argument("--brokers", type=_node_count, default=1, metavar="N",
                   help=f"{what}: N KRaft nodes on loopback (broker and controller each, one "
                   "quorum); topics get replication factor min(3, N) and min.insync.replicas "
                   "2 from 3 (docs/operations.md, \"A cluster of three brokers\")")
    p.add_argument("--racks", default=None, metavar="R1,R2,...",
                   help="with --brokers: each node's broker.rack; a consumer that sets "
                   "client.rack (a pool's rack: pools.<name>.rack) reads from a replica in its "
                   "rack (RackAwareReplicaSelector)")


def add_run_options(
    p: argparse.ArgumentParser,
    *,
    required: bool = True,
    bootstrap: bool = True,
    positional: bool = False,
) -> None:
    """``--topology/-t FILE`` and ``--run NAME`` (and ``--bootstrap`` when the command talks
    to Kafka). ``positional``: a bare ``FILE`` is accepted too (the older spelling of
    ``topics apply FILE`` and ``up FILE``); the topology is then required by ``main``."""
    if positional:  # same dest: either spelling lands in args.topology
        p.add_argument(
            "topology",
            nargs="?",
            default=argparse.SUPPRESS,
            metavar="FILE",
            help="the topology YAML (same as --topology)",
        )
    p.add_argument(
        "--topology",
        "-t",
        required=required and not positional,
        metavar="FILE",
        help="topology YAML: topics, Kafka settings, components",
    )
    p.add_argument(
        "--run",
        metavar="NAME",
        help="run name, overriding the topology's: the prefix of its topics and consumer "
        "groups, so one file runs twice side by side (default $ASTRAFLOW_RUN, else the file's)",
    )
    if bootstrap:
        p.add_argument(
            "--bootstrap",
            metavar="SERVERS",
            help="Kafka bootstrap servers, overriding the topology's (ASTRAFLOW_BOOTSTRAP "
            "overrides both)",
        )
    if positional and required:  # argparse cannot require one of two spellings: main does
        p.set_defaults(topology_required=p.prog.partition(" ")[2] or p.prog)


def add_table(p: argparse.ArgumentParser, title: str | None, table: Sequence[Option]) -> None:
    """Add every option of ``table``, under the heading ``title`` in ``--help`` (``None``:
    among the command's own options)."""
    target: Any = p.add_argument_group(title) if title else p
    for flags, kwargs in table:
        target.add_argument(*flags, **kwargs)


def walk(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> list[
        tuple[tuple[str, ...], argparse.ArgumentParser, bool]]:
    """Every parser of the tree under ``parser``, as ``(path, parser, hidden)``, the root
    first (path ``()``); ``hidden`` marks an old spelling left out of its group's list."""
    out = [(path, parser, False)]
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        listed = {a.dest for a in action._choices_actions}
        for name, sub in action.choices.items():
            for sub_path, p, hidden in walk(sub, (*path, name)):
                out.append((sub_path, p, hidden or name not in listed))
    return out
