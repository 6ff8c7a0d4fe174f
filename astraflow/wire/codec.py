"""Avro encoding of records on the wire.

Two wire formats behind one ``Codec`` protocol:

* ``SingleObjectCodec`` (default): Avro single-object encoding, ``C3 01`` + 8-byte
  CRC-64-AVRO fingerprint of the writer schema + body. Every message names its schema
  without a registry; writer schemas are looked up in a ``SchemaSet``.
* ``RegistryCodec``: the Confluent Schema Registry wire format (``00`` + 4-byte schema id
  + body) through confluent-kafka's Avro serializers; chosen when a registry URL is set.

Decoding failures raise a ``RecordDecodeError`` subclass naming topic, partition, offset.
"""

from __future__ import annotations

import dataclasses
import io
import json
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

from fastavro import parse_schema, schemaless_reader, schemaless_writer

from astraflow.wire.records import RECORD_TYPES, Record, avro_builder, is_flat
from astraflow.wire.schemas import SchemaSet

MAGIC = b"\xc3\x01"
_new = object.__new__
_BytesIO = io.BytesIO
HEADER_LEN = 10


class RecordDecodeError(Exception):
    """A message could not be turned into a record."""

    def __init__(self, reason: str, topic: str = "", partition: int = -1, offset: int = -1):
        self.reason = reason
        self.topic = topic
        self.partition = partition
        self.offset = offset
        super().__init__(f"{topic}[{partition}]@{offset}: {reason}")


class UnknownSchemaError(RecordDecodeError):
    """The message names a schema (fingerprint or registry id) that nobody knows."""


class TruncatedRecordError(RecordDecodeError):
    """The message ends before its record does."""


class SchemaMismatchError(RecordDecodeError):
    """The message is not the record type expected, or its body does not fit its schema."""


class Codec(Protocol):
    """Turns records into message values and back."""

    def encode(self, record: Record, topic: str) -> bytes: ...

    def decode(
        self,
        data: bytes | None,
        topic: str = "",
        partition: int = -1,
        offset: int = -1,
        expect: type[Record] | None = None,
    ) -> Record: ...


def _check_expected(name: str, expect, where: tuple[str, int, int]) -> type[Record]:
    if expect is not None and name != expect.avro_name:
        raise SchemaMismatchError(f"expected {expect.avro_name}, message holds {name}", *where)
    cls = RECORD_TYPES.get(name)
    if cls is None:
        raise SchemaMismatchError(f"{name} is not an astraflow record type", *where)
    return cls


def _public_reader(fo: io.BytesIO, writer: Any, named: Any, reader: Any, options: Any) -> Any:
    return schemaless_reader(fo, writer, reader)


_READ_OPTIONS = {"return_record_name": False, "return_record_name_override": False,
                 "handle_unicode_errors": "strict", "return_named_type": False,
                 "return_named_type_override": False}


def _body_reader(writer: Any, reader: Any | None) -> tuple[Callable[..., Any], tuple]:
    """How to read one body of ``writer`` (as ``reader``, if given) from a file:
    ``fn(fo, *args)``.

    ``fastavro.schemaless_reader`` re-checks its schemas and builds its options on every
    call, about a tenth of the time a small record takes; the compiled reader underneath
    takes them once here. Where that reader is missing or reads differently (another
    fastavro), the public function does the work."""
    public = (_public_reader, (writer, None, reader, None))
    try:
        from fastavro._read import _read_data  # the compiled reader behind schemaless_reader
    except ImportError:
        return public
    named: dict[str, dict] = {"writer": {}, "reader": {}}
    w = parse_schema(writer, named["writer"])
    r = parse_schema(reader, named["reader"]) if reader is not None else None
    compiled = (_read_data, (w, named, r, _READ_OPTIONS))
    return compiled if _same_reading(compiled, public, writer) else public


def _same_reading(a: tuple[Callable[..., Any], tuple], b: tuple[Callable[..., Any], tuple],
                  writer: Any) -> bool:
    """Whether two readers agree on a made-up record of ``writer``."""
    from fastavro.utils import generate_one

    try:
        buf = io.BytesIO()
        schemaless_writer(buf, writer, generate_one(writer))
        data = buf.getvalue()
        return a[0](io.BytesIO(data), *a[1]) == b[0](io.BytesIO(data), *b[1])
    except Exception:  # noqa: BLE001 - any failure: the public reader it is
        return False


