"""The Kafka server properties the embedded broker, the embedded cluster and
``broker secure-config`` write: one KRaft node's config, its PLAINTEXT listeners, a cluster
id. The secured listeners are ``astraflow.broker.secure``'s."""

from __future__ import annotations

import base64
import uuid
from pathlib import Path

RemoteListener = tuple[int, str]  # (port bound on 127.0.0.1, advertised "host:port")


def cluster_id() -> str:
    """A new KRaft cluster id (22 characters of URL-safe base64)."""
    return base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")


def listeners(port: int, controller_port: int, remote: RemoteListener | None) -> str:
    """The PLAINTEXT listeners' part of the config."""
    listeners = f"PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port}"
    advertised = f"PLAINTEXT://127.0.0.1:{port}"
    protocols = "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT"
    if remote is not None:
        listeners += f",REMOTE://127.0.0.1:{remote[0]}"
        advertised += f",REMOTE://{remote[1]}"
        protocols += ",REMOTE:PLAINTEXT"
    return f"""listeners={listeners}
advertised.listeners={advertised}
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map={protocols}
"""


def node_properties(node_id: int, quorum: str, listeners: str, data: Path | str,
                    size: int = 1, rack: str | None = None) -> str:
    """The config of KRaft node ``node_id`` (broker and controller) of a cluster of
    ``size``: its ``quorum`` line, ``listeners`` part and ``log.dirs``. Internal topics
    get replication factor ``size`` capped at 3, and ``min.insync.replicas`` 2 from 3
    nodes (1 below), as do topics created without either."""
    replicas = min(3, size)
    min_isr = 2 if replicas >= 3 else 1
    racks = (f"broker.rack={rack}\nreplica.selector.class="
             "org.apache.kafka.common.replica.RackAwareReplicaSelector\n" if rack else "")
    return f"""# written by astraflow broker start
process.roles=broker,controller
node.id={node_id}
{quorum}
{listeners}{racks}log.dirs={data}
num.partitions=1
auto.create.topics.enable=false
default.replication.factor={replicas}
min.insync.replicas={min_isr}
offsets.topic.replication.factor={replicas}
offsets.topic.num.partitions=8
transaction.state.log.replication.factor={replicas}
transaction.state.log.min.isr={min_isr}
transaction.state.log.num.partitions=8
share.coordinator.state.topic.replication.factor={replicas}
share.coordinator.state.topic.min.isr={min_isr}
group.initial.rebalance.delay.ms=0
message.max.bytes=16777216
# segments below a log start offset that DeleteRecords moved (pruned weight blobs) are
# removed within 30 s instead of the default 5 min
log.retention.check.interval.ms=30000
"""


def single_node_properties(controller_port: int, listeners: str, data: Path | str,
                           host: str = "127.0.0.1") -> str:
    """The config of a broker that is its own one-node cluster, its controller at
    ``host:controller_port``."""
    return node_properties(1, f"controller.quorum.bootstrap.servers={host}:{controller_port}",
                           listeners, data)
