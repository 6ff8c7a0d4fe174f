"""Against the secured embedded broker (SASL_SSL, SCRAM-SHA-512, ACLs enforced): users and
ACLs from the topology, each component as its own principal, denials and bad credentials
that stop a component with one line, and no secret anywhere."""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from confluent_kafka import Consumer, TopicPartition

from astraflow.config.topology import Topology, parse_topology
from astraflow.kafka.access import EXIT_REFUSED, KafkaAccessError, check_login
from astraflow.kafka.clients import RecordProducer, make_admin
from astraflow.kafka.config import KafkaConfig
from astraflow.kafka.loop import LoopSpec, RuntimeCounters, TransactionalLoop
from astraflow.kafka.topics import apply_topics
from astraflow.security.acls_apply import apply
from astraflow.security.tls import make_ca, tls_files
from astraflow.wire.records import ComponentStatus, Task
from tests.conftest import REPO, random_name, wait_for

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
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / f"{data['run']}.yaml"
    path.write_text(yaml.safe_dump(data))
    return parse_topology(data, source=str(path)), path


def applied(broker, tmp_path: Path, source: str = "default.yaml") -> Topology:
    """A secured run with its topics, users and ACLs made."""
    topo, _ = secured(broker, tmp_path, source)
    apply_topics(make_admin(admin_config(broker)), topo.resolved_topics())
    apply(topo, admin_config(broker), None)
    return topo


@pytest.fixture(autouse=True)
def _no_bootstrap_override(monkeypatch: pytest.MonkeyPatch) -> None:
    """The topologies here name the secured broker; ``ASTRAFLOW_BOOTSTRAP`` (set when the
    suite runs against a broker of its own) would override it for every client."""
    monkeypatch.delenv("ASTRAFLOW_BOOTSTRAP", raising=False)


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120):
    return subprocess.run([sys.executable, "-m", "astraflow.cli.main", *args], capture_output=True,
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
    os_env = dict(os.environ)
    run = lambda *a: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "astraflow.cli.main", "broker", *a], capture_output=True,
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


def _run_until_error(loop: TransactionalLoop, timeout: float = 300.0) -> BaseException:
    """Run ``loop`` until it raises; that error (``timeout``: only a guard against a hang)."""
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
        return max(tp.offset for tp in c.committed(
            [TopicPartition(topo.full_name(topic), p)
             for p in range(topo.topic(topic).partitions)], timeout=10))
    finally:
        c.close()


def _loop(topo: Topology, key: str, group: str, txn: str, inputs: list[str],
          outputs: list[str], work) -> TransactionalLoop:
    full = topo.full_name
    spec = LoopSpec(component_id=key, group=group, transactional_id=txn,
                    inputs=[full(t) for t in inputs], outputs=[full(t) for t in outputs],
                    dlq=full("dlq"), status_topic=full("status"), status_interval_s=60)
    from astraflow.wire.codec import make_codec

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
    # the broker logged the denial (what the other tests check is absent)
    wait_for(lambda: _denials(secure_broker, topo.run), 60, "the broker's denial line")


def test_a_side_reader_denied_its_topic_stops_with_one_line(secure_broker, tmp_path):
    """The weights table a RaaS node, trainer or evaluator follows (``TopicTable``, no
    group), opened as a principal without READ on it (the feeder's): the denial in the
    metadata answer raises a ``KafkaAccessError`` (what ends a component with exit 77), one
    line naming principal, operation and topic."""
    from astraflow.kafka.table import TopicTable
    from astraflow.wire.records import WeightManifest

    topo = applied(secure_broker, tmp_path)
    topic = topo.full_name("weights.actor")
    with pytest.raises(KafkaAccessError) as denied:
        TopicTable.open(topo.component_kafka("feeder"), topic, WeightManifest,
                        key=lambda e: e.key)
    assert str(denied.value).startswith(
        f"User:{topo.run}.feeder was denied DESCRIBE on topic {topic} "
        "(TOPIC_AUTHORIZATION_FAILED)"), denied.value
    assert "\n" not in str(denied.value)
    # the pool's own principal may follow it
    table = TopicTable.open(topo.component_kafka("pool.local"), topic, WeightManifest,
                            key=lambda e: e.key)
    assert table.catch_up(20)


