"""Signed weight manifests on a broker: the trainer's resume refuses a badly signed newest
manifest, dead-letters it with the reason and resumes from the newest trusted version."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from astraflow.config.topology import WeightSigningSpec
from astraflow.weights.signing import ManifestSigner, keygen, refusal, split_trusted
from astraflow.wire.records import WeightManifest
from tests.unit.trainer.test_trainer import tiny_model  # noqa: F401 - a fixture
from tests.unit.weights.test_signing import keys  # noqa: F401 (fixtures)


def _forge_after(newest: WeightManifest, key: Path, producer, topic: str
                 ) -> tuple[WeightManifest, WeightManifest]:
    """Produce to ``topic`` the next version after ``newest`` signed with ``key`` and the
    one after it unsigned; both."""
    forged = copy.deepcopy(newest)
    forged.version, forged.base_version = newest.version + 1, newest.version
    ManifestSigner.from_file(key).sign(forged)
    unsigned = copy.deepcopy(forged)
    unsigned.version, unsigned.base_version, unsigned.signature = forged.version + 1, \
        forged.version, None
    producer.produce(topic, forged, key="actor")
    producer.produce(topic, unsigned, key="actor")
    producer.flush()
    return forged, unsigned


def dead_letters(config, topic: str) -> list:
    """The ``DeadLetter``s on ``topic``, once there is one."""
    from astraflow.kafka.table import TopicReader
    from astraflow.wire.records import DeadLetter
    from tests.conftest import wait_for

    reader = TopicReader(config, topic, DeadLetter, client_id="dlq")
    try:
        return wait_for(lambda: [e.value for e in reader.catch_up(5.0) if e.value], 30,
                        f"dead letters on {topic}")
    finally:
        reader.close()


@pytest.mark.slow
def test_the_trainers_resume_refuses_a_badly_signed_newest_manifest(
        keys, kafka_config, make_topology, tiny_model, tmp_path):  # noqa: F811 - the fixture
    """The newest manifests on weights.actor are signed by another key and unsigned: the
    trainer resumes from the newest one its key signed, dead-letters the others with the
    reason, never loads them, and publishes its own next version. When every manifest is
    refused it does not start (nor publish version 0 over them)."""
    import torch

    from astraflow.kafka.clients import RecordProducer
    from astraflow.trainer.service import TrainerService
    from astraflow.weights.stores.kafka import read_manifests
    from tests.integration.trainer.test_trainer import service_options
    from tests.unit.trainer.test_trainer import make_batch

    signer, verifier, private, public = keys
    other, _ = keygen(tmp_path / "other")
    topo, _ = make_topology(
        topics={"batches.actor": {"partitions": 1}, "weights.actor": {"partitions": 1},
                "dlq": {"partitions": 1}},
        weight_signing={"private_key": str(private), "public_key": str(public)})
    weights, producer = topo.full_name("weights.actor"), RecordProducer(kafka_config)
    for i in range(3):
        producer.produce(topo.full_name("batches.actor"), make_batch(i), key="actor")
    producer.flush()
    torch.set_num_threads(1)

    def service(topology, steps: int) -> TrainerService:
        return TrainerService(topology, service_options(
            tiny_model, tmp_path / "state", max_steps=steps), config=kafka_config)

    service(topo, 2).run()
    published = read_manifests(kafka_config, weights)
    assert {m.version for m in published} == {0, 1, 2}
    assert split_trusted(published, verifier)[1] == []  # the trainer signs each one
    forged, _ = _forge_after(max(published, key=lambda m: m.version), other, producer,
                             weights)

    resumed = service(topo, 1)
    resumed.run()
    assert (resumed.resumed_from, resumed.version) == (2, 3)
    letters = dead_letters(kafka_config, topo.full_name("dlq"))
    assert [(d.source_topic, d.component_id) for d in letters] == [
        (weights, "trainer.actor/0")] * 2
    assert letters[0].error == (
        f"refused: manifest actor v3 ({forged.kind}) is signed by key {forged.signing_key}, "
        f"which is not trusted (trusted: {signer.key_id})")
    assert letters[1].error.startswith(f"refused: manifest actor v4 ({forged.kind}) is "
                                       "unsigned")
    mine = [m for m in read_manifests(kafka_config, weights) if m.version == 3][-1]
    assert refusal(verifier, mine) is None and mine.signature != forged.signature

    _, third = keygen(tmp_path / "third")  # signed none of them
    _refuses_every_manifest(service(topo.model_copy(update={
        "weight_signing": WeightSigningSpec(public_key=str(third))}), 1))


def _refuses_every_manifest(svc) -> None:
    """``svc`` (a trainer service whose public key signed none of its weights topic) does
    not resume, nor publish version 0."""
    svc._open()
    try:
        with pytest.raises(RuntimeError, match="every manifest of actor is refused .*not "
                           "resuming from any, nor publishing version 0"):
            svc._restore()
    finally:
        svc.store.close()

