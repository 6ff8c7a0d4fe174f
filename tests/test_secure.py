"""Against the secured embedded broker (SASL_SSL, SCRAM-SHA-512, ACLs enforced): users and
ACLs from the topology, each component as its own principal, denials and bad credentials
that stop a component with one line, and no secret anywhere."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from confluent_kafka import Consumer, TopicPartition

from astraflow.acls_apply import apply
from astraflow.kafka.access import EXIT_REFUSED, KafkaAccessError, check_login
from astraflow.kafka.clients import RecordProducer, make_admin
from astraflow.kafka.config import KafkaConfig
from astraflow.kafka.loop import LoopSpec, RuntimeCounters, TransactionalLoop
from astraflow.kafka.tls import make_ca, tls_files
from astraflow.kafka.topics import apply_topics
from astraflow.records import ComponentStatus, Task
from astraflow.topology import Topology, parse_topology

from .conftest import REPO, random_name, wait_for

TOPOLOGIES = sorted((REPO / "topology").glob("*.yaml"))


def admin_config(broker) -> KafkaConfig:
    st = broker.status()
    return KafkaConfig(bootstrap_servers=st.bootstrap, client_id="astraflow-tests",
                       security=st.secure.client_security())


def secured(broker, tmp_path: Path, source: str = "default.yaml") -> tuple[Topology, Path]:
    """``topology/<source>`` as a fresh run on the secured broker: the operator is the
    admin, every component ``<run>.<key>`` with its password in ``tmp_path/creds``."""
    st = broker.status()
    data = yaml.safe_load((REPO / "topology" / source).read_text())
    data["run"] = random_name("sec")
    data["kafka"] = {"bootstrap_servers": st.bootstrap, "security": {
        "protocol": "SASL_SSL", "ca_location": str(st.secure.tls.ca), "username": "admin",
        "password_file": str(st.secure.admin_password),
        "credentials_dir": str(tmp_path / "creds")}}
    path = tmp_path / f"{data['run']}.yaml"
    path.write_text(yaml.safe_dump(data))
    return parse_topology(data, source=str(path)), path


def applied(broker, tmp_path: Path, source: str = "default.yaml") -> Topology:
    """A secured run with its topics, users and ACLs made."""
    topo, _ = secured(broker, tmp_path, source)
    apply_topics(make_admin(admin_config(broker)), topo.resolved_topics())
    apply(topo, admin_config(broker), None)
    return topo


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120):
    return subprocess.run([sys.executable, "-m", "astraflow.cli", *args], capture_output=True,
                          text=True, cwd=REPO, timeout=timeout,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})


def private(path: Path) -> bool:
    return stat.S_IMODE(path.stat().st_mode) == 0o600


def test_the_secured_broker_keeps_its_secrets_private_and_names_only_their_files(
        secure_broker):
    st = secure_broker.status()
    files = st.secure
    for path in (files.admin_password, files.controller_password, files.tls.ca_key,
                 files.tls.broker, secure_broker.state / "server.properties"):
        assert private(path), path
    text = st.describe()
    assert str(files.tls.ca) in text and str(files.admin_password) in text
    assert files.admin_password.read_text().strip() not in text
    # the admin gets in; a client without credentials, or with the admin's wrong, does not
    assert make_admin(admin_config(secure_broker)).list_topics(timeout=10).brokers
    wrong = admin_config(secure_broker).security.model_copy(
        update={"password_file": None, "password_env": "NO_SUCH_PASSWORD_VAR"})
    os.environ["NO_SUCH_PASSWORD_VAR"] = "wrong"
    try:
        conf = KafkaConfig(bootstrap_servers=st.bootstrap, security=wrong)
        with pytest.raises(KafkaAccessError, match=r"User:admin: Kafka at .* refused the login"):
            conf.admin_conf()
    finally:
        del os.environ["NO_SUCH_PASSWORD_VAR"]


@pytest.mark.slow
@pytest.mark.kafka
@pytest.mark.secure
def test_broker_start_secure_prints_what_clients_need_and_keeps_ca_and_port(tmp_path):
    env = {"ASTRAFLOW_STATE": str(tmp_path / "state")}
    env.pop("ASTRAFLOW_BOOTSTRAP", None)
    os_env = {k: v for k, v in os.environ.items() if k != "ASTRAFLOW_BOOTSTRAP"}
    run = lambda *a: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "astraflow.cli", "broker", *a], capture_output=True,
        text=True, cwd=REPO, timeout=180, env={**os_env, **env})
    try:
        first = run("start", "--secure", "--port", "0")
        assert first.returncode == 0, first.stdout + first.stderr
        state = tmp_path / "state"
        password = (state / "admin.password").read_text().strip()
        assert "SASL_SSL" in first.stdout and str(state / "tls" / "ca.pem") in first.stdout
        assert str(state / "admin.password") in first.stdout and password not in first.stdout
        ca = (state / "tls" / "ca.pem").read_bytes()
        bootstrap = next(w for w in first.stdout.split() if w.startswith("127.0.0.1:"))
        assert run("stop").returncode == 0
        again = run("start")  # the state says secured: it stays so, on the same port
        assert again.returncode == 0, again.stdout + again.stderr
        assert bootstrap in again.stdout and "secured" in again.stdout
        assert (state / "tls" / "ca.pem").read_bytes() == ca
        assert (state / "admin.password").read_text().strip() == password
    finally:
        run("stop", "--purge")


def test_acls_apply_makes_users_and_acls_and_can_run_again(secure_broker, tmp_path):
    topo, path = secured(secure_broker, tmp_path)
    apply_topics(make_admin(admin_config(secure_broker)), topo.resolved_topics())
    first = cli("topology", "acls", str(path), "--apply")
    assert first.returncode == 0, first.stderr
    assert "ACLs: 0 created" not in first.stdout and "as User:admin" in first.stdout
    creds = tmp_path / "creds"
    keys = topo.component_keys()
    for key in keys:
        assert private(creds / f"{key}.password"), key
    again = cli("topology", "acls", str(path), "--apply")
    assert again.returncode == 0, again.stderr
    assert f"users: 0 created, {len(keys)} already had" in again.stdout
    assert "ACLs: 0 created" in again.stdout
    for key in keys:  # every component's user gets in
        check_login(topo.component_kafka(key).admin_conf())
    passwords = [(creds / f"{k}.password").read_text().strip() for k in keys]
    assert not any(p in first.stdout + first.stderr + again.stdout for p in passwords)


class _Forward:
    """A work that adds one record per input to ``topic``: what a rogue or misconfigured
    component would do."""

    def __init__(self, topic: str, record):
        self.topic, self.record = topic, record
        self.counters = RuntimeCounters()

    def start(self, loop) -> None: ...

    def handle(self, msgs, cp) -> None:
        for _ in msgs:
            cp.add(self.topic, self.record)

    def on_revoke(self, partitions) -> None: ...

    def held_offsets(self) -> dict:
        return {}

    def status(self) -> ComponentStatus:
        return ComponentStatus(component_id="rogue", kind="processor", host="h",
                               state="running")

    def close(self) -> None: ...


def _run_until_error(loop: TransactionalLoop, timeout: float = 60.0) -> BaseException:
    box: dict[str, BaseException] = {}

    def target() -> None:
        try:
            loop.run()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box["e"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        loop.stop()
        t.join(30)
        raise AssertionError("the loop did not stop on the denial")
    assert "e" in box, "the loop ended without an error"
    return box["e"]


def _task(topo: Topology, broker) -> None:
    producer = RecordProducer(admin_config(broker))
    producer.produce(topo.full_name("tasks"), Task(task_id="t1", prompt_id="p1",
                                                   workflow="arithmetic", payload="{}",
                                                   source="test"))
    producer.flush(30)


def _committed(topo: Topology, broker, group: str, topic: str) -> int:
    c = Consumer(admin_config(broker).consumer_conf(group))
    try:
        return c.committed([TopicPartition(topo.full_name(topic), p)
                            for p in range(topo.topic(topic).partitions)], timeout=10)[0].offset
    finally:
        c.close()


def _loop(topo: Topology, key: str, group: str, txn: str, inputs: list[str],
          outputs: list[str], work) -> TransactionalLoop:
    full = topo.full_name
    spec = LoopSpec(component_id=key, group=group, transactional_id=txn,
                    inputs=[full(t) for t in inputs], outputs=[full(t) for t in outputs],
                    dlq=full("dlq"), status_topic=full("status"), status_interval_s=60)
    from astraflow.codec import make_codec

    return TransactionalLoop(spec, work, topo.component_kafka(key), make_codec())


def test_a_raas_principal_may_not_write_weights(secure_broker, tmp_path):
    topo = applied(secure_broker, tmp_path)
    _task(topo, secure_broker)
    group = topo.raas_group("local")
    work = _Forward(topo.full_name("weights.actor"), ComponentStatus(
        component_id="x", kind="raas", host="h", state="running"))
    loop = _loop(topo, "pool.local", group, f"{topo.run}.raas.local.n0", ["tasks"],
                 ["weights.actor"], work)
    loop.spec.max_bytes = {}
    e = _run_until_error(loop)
    assert isinstance(e, KafkaAccessError), repr(e)
    assert str(e).startswith(f"User:{topo.run}.pool.local was denied WRITE on topic "
                             f"{topo.run}.weights.actor (TOPIC_AUTHORIZATION_FAILED)"), e
    assert "\n" not in str(e)
    # aborted: the task's offset was not committed, so nothing is lost
    assert _committed(topo, secure_broker, group, "tasks") < 0


def test_a_processor_principal_may_not_read_a_pools_group(secure_broker, tmp_path):
    topo = applied(secure_broker, tmp_path)
    _task(topo, secure_broker)
    loop = _loop(topo, "processor.staleness", topo.raas_group("local"),
                 f"{topo.group_of('staleness')}.x", ["tasks"], ["trajectories"],
                 _Forward(topo.full_name("trajectories"), None))
    e = _run_until_error(loop)
    assert isinstance(e, KafkaAccessError), repr(e)
    # the processor may not even read tasks: whichever the broker checks first is named
    assert str(e).startswith(f"User:{topo.run}.processor.staleness was denied READ on "), e
    assert f"group {topo.raas_group('local')}" in str(e) or "topic" in str(e)


def test_a_wrong_password_ends_the_component_within_seconds_with_one_line(
        secure_broker, tmp_path):
    topo = applied(secure_broker, tmp_path)
    path = Path(topo.source)
    start = time.monotonic()
    res = cli("processor", "run", "router", "--topology", str(path), env={
        "ASTRAFLOW_SASL_USERNAME": f"{topo.run}.processor.router",
        "ASTRAFLOW_SASL_PASSWORD": "not-the-password"}, timeout=60)
    took = time.monotonic() - start
    assert res.returncode == EXIT_REFUSED, res.stdout + res.stderr
    assert took < 10, took
    lines = [ln for ln in (res.stdout + res.stderr).splitlines() if ln.strip()]
    assert len(lines) <= 3, lines
    assert f"User:{topo.run}.processor.router: Kafka at" in res.stderr
    assert "refused the login" in res.stderr and "not-the-password" not in res.stderr


def test_an_untrusted_broker_certificate_is_named(secure_broker, tmp_path):
    other = tls_files(tmp_path / "other-ca")
    make_ca(other)
    conf = admin_config(secure_broker)
    conf = conf.model_copy(update={"security": conf.security.model_copy(
        update={"ca_location": str(other.ca)})})
    with pytest.raises(KafkaAccessError) as e:
        conf.admin_conf()
    text = str(e.value)
    assert "TLS with Kafka at" in text and "does not verify against the CA in" in text, text
    assert "certificate" in text.split("verify against", 1)[1], text


def test_every_shipped_topologys_processors_run_with_exactly_their_acls(secure_broker,
                                                                        tmp_path):
    """Each processor of every shipped topology starts as its own principal with the
    ACLs `topology acls` gives it (nothing else) and is never denied: its loop comes up,
    reads its side topics, and commits a status transaction."""
    from astraflow.kafka.runtime import ProcessorRuntime

    for source in TOPOLOGIES:
        topo = applied(secure_broker, tmp_path / source.stem, source.name)
        for name in topo.processors:
            rt = ProcessorRuntime(topo, name, instance="t")
            rt.loop.spec.status_interval_s = 0.5
            box: dict[str, BaseException] = {}

            def target(rt=rt, box=box) -> None:
                try:
                    rt.run()
                except BaseException as e:  # noqa: BLE001
                    box["e"] = e

            t = threading.Thread(target=target, daemon=True)
            t.start()
            try:
                wait_for(lambda rt=rt, box=box, t=t: "e" in box or not t.is_alive()
                         or rt.counters.transactions >= 2, 60,
                         f"{source.name}: {name} committing")
            finally:
                rt.stop()
                t.join(30)
            assert "e" not in box, f"{source.name}: {name}: {box.get('e')!r}"
