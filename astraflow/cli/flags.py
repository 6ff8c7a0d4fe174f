"""The ``argparse`` options of a component's override flags, built from their table.

A table (``astraflow.config.overrides``) names, for each flag, the typed setting it
overrides; the option takes that setting's type (and its choices), description and
default from the model. Every option defaults to None, "not given": the component then
takes the setting from its topology file, whose own default is the model's, so
``--help`` shows that default and no flag repeats it.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from typing import Any

from astraflow.config.overrides import Flag


def _default_text(flag: Flag) -> str:
    if flag.key is None or flag.info.is_required() or "default" in (flag.help or ""):
        return ""
    default = flag.default
    if default is None or default == {} or flag.kind in ("keyed_json", "json"):
        return " (default: the topology's)"
    if flag.kind in ("on", "off"):
        return ""
    return f" (default: the topology's, else {default})"


def _converter(flag: Flag) -> Any:
    def convert(text: str) -> Any:
        try:
            return flag.convert(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = flag.dest  # argparse names it in "invalid <name> value"
    return convert


def option(flag: Flag) -> tuple[tuple[str, ...], dict[str, Any]]:
    """The flags and ``add_argument`` keyword arguments of ``flag``."""
    kwargs: dict[str, Any] = {"dest": flag.dest, "default": None,
                              "help": (flag.description + _default_text(flag)).replace(
                                  "%", "%%")}
    if flag.kind in ("on", "off"):
        kwargs["action"] = "store_true"
    else:
        if flag.kind in ("append", "keyed", "keyed_json"):
            kwargs["action"] = "append"
        _, choices = flag.value_type()
        if choices is not None and flag.kind == "value":
            kwargs["choices"] = list(choices)
        kwargs["type"] = _converter(flag)
        if flag.metavar:
            kwargs["metavar"] = flag.metavar
    return (flag.name, *flag.aliases), kwargs


def add_flags(parser: argparse.ArgumentParser, flags: Iterable[Flag],
              sections: dict[str, Any] | None = None) -> None:
    """Add the option of every flag to ``parser``, those of a ``section`` under its
    heading in ``--help`` (``sections``: heading -> argument group, filled as needed)."""
    groups = sections if sections is not None else {}
    for flag in flags:
        target: Any = parser
        if flag.section:
            if flag.section not in groups:
                groups[flag.section] = parser.add_argument_group(flag.section)
            target = groups[flag.section]
        names, kwargs = option(flag)
        target.add_argument(*names, **kwargs)


def given(args: argparse.Namespace, flags: Iterable[Flag]) -> dict[str, Any]:
    """Dest -> value of every flag of ``flags`` given on the command line."""
    out = {}
    for flag in flags:
        value = getattr(args, flag.dest, None)
        if value is not None:
            out[flag.dest] = value
    return out
