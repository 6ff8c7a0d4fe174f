"""The command-line overrides of each component's typed settings, declared once.

Each component's flags are a table of ``Flag`` entries derived from the models of
``astraflow.config.sections``: a flag names the field it overrides, and takes the field's
type, its default (shown in ``--help``) and its description (the help text) from there,
so a setting is declared in one place. ``astraflow.cli`` builds the ``argparse`` options
of ``trainer run``, ``raas run``, ``eval run`` and ``feeder run`` from these tables; a
component started by hand reads its section of the topology file and applies the flags
it was given on top (``apply``, ``astraflow.config.components``);
``astraflow.config.migrate`` parses the argv lists of old topology files with them
(``parse_argv``). Nothing here imports ``argparse``.

Flag kinds: ``value`` (``--lr 1e-5``, typed by the field), ``on`` (``--tis-mask``: true),
``off`` (``--no-std-normalize``: the field false), ``append`` (``--policy P``, repeated: a
list), ``json`` (one JSON object), ``spec`` (a name or a JSON object: a reward),
``keyed`` (``--policy-model POLICY=PATH``, repeated) and ``keyed_json``
(``--workflow-options NAME=JSON``, repeated).
"""

from __future__ import annotations

import json
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo

from astraflow.config.sections import (
    DatasetSpec,
    EvalSpec,
    FeederSpec,
    ParallelSpec,
    PolicyEvalSpec,
    PolicySpec,
    PoolSpec,
    TrainerSpec,
    WarmStartSpec,
)

KINDS = ("value", "on", "off", "append", "json", "spec", "keyed", "keyed_json")


@dataclass(frozen=True)
class Flag:
    """One flag: the field of ``model`` it overrides, and where that lands (``key``)."""

    name: str  # "--lr"
    model: type[BaseModel]  # the model that declares the setting
    field: str  # its field there
    # dotted key of the setting in the component's section of the file (and in the model
    # ``apply`` sets it in); None: the setting lives elsewhere (another section)
    key: str | None
    kind: str = "value"
    # False: the component's resolver applies it (``apply`` leaves it alone)
    applied: bool = True
    aliases: tuple[str, ...] = ()
    metavar: str | None = None
    help: str | None = None  # default: the field's description
    group: str | None = None  # default: the field's ``json_schema_extra["group"]``

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"{self.name}: unknown flag kind {self.kind!r}")
        if self.field not in self.model.model_fields:
            raise ValueError(f"{self.name}: {self.model.__name__} has no field {self.field}")

    @property
    def dest(self) -> str:
        """The attribute the parsed flag lands in (``--top-p``: ``top_p``)."""
        return self.name[2:].replace("-", "_")

    @property
    def info(self) -> FieldInfo:
        return self.model.model_fields[self.field]

    @property
    def default(self) -> Any:
        """The setting's one default (its model's)."""
        return self.info.get_default(call_default_factory=True)

    @property
    def description(self) -> str:
        return self.help or self.info.description or ""

    @property
    def section(self) -> str | None:
        """The ``--help`` section the flag is listed in (None: the command's own)."""
        extra = self.info.json_schema_extra
        return self.group or (extra.get("group") if isinstance(extra, dict) else None)

    def value_type(self) -> tuple[type, tuple[Any, ...] | None]:
        """``(type, choices)`` of one value of the flag, from the field's annotation."""
        return value_type(self.info.annotation)

    def convert(self, text: str) -> Any:
        """One command-line value of the flag as its field takes it; ``ValueError`` with
        the reason."""
        if self.kind in ("json", "spec", "keyed_json"):
            if self.kind == "keyed_json":
                name, value = split_keyed(text)
                return name, json_object(value, name)
            if self.kind == "spec" and not text.lstrip().startswith("{"):
                return text
            return json_object(text)
        if self.kind == "keyed":
            return split_keyed(text)
        annotation = self.info.annotation
        if self.kind == "append":
            annotation = self.value_type()[0]
        try:
            return TypeAdapter(annotation).validate_python(text)
        except ValidationError as e:
            raise ValueError(e.errors()[0]["msg"]) from None


def value_type(annotation: Any) -> tuple[type, tuple[Any, ...] | None]:
    """``(type, choices)`` of a field annotation: ``X | None`` and ``Annotated[X, ...]`` are
    ``X``; ``Literal[...]`` gives its choices; a list is its item's type."""
    while True:
        origin = typing.get_origin(annotation)
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if origin in (typing.Union, types.UnionType) and len(args) == 1:
            annotation = args[0]
        elif origin is Annotated or origin in (list, Sequence):
            annotation = args[0]
        else:
            break
    if typing.get_origin(annotation) is Literal:
        choices = typing.get_args(annotation)
        return type(choices[0]), choices
    return (annotation if isinstance(annotation, type) else str), None


