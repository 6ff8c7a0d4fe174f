"""The broker-free parts of running secured: certificates, the broker's config, refusal
messages, what `up --secure` hands each component, and no restart after a refusal."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
import yaml
from confluent_kafka import KafkaError

from astraflow.broker.embedded import _server_properties
from astraflow.broker.secure import prepare, scram_bootstrap, secure_files
from astraflow.config.topology import parse_topology
from astraflow.kafka.access import (
    EXIT_REFUSED,
    access_failure,
    principal_of_conf,
    refusal,
)
from astraflow.launch.secure import SecureRun, component_env, component_key
from astraflow.launch.supervisor import GaveUp, RestartPolicy
from astraflow.security.tls import ensure_broker_tls, expires_in_days, tls_files

REPO = Path(__file__).resolve().parents[3]


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_broker_certificate_names_localhost_and_127_0_0_1_and_is_kept(tmp_path):
    from cryptography import x509

    files = ensure_broker_tls(tmp_path / "tls", log=lambda _m: None)
    assert mode(files.ca_key) == mode(files.broker) == 0o600
    pem = files.broker.read_bytes()
    assert pem.startswith(b"-----BEGIN PRIVATE KEY-----")  # PKCS8 key, then the chain
    cert = x509.load_pem_x509_certificate(pem[pem.index(b"-----BEGIN CERTIFICATE-----"):])
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["localhost"]
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    assert expires_in_days(files.broker) > 800
    before = (files.ca.read_bytes(), pem)
    ensure_broker_tls(tmp_path / "tls")  # kept across restarts
    assert (files.ca.read_bytes(), files.broker.read_bytes()) == before


def test_the_secured_config_has_sasl_ssl_a_sasl_controller_and_no_fallback(tmp_path):
    files = prepare(tmp_path, log=lambda _m: None)
    props = _server_properties(9094, 9095, tmp_path / "data", secure=files)
    for line in ("listeners=SASL_SSL://127.0.0.1:9094,CONTROLLER://127.0.0.1:9095",
                 "listener.security.protocol.map=SASL_SSL:SASL_SSL,CONTROLLER:SASL_PLAINTEXT",
                 "sasl.mechanism.controller.protocol=PLAIN",
                 "inter.broker.listener.name=SASL_SSL",
                 "authorizer.class.name=org.apache.kafka.metadata.authorizer."
                 "StandardAuthorizer",
                 "allow.everyone.if.no.acl.found=false",
                 "super.users=User:admin;User:controller",
                 f"ssl.keystore.location={files.tls.broker}", "ssl.keystore.type=PEM"):
        assert line in props.splitlines(), line
    assert "PLAINTEXT://" not in props.replace("SASL_PLAINTEXT", "")
    assert mode(files.admin_password) == mode(files.controller_password) == 0o600
    admin = files.admin_password.read_text().strip()
    assert scram_bootstrap(files) == [f"SCRAM-SHA-512=[name=admin,password={admin}]"]
    again = prepare(tmp_path, log=lambda _m: None)  # the passwords are kept
    assert again.admin_password.read_text().strip() == admin
    assert secure_files(tmp_path, "SASL_PLAINTEXT").client_security().ca_location is None


def test_refusals_name_the_principal_the_operation_and_the_resource():
    err = KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED)
    e = refusal(err, "User:r.pool.local", "WRITE", "topic r.weights.actor")
    assert str(e).startswith("User:r.pool.local was denied WRITE on topic r.weights.actor "
                             "(TOPIC_AUTHORIZATION_FAILED); grant it")
    assert refusal(KafkaError(KafkaError._TRANSPORT), "User:x", "READ") is None
    conf = {"security.protocol": "SASL_SSL", "sasl.username": "bob",
            "sasl.password": "pw-never-shown", "bootstrap.servers": "h:1"}
    assert principal_of_conf(conf) == "User:bob"
    assert principal_of_conf({"sasl.username": "bob"}) == "User:ANONYMOUS"
    bad = access_failure(KafkaError(KafkaError._AUTHENTICATION, "SASL authentication error"),
                         conf)
    assert "User:bob: Kafka at h:1 refused the login" in str(bad)
    assert "pw-never-shown" not in str(bad)
    assert access_failure(KafkaError(KafkaError._TRANSPORT), conf) is None


def test_a_refused_component_is_not_restarted():
    policy = RestartPolicy()
    with pytest.raises(GaveUp, match="Kafka refused it"):
        policy.on_exit("raas-local-0", EXIT_REFUSED, 0.0)
    assert policy.on_exit("raas-local-0", 1, 0.0) is not None  # others are, as before


def test_up_secure_gives_each_process_its_own_user_and_only_trainers_the_signing_key():
    data = yaml.safe_load((REPO / "topology" / "default.yaml").read_text())
    data["eval"] = {"every_versions": 2}
    topo = parse_topology(data)
    names = {"trainer-actor": "trainer.actor", "processor-batcher": "processor.batcher",
             "raas-local-0": "pool.local", "feeder": "feeder", "eval-actor": "eval.actor"}
    for process, key in names.items():
        assert component_key(topo, process) == key
    run = SecureRun(Path("/s/ca.pem"), Path("/s/creds"), "/k/key", "/k/pub")
    env = component_env(topo, run, "raas-local-0")
    assert env["ASTRAFLOW_SASL_USERNAME"] == "default.pool.local"
    assert env["ASTRAFLOW_SASL_PASSWORD_FILE"] == "/s/creds/pool.local.password"
    assert env["ASTRAFLOW_SECURITY_PROTOCOL"] == "SASL_SSL"
    assert env["ASTRAFLOW_WEIGHTS_PUBLIC_KEY"] == "/k/pub"
    assert "ASTRAFLOW_WEIGHTS_SIGNING_KEY" not in env
    assert component_env(topo, run, "trainer-actor")["ASTRAFLOW_WEIGHTS_SIGNING_KEY"] == "/k/key"


def test_trainers_may_prune_their_blob_topic_and_nothing_else_may_delete():
    from astraflow.security.acls import component_acls

    topo = parse_topology(yaml.safe_load((REPO / "topology" / "default.yaml").read_text()))
    deletes = {(c.key, a.name) for c in component_acls(topo, operator=False)
               for a in c.acls if a.operation == "DELETE"}
    assert deletes == {("trainer.actor", "default.weights.blobs")}


def test_tls_files_layout(tmp_path):
    files = tls_files(tmp_path)
    assert (files.ca.name, files.ca_key.name, files.broker.name) == (
        "ca.pem", "ca.key", "broker.pem")


def _tls_server(cert_file: Path):
    """A TLS server on a free loopback port that completes handshakes with ``cert_file``
    (key then chain); (port, stop)."""
    import socket
    import ssl
    import threading

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert_file)
    sock = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        sock.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = sock.accept()
            except OSError:
                continue
            try:
                with ctx.wrap_socket(conn, server_side=True):
                    pass
            except (OSError, ssl.SSLError):
                pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()

    def close() -> None:
        stop.set()
        thread.join(5)
        sock.close()

    return sock.getsockname()[1], close


@pytest.mark.parametrize("case", ["expired", "untrusted", "misnamed"])
def test_certificate_problems_are_named(tmp_path, case):
    import datetime as dt

    from astraflow.kafka.access import certificate_problem
    from astraflow.security.tls import make_ca, make_leaf

    files = tls_files(tmp_path / "ca")
    make_ca(files)
    served = tmp_path / "served.pem"
    if case == "expired":
        make_leaf(files, served, not_before=dt.datetime.now(dt.timezone.utc)
                  - dt.timedelta(days=10), days=1)
    elif case == "misnamed":
        make_leaf(files, served, dns=("elsewhere",), ips=("10.9.9.9",))
    else:
        make_leaf(files, served)
    trusted = files.ca
    if case == "untrusted":
        other = tls_files(tmp_path / "other")
        make_ca(other)
        trusted = other.ca
    port, close = _tls_server(served)
    try:
        problem = certificate_problem(f"127.0.0.1:{port}", str(trusted))
    finally:
        close()
    expected = {"expired": "certificate has expired",
                "untrusted": "certificate", "misnamed": "mismatch"}[case]
    assert problem is not None and expected in problem, problem
    assert f"does not verify against the CA in {trusted}" in problem


def test_acls_apply_without_a_credentials_dir_is_one_line(tmp_path):
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-m", "astraflow.cli.main", "topology", "acls",
                          "topology/default.yaml", "--apply"], capture_output=True, text=True,
                         cwd=REPO, timeout=60,
                         env={"PATH": "/usr/bin:/bin", "ASTRAFLOW_STATE": str(tmp_path),
                              "ASTRAFLOW_BOOTSTRAP": "127.0.0.1:9", "PYTHONPATH": str(REPO)})
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "astraflow: topology acls --apply: give --credentials-dir DIR (or set "
        "kafka.security.credentials_dir): the components' passwords are written there"]