def test_a_processor_principal_may_not_read_a_pools_group(secure_broker, tmp_path):
    """Its own input, but in the RaaS pool's consumer group."""
    topo = applied(secure_broker, tmp_path)
    loop = _loop(topo, "processor.staleness", topo.raas_group("local"),
                 f"{topo.group_of('staleness')}.x", ["trajectories.raw"], ["trajectories"],
                 _Forward(topo.full_name("trajectories"), None))
    e = _run_until_error(loop)
    assert isinstance(e, KafkaAccessError), repr(e)
    assert str(e).startswith(f"User:{topo.run}.processor.staleness was denied READ on group "
                             f"{topo.raas_group('local')} (GROUP_AUTHORIZATION_FAILED)"), e


def test_a_wrong_password_ends_the_component_with_one_line(secure_broker, tmp_path):
    """librdkafka alone retries a refused login forever: that the component exits at all,
    with the refusal's exit code and line, shows the refusal ended it (the subprocess
    timeout only guards against a hang)."""
    topo = applied(secure_broker, tmp_path)
    path = Path(topo.source)
    res = cli("processor", "run", "router", "--topology", str(path), env={
        "ASTRAFLOW_SASL_USERNAME": f"{topo.run}.processor.router",
        "ASTRAFLOW_SASL_PASSWORD": "not-the-password"}, timeout=600)
    assert res.returncode == EXIT_REFUSED, res.stdout + res.stderr
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
    reads its side topics, and commits a status transaction. A topology's processors run
    at once, as under `up`."""
    from astraflow.dataflow.runtime import ProcessorRuntime

    def run(rt: ProcessorRuntime, box: dict[str, BaseException]) -> None:
        try:
            rt.run()
        except BaseException as e:  # noqa: BLE001
            box["e"] = e

    for source in TOPOLOGIES:
        topo = applied(secure_broker, tmp_path / source.stem, source.name)
        started = []
        for name in topo.processors:
            rt = ProcessorRuntime(topo, name, instance="t")
            rt.loop.spec.status_interval_s = 0.5
            box: dict[str, BaseException] = {}
            t = threading.Thread(target=run, args=(rt, box), daemon=True)
            t.start()
            started.append((name, rt, box, t))
        try:
            for name, rt, box, t in started:
                # a denial ends the wait at once; the deadline only guards against a hang
                wait_for(lambda rt=rt, box=box, t=t: "e" in box or not t.is_alive()
                         or rt.counters.transactions >= 2, 300,
                         f"{source.name}: {name} committing")
        finally:
            for _, rt, _, _ in started:
                rt.stop()
            for _, _, _, t in started:
                t.join(30)
        for name, _, box, _ in started:
            assert "e" not in box, f"{source.name}: {name}: {box.get('e')!r}"
        assert _denials(secure_broker, topo.run) == [], source.name  # nothing refused


def _denials(broker, run: str) -> list[str]:
    """The broker's log lines that deny one of ``run``'s principals."""
    log = broker.log_file.read_text(errors="replace")
    return [ln for ln in log.splitlines() if "Denied" in ln and f"User:{run}." in ln]


# How long an `up --secure` test waits for training, at most: only a guard against a hang.
# On a loaded machine it takes what it takes; what dooms the run fails it at once
# (`up` exiting, a denial, a refused login, a traceback: ``_trouble``).
UP_HANG_GUARD_S = 1200


def _trouble(broker, run: str, run_dir: Path) -> list[str]:
    """What already fails an `up --secure` run while it goes on: a denial of one of its
    principals in the broker's log, a denial, refused login or traceback in a component's
    log."""
    found = [f"broker: {ln}" for ln in _denials(broker, run)]
    for log_file in sorted((run_dir / "logs").glob("*.log")):
        text = log_file.read_text(errors="replace")
        found += [f"{log_file.name}: {marker}\n{text[-2000:]}"
                  for marker in ("was denied", "refused the login", "Traceback")
                  if marker in text]
    return found


@contextlib.contextmanager
def _up_secure(path: Path, broker, tmp_path: Path):
    """``up PATH --secure`` in the background, its output in ``tmp_path/up.log``: yields
    ``(process, log path)``; when the body is done, Ctrl-C (SIGINT) and a clean exit."""
    env = {**os.environ, "ASTRAFLOW_STATE": str(broker.state), "PYTHONUNBUFFERED": "1"}
    out = tmp_path / "up.log"
    with open(out, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "astraflow.cli.main", "up", str(path), "--secure",
             "--duration", "300", "--runs-dir", str(tmp_path / "runs")],
            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    try:
        yield proc, out
        proc.send_signal(signal.SIGINT)  # seen all it needs: stop as Ctrl-C does
        proc.wait(300)  # a guard against a hang only
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert proc.returncode == 0, out.read_text()[-3000:]


def _versions(config: KafkaConfig, topic: str, proc: subprocess.Popen, out: Path) -> int:
    """Records on a weights topic (0 before it exists); fails once ``up`` has exited."""
    from astraflow.kafka.clients import read_all

    assert proc.poll() is None, out.read_text()[-3000:]
    try:
        return len(read_all(config, topic, timeout_s=10, idle_s=0.5))
    except Exception:  # noqa: BLE001 - not created yet
        return 0


def _all_bytes(config: KafkaConfig, topo: Topology) -> bytes:
    """Every record (key and value, aborted ones too) of every topic of the run."""
    from confluent_kafka import OFFSET_BEGINNING

    c = Consumer(config.consumer_conf("astraflow-table", **{
        "isolation.level": "read_uncommitted", "enable.partition.eof": True}))
    parts = [TopicPartition(t.full_name, p, OFFSET_BEGINNING)
             for t in topo.resolved_topics() for p in range(t.partitions)]
    c.assign(parts)
    out, ended = [], 0
    deadline = time.monotonic() + 120
    while ended < len(parts) and time.monotonic() < deadline:
        for m in c.consume(500, 1.0):
            if m.error() is not None:
                ended += 1
                continue
            out += [m.key() or b"", m.value() or b""]
    c.close()
    return b"\n".join(out)


def _forge(topo: Topology, broker, tmp_path: Path) -> int:
    """As the trainer's principal (the one writer the ACLs let through), publish the
    newest manifest again as a far newer version, signed with a key of its own."""
    from astraflow.kafka.clients import read_all
    from astraflow.weights.signing import ManifestSigner, keygen
    from astraflow.wire.records import WeightManifest

    config = admin_config(broker)
    manifests = [r.record for r in read_all(config, topo.full_name("weights.actor"),
                                            expect=WeightManifest)]
    forged = manifests[-1]
    forged.version += 100
    forged.signature = forged.signing_key = None
    private, _ = keygen(tmp_path / "rogue-keys")
    forged = ManifestSigner.from_file(private).sign(forged)
    producer = RecordProducer(config.model_copy(update={
        "security": config.security.model_copy(update={
            "protocol": "SASL_SSL", "ca_location": config.security.ca_location,
            "username": f"{topo.run}.trainer.actor",
            "password_file": str(tmp_path / "runs" / topo.run / "credentials"
                                 / "trainer.actor.password")})}))
    producer.produce(topo.full_name("weights.actor"), forged, key="actor")
    producer.flush(30)
    return forged.version


@pytest.mark.slow
def test_up_secure_trains_with_one_principal_per_component_and_no_secret_leaks(
        secure_broker, tmp_path):
    """`up --secure`: every component as its own principal with exactly its ACLs (the
    broker denies none of them anything), training reaches a few versions, a manifest
    signed with another key is refused (dead-lettered), and no password appears in any
    log or topic."""
    from astraflow.kafka.clients import read_all
    from astraflow.wire.records import DeadLetter

    data = yaml.safe_load((REPO / "topology" / "default.yaml").read_text())
    run = data["run"] = random_name("up-sec")
    data["policies"]["actor"].update(
        model=str(tmp_path / "model"),
        warm_start={"steps": 200, "slip": 0.7, "levels": "1", "until": 0.9})
    data["feeder"] = {"epochs": 0, "rate": 60, "levels": "1"}
    data["eval"] = {"every_versions": 2, "size": 20, "levels": "1"}
    path = tmp_path / "sec.yaml"
    path.write_text(yaml.safe_dump(data))
    topo = parse_topology(data, source=str(path))
    config = admin_config(secure_broker)
    run_dir = tmp_path / "runs" / run
    with _up_secure(path, secure_broker, tmp_path) as (proc, out):
        def versions() -> int:
            trouble = _trouble(secure_broker, run, run_dir)
            assert not trouble, trouble
            return _versions(config, topo.full_name("weights.actor"), proc, out)

        wait_for(lambda: versions() >= 3, UP_HANG_GUARD_S, "three weight versions", step=2)
        forged = _forge(topo, secure_broker, tmp_path)

        def refused() -> list:
            assert proc.poll() is None, out.read_text()[-3000:]
            return [d.record for d in read_all(config, topo.full_name("dlq"), timeout_s=10,
                                               idle_s=0.5, expect=DeadLetter)
                    if f"v{forged}" in d.record.error and "refused" in d.record.error]

        letters = wait_for(refused, UP_HANG_GUARD_S, "the forged manifest dead-lettered",
                           step=1)
        assert any("raas" in d.component_id or "local" in d.component_id
                   for d in letters), [d.component_id for d in letters]
    text = out.read_text()
    assert "Traceback" not in text
    for log_file in (run_dir / "logs").glob("*.log"):
        assert "Traceback" not in log_file.read_text(), log_file
        assert "was denied" not in log_file.read_text(), log_file
    assert _denials(secure_broker, run) == []
    secrets = [p.read_text().strip() for p in (run_dir / "credentials").glob("*.password")]
    secrets.append(secure_broker.status().secure.admin_password.read_text().strip())
    assert len(secrets) == len(topo.component_keys()) + 1
    logs = text + "".join(p.read_text() for p in (run_dir / "logs").glob("*.log"))
    topics = _all_bytes(config, topo)
    for secret in secrets:
        assert secret not in logs and secret.encode() not in topics


@pytest.mark.kafka
@pytest.mark.secure
def test_secure_config_makes_a_broker_of_its_own_that_lets_its_admin_in(tmp_path):
    """`astraflow broker secure-config` (what the compose profile's kafka-secure runs
    with) started as a plain Kafka: SASL_SSL on the named host, the admin gets in."""
    from astraflow.broker.embedded import _format_storage, ensure_jars, free_port
    from astraflow.broker.java import find_java
    from astraflow.broker.secure import scram_bootstrap, secure_files

    port, cport = free_port(), free_port()
    out = tmp_path / "secrets"
    res = cli("broker", "secure-config", "--host", "localhost", "--port", str(port),
              "--controller-port", str(cport), "--out", str(out), "--data",
              str(tmp_path / "data"), "--weights-keys")
    assert res.returncode == 0, res.stderr
    files = secure_files(out)
    assert files.admin_password.read_text().strip() not in res.stdout + res.stderr
    assert private(out / "admin-client.properties") and (out / "keys").is_dir()
    jvm = [find_java(log=lambda _m: None).path, "-Xmx512m"]  # the system's, or the bundled
    classpath = f"{ensure_jars(log=lambda _m: None)}/*"
    _format_storage(jvm, classpath, out / "server.properties", tmp_path / "data",
                    scram_bootstrap(files))
    with open(tmp_path / "kafka.log", "wb") as log:
        proc = subprocess.Popen([*jvm, "-cp", classpath, "kafka.Kafka",
                                 str(out / "server.properties")], stdout=log,
                                stderr=subprocess.STDOUT)
    try:
        conf = KafkaConfig(bootstrap_servers=f"localhost:{port}",
                           security=files.client_security())

        def admin_in() -> bool:
            assert proc.poll() is None, (tmp_path / "kafka.log").read_text()[-3000:]
            try:
                return bool(make_admin(conf).list_topics(timeout=2).brokers)
            except Exception:  # noqa: BLE001 - not up yet
                return False

        wait_for(admin_in, 90, "the secured broker to let its admin in", step=0.5)
    finally:
        proc.terminate()
        proc.wait(30)


def test_a_component_run_as_a_principal_without_its_acls_stops_with_one_line(
        secure_broker, tmp_path):
    """`processor run batcher` as the router's user: the batcher's output is not even
    visible to it; it stops (no retry), exit 77, one line naming principal, operation and
    topic."""
    topo = applied(secure_broker, tmp_path)
    creds = tmp_path / "creds"
    res = cli("processor", "run", "batcher", "--topology", str(topo.source), env={
        "ASTRAFLOW_SASL_USERNAME": f"{topo.run}.processor.router",
        "ASTRAFLOW_SASL_PASSWORD_FILE": str(creds / "processor.router.password")},
        timeout=600)  # a guard against a hang only: a denial is not retried
    assert res.returncode == EXIT_REFUSED, res.stdout + res.stderr
    lines = [ln for ln in (res.stdout + res.stderr).splitlines() if ln.strip()]
    assert lines == [f"astraflow: User:{topo.run}.processor.router was denied DESCRIBE on "
                     f"topic {topo.run}.batches.actor (TOPIC_AUTHORIZATION_FAILED); grant it "
                     "(`astraflow topology acls FILE --apply`, or the cluster's operator), "
                     "or run it as a principal that has it"], lines


@pytest.mark.slow
@pytest.mark.parametrize("source", ["solver-verifier.yaml", "data-algorithms.yaml",
                                    "replay.yaml"])
def test_up_secure_runs_every_component_of_a_shipped_topology_undenied(
        secure_broker, tmp_path, source):
    """Each other shipped topology (the real-model ones aside: they need SmolLM2) under
    `up --secure` until every trainer is up and one has trained a version, then Ctrl-C: every
    component (feeder, processors, pools, trainers, evaluators) runs as its own principal
    with exactly the ACLs `topology acls` prints, and the broker denies none of them
    anything."""

    data = yaml.safe_load((REPO / "topology" / source).read_text())
    run = data["run"] = random_name("up-sec")
    for policy, spec in data["policies"].items():
        spec["model"] = str(tmp_path / policy)
        spec["warm_start"] = {**(spec.get("warm_start") or {}), "steps": 30}
        spec["warm_start"].pop("until", None)
    path = tmp_path / source
    path.write_text(yaml.safe_dump(data))
    topo = parse_topology(data, source=str(path))
    config = admin_config(secure_broker)
    with _up_secure(path, secure_broker, tmp_path) as (proc, out):
        def trained() -> bool:
            trouble = _trouble(secure_broker, run, tmp_path / "runs" / run)
            assert not trouble, trouble
            counts = [_versions(config, topo.full_name(f"weights.{p}"), proc, out)
                      for p in topo.policies]
            return min(counts) >= 1 and max(counts) >= 2

        # every trainer up (its version 0) and one trained version: the data went the whole
        # way round, from the feeder through the pools and processors to a trainer; the
        # deadline is a hang guard, a component's failure ends the wait at once
        wait_for(trained, UP_HANG_GUARD_S, "every policy's version 0 and one trained version",
                 step=2)
    logs = tmp_path / "runs" / run / "logs"
    for log_file in logs.glob("*.log"):
        text = log_file.read_text()
        assert "was denied" not in text and "refused the login" not in text, log_file
        assert "Traceback" not in text, (log_file, text[-2000:])
    assert _denials(secure_broker, run) == []
