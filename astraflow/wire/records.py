"""Typed Python views of the Avro records in ``schemas/``.

Each dataclass mirrors one ``astraflow.<Name>`` Avro record field for field (a test keeps
them in step). ``to_dict`` gives what the Avro writer takes; ``from_dict`` rebuilds the
dataclass, nested records included, from a dict. The codec's hot path uses ``avro_value``
and ``from_avro``, which skip copies and ``__init__``: how to convert each class is worked
out once from its type hints, not per record.
"""

from __future__ import annotations

import dataclasses
import operator
import time
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

R = TypeVar("R", bound="Record")


def now_ms() -> int:
    return int(time.time() * 1000)


def _nested_as(out: dict[str, Any], plan: Any,
               convert: Callable[[Record], dict[str, Any]]) -> dict[str, Any]:
    """``out`` with its nested records (single or in lists) replaced by ``convert`` of them."""
    for name, many, _ in plan.nested:
        v = out[name]
        if many and isinstance(v, list):
            out[name] = [convert(x) if isinstance(x, Record) else x for x in v]
        elif isinstance(v, Record):
            out[name] = convert(v)
    return out


class Record:
    """Base of every record dataclass: Avro name and dict conversion."""

    avro_name: ClassVar[str]

    def to_dict(self) -> dict[str, Any]:
        """Field values as the Avro writer takes them (shallow: lists are not copied)."""
        plan = _plan(type(self))
        return _nested_as(dict(zip(plan.names, plan.values(self))), plan, Record.to_dict)

    def avro_value(self) -> dict[str, Any]:
        """What the Avro writer takes, without copying where it can: the instance's own
        ``__dict__`` for a record without nested records. Read it, never change it."""
        plan = _plan(type(self))
        if not plan.nested:
            return self.__dict__
        return _nested_as(self.__dict__.copy(), plan, Record.avro_value)

    @classmethod
    def from_dict(cls: type[R], data: dict[str, Any]) -> R:
        """The record of ``data``: missing fields take their defaults, nested records may
        be dicts or records, lists are copied."""
        plan = _plan(cls)
        kwargs = {name: data[name] for name in plan.names if name in data}
        for name, convert in plan.converters:
            v = kwargs.get(name)
            if v is not None:
                kwargs[name] = convert(v)
        return cls(**kwargs)

    @classmethod
    def from_avro(cls: type[R], value: dict[str, Any]) -> R:
        """The record of what the Avro reader returned for this record's current schema
        (every field present, nothing else): ``value`` becomes the record's own state."""
        return _plan(cls).build(value)


@dataclass(frozen=True)
class _Plan:
    """What converting one record class needs, worked out once from its type hints."""

    names: tuple[str, ...]
    values: Callable[[Any], tuple[Any, ...]]  # the field values, in order
    nested: tuple[tuple[str, bool, type[Record]], ...]  # (field, is a list, record class)
    converters: tuple[tuple[str, Callable[[Any], Any]], ...]  # for ``from_dict``
    build: Callable[[dict[str, Any]], Any]  # ``from_avro``


_PLANS: dict[type, _Plan] = {}


def _plan(cls: type) -> _Plan:
    plan = _PLANS.get(cls)
    if plan is None:
        plan = _PLANS[cls] = _make_plan(cls)
    return plan


def _make_plan(cls: type) -> _Plan:
    hints = typing.get_type_hints(cls)
    names = tuple(f.name for f in dataclasses.fields(cls))
    nested, converters = [], []
    for name in names:
        hint = _unwrap_optional(hints[name])
        if typing.get_origin(hint) is list:
            (item,) = typing.get_args(hint)
            if isinstance(item, type) and issubclass(item, Record):
                nested.append((name, True, item))
                converters.append((name, _records_of(item)))
            else:
                converters.append((name, list))
        elif isinstance(hint, type) and issubclass(hint, Record):
            nested.append((name, False, hint))
            converters.append((name, _record_of(hint)))
    if len(names) == 1:  # attrgetter of one name returns the value, not a tuple
        only = names[0]
        values: Callable[[Any], tuple[Any, ...]] = lambda r: (getattr(r, only),)  # noqa: E731
    else:
        values = operator.attrgetter(*names)
    return _Plan(names, values, tuple(nested), tuple(converters), _builder(cls, nested))


def _builder(cls: type, nested: list[tuple[str, bool, type[Record]]]
             ) -> Callable[[dict[str, Any]], Any]:
    """Builds a ``cls`` around the Avro reader's dict without ``__init__`` (no record
    class has a ``__post_init__``): a third of the cost of ``cls(**value)``."""
    new = object.__new__
    if not nested:
        def build(value: dict[str, Any]) -> Any:
            obj = new(cls)
            obj.__dict__ = value
            return obj
        return build
    subs = [(name, many, _plan(sub).build) for name, many, sub in nested]

    def build_nested(value: dict[str, Any]) -> Any:
        for name, many, sub_build in subs:
            v = value[name]
            if v is not None:
                value[name] = [sub_build(x) for x in v] if many else sub_build(v)
        obj = new(cls)
        obj.__dict__ = value
        return obj
    return build_nested


def is_flat(cls: type[Record]) -> bool:
    """Whether ``cls`` has no nested records: its ``avro_value`` is its ``__dict__``."""
    return not _plan(cls).nested


