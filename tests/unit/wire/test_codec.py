"""Schemas and codecs, without a broker."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from astraflow.wire.codec import (
    RegistryCodec,
    SchemaMismatchError,
    SingleObjectCodec,
    TruncatedRecordError,
    UnknownSchemaError,
)
from astraflow.wire.records import (
    RECORD_TYPES,
    Batch,
    BlobChunk,
    BlobRef,
    ComponentStatus,
    DeadLetter,
    OffsetRange,
    PartitionOffset,
    ScalingAdvice,
    Sequence,
    Task,
    TensorInfo,
    TrajectoryGroup,
    WeightManifest,
)
from astraflow.wire.schemas import SchemaSet

REPO = Path(__file__).resolve().parents[3]


def sample_records() -> list:
    seq = Sequence(policy="actor", token_ids=[5, 6, 7, 8], loss_mask=[0, 0, 1, 1],
                   logprobs=[0.0, 0.0, -0.5, -1.25], versions=[-1, -1, 3, 4], reward=1.0,
                   sample_index=0, finish_reason="stop", role="solver")
    group = TrajectoryGroup(group_id="g1", prompt_id="p1", task_id="t1", workflow="single_turn",
                            source="arith", raas_id="raas-0", pool="local", sequences=[seq],
                            rewards=[1.0], metrics={"rollout/len": 4.0}, meta={"k": "v"})
    return [
        Task(task_id="t1", prompt_id="p1", workflow="single_turn", payload='{"q": "1+1"}',
             source="arith", policies=["actor"], meta={"level": "1"}),
        group,
        Batch(policy="actor", batch_id="b1", groups=[group, group], replayed=1,
              source_offsets=[OffsetRange("x.samples.actor", 0, 10, 12)]),
        WeightManifest(policy="actor", version=3, base_version=2, kind="delta", dtype="bfloat16",
                       tensors=[TensorInfo("w", [2, 3], "bfloat16")],
                       blobs=[BlobRef("file:///tmp/b", 10, "ab" * 32)], num_params=6,
                       num_changed=1, sparsity=5 / 6, encoded_bytes=10, trainer_step=3,
                       consumed_offsets=[PartitionOffset("x.batches.actor", 0, 3)]),
        WeightManifest(policy="actor", version=0, base_version=None, kind="full",
                       dtype="bfloat16", tensors=[], blobs=[], num_params=0, num_changed=0,
                       sparsity=0.0, encoded_bytes=0, trainer_step=0),
        BlobChunk(blob_id="b", index=0, count=1, data=b"\x00\xff" * 10, total_bytes=20),
        ComponentStatus(component_id="c/0", kind="processor", host="h", produced=3,
                        weight_versions={"actor": 3}, metrics={"x/y": 1.5}),
        ScalingAdvice(pool="local", current_size=2, target_size=3, branch="up",
                      wait_fraction=0.2, upper=0.1, lower=0.05),
        DeadLetter(source_topic="x.tasks", partition=0, offset=7, component_id="c/0",
                   error="bad", raw=b"\x01\x02", raw_key=b"k"),
    ]


@pytest.mark.parametrize("rec", sample_records(), ids=lambda r: type(r).__name__)
def test_single_object_round_trip(rec):
    codec = SingleObjectCodec()
    data = codec.encode(rec, "topic")
    assert data[:2] == b"\xc3\x01"
    assert data[2:10] == codec.schemas.reader(rec.avro_name).fingerprint
    assert codec.decode(data, "topic", 0, 0, expect=type(rec)) == rec


def test_dataclasses_match_schemas():
    schemas = SchemaSet()
    for name, cls in RECORD_TYPES.items():
        avro_fields = [f["name"] for f in schemas.named[name]["fields"]]
        py_fields = [f.name for f in dataclasses.fields(cls)]
        assert sorted(avro_fields) == sorted(py_fields), name
    assert set(schemas.named) == set(RECORD_TYPES)


def test_fingerprint_is_crc64_avro_of_canonical_form():
    # Known value from the Avro specification's test suite: CRC-64-AVRO of "int".
    from fastavro.schema import fingerprint

    assert fingerprint('"int"', "CRC-64-AVRO") == "8f5c393f1ad57572"


def test_errors_name_topic_partition_offset():
    codec = SingleObjectCodec()
    data = codec.encode(sample_records()[0], "t")
    with pytest.raises(TruncatedRecordError) as e:
        codec.decode(data[:-4], "in", 2, 41)
    assert (e.value.topic, e.value.partition, e.value.offset) == ("in", 2, 41)
    assert "in[2]@41" in str(e.value)
    with pytest.raises(TruncatedRecordError):
        codec.decode(data[:6], "in", 2, 41)
    with pytest.raises(UnknownSchemaError, match="fingerprint"):
        codec.decode(data[:2] + b"\x00" * 8 + data[10:], "in", 0, 1)
    with pytest.raises(SchemaMismatchError, match="expected astraflow.Batch"):
        codec.decode(data, "in", 0, 1, expect=Batch)
    with pytest.raises(SchemaMismatchError, match="single-object"):
        codec.decode(b"hello, this is not avro", "in", 0, 1)
    with pytest.raises(SchemaMismatchError, match="trailing"):
        codec.decode(data + b"\x00\x00", "in", 0, 1)
    with pytest.raises(SchemaMismatchError, match="tombstone"):
        codec.decode(None, "in", 0, 1)


def test_record_written_with_previous_schema_decodes(tmp_path: Path):
    """Evolution: add a field with a default; records of the old version still decode."""
    folder = tmp_path / "schemas"
    shutil.copytree(REPO / "schemas", folder)
    old = json.loads((folder / "Task.avsc").read_text())
    new = json.loads(json.dumps(old))
    new["fields"].append({"name": "priority", "type": "int", "default": 7})
    (folder / "Task.avsc").write_text(json.dumps(new))
    (folder / "history").mkdir(exist_ok=True)
    (folder / "history" / "Task.v1.avsc").write_text(json.dumps(old))

    writer_side = SingleObjectCodec(SchemaSet(REPO / "schemas"))  # a producer on v1
    task = sample_records()[0]
    data = writer_side.encode(task, "t")
    reader_schemas = SchemaSet(folder)
    assert reader_schemas.reader("Task").fingerprint != data[2:10]
    import io

    from fastavro import schemaless_reader

    writer = reader_schemas.by_fingerprint[data[2:10]]
    value = schemaless_reader(io.BytesIO(data[10:]), writer.parsed,
                              reader_schemas.reader("Task").parsed)
    assert value["priority"] == 7 and value["task_id"] == "t1"
    assert SingleObjectCodec(reader_schemas).decode(data, "t", 0, 0) == task
    # and without the history file the same bytes are refused, not misread
    for old_task in (folder / "history").glob("Task.*.avsc"):
        old_task.unlink()
    with pytest.raises(UnknownSchemaError):
        SingleObjectCodec(SchemaSet(folder)).decode(data, "t", 0, 0)


def test_current_records_decode_after_field_added_to_nested_type(tmp_path: Path):
    """A Batch written before Sequence grew a field decodes with the new reader schema."""
    folder = tmp_path / "schemas"
    shutil.copytree(REPO / "schemas", folder)
    seq = json.loads((folder / "Sequence.avsc").read_text())
    seq["fields"].append({"name": "turn", "type": "int", "default": 0})
    (folder / "Sequence.avsc").write_text(json.dumps(seq))
    (folder / "history").mkdir(exist_ok=True)
    old_set = SchemaSet(REPO / "schemas")
    (folder / "history" / "Batch.v1.avsc").write_text(
        json.dumps(old_set.reader("Batch").expanded))
    batch = sample_records()[2]
    data = SingleObjectCodec(old_set).encode(batch, "t")
    new_set = SchemaSet(folder)
    import io

    from fastavro import schemaless_reader

    value = schemaless_reader(io.BytesIO(data[10:]), new_set.by_fingerprint[data[2:10]].parsed,
                              new_set.reader("Batch").parsed)
    assert value["groups"][0]["sequences"][0]["turn"] == 0
    assert value["groups"][0]["sequences"][0]["token_ids"] == [5, 6, 7, 8]


@pytest.mark.parametrize("rec", sample_records()[:3], ids=lambda r: type(r).__name__)
def test_schema_registry_wire_format(rec):
    codec = RegistryCodec("mock://astraflow-tests")
    data = codec.encode(rec, "run.topic")
    assert data[0] == 0  # Confluent magic byte, then a 4-byte schema id
    assert codec.decode(data, "run.topic", 0, 5, expect=type(rec)) == rec
    with pytest.raises(TruncatedRecordError):
        codec.decode(data[:-3], "run.topic", 0, 5)
    with pytest.raises(SchemaMismatchError, match="magic"):
        codec.decode(b"\x07" + data[1:], "run.topic", 0, 5)
    with pytest.raises(UnknownSchemaError):
        codec.decode(b"\x00\x00\x00\x7f\xff" + data[5:], "run.topic", 0, 5)


def test_sequence_versions_derived():
    seq = sample_records()[1].sequences[0]
    assert (seq.min_version, seq.max_version) == (3, 4)


def test_record_conversions_are_worked_out_once_per_class():
    """``from_dict`` fills defaults and builds nested records from dicts; ``to_dict`` gives
    fresh dicts; ``avro_value`` and ``from_avro`` (the codec's path) skip the copies."""
    group = sample_records()[1]
    as_dict = group.to_dict()
    assert isinstance(as_dict["sequences"][0], dict) and as_dict is not group.__dict__
    assert TrajectoryGroup.from_dict(as_dict) == group
    task = Task.from_dict({"task_id": "t", "prompt_id": "p", "workflow": "w", "payload": "{}",
                           "source": "s"})
    assert task.policies == [] and task.attempt == 0
    assert task.avro_value() is task.__dict__  # no nested records: read as it is
    nested = group.avro_value()
    assert nested["sequences"][0] == group.sequences[0].__dict__
    rebuilt = TrajectoryGroup.from_avro(dict(nested, sequences=[dict(s) for s in
                                                                nested["sequences"]]))
    assert rebuilt == group and isinstance(rebuilt.sequences[0], Sequence)


def test_decoder_uses_fastavros_compiled_reader_and_falls_back_to_the_public_one(monkeypatch):
    """The codec reads bodies with the compiled reader behind ``schemaless_reader`` (its
    per-call schema checks skipped); where that reader is missing or reads differently,
    the public function does the work and records decode the same."""
    import fastavro._read

    from astraflow.wire import codec as codec_mod

    task = Task(task_id="t", prompt_id="p", workflow="w", payload="x" * 100, source="s",
                created_at_ms=1)
    fast = SingleObjectCodec()
    msg = fast.encode(task)
    assert fast.decode(msg) == task
    assert fast._decoders[msg[:10]].read is fastavro._read._read_data

    monkeypatch.setattr(fastavro._read, "_read_data", lambda fo, *a: {"other": 1})
    slow = SingleObjectCodec()
    assert slow.decode(msg) == task
    assert slow._decoders[msg[:10]].read is codec_mod._public_reader

    monkeypatch.delattr(fastavro._read, "_read_data")
    gone = SingleObjectCodec()
    assert gone.decode(msg) == task
    assert gone._decoders[msg[:10]].read is codec_mod._public_reader


def test_every_current_schema_is_kept_in_the_history():
    """Every shipped writer schema stays decodable: the current version of each schema is
    under schemas/history/ (a changed schema fails here until its new version is added with
    ``snapshot_history()``; the old one is already there)."""
    from astraflow.wire.schemas import history_file

    schemas = SchemaSet()
    history = schemas.folder / "history"
    missing = [history_file(ws) for ws in schemas.current.values()
               if not (history / history_file(ws)).is_file()]
    assert not missing, (f"add {missing} to {history}: python3 -c 'from astraflow.wire.schemas "
                         "import snapshot_history; snapshot_history()'")


def test_records_written_with_every_shipped_schema_decode_with_todays_code():
    """A record written with each version under schemas/history/ (fields filled by fastavro's
    generator, seeded) decodes with today's codec; every field both versions have keeps
    its value, and fields added since take their defaults."""
    import io
    import random

    from fastavro import schemaless_writer
    from fastavro.utils import generate_one

    from astraflow.wire.codec import MAGIC
    from astraflow.wire.schemas import make_writer_schema

    codec = SingleObjectCodec()
    history = sorted((codec.schemas.folder / "history").glob("*.avsc"))
    assert history
    random.seed(0)
    for path in history:
        ws = make_writer_schema(json.loads(path.read_text()))
        written = generate_one(ws.parsed)
        buf = io.BytesIO()
        schemaless_writer(buf, ws.parsed, written)
        record = codec.decode(MAGIC + ws.fingerprint + buf.getvalue(), "history", 0, 0)
        assert type(record).avro_name == ws.name, path.name
        decoded = record.to_dict()
        for name in written:
            assert _same(decoded[name], written[name]), (path.name, name)


def _same(a, b) -> bool:
    """Equal, floats to float32 precision (an Avro ``float`` keeps 24 bits)."""
    if isinstance(a, float) and isinstance(b, float):
        return a == pytest.approx(b, rel=1e-6) or (a != a and b != b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() >= b.keys() and all(_same(a[k], b[k]) for k in b)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_a_record_of_an_unknown_schema_is_refused_naming_its_fingerprint():
    data = MAGIC_HEADER_OF_NOBODY + b"\x02a"
    with pytest.raises(UnknownSchemaError, match="unknown schema fingerprint 0102030405060708"):
        SingleObjectCodec().decode(data, "t", 3, 9)


MAGIC_HEADER_OF_NOBODY = b"\xc3\x01\x01\x02\x03\x04\x05\x06\x07\x08"
