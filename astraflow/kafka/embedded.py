"""Finding the embedded broker or cluster from the state they record, as a client does.

``astraflow broker start`` (``astraflow.broker``) writes what a client needs into its state
directory: the pid and ports (``broker.json``, ``ports.json``), for a secured broker the CA
and the admin's password file, and for the cluster ``cluster.json`` plus one ``pid.json``
a node. This module only reads those files, so that a client configuration
(``KafkaConfig.effective``) finds a running embedded broker without importing the code that
starts one.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from astraflow.kafka.security import KafkaSecurity

ADMIN_USER = "admin"
MECHANISM = "SCRAM-SHA-512"


def state_dir() -> Path:
    """The embedded broker's state directory: ``$ASTRAFLOW_STATE``, else
    ``~/.local/state/astraflow/broker``."""
    default = Path.home() / ".local" / "state" / "astraflow" / "broker"
    return Path(os.environ.get("ASTRAFLOW_STATE", default))


def cluster_state_dir() -> Path:
    """``$ASTRAFLOW_CLUSTER_STATE``, else the embedded broker's state directory with
    ``-cluster`` appended (``~/.local/state/astraflow/broker-cluster``)."""
    env = os.environ.get("ASTRAFLOW_CLUSTER_STATE")
    if env:
        return Path(env)
    broker = state_dir()
    return broker.with_name(broker.name + "-cluster")


def read_json(path: Path) -> dict:
    """A state file's content, {} when it is missing or unreadable."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie child still answers kill(0); check its state
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


@dataclass(frozen=True)
class TlsFiles:
    """Where the CA and broker certificate are."""

    ca: Path  # the CA certificate (PEM): what clients trust
    ca_key: Path
    broker: Path  # the broker's key, then its certificate and the CA's (PEM keystore)


def tls_files(folder: Path) -> TlsFiles:
    return TlsFiles(folder / "ca.pem", folder / "ca.key", folder / "broker.pem")


@dataclass(frozen=True)
class SecureFiles:
    """A secured broker's files in its state directory."""

    tls: TlsFiles
    admin_password: Path
    controller_password: Path
    # the client listener's: SASL_SSL, or SASL_PLAINTEXT (benches: SASL without TLS)
    protocol: str = "SASL_SSL"

    @property
    def uses_tls(self) -> bool:
        return self.protocol == "SASL_SSL"

    def client_security(self) -> KafkaSecurity:
        """The admin's client settings: SASL_SSL (this CA), SCRAM-SHA-512."""
        return KafkaSecurity(protocol=self.protocol, sasl_mechanism=MECHANISM,
                             username=ADMIN_USER, password_file=str(self.admin_password),
                             ca_location=str(self.tls.ca) if self.uses_tls else None)

    def client_conf(self) -> dict[str, str]:
        """librdkafka properties of an admin client (the password read now)."""
        conf = {"security.protocol": self.protocol, "sasl.mechanism": MECHANISM,
                "sasl.username": ADMIN_USER,
                "sasl.password": self.admin_password.read_text().strip()}
        if self.uses_tls:
            conf["ssl.ca.location"] = str(self.tls.ca)
        return conf


def secure_files(state: Path, protocol: str = "SASL_SSL") -> SecureFiles:
    return SecureFiles(tls_files(state / "tls"), state / "admin.password",
                       state / "controller.password", protocol)


@dataclass(frozen=True)
class Recorded:
    """A running embedded broker as its state records it."""

    pid: int
    port: int
    info: dict  # broker.json
    secure: SecureFiles | None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"


def recorded_secure(state: Path) -> SecureFiles | None:
    """The secured broker's files if ``state`` is a secured broker's, else None."""
    mode = read_json(state / "ports.json").get("secure")
    if not mode:
        return None
    return secure_files(state, mode if isinstance(mode, str) else "SASL_SSL")


def running_broker(state: Path | None = None) -> Recorded | None:
    """The embedded broker of ``state`` (default ``state_dir()``) while it runs, else None."""
    state = state or state_dir()
    info = read_json(state / "broker.json")
    if not info or not pid_alive(int(info["pid"])):
        return None
    secure = recorded_secure(state) if info.get("secure") else None
    return Recorded(int(info["pid"]), int(info["port"]), info, secure)


def node_pid(state: Path, node_id: int) -> int | None:
    """Node ``node_id``'s JVM pid of the cluster in ``state`` while it runs, else None."""
    node = state / f"node-{node_id}"
    pid = read_json(node / "pid.json").get("pid")
    if not pid or not pid_alive(int(pid)):
        return None
    try:  # the pid of a node that died long ago may be another process's now
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return int(pid)  # no /proc: trust the pid
    return int(pid) if str(node / "server.properties").encode() in cmdline else None


def running_cluster_bootstrap(state: Path | None = None) -> str | None:
    """Every node's client address while any node of the cluster runs, else None (no
    client call: cheap)."""
    state = state or cluster_state_dir()
    info = read_json(state / "cluster.json")
    nodes = info.get("nodes", {})
    size = int(info.get("size", 3))
    if not nodes or all(node_pid(state, i) is None for i in range(1, size + 1)):
        return None
    ports = {int(i): int(v["port"]) for i, v in nodes.items()}
    if any(i not in ports for i in range(1, size + 1)):
        return None
    return ",".join(f"127.0.0.1:{ports[i]}" for i in range(1, size + 1))