def split_keyed(text: str) -> tuple[str, str]:
    """``NAME=VALUE`` as ``(NAME, VALUE)``; ``ValueError`` otherwise."""
    name, sep, value = text.partition("=")
    if not sep or not name or not value:
        raise ValueError(f"expected NAME=VALUE, got {text!r}")
    return name, value


def json_object(text: str, name: str | None = None) -> dict[str, Any]:
    """``text`` as a JSON object; ``ValueError`` naming ``name`` otherwise."""
    where = f"{name}: " if name else ""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{where}not JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{where}expected a JSON object")
    return value


def _field_flags(model: type[BaseModel], prefix: str,
                 names: dict[str, str] | None = None,
                 metavars: dict[str, str] | None = None) -> list[Flag]:
    """A flag per field of ``model``, ``--<field>`` (``names``: other flag names); a
    bool field that is on by default is turned off by ``--no-<field>``."""
    out = []
    for field, info in model.model_fields.items():
        if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):
            continue  # a nested section declares its own flags
        name = (names or {}).get(field, "--" + field.replace("_", "-"))
        kind = "value"
        if info.annotation is bool:
            kind = "off" if info.default is True else "on"
            if kind == "off":
                name = "--no-" + name[2:]
        out.append(Flag(name, model, field, f"{prefix}{field}", kind,
                        metavar=(metavars or {}).get(field)))
    return out


# `trainer run`: the policy's trainer section with the policy's own sampling and
# staleness; applied to the policy's PolicySpec
TRAINER_FLAGS: tuple[Flag, ...] = (
    Flag("--model", PolicySpec, "model", "model", metavar="PATH",
         help="local Hugging Face causal-LM directory (initial weights, config); default: "
         "the policy's model in the topology"),
    Flag("--temperature", PolicySpec, "temperature", "temperature", metavar="T"),
    Flag("--top-p", PolicySpec, "top_p", "top_p", metavar="P"),
    Flag("--max-staleness", PolicySpec, "max_staleness", "max_staleness", metavar="K"),
    *_field_flags(TrainerSpec, "trainer.", metavars={
        "loss": "NAME", "m2_threshold": "TAU", "minibatches": "N", "micro_batch_size": "N",
        "micro_batch_tokens": "N", "blob_store": "URI", "keep_versions": "N",
        "state_dir": "DIR", "state_interval": "N", "state_max_lag": "K",
        "keep_optimizer": "K", "max_steps": "N", "checkpoint_dir": "DIR"}),
    *_field_flags(ParallelSpec, "trainer.parallel.", names={"port": "--parallel-port"},
                  metavars={"processes": "N", "port": "PORT"}),
)

# `raas run`: the pool's section (applied to its PoolSpec), the policies it serves
NODE_FLAGS: tuple[Flag, ...] = (
    Flag("--policy-model", PolicySpec, "model", None, "keyed", aliases=("--model",),
         metavar="POLICY=PATH", help="a local transformers model directory per policy "
         "(repeatable); default: every policy of the topology, at its model"),
    Flag("--chat", PolicySpec, "chat", None, "keyed_json", metavar="POLICY=JSON",
         help='prompt format of a policy (astraflow.models.chat), e.g. actor=\'{"template": '
         '"auto", "system_prompt": "Answer with the number only."}\' (repeatable); default: '
         "the policy's chat in the topology"),
    Flag("--n-samples", PoolSpec, "n_samples", "n_samples", metavar="N"),
    Flag("--tasks-per-transaction", PoolSpec, "tasks_per_transaction",
         "tasks_per_transaction", metavar="K"),
    Flag("--session-timeout-ms", PoolSpec, "session_timeout_ms", "session_timeout_ms"),
    Flag("--speed", PoolSpec, "speed", "speed", metavar="F"),
    Flag("--no-follow-weights", PoolSpec, "follow_weights", "follow_weights", "off"),
    Flag("--update-every-tokens", PoolSpec, "update_every_tokens", "update_every_tokens",
         metavar="N"),
    Flag("--workflow-options", PoolSpec, "workflows", "workflows", "keyed_json",
         applied=False, metavar="NAME=JSON"),
    Flag("--engine", PoolSpec, "engine", "engine", applied=False, group="engine"),
    Flag("--engine-options", PoolSpec, "engine_options", "engine_options", "json",
         applied=False, metavar="JSON", group="engine"),
    Flag("--device", PoolSpec, "device", "device", group="engine"),
    Flag("--dtype", PolicySpec, "dtype", None, group="engine",
         help="model dtype of every policy's engine; default: the policies' dtype in the "
         "topology, else as saved"),
    Flag("--prefix-cache-mib", PoolSpec, "prefix_cache_mib", "prefix_cache_mib",
         metavar="MIB", group="engine"),
)


