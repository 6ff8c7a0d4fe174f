"""One client configuration for every Kafka client AstraFlow makes."""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from astraflow.kafka.access import check_login, guarded_error_cb, principal_of_conf
from astraflow.kafka.embedded import running_broker, running_cluster_bootstrap
from astraflow.kafka.security import (
    SECURITY_OPTIONS,
    KafkaSecurity,
    check_no_secrets,
    client_settings,
)

DEFAULT_BOOTSTRAP = "127.0.0.1:19092"
# group ids of readers that assign partitions and never join a group nor commit; the broker
# still wants DESCRIBE on them (the least-privilege ACLs of ``astraflow.security.acls`` grant it)
TABLE_GROUP = "astraflow-table"  # TopicReader, TopicTable: weights, status, followed topics
ADMISSION_GROUP = "astraflow-admission"  # the admission processor's record counters
REPLAY_GROUP = "astraflow-replay"  # replay copies (an operator command)
TRAINER_REPLAY_GROUP_PREFIX = "astraflow-trainer-replay-"  # + random: batches on resume
BLOB_READER_GROUP_PREFIX = "astraflow-blob-reader-"  # + random: weights.blobs chunks
LIBRDKAFKA_LOG = logging.getLogger("astraflow.librdkafka")
RACK_ENV = "ASTRAFLOW_RACK"  # a RaaS node's rack when started by hand (`raas run --rack`)
if os.environ.get("ASTRAFLOW_LIBRDKAFKA_LOG", "").lower() not in ("1", "debug", "on"):
    LIBRDKAFKA_LOG.setLevel(logging.CRITICAL)