def avro_builder(cls: type[R]) -> Callable[[dict[str, Any]], R]:
    """``cls.from_avro`` as a plain function, for a caller that builds many records."""
    return _plan(cls).build


def _unwrap_optional(hint: Any) -> Any:
    args = typing.get_args(hint)
    if args and type(None) in args and len(args) == 2:
        return next(a for a in args if a is not type(None))
    return hint


def _record_of(cls: type[Record]) -> Callable[[Any], Any]:
    return lambda v: cls.from_dict(v) if isinstance(v, dict) else v


def _records_of(cls: type[Record]) -> Callable[[Any], Any]:
    return lambda vs: [cls.from_dict(v) if isinstance(v, dict) else v for v in vs]


def record(name: str):
    """Class decorator: a dataclass that is the Python view of ``astraflow.<name>``."""

    def wrap(cls):
        cls = dataclass(cls)
        cls.avro_name = f"astraflow.{name}"
        RECORD_TYPES[cls.avro_name] = cls
        return cls

    return wrap


RECORD_TYPES: dict[str, type[Record]] = {}


@record("OffsetRange")
class OffsetRange(Record):
    topic: str
    partition: int
    start: int
    end: int


@record("PartitionOffset")
class PartitionOffset(Record):
    topic: str
    partition: int
    offset: int


@record("Task")
class Task(Record):
    task_id: str
    prompt_id: str
    workflow: str
    payload: str
    source: str
    policies: list[str] = field(default_factory=list)
    attempt: int = 0
    created_at_ms: int = field(default_factory=now_ms)
    meta: dict[str, str] = field(default_factory=dict)


@record("Sequence")
class Sequence(Record):
    policy: str
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    reward: float
    sample_index: int
    finish_reason: str
    role: str = ""
    meta: dict[str, str] = field(default_factory=dict)

    @property
    def min_version(self) -> int:
        """Oldest weight version among generated tokens (-1 if none was generated)."""
        gen = [v for v in self.versions if v >= 0]
        return min(gen) if gen else -1

    @property
    def max_version(self) -> int:
        return max(self.versions, default=-1)


@record("TrajectoryGroup")
class TrajectoryGroup(Record):
    group_id: str
    prompt_id: str
    task_id: str
    workflow: str
    source: str
    raas_id: str
    pool: str
    sequences: list[Sequence]
    rewards: list[float]
    created_at_ms: int = field(default_factory=now_ms)
    metrics: dict[str, float] = field(default_factory=dict)
    meta: dict[str, str] = field(default_factory=dict)


@record("Batch")
class Batch(Record):
    policy: str
    batch_id: str
    groups: list[TrajectoryGroup]
    replayed: int = 0
    source_offsets: list[OffsetRange] = field(default_factory=list)
    created_at_ms: int = field(default_factory=now_ms)
    meta: dict[str, str] = field(default_factory=dict)


@record("TensorInfo")
class TensorInfo(Record):
    name: str
    shape: list[int]
    dtype: str


@record("BlobRef")
class BlobRef(Record):
    uri: str
    bytes: int
    sha256: str


@record("WeightManifest")
class WeightManifest(Record):
    policy: str
    version: int
    base_version: int | None
    kind: str
    dtype: str
    tensors: list[TensorInfo]
    blobs: list[BlobRef]
    num_params: int
    num_changed: int
    sparsity: float
    encoded_bytes: int
    trainer_step: int
    consumed_offsets: list[PartitionOffset] = field(default_factory=list)
    created_at_ms: int = field(default_factory=now_ms)
    codec: str = ""
    meta: dict[str, str] = field(default_factory=dict)
    # ed25519 over the canonical bytes (astraflow.weights.signing); None: unsigned
    signature: bytes | None = None
    signing_key: str | None = None  # the signing key's id


@record("BlobChunk")
class BlobChunk(Record):
    blob_id: str
    index: int
    count: int
    data: bytes
    total_bytes: int = -1
    sha256: str = ""


@record("ComponentStatus")
class ComponentStatus(Record):
    component_id: str
    kind: str
    host: str
    policy: str = ""
    pool: str = ""
    state: str = "running"
    produced: int = 0
    consumed: int = 0
    in_flight: int = 0
    dead_lettered: int = 0
    waiting_s: float = 0.0
    busy_s: float = 0.0
    weight_versions: dict[str, int] = field(default_factory=dict)
    capacity: float = 0.0
    started_at_ms: int = 0
    at_ms: int = field(default_factory=now_ms)
    metrics: dict[str, float] = field(default_factory=dict)


@record("ScalingAdvice")
class ScalingAdvice(Record):
    pool: str
    current_size: int
    target_size: int
    branch: str
    wait_fraction: float
    upper: float
    lower: float
    produced_rate: float = 0.0
    consumed_rate: float = 0.0
    reason: str = ""
    at_ms: int = field(default_factory=now_ms)


@record("EpisodeCall")
class EpisodeCall(Record):
    episode: str
    task_id: str
    kind: str
    index: int
    route: str = ""
    request_sha256: str = ""
    policy: str = ""
    prompt_ids: list[int] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    versions: list[list[int]] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    response: str = ""
    raas_id: str = ""
    at_ms: int = field(default_factory=now_ms)


@record("DeadLetter")
class DeadLetter(Record):
    source_topic: str
    partition: int
    offset: int
    component_id: str
    error: str
    raw: bytes
    raw_key: bytes | None = None
    at_ms: int = field(default_factory=now_ms)