class _Decoder(NamedTuple):
    """How to decode the body of one writer schema."""

    read: Callable[..., Any]  # read(fo, *args): one body, as the current schema, to a dict
    a1: Any
    a2: Any
    a3: Any
    a4: Any
    # the record of the reader's dict; None: the dict becomes a flat record's own state
    build: Callable[[dict[str, Any]], Record] | None
    cls: type[Record]
    name: str


class SingleObjectCodec:
    """Avro single-object encoding; needs no registry.

    The header (magic and fingerprint) of each writer schema maps to a ready ``_Decoder``,
    and each record class to its ready header and parsed schema, so a record costs one dict
    look-up besides fastavro's own work.
    """

    def __init__(self, schemas: SchemaSet | None = None):
        self.schemas = schemas or SchemaSet()
        self._decoders: dict[bytes, _Decoder] = {}
        self._encoders: dict[str, tuple[bytes, Any, bool]] = {}

    def encode(self, record: Record, topic: str = "") -> bytes:
        try:
            header, schema, flat = self._encoders[record.avro_name]
        except KeyError:
            ws = self.schemas.reader(record.avro_name)
            header, schema, flat = self._encoders[record.avro_name] = (
                MAGIC + ws.fingerprint, ws.parsed, is_flat(type(record)))
        buf = io.BytesIO()
        buf.write(header)
        # a record without nested records is its own __dict__ to the writer (read only)
        schemaless_writer(buf, schema, record.__dict__ if flat else record.avro_value())
        return buf.getvalue()

    def decode(
        self,
        data: bytes | None,
        topic: str = "",
        partition: int = -1,
        offset: int = -1,
        expect: type[Record] | None = None,
    ) -> Record:
        try:
            read, a1, a2, a3, a4, build, cls, name = self._decoders[data[:10]]
        except (KeyError, TypeError):  # a header not seen yet, or no value at all
            read, a1, a2, a3, a4, build, cls, name = self._decoder(data, (topic, partition,
                                                                         offset))
        if expect is not None and cls is not expect:
            _check_expected(name, expect, (topic, partition, offset))
        buf = _BytesIO(data)
        buf.seek(10)  # HEADER_LEN
        try:
            value = read(buf, a1, a2, a3, a4)
        except (EOFError, StopIteration, IndexError) as e:
            raise TruncatedRecordError(f"body ends early: {type(e).__name__} {e}", topic,
                                       partition, offset) from e
        except Exception as e:  # fastavro raises assorted errors on bad bodies
            raise SchemaMismatchError(f"body does not fit {name}: {e}", topic, partition,
                                      offset) from e
        if buf.tell() != len(data):
            raise SchemaMismatchError(
                f"{len(data) - buf.tell()} trailing bytes after the {name} body", topic,
                partition, offset)
        if build is None:
            obj = _new(cls)
            obj.__dict__ = value
            return obj
        return build(value)

    def _decoder(self, data: bytes | None, where: tuple[str, int, int]) -> _Decoder:
        """The decoder for ``data``'s header, made on first sight; or why there is none."""
        if data is None:
            raise SchemaMismatchError("message has no value (tombstone)", *where)
        if len(data) < HEADER_LEN:
            if data[:2] == MAGIC[: len(data[:2])]:
                raise TruncatedRecordError(
                    f"{len(data)} bytes: shorter than the 10-byte single-object header", *where
                )
            raise SchemaMismatchError("not Avro single-object encoded (no C3 01 header)", *where)
        if data[:2] != MAGIC:
            raise SchemaMismatchError(
                f"not Avro single-object encoded: starts with {data[:2].hex()}, not c301", *where
            )
        fp = data[2:HEADER_LEN]
        writer = self.schemas.by_fingerprint.get(fp)
        if writer is None:
            raise UnknownSchemaError(f"unknown schema fingerprint {fp.hex()}", *where)
        cls = _check_expected(writer.name, None, where)
        reader = self.schemas.reader(writer.name)
        fields = tuple(f["name"] for f in reader.expanded["fields"])
        exact = set(fields) == {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        build = (None if is_flat(cls) else avro_builder(cls)) if exact else cls.from_dict
        same = reader.fingerprint == fp
        read, args = _body_reader(writer.parsed, None if same else reader.parsed)
        dec = _Decoder(read, *args, build, cls, writer.name)
        self._decoders[data[:HEADER_LEN]] = dec
        return dec


class RegistryCodec:
    """Confluent Schema Registry wire format through confluent-kafka's Avro serdes.

    ``url`` may be ``mock://name`` (confluent-kafka's in-process mock registry, for tests).
    Subjects follow the default topic-name strategy (``<topic>-value``).
    """

    def __init__(
        self, url: str, conf: dict[str, Any] | None = None, schemas: SchemaSet | None = None
    ):
        from confluent_kafka.schema_registry import SchemaRegistryClient

        self.schemas = schemas or SchemaSet()
        self.client = SchemaRegistryClient.new_client({"url": url, **(conf or {})})
        self._serializers: dict[str, Any] = {}
        self._deserializers: dict[str, Any] = {}
        self._id_names: dict[int, str] = {}

    def _serializer(self, name: str):
        from confluent_kafka.schema_registry.avro import AvroSerializer

        if name not in self._serializers:
            schema_str = json.dumps(self.schemas.reader(name).expanded)
            self._serializers[name] = AvroSerializer(self.client, schema_str)
        return self._serializers[name]

    def _deserializer(self, name: str):
        from confluent_kafka.schema_registry.avro import AvroDeserializer

        if name not in self._deserializers:
            schema_str = json.dumps(self.schemas.reader(name).expanded)
            self._deserializers[name] = AvroDeserializer(self.client, schema_str)
        return self._deserializers[name]

    def encode(self, record: Record, topic: str) -> bytes:
        from confluent_kafka.serialization import MessageField, SerializationContext

        ctx = SerializationContext(topic, MessageField.VALUE)
        return self._serializer(record.avro_name)(record.to_dict(), ctx)

    def decode(
        self,
        data: bytes | None,
        topic: str = "",
        partition: int = -1,
        offset: int = -1,
        expect: type[Record] | None = None,
    ) -> Record:
        from confluent_kafka.serialization import MessageField, SerializationContext

        where = (topic, partition, offset)
        if data is None:
            raise SchemaMismatchError("message has no value (tombstone)", *where)
        if len(data) < 5:
            raise TruncatedRecordError(f"{len(data)} bytes: shorter than the 5-byte header", *where)
        if data[0] != 0:
            raise SchemaMismatchError(
                f"not Schema Registry framed: magic byte {data[0]:#04x}, not 0x00", *where
            )
        schema_id = int.from_bytes(data[1:5], "big")
        name = self._id_names.get(schema_id)
        if name is None:
            try:
                schema = self.client.get_schema(schema_id)
                raw = json.loads(schema.schema_str)
            except Exception as e:
                raise UnknownSchemaError(f"schema id {schema_id}: {e}", *where) from e
            ns = raw.get("namespace")
            name = raw["name"] if "." in raw["name"] or not ns else f"{ns}.{raw['name']}"
            self._id_names[schema_id] = name
        cls = _check_expected(name, expect, where)
        try:
            value = self._deserializer(name)(data, SerializationContext(topic, MessageField.VALUE))
        except (EOFError, StopIteration, IndexError) as e:
            raise TruncatedRecordError(f"body ends early: {type(e).__name__} {e}", *where) from e
        except Exception as e:
            cause = e.__cause__ or e.__context__
            if isinstance(cause, (EOFError, StopIteration, IndexError)):
                raise TruncatedRecordError(f"body ends early: {e}", *where) from e
            raise SchemaMismatchError(f"body does not fit {name}: {e}", *where) from e
        return cls.from_dict(value)


def make_codec(
    registry_url: str | None = None,
    registry_conf: dict[str, Any] | None = None,
    schemas: SchemaSet | None = None,
) -> Codec:
    """Single-object encoding, or the registry format when ``registry_url`` is given."""
    if registry_url:
        return RegistryCodec(registry_url, registry_conf, schemas)
    return SingleObjectCodec(schemas)
