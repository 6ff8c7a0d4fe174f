"""Typed Python views of the Avro records in ``schemas/``.

Each dataclass mirrors one ``astraflow.<Name>`` Avro record field for field (a test keeps
them in step). ``to_dict`` gives what the Avro writer takes; ``from_dict`` rebuilds the
dataclass, nested records included, from what the Avro reader returns.
"""

from __future__ import annotations

import dataclasses
import time
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

R = TypeVar("R", bound="Record")


def now_ms() -> int:
    return int(time.time() * 1000)


class Record:
    """Base of every record dataclass: Avro name and dict conversion."""

    avro_name: ClassVar[str]

    def to_dict(self) -> dict[str, Any]:
        """Field values as the Avro writer takes them (shallow: lists are not copied)."""
        out = {}
        for name in self._field_names():
            v = getattr(self, name)
            if isinstance(v, Record):
                v = v.to_dict()
            elif isinstance(v, list) and v and isinstance(v[0], Record):
                v = [x.to_dict() for x in v]
            out[name] = v
        return out

    @classmethod
    def _field_names(cls) -> tuple[str, ...]:
        names = _FIELDS.get(cls)
        if names is None:
            names = _FIELDS[cls] = tuple(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]
        return names

    @classmethod
    def from_dict(cls: type[R], data: dict[str, Any]) -> R:
        hints = _hints(cls)
        kwargs = {}
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            if f.name not in data:
                continue
            kwargs[f.name] = _convert(hints[f.name], data[f.name])
        return cls(**kwargs)


_HINTS: dict[type, dict[str, Any]] = {}
_FIELDS: dict[type, tuple[str, ...]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _convert(hint: Any, value: Any) -> Any:
    if value is None:
        return None
    origin = typing.get_origin(hint)
    if origin is list:
        (item,) = typing.get_args(hint)
        if isinstance(item, type) and issubclass(item, Record):
            return [item.from_dict(v) if isinstance(v, dict) else v for v in value]
        return list(value)
    if isinstance(hint, type) and issubclass(hint, Record) and isinstance(value, dict):
        return hint.from_dict(value)
    return value


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
