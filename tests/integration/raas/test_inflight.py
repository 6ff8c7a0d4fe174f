"""Weight updates inside a generation on a real broker: a node with ``update_every_tokens``
fetches versions published while it generates (its watcher's prefetch thread) and applies
them between chunks; the group it produces records each token's version."""

from __future__ import annotations

import pytest
import torch

from astraflow.raas.engine import TorchEngine
from astraflow.wire.records import TrajectoryGroup
from tests.conftest import running, wait_for
from tests.integration.raas.test_raas import node_topology
from tests.unit.raas.test_engine import tiny_model, tiny_tokenizer
from tests.unit.raas.test_workflows import task_of


class PublishingMidway:
    """Wraps the node's watcher (the engine's in-flight source): at the chunk boundaries
    ``at`` it publishes the next version and waits until the watcher, fetching in its own
    thread, hands it over; at the others it asks the watcher as the engine would."""

    def __init__(self, watcher, publish, at: tuple[int, ...]):
        self.watcher = watcher
        self.publish = publish  # () -> the version it published
        self.at = at
        self.boundaries = 0

    def take_ready(self, current, load):
        self.boundaries += 1
        if self.boundaries not in self.at:
            return self.watcher.take_ready(current, load)
        version = self.publish()
        return wait_for(lambda: self.watcher.take_ready(current, load), 60,
                        f"the watcher to fetch version {version} while the engine generates")


@pytest.mark.slow
def test_a_node_applies_versions_published_during_a_generation(kafka_config, make_topology,
                                                                tmp_path):
    from astraflow.kafka.clients import RecordProducer, read_all
    from astraflow.raas.node import NodeOptions, RaaSNode
    from astraflow.weights import FileBlobStore, WeightPublisher

    topo, _ = node_topology(make_topology, **{"weights.actor": {"partitions": 1}})
    store = FileBlobStore(str(tmp_path / "blobs"))
    pub = WeightPublisher(store, "actor", anchor_interval=10)
    producer = RecordProducer(kafka_config)
    model = tiny_model()
    v0 = {k: v.clone() for k, v in model.state_dict().items()}
    later = [{k: v + 0.02 * (i + 1) * torch.randn_like(v) for k, v in v0.items()}
             for i in range(2)]
    published: list[int] = []

    def publish(state) -> int:
        for m in pub.publish(state):
            producer.produce(topo.full_name("weights.actor"), m, key="actor")
        producer.flush()
        published.append(len(published))
        return published[-1]

    sources: list[PublishingMidway] = []

    class Engine(TorchEngine):
        def follow_inflight(self, source, every):
            sources.append(PublishingMidway(source, lambda: publish(later[len(published) - 1]),
                                            at=(1, 3)))
            super().follow_inflight(sources[-1], every)

    publish(v0)
    eng = Engine(model, tiny_tokenizer(), policy="actor", version=0)
    producer.produce(topo.full_name("tasks"), task_of({"prompt": "1+2=", "answer": "3"}),
                     key="p-t0")
    producer.flush()
    # a stop token the model cannot sample: every sample runs to its 16 tokens
    node = RaaSNode(topo, {"actor": eng}, NodeOptions(
        instance="w", n_samples=2, poll_timeout_s=0.2, update_every_tokens=4,
        workflow_options={"single_turn": {"max_new_tokens": 16, "stop_token_ids": [999]}}))
    with running(node) as thread:
        out = topo.full_name("trajectories.raw")
        wait_for(lambda: read_all(kafka_config, out, idle_s=0.3), 90, "a trajectory group")
        (g,) = [r.record for r in read_all(kafka_config, out, idle_s=0.3, expect=TrajectoryGroup)]
    assert not thread.is_alive()
    assert len(g.sequences) == 2
    for s in g.sequences:
        generated = [v for v, m in zip(s.versions, s.loss_mask) if m]
        assert generated == [0] * 4 + [1] * 8 + [2] * 4
        assert (s.min_version, s.max_version) == (0, 2)
    assert g.metrics["rollout/version_span_max"] == 2.0
    assert sources[0].boundaries == 3 and eng.version == 2 and eng.inflight_updates == 2
    for k, t in eng.model.state_dict().items():  # the last version, exactly as published
        assert torch.equal(t, later[1][k]), k
    m = node.status().metrics
    assert m["raas/weight_updates_inflight"] == 2.0
    assert node.status().weight_versions == {"actor": 2}