def _dataset_flags(what: str) -> tuple[Flag, ...]:
    return (
        Flag("--dataset", DatasetSpec, "path", "dataset.path", metavar="PATH",
             help=f"local .jsonl/.parquet file (default: {what})"),
        Flag("--prompt-field", DatasetSpec, "prompt_field", "dataset.prompt_field"),
        Flag("--answer-field", DatasetSpec, "answer_field", "dataset.answer_field"),
        Flag("--messages-field", DatasetSpec, "messages_field", "dataset.messages_field"),
    )


# `eval run`: the evaluator's settings (``EvalSettings``): the topology's `eval:` with the
# policy's own `eval:` over it, and the policy's role, model, chat and dtype
EVAL_FLAGS: tuple[Flag, ...] = (
    Flag("--model", PolicySpec, "model", "model", metavar="PATH",
         help="the policy's base model dir; default: the policy's model in the topology"),
    Flag("--every", EvalSpec, "every_versions", "every_versions", metavar="N"),
    Flag("--levels", EvalSpec, "levels", "levels"),
    *_dataset_flags("the synthetic arithmetic eval split"),
    Flag("--reward", EvalSpec, "reward", "reward", "spec", metavar="NAME|JSON"),
    Flag("--chat", PolicySpec, "chat", "chat", "json", metavar="JSON",
         help='prompt format, e.g. \'{"template": "auto", "system_prompt": "..."}\'; default: '
         "the policy's chat in the topology"),
    Flag("--dtype", PolicySpec, "dtype", "dtype"),
    Flag("--size", EvalSpec, "size", "size"),
    Flag("--max-new-tokens", EvalSpec, "max_new_tokens", "max_new_tokens"),
    Flag("--role", PolicySpec, "role", "role"),
    Flag("--blind", PolicyEvalSpec, "blind", "blind", "on"),
    Flag("--agreement", PolicyEvalSpec, "agreement", "agreement", "on"),
    Flag("--corrective", PolicyEvalSpec, "corrective", "corrective", "on"),
)

# `feeder run`: the topology's `feeder:` (applied to its FeederSpec)
FEEDER_FLAGS: tuple[Flag, ...] = (
    Flag("--count", FeederSpec, "count", "count", metavar="N"),
    Flag("--rate", FeederSpec, "rate", "rate", metavar="R"),
    Flag("--epochs", FeederSpec, "epochs", "epochs", metavar="E"),
    Flag("--seed", FeederSpec, "seed", "seed"),
    Flag("--from-start", FeederSpec, "from_start", "from_start", "on"),
    Flag("--policy", FeederSpec, "policies", "policies", "append", metavar="NAME"),
    Flag("--workflow", FeederSpec, "workflow", "workflow"),
    *(Flag(f.name, f.model, f.field, f.key, f.kind, metavar=f.metavar, help=f.help,
           group="tasks") for f in _dataset_flags("synthetic tasks of --task-family")),
    Flag("--task-family", FeederSpec, "task_family", "task_family", group="tasks"),
    Flag("--levels", FeederSpec, "levels", "levels", group="tasks"),
    Flag("--split", FeederSpec, "split", "split", group="tasks"),
    Flag("--size", FeederSpec, "size", "size", metavar="N", group="tasks"),
)

# `model init` / `model init-role`: a policy's `warm_start:` (``astraflow up`` writes the
# tiny model with these; old files' init_args are read back with them)
WARM_START_FLAGS: tuple[Flag, ...] = tuple(_field_flags(WarmStartSpec, "", names={
    "steps": "--warm-start-steps", "slip": "--carry-slip", "until": "--warm-start-until"}))


def by_dest(flags: Iterable[Flag]) -> dict[str, Flag]:
    return {f.dest: f for f in flags}


