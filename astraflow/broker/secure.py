"""The embedded broker's secured mode (``astraflow broker start --secure``).

The client listener speaks SASL_SSL with SCRAM-SHA-512; the controller listener SASL
PLAIN with its own ``controller`` user (a PLAINTEXT controller listener would make
``User:ANONYMOUS`` a super user, open to anyone on the host); ``StandardAuthorizer``
refuses whatever no ACL allows. ``admin`` is the super user the operator commands use: it
is created when the storage is formatted, because the broker logs in to itself with it.
Everything lives in the state directory, kept across restarts: ``tls/`` (CA and broker
certificate, ``astraflow.security.tls``), ``admin.password`` and ``controller.password``
(mode 0600). No password is ever printed; only the files that hold them are named.
"""

from __future__ import annotations

import secrets
from pathlib import Path

from astraflow.broker.properties import cluster_id, single_node_properties
from astraflow.kafka.embedded import ADMIN_USER, MECHANISM, SecureFiles, secure_files
from astraflow.security.tls import ensure_broker_tls, write_private

CONTROLLER_USER = "controller"
AUTHORIZER = "org.apache.kafka.metadata.authorizer.StandardAuthorizer"


PROTOCOLS = ("SASL_SSL", "SASL_PLAINTEXT")


def _read(path: Path) -> str:
    return path.read_text().strip()


def _password(path: Path) -> str:
    """The password kept in ``path``; a new random one (written mode 0600) if none."""
    if path.exists() and _read(path):
        return _read(path)
    value = secrets.token_urlsafe(24)  # letters, digits, - and _: safe inside JAAS quotes
    write_private(path, value + "\n")
    return value


def prepare(state: Path, log=print, protocol: str = "SASL_SSL",
            dns: tuple[str, ...] = ("localhost",)) -> SecureFiles:
    """Make what a secured broker needs in ``state`` unless it is there (kept otherwise);
    ``dns``: the names its certificate holds (besides ``IP:127.0.0.1``)."""
    files = secure_files(state, protocol)
    ensure_broker_tls(state / "tls", log=log, dns=dns)
    _password(files.admin_password)
    _password(files.controller_password)
    return files


def scram_bootstrap(files: SecureFiles) -> list[str]:
    """The ``--add-scram`` values of the storage format: the admin user."""
    return [f"{MECHANISM}=[name={ADMIN_USER},password={_read(files.admin_password)}]"]


def secure_properties(port: int, controller_port: int, files: SecureFiles,
                      host: str = "127.0.0.1", bind: str = "127.0.0.1") -> str:
    """The listener, SASL, TLS and authorizer part of a secured broker's config: bound on
    ``bind``, advertised as ``host``."""
    admin, ctl = _read(files.admin_password), _read(files.controller_password)
    scram = "org.apache.kafka.common.security.scram.ScramLoginModule"
    plain = "org.apache.kafka.common.security.plain.PlainLoginModule"
    name = files.protocol  # the client listener is named after its protocol
    return f"""listeners={name}://{bind}:{port},CONTROLLER://{bind}:{controller_port}
advertised.listeners={name}://{host}:{port}
controller.listener.names=CONTROLLER
inter.broker.listener.name={name}
listener.security.protocol.map={name}:{name},CONTROLLER:SASL_PLAINTEXT
sasl.enabled.mechanisms={MECHANISM}
sasl.mechanism.inter.broker.protocol={MECHANISM}
sasl.mechanism.controller.protocol=PLAIN
listener.name.{name.lower()}.sasl.enabled.mechanisms={MECHANISM}
listener.name.{name.lower()}.{MECHANISM.lower()}.sasl.jaas.config={scram} required \\
  username="{ADMIN_USER}" password="{admin}";
listener.name.controller.sasl.enabled.mechanisms=PLAIN
listener.name.controller.plain.sasl.jaas.config={plain} required \\
  username="{CONTROLLER_USER}" password="{ctl}" user_{CONTROLLER_USER}="{ctl}";
ssl.keystore.type=PEM
ssl.keystore.location={files.tls.broker}
ssl.truststore.type=PEM
ssl.truststore.location={files.tls.ca}
ssl.client.auth=none
authorizer.class.name={AUTHORIZER}
allow.everyone.if.no.acl.found=false
super.users=User:{ADMIN_USER};User:{CONTROLLER_USER}
"""


def describe(bootstrap: str, files: SecureFiles) -> str:
    """What a client needs, without a secret: bootstrap, CA, admin credentials file."""
    ca = f"ASTRAFLOW_SSL_CA_LOCATION={files.tls.ca} " if files.uses_tls else ""
    return (f"  bootstrap {bootstrap} ({files.protocol}, {MECHANISM})\n"
            + (f"  CA certificate {files.tls.ca}\n" if files.uses_tls else "")
            + f"  admin user {ADMIN_USER}, password in {files.admin_password} (mode 0600)\n"
            f"  clients: ASTRAFLOW_SECURITY_PROTOCOL={files.protocol} {ca}"
            f"ASTRAFLOW_SASL_USERNAME={ADMIN_USER} "
            f"ASTRAFLOW_SASL_PASSWORD_FILE={files.admin_password}")




def write_cluster_config(out: Path, host: str, port: int, controller_port: int,
                         data_dir: str, weights_keys: bool = False, log=print) -> SecureFiles:
    """Everything a secured single-node Kafka of its own needs (``astraflow broker
    secure-config``, the docker-compose ``secure`` profile): the CA and a certificate for
    ``host``, the admin and controller passwords, ``server.properties`` (listening on all
    interfaces, advertised as ``host``), ``cluster.id``, ``admin-client.properties`` (for
    Kafka's own tools) and, with ``weights_keys``, a weight-signing key pair in ``keys/``.
    What exists is kept; run it again safely."""
    out.mkdir(parents=True, exist_ok=True)
    out.chmod(0o700)
    files = prepare(out, log=log, dns=(host, "localhost"))
    listeners = secure_properties(port, controller_port, files, host, "0.0.0.0")
    write_private(out / "server.properties",
                  single_node_properties(controller_port, listeners, data_dir, host))
    if not (out / "cluster.id").exists():
        (out / "cluster.id").write_text(cluster_id() + "\n")
    scram = "org.apache.kafka.common.security.scram.ScramLoginModule"
    write_private(out / "admin-client.properties", (
        f"security.protocol=SASL_SSL\nsasl.mechanism={MECHANISM}\n"
        f'sasl.jaas.config={scram} required username="{ADMIN_USER}" '
        f'password="{_read(files.admin_password)}";\n'
        f"ssl.truststore.type=PEM\nssl.truststore.location={files.tls.ca}\n"))
    if weights_keys and not (out / "keys" / "weights-signing.pub").exists():
        from astraflow.weights.signing import keygen

        keygen(out / "keys")
    log(f"secured Kafka config for {host}:{port} in {out}: server.properties, CA "
        f"{files.tls.ca}, admin password in {files.admin_password} (0600)")
    return files


__all__ = ["ADMIN_USER", "PROTOCOLS", "SecureFiles", "describe", "prepare", "scram_bootstrap",
           "secure_files", "secure_properties", "write_cluster_config"]