class KafkaConfig(BaseModel):
    """Bootstrap servers, client id, security, and librdkafka options passed through.

    ``security`` (``astraflow.kafka.security.KafkaSecurity``) holds TLS, SASL and the
    credentials of each component; ``for_component`` picks one component's. ``options``
    takes any other librdkafka property and is applied to producers, consumers and admin
    clients alike; the per-role dicts are applied on top of it. No option may hold a secret
    (``sasl.password``, ``ssl.key.password`` ...): that fails at load naming the key, and a
    password is read from an environment variable or a file instead.
    """

    model_config = ConfigDict(extra="forbid")

    # None: ASTRAFLOW_BOOTSTRAP, else the embedded broker, else the embedded cluster
    bootstrap_servers: str | None = None
    client_id: str = Field(default_factory=lambda: f"astraflow-{socket.gethostname()}")
    options: dict[str, Any] = Field(default_factory=dict)
    producer_options: dict[str, Any] = Field(default_factory=dict)
    consumer_options: dict[str, Any] = Field(default_factory=dict)
    schema_registry_url: str | None = None
    schema_registry_options: dict[str, Any] = Field(default_factory=dict)
    # a component waits this long for a broker that went away, then exits non-zero
    outage_limit_s: float = Field(default=300.0, gt=0)
    outage_log_interval_s: float = Field(default=10.0, gt=0)  # one line per interval
    # how long one transaction may stay open (its records and offsets, not the work
    # before it); at most the broker's transaction.max.timeout.ms (15 min by default)
    transaction_timeout_ms: int = Field(default=60_000, ge=1000)
    security: KafkaSecurity = Field(default_factory=KafkaSecurity)

    @model_validator(mode="after")
    def _no_secrets(self) -> KafkaConfig:
        for name in ("options", "producer_options", "consumer_options",
                     "schema_registry_options"):
            check_no_secrets(getattr(self, name), f".{name}")
        for name in ("options", "producer_options"):
            acks = getattr(self, name).get("acks", "all")
            if str(acks) not in ("all", "-1"):
                raise ValueError(f".{name}.acks: every producer writes with acks=all (an "
                                 "idempotent producer needs it; with min.insync.replicas "
                                 f"a write survives a lost broker), not {acks!r}")
        if self.security.enabled:
            for name in ("options", "producer_options", "consumer_options"):
                clash = sorted(SECURITY_OPTIONS & set(getattr(self, name)))
                if clash:
                    raise ValueError(f".{name}.{clash[0]}: set by kafka.security; give it "
                                     "there, not as a librdkafka option")
        return self

    def for_component(self, key: str, run: str) -> KafkaConfig:
        """This config with the credentials of component ``key`` (``trainer.actor``,
        ``pool.local`` ...; see ``KafkaSecurity``) of run ``run``."""
        return self.model_copy(update={"security": self.security.for_component(key, run)})

    @classmethod
    def from_env(cls, **overrides: Any) -> KafkaConfig:
        """Bootstrap from ``ASTRAFLOW_BOOTSTRAP``, else the embedded broker's address."""
        data: dict[str, Any] = {"bootstrap_servers": resolve_bootstrap()}
        if os.environ.get("ASTRAFLOW_SCHEMA_REGISTRY"):
            data["schema_registry_url"] = os.environ["ASTRAFLOW_SCHEMA_REGISTRY"]
        data.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**data)

    def effective(self) -> KafkaConfig:
        """This config with ``ASTRAFLOW_BOOTSTRAP`` (it wins), the embedded broker or the
        embedded cluster (when the broker does not run) filled in; a secured embedded
        broker's admin credentials too when nothing (topology or environment) sets any."""
        env = os.environ.get("ASTRAFLOW_BOOTSTRAP")
        if env:
            return self.model_copy(update={"bootstrap_servers": env})
        if self.bootstrap_servers:
            return self
        broker = running_broker()
        update: dict[str, Any] = {"bootstrap_servers": (
            broker.bootstrap if broker else running_cluster_bootstrap() or DEFAULT_BOOTSTRAP)}
        if broker and broker.secure is not None and not self.security.with_env().enabled:
            update["security"] = broker.secure.client_security()
        return self.model_copy(update=update)

    def with_rack(self, rack: str | None) -> KafkaConfig:
        """This config with ``client.rack`` = ``rack`` on every consumer made from it, so
        that a broker with ``RackAwareReplicaSelector`` serves it from the replica in its
        rack (fetch from follower, KIP-392); unchanged for None. Producers write to the
        leader whatever their rack, so it is a consumer option only."""
        if rack is None:
            return self
        check_rack(rack, "rack")
        return self.model_copy(update={
            "consumer_options": {**self.consumer_options, "client.rack": rack}})

    def _base(self) -> dict[str, Any]:
        conf = {
            "bootstrap.servers": self.bootstrap_servers or resolve_bootstrap(),
            "client.id": self.client_id,
            # librdkafka's own log lines (one per failed reconnect) go to Python logging,
            # quiet unless asked for; what matters reaches us as errors and error_cb
            "logger": LIBRDKAFKA_LOG,
            **self.options,
            # TLS and SASL, the password read now (never held by this object)
            **client_settings(self.security),
        }
        return conf

    @staticmethod
    def _guarded(conf: dict[str, Any]) -> dict[str, Any]:
        """``conf`` with its ``error_cb`` wrapped: a refused login or a failed TLS
        handshake raises ``KafkaAccessError`` instead of being retried forever. Under SASL
        or TLS, the first configuration made for a set of credentials checks them against
        the broker (``check_login``): a wrong password fails here, at once."""
        check_login(conf)
        conf["error_cb"] = guarded_error_cb(conf, conf.get("error_cb"))
        return conf

    def principal(self) -> str:
        """``User:<name>`` the clients made from this config authenticate as."""
        return principal_of_conf(client_settings(self.security))

    def admin_conf(self, **extra: Any) -> dict[str, Any]:
        return self._guarded({**self._base(), **extra})

    def producer_conf(self, **extra: Any) -> dict[str, Any]:
        conf = {
            **self._base(),
            "enable.idempotence": True,
            "acks": "all",
            "linger.ms": 5,
            "compression.type": "lz4",
            **self.producer_options,
        }
        conf.update(extra)
        return self._guarded(conf)

    def consumer_conf(self, group_id: str, **extra: Any) -> dict[str, Any]:
        conf = {
            **self._base(),
            "group.id": group_id,
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            "isolation.level": "read_committed",
            **self.consumer_options,
        }
        conf.update(extra)
        return self._guarded(conf)


def rack_problem(rack: Any) -> str | None:
    """What is wrong with ``rack`` as a rack name (not empty, no blank and no comma:
    ``--racks`` lists them comma-separated), None when nothing is."""
    if isinstance(rack, str) and rack and not any(c.isspace() or c == "," for c in rack):
        return None
    return (f"{rack!r} is no rack name (a non-empty name without blanks or commas, as a "
            "broker's broker.rack: r1, eu-west-1a ...)")


def check_rack(rack: Any, key: str) -> str:
    """``rack``, or a ``ValueError`` ``key: problem`` unless it is a rack name."""
    problem = rack_problem(rack)
    if problem:
        raise ValueError(f"{key}: {problem}")
    return rack


def resolve_bootstrap() -> str:
    """``ASTRAFLOW_BOOTSTRAP`` if set, else the embedded broker's recorded address."""
    env = os.environ.get("ASTRAFLOW_BOOTSTRAP")
    if env:
        return env
    broker = running_broker()
    return broker.bootstrap if broker else running_cluster_bootstrap() or DEFAULT_BOOTSTRAP