def parse_argv(flags: Sequence[Flag], argv: Sequence[Any],
               ignored: Mapping[str, int] | None = None) -> dict[str, Any] | None:
    """Dest -> value of every flag ``argv`` gives (in the order of ``flags``); other flags
    named in ``ignored`` (name -> number of values) are skipped. None when ``argv`` names an
    unknown flag, lacks a value or gives one of the wrong type."""
    names = {n: f for f in flags for n in (f.name, *f.aliases)}
    tokens = [str(a) for a in argv]
    out: dict[str, Any] = {}
    i = 0
    while i < len(tokens):
        token = tokens[i]
        name, eq, inline = token.partition("=")
        i += 1
        flag = names.get(name)
        if flag is None and ignored and name in ignored:
            i += 0 if eq else ignored[name]
            continue
        if flag is None or not token.startswith("--"):
            return None
        if flag.kind in ("on", "off"):
            if eq:
                return None
            out[flag.dest] = True
            continue
        if not eq:
            if i >= len(tokens):
                return None
            inline, i = tokens[i], i + 1
        try:
            value = flag.convert(inline)
        except ValueError:
            return None
        if flag.kind in ("append", "keyed", "keyed_json"):
            out.setdefault(flag.dest, []).append(value)
        else:
            out[flag.dest] = value
    order = list(by_dest(flags))
    return {d: out[d] for d in order if d in out}


def settings_value(flag: Flag, value: Any) -> Any:
    """What a given flag sets its field to: ``off`` flags false, ``on`` flags true,
    ``keyed_json`` a mapping of its names."""
    if flag.kind == "off":
        return not value
    if flag.kind == "on":
        return bool(value)
    if flag.kind == "keyed_json":
        return {name: options for name, options in value}
    if flag.kind == "keyed":
        return dict(value)
    return value


class OverrideError(ValueError):
    """A flag's value that its setting refuses; the message names the flag."""


def apply(section: BaseModel, flags: Iterable[Flag], given: Mapping[str, Any]) -> BaseModel:
    """``section`` with the ``given`` flags (dest -> value) set, validated again as the
    file's values are: each setting keeps its one declaration and checks. Only the flags
    with a ``key`` that are ``applied`` apply here; an ``OverrideError`` names the flag of
    a refused value."""
    if not _keyed(flags, given):
        return section
    return apply_to(type(section), section.model_dump(exclude_unset=True, by_alias=True),
                    flags, given)


def apply_to(model: type[BaseModel], data: dict[str, Any], flags: Iterable[Flag],
             given: Mapping[str, Any]) -> Any:
    """``model`` validated from ``data`` (the file's settings, as a mapping) with the
    ``given`` flags set in it; ``OverrideError`` as ``apply``."""
    keyed = _keyed(flags, given)
    data = dict(data)
    for flag in keyed:
        *parents, last = flag.key.split(".")
        where = data
        for part in parents:
            nested = where.get(part)
            if isinstance(nested, BaseModel):
                nested = nested.model_dump(exclude_unset=True, by_alias=True)
            where[part] = nested = dict(nested) if isinstance(nested, dict) else {}
            where = nested
        value = settings_value(flag, given[flag.dest])
        if flag.kind == "keyed_json" and isinstance(where.get(last), dict):
            value = {**where[last], **{k: {**(where[last].get(k) or {}), **v}
                                       for k, v in value.items()}}
        where[last] = value
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise OverrideError(_flag_errors(e, keyed)) from None


def _keyed(flags: Iterable[Flag], given: Mapping[str, Any]) -> list[Flag]:
    return [f for f in flags
            if f.key is not None and f.applied and given.get(f.dest) is not None]


def _flag_errors(e: ValidationError, flags: list[Flag]) -> str:
    """The errors of ``e``, each by the flag whose key it concerns (else by its key)."""
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if msg.startswith("."):  # a model's own check: ".key: message"
            key, _, msg = msg[1:].partition(": ")
            loc = f"{loc}.{key}" if loc else key
        exact = [f for f in flags if loc == f.key or loc.startswith(f"{f.key}.")]
        under = [f for f in flags if loc and f.key.startswith(f"{loc}.")]
        match = exact or (under if len(under) == 1 else [])
        where = match[0].name if match else loc
        parts.append(f"{where}: {msg}" if where else msg)
    return "; ".join(parts)


__all__ = ["EVAL_FLAGS", "FEEDER_FLAGS", "KINDS", "NODE_FLAGS", "TRAINER_FLAGS",
           "WARM_START_FLAGS", "Flag", "OverrideError", "apply", "apply_to", "by_dest",
           "json_object", "parse_argv", "settings_value", "split_keyed", "value_type"]
