"""Old-format topology keys: each one found fails the load with what to write instead.

Before the typed topology, a file carried component flags as argv lists
(``trainer_args``, ``init_args``, ``eval_args``, ``raas_args``, ``feeder.args``,
``eval.args``), some hyperparameters at the top of a policy (``lr``,
``anchor_interval``, ``warm_start_steps``, ``warm_start_slip``) and ``max_staleness``
three times (staleness filter, batcher, ``--max-staleness``). ``old_format_errors``
names every such key of a raw (YAML-parsed) topology and, where it can, translates the
old value into the typed fields: the argv lists are parsed by the component's own
command-line parser.
"""

from __future__ import annotations

import argparse
from typing import Any

import yaml

# dest of a component flag -> (section, field) of the typed topology; section "" is the
# policy (or the pool) itself; a missing dest keeps its name in the section
TRAINER_DESTS = {"max_staleness": ("", "max_staleness"),
                 "no_std_normalize": ("trainer", "std_normalize"),
                 "no_share_prompt": ("trainer", "share_prompt"),
                 "temperature": ("", "temperature"),
                 "top_p": ("", "top_p")}
INIT_DESTS = {"warm_start_steps": ("warm_start", "steps"),
              "carry_slip": ("warm_start", "slip"),
              "warm_start_until": ("warm_start", "until")}
EVAL_DESTS = {"every": ("eval", "every_versions")}
RAAS_DESTS = {"no_follow_weights": ("", "follow_weights"),
              "workflow_options": ("", "workflows")}
FEEDER_DESTS = {"policy": ("", "policies")}
INVERTED = {"no_std_normalize", "no_share_prompt", "no_follow_weights"}
# argv flags no typed field takes: the launcher sets them per process
PER_PROCESS = {"topology", "bootstrap", "policy", "model", "pool", "instance", "verbose",
               "policy_model", "chat", "dir", "role", "json", "once", "func"}


def flow(value: Any) -> str:
    """``value`` as one line of YAML flow style, as a user would write it."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10**6, sort_keys=False)
    return text.strip().removesuffix("...").strip()  # a scalar ends its document


def _set_dests(command: list[str], argv: list[str]) -> dict[str, Any] | None:
    """Dest -> value of the flags ``argv`` gives on ``command`` (parsed by the real CLI
    parser); None when ``argv`` does not parse."""
    from astraflow.cli.main import build_parser

    parser = build_parser()
    try:
        base = vars(parser.parse_args(command))
        full = vars(parser.parse_args([*command, *[str(a) for a in argv]]))
    except SystemExit:
        return None
    except argparse.ArgumentError:
        return None
    # a flag written with its default value counts too: the file said it
    named = {str(a)[2:].split("=")[0].replace("-", "_") for a in argv if str(a).startswith("--")}
    return {k: v for k, v in full.items()
            if (base.get(k) != v or k in named) and k not in PER_PROCESS}


def _translate(dests: dict[str, Any], table: dict[str, tuple[str, str]],
               section: str) -> dict[str, dict[str, Any]]:
    """Section -> {field: value} of the typed topology for the flags in ``dests``."""
    out: dict[str, dict[str, Any]] = {}
    for dest, value in dests.items():
        where, name = table.get(dest, (section, dest))
        if dest in INVERTED:
            value = not value
        elif dest == "workflow_options":
            value = dict(value)
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


def _argv_message(key: str, prefix: str, command: list[str], argv: Any,
                  table: dict[str, tuple[str, str]], section: str) -> str:
    dests = _set_dests(command, argv) if isinstance(argv, list) else None
    if dests is None:
        return (f"{key}: no longer accepted (argv lists are gone); write the typed fields "
                f"of {prefix}.{section or '<field>'} instead (docs/topology.md)")
    return f"{key}: no longer accepted; {_write(prefix, _translate(dests, table, section))}"


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
    model = str(spec.get("model", "m"))
    if "trainer_args" in spec:
        out.append(_argv_message(f"{key}.trainer_args", key, [
            "trainer", "run", "--topology", "-", "--policy", name, "--model", model],
            spec["trainer_args"], TRAINER_DESTS, "trainer"))
    if "init_args" in spec:
        role = spec.get("role", "solver")
        command = (["model", "init", model] if role == "solver"
                   else ["model", "init-role", model, "--role", str(role)])
        out.append(_argv_message(f"{key}.init_args", key, command, spec["init_args"],
                                 INIT_DESTS, "warm_start"))
    if "eval_args" in spec:
        out.append(_argv_message(f"{key}.eval_args", key, [
            "eval", "run", "--topology", "-", "--model", model], spec["eval_args"],
            {**EVAL_DESTS}, "eval"))
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
        named = (opts.get("policies") or ["actor"] if p["kind"] == "staleness_filter"
                 else [opts.get("policy", "actor")])
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
            out.append(_argv_message(f"{key}.raas_args", key, [
                "raas", "run", "--topology", "-", "--policy-model", "p=m"],
                spec["raas_args"], RAAS_DESTS, ""))
    for section, command in (("feeder", ["feeder", "run", "--topology", "-"]),
                             ("eval", ["eval", "run", "--topology", "-", "--model", "m"])):
        spec = data.get(section)
        if isinstance(spec, dict) and "args" in spec:
            table = FEEDER_DESTS if section == "feeder" else {"every": ("", "every_versions")}
            out.append(_argv_message(f"{section}.args", section, command, spec["args"],
                                     table, ""))
    return out + _processor_errors(data)
