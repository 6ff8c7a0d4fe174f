"""Old-format topology keys: each one found fails the load with what to write instead.

Before the typed topology, a file carried component flags as argv lists
(``trainer_args``, ``init_args``, ``eval_args``, ``raas_args``, ``feeder.args``,
``eval.args``), some hyperparameters at the top of a policy (``lr``,
``anchor_interval``, ``warm_start_steps``, ``warm_start_slip``) and ``max_staleness``
three times (staleness filter, batcher, ``--max-staleness``). ``old_format_errors``
names every such key of a raw (YAML-parsed) topology and, where it can, translates the
old value into the typed fields: the argv lists are parsed with the component's flags,
which are derived from the typed fields (``astraflow.config.overrides``).
"""

from __future__ import annotations

from typing import Any

import yaml
from pydantic import BaseModel

from astraflow.config.overrides import (
    EVAL_FLAGS,
    FEEDER_FLAGS,
    NODE_FLAGS,
    TRAINER_FLAGS,
    WARM_START_FLAGS,
    Flag,
    by_dest,
    parse_argv,
    settings_value,
)
from astraflow.config.processors import BatcherOptions, StalenessOptions
from astraflow.config.sections import (
    EvalSpec,
    FeederSpec,
    PolicyEvalSpec,
    PolicySpec,
    PoolSpec,
    WarmStartSpec,
)

# flags of the old command lines that no typed field takes: the launcher set them per
# process (flag -> the number of values it takes)
PER_PROCESS = {"--topology": 1, "-t": 1, "--run": 1, "--bootstrap": 1, "--policy": 1,
               "--instance": 1, "--pool": 1, "--rack": 1, "--role": 1, "-v": 0,
               "--verbose": 0, "--json": 0, "--once": 0, "--history": 1, "--public-key": 1,
               "--max-steps": 1}
# dests of the old command lines a file no longer sets in that section
NOT_TRANSLATED = {"model", "policy_model", "chat", "dtype", "role"}


def flow(value: Any) -> str:
    """``value`` as one line of YAML flow style, as a user would write it."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10**6, sort_keys=False)
    return text.strip().removesuffix("...").strip()  # a scalar ends its document


def _translate(flags: tuple[Flag, ...], dests: dict[str, Any], model: type[BaseModel],
               section: str) -> dict[str, dict[str, Any]]:
    """Section -> {field: value} of the typed topology for the flags in ``dests`` (those
    ``model``, the section's model, declares), ``section`` the section they sit in."""
    table = by_dest(flags)
    out: dict[str, dict[str, Any]] = {}
    for dest, value in dests.items():
        flag = table[dest]
        if flag.key is None or dest in NOT_TRANSLATED:
            continue
        if flag.key.split(".")[0] not in model.model_fields:
            continue
        where, _, name = ".".join(p for p in (section, flag.key) if p).rpartition(".")
        value = settings_value(flag, value)
        if "." in where:  # a nested section (eval.dataset): one mapping under its parent
            where, _, sub = where.rpartition(".")
            out.setdefault(where, {}).setdefault(sub, {})[name] = value
        else:
            out.setdefault(where, {})[name] = value
    return out


def _write(prefix: str, sections: dict[str, dict[str, Any]]) -> str:
    """``write policies.actor.trainer: {lr: 0.1} and policies.actor.max_staleness: 4``."""
    parts = []
    for section, fields in sections.items():
        if section:
            parts.append(f"{prefix}.{section}: {flow(fields)}")
        else:
            parts += [f"{prefix}.{k}: {flow(v)}" for k, v in fields.items()]
    return "write " + " and ".join(parts) if parts else "remove it"


def _argv_message(key: str, prefix: str, flags: tuple[Flag, ...], argv: Any,
                  model: type[BaseModel], section: str, hint: str = "") -> str:
    """What to write instead of the argv list ``argv`` of ``key``: its flags (a table of
    ``astraflow.config.overrides``) as the typed fields of ``prefix`` (``hint``: the
    section named when ``argv`` does not parse)."""
    dests = parse_argv(flags, argv, PER_PROCESS) if isinstance(argv, list) else None
    if dests is None:
        where = hint or section or "<field>"
        return (f"{key}: no longer accepted (argv lists are gone); write the typed fields "
                f"of {prefix}.{where} instead (docs/topology.md)")
    return f"{key}: no longer accepted; {_write(prefix, _translate(flags, dests, model, section))}"


def _policy_errors(name: str, spec: dict[str, Any]) -> list[str]:
    key = f"policies.{name}"
    out = []
    moved = {"lr": ("trainer", "lr"), "anchor_interval": ("trainer", "anchor_interval"),
             "warm_start_steps": ("warm_start", "steps"),
             "warm_start_slip": ("warm_start", "slip")}
    for old, (section, field) in moved.items():
        if old in spec:
            out.append(f"{key}.{old}: moved; write {key}.{section}: "
                       f"{flow({field: spec[old]})}")
    if "trainer_args" in spec:
        out.append(_argv_message(f"{key}.trainer_args", key, TRAINER_FLAGS,
                                 spec["trainer_args"], PolicySpec, "", hint="trainer"))
    if "init_args" in spec:
        out.append(_argv_message(f"{key}.init_args", key, WARM_START_FLAGS,
                                 spec["init_args"], WarmStartSpec, "warm_start"))
    if "eval_args" in spec:
        out.append(_argv_message(f"{key}.eval_args", key, EVAL_FLAGS, spec["eval_args"],
                                 PolicyEvalSpec, "eval"))
    return out


def _processor_errors(data: dict[str, Any]) -> list[str]:
    """``max_staleness`` in a staleness filter's or batcher's options where the topology
    declares the policy: the policy's own ``max_staleness`` is the one place for it."""
    policies = data.get("policies") or {}
    out = []
    for pname, p in (data.get("processors") or {}).items():
        if not isinstance(p, dict) or not isinstance(p.get("options"), dict):
            continue
        opts = p["options"]
        if "max_staleness" not in opts or p.get("kind") not in ("staleness_filter", "batcher"):
            continue
        # the file is not valid yet: its keys read raw, an unset one at its model's default
        if p["kind"] == "staleness_filter":
            named = opts.get("policies") or StalenessOptions().policies
        else:
            named = [opts.get("policy", BatcherOptions.model_fields["policy"].default)]
        declared = [n for n in named if n in policies]
        if declared:
            where = " and ".join(f"policies.{n}.max_staleness: {opts['max_staleness']}"
                                 for n in declared)
            out.append(f"processors.{pname}.options.max_staleness: no longer accepted where "
                       f"the policy is declared; write {where} (the staleness filter, the "
                       "batcher and the trainer all take it from there)")
    return out


def old_format_errors(data: dict[str, Any]) -> list[str]:
    """One message per old-format key of the raw topology ``data`` (none: new format)."""
    out = []
    for name, spec in (data.get("policies") or {}).items():
        if isinstance(spec, dict):
            out += _policy_errors(str(name), spec)
    for name, spec in (data.get("pools") or {}).items():
        if isinstance(spec, dict) and "raas_args" in spec:
            key = f"pools.{name}"
            out.append(_argv_message(f"{key}.raas_args", key, NODE_FLAGS, spec["raas_args"],
                                     PoolSpec, ""))
    for section, flags, model in (("feeder", FEEDER_FLAGS, FeederSpec),
                                  ("eval", EVAL_FLAGS, EvalSpec)):
        spec = data.get(section)
        if isinstance(spec, dict) and "args" in spec:
            out.append(_argv_message(f"{section}.args", section, flags, spec["args"],
                                     model, ""))
    return out + _processor_errors(data)
