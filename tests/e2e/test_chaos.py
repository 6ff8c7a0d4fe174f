"""Chaos: the default topology under ``astraflow up`` survives a SIGKILLed ``up``, a
SIGKILLed processor, RaaS node and trainer, a broker stopped for longer than the
transactions' timeout, and a SIGKILLed broker.

Each scenario runs on a broker of its own (the session's broker is never stopped), faults
the run once it has published a few versions, waits until the trainer publishes again,
stops ``up`` with Ctrl-C and then accounts for every record on every topic
(``astraflow.launch.audit``): nothing lost, nothing done twice, versions contiguous, no batch
trained twice.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from astraflow.broker.embedded import EmbeddedBroker, _pid_alive, free_port
from astraflow.broker.faults import kill_up
from astraflow.kafka.config import KafkaConfig
from astraflow.launch.audit import audit_run, newest_version
from tests.conftest import random_name, wait_for

pytestmark = [pytest.mark.chaos, pytest.mark.kafka, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def chaos_model(tmp_path_factory) -> Path:
    """A tiny model with a short warm start, shared by the scenarios (read only)."""
    path = tmp_path_factory.mktemp("chaos") / "model"
    subprocess.run([sys.executable, "-m", "astraflow.cli.main", "model", "init", str(path),
                    "--warm-start-steps", "100", "--carry-slip", "0.7"],
                   check=True, cwd=REPO, capture_output=True, timeout=600)
    return path


@pytest.fixture
def broker(tmp_path) -> EmbeddedBroker:
    b = EmbeddedBroker(tmp_path / "broker")
    b.start(port=free_port(), log=lambda *_: None)
    yield b
    b.destroy()


class Run:
    """One ``astraflow up`` of the default topology against ``broker``."""

    def __init__(self, broker: EmbeddedBroker, model: Path, tmp_path: Path,
                 trainer_processes: int = 1, transaction_timeout_ms: int | None = None):
        self.broker = broker
        self.bootstrap = broker.bootstrap()
        self.config = KafkaConfig(bootstrap_servers=self.bootstrap, client_id="chaos")
        topo = yaml.safe_load((REPO / "topology" / "default.yaml").read_text())
        self.run = topo["run"] = random_name("chaos")
        topo["kafka"] = {"bootstrap_servers": self.bootstrap}
        if transaction_timeout_ms is not None:
            topo["kafka"]["transaction_timeout_ms"] = transaction_timeout_ms
        topo["policies"]["actor"].update(model=str(model),
                                         warm_start={"steps": 100, "slip": 0.7})
        if trainer_processes > 1:
            trainer = topo["policies"]["actor"].setdefault("trainer", {})
            trainer["parallel"] = {"processes": trainer_processes}
        topo["feeder"] = {"epochs": 0, "rate": 20, "levels": "1"}
        topo["eval"] = {"every_versions": 5, "size": 20, "levels": "1"}
        self.path = tmp_path / "chaos.yaml"
        self.path.write_text(yaml.safe_dump(topo))
        self.runs = tmp_path / "runs"
        self.out = tmp_path / "up.log"
        self.start()

    def start(self) -> None:
        """``astraflow up`` of the run (again: it resumes where the last one left off)."""
        env = {**os.environ, "ASTRAFLOW_BOOTSTRAP": self.bootstrap}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "astraflow.cli.main", "up", str(self.path), "--duration", "900",
             "--runs-dir", str(self.runs)],
            stdout=open(self.out, "ab"), stderr=subprocess.STDOUT, env=env, cwd=REPO)

    def topic(self, logical: str) -> str:
        return f"{self.run}.{logical}"

    def versions(self) -> int:
        """Versions published so far (-1: none, or no topic yet)."""
        return newest_version(self.config, self.topic("weights.actor"))

    def wait_versions(self, n: int, timeout: float) -> None:
        wait_for(lambda: self.versions() >= n, timeout, f"version {n} on {self.run}",
                 step=2.0)

    def pid(self, component: str) -> int:
        """The component's pid from ``up``'s pids.json (-1 while that is being rewritten)."""
        try:
            return int(json.loads((self.runs / self.run / "pids.json").read_text())[component])
        except (ValueError, KeyError, FileNotFoundError):
            return -1

    def stop(self) -> dict:
        """Ctrl-C ``up``; its summary."""
        self.proc.send_signal(signal.SIGINT)
        code = self.proc.wait(180)
        text = self.out.read_text()
        assert code == 0, text[-4000:]
        assert f"summary: {self.runs / self.run / 'summary.json'}" in text, text[-2000:]
        return json.loads((self.runs / self.run / "summary.json").read_text())

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}"
                         for p in sorted((self.runs / self.run / "logs").glob("*.log")))

    def exits(self, restarts: dict[str, int]) -> str:
        """Why the restarted components exited: ``up``'s lines about them and each one's
        warnings, errors and traceback (pytest cuts a long message short, so these first)."""
        up = [line for line in self.out.read_text().splitlines()
              if any(f"{name} exited" in line for name in restarts)]
        out = ["--- up.log", *up]
        for name in restarts:
            log = self.runs / self.run / "logs" / f"{name}.log"
            lines = log.read_text().splitlines() if log.exists() else []
            keep = [line for line in lines
                    if (not line[:1].isdigit() and "Loading" not in line)  # a traceback
                    or any(f" {level} " in line for level in ("WARNING", "ERROR", "CRITICAL"))]
            out += [f"--- {name}.log", *keep[-60:]]
        return "\n".join(out)

    def kill(self) -> None:
        """Teardown after a failure: ``up`` and every component it started."""
        kill_up(self.proc, self.runs / self.run)


@pytest.fixture
def chaos_run(broker, chaos_model, tmp_path):
    run = Run(broker, chaos_model, tmp_path)
    yield run
    run.kill()


@pytest.fixture
def chaos_run_short_transactions(broker, chaos_model, tmp_path):
    """A run whose transactions time out after 20 s (default 60 s): an outage that
    outlives them takes a third of the time."""
    run = Run(broker, chaos_model, tmp_path, transaction_timeout_ms=20_000)
    yield run
    run.kill()


@pytest.fixture
def chaos_run_two_trainer_processes(broker, chaos_model, tmp_path):
    run = Run(broker, chaos_model, tmp_path, trainer_processes=2)
    yield run
    run.kill()


def _children(pid: int) -> list[int]:
    """The child processes of ``pid`` (Linux), in the order they were started."""
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return sorted(int(x) for x in text.split())


def _account(run: Run, killed: str | None = None) -> dict:
    """Every record of the run accounted for (``astraflow.launch.audit``); the counts per stage.
    ``killed``: the processor that was SIGKILLed (its drop counter restarted with it)."""
    audit = audit_run(run.config, run.run, run.runs / run.run / "logs", killed=killed)
    assert audit.ok, "\n".join(audit.problems)
    return audit.books


def _recovers(run: Run, fault, wait_s: float = 600) -> None:
    """Apply ``fault`` once two versions are out; then the trainer must publish two more
    (which needs every stage from the feeder to the trainer)."""
    run.wait_versions(2, 600)
    before = run.versions()
    fault()
    run.wait_versions(before + 2, wait_s)


def _restarted(run: Run, component: str, signal_pid: Callable[[], int]) -> None:
    """SIGKILL the process ``signal_pid()`` names; wait until ``component`` is restarted and
    back in its consumer group (not merely spawned)."""
    log = run.runs / run.run / "logs" / f"{component}.log"
    joined = log.read_text().count("consuming ")
    pid = signal_pid()
    assert pid > 0, f"no pid for {component}"  # os.kill(-1) would signal every process
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: log.read_text().count("consuming ") > joined, 300,
             f"{component} to be restarted and consuming again")


def _crash_broker(run: Run) -> None:
    """SIGKILL the run's broker, then start it again on its port and data."""
    pid = int(json.loads(run.broker.info_file.read_text())["pid"])
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not _pid_alive(pid), 30, "the broker to die")
    run.broker.start(log=lambda *_: None)


def _up_sigkilled_and_started_again(run: Run) -> None:
    """SIGKILL ``up`` itself once two versions are out: the kernel sends each component
    SIGTERM (``die_with_parent``), so every one stops (none left running, as before that,
    in its own session); a new ``up`` of the run must publish two more versions."""
    run.wait_versions(2, 600)
    components = json.loads((run.runs / run.run / "pids.json").read_text())
    running = lambda: {n: p for n, p in components.items() if _pid_alive(p)}  # noqa: E731
    run.proc.kill()
    run.proc.wait(30)
    try:
        wait_for(lambda: not running(), 180, "every component to stop with up")
    except AssertionError as e:
        raise AssertionError(f"{e}: still running {running()}\n{run.logs()}") from None
    before = run.versions()
    run.start()
    try:
        run.wait_versions(before + 2, 600)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{run.out.read_text()[-3000:]}\n{run.logs()}") from None


def test_sigkilled_up_components_and_broker_are_ridden_out_with_nothing_lost_or_done_twice(
        chaos_run):
    """One run, faulted five times in turn, each once the trainer has published two versions
    since the last: ``up`` itself SIGKILLed and started again (it resumes the run), then,
    under the new ``up``, the RaaS node, the trainer and the batcher SIGKILLed (``up``
    restarts each), then the broker SIGKILLed and started again (nothing restarts). The
    books balance over both ``up``s. One run, not one each: the faults compound, and the
    suite pays one start-up instead of five."""
    run = chaos_run
    _up_sigkilled_and_started_again(run)
    components = ["raas-local-0", "trainer-actor", "processor-batcher"]
    for component in components:
        _recovers(run, lambda c=component: _restarted(run, c, lambda: run.pid(c)))
    _recovers(run, lambda: _crash_broker(run))
    summary = run.stop()  # the second up's: it restarted each SIGKILLed component once
    assert summary["restarts"] == dict.fromkeys(components, 1), (summary["restarts"],
                                                                 run.exits(summary["restarts"]))
    print("SIGKILLed up,", components, "and the broker:", _account(run, killed="batcher"))


def test_a_sigkilled_trainer_process_takes_its_group_down_and_it_resumes_exactly(
        chaos_run_two_trainer_processes):
    """A trainer of 2 processes (FSDP2, gloo): SIGKILL rank 1 mid-run, then, once the
    group is back and has published two more versions, rank 0 of the new group. Each time
    the group's supervisor takes the other process down and exits; ``up`` restarts the
    trainer, which resumes from the committed offsets and the newest manifest: versions
    contiguous, no batch trained twice, none lost."""
    run = chaos_run_two_trainer_processes

    def rank(r: int) -> int:
        wait_for(lambda: len(_children(run.pid("trainer-actor"))) == 2, 120,
                 "the trainer's 2 processes")
        return _children(run.pid("trainer-actor"))[r]

    for r in (1, 0):
        _recovers(run, lambda r=r: _restarted(run, "trainer-actor", lambda: rank(r)))
    summary = run.stop()
    assert summary["restarts"] == {"trainer-actor": 2}, (summary["restarts"], run.logs())
    log = run.runs / run.run / "logs" / "trainer-actor.log"
    assert "trainer group of 2 processes" in log.read_text()
    print("trainer ranks 1 then 0", _account(run))


# 30 s outlives the run's 20-s transaction timeout (kafka.transaction_timeout_ms; 60 s by
# default) and the consumers' 10-s sessions, so the broker aborts what was open: the
# harder case, as a 90-s outage under the defaults, in a third of the time. A short
# outage, within the timeout, is the SIGKILLed broker's above (back in seconds);
# bench/outage.py measures longer outages (180 s and more) under the defaults.
def test_every_component_rides_out_a_broker_outage(chaos_run_short_transactions):
    run = chaos_run_short_transactions
    outage_s = 30

    def outage() -> None:
        assert run.broker.stop()
        time.sleep(outage_s)  # the length of the outage is the scenario, not a wait
        run.broker.start(log=lambda *_: None)

    _recovers(run, outage)
    summary = run.stop()
    assert not summary.get("restarts"), run.exits(summary["restarts"])
    books = _account(run)
    logs = "".join(p.read_text() for p in (run.runs / run.run / "logs").glob("*.log"))
    assert "not answering" in logs and "answers again after" in logs, run.logs()
    print(f"outage {outage_s}s", books)


def test_past_its_outage_limit_a_component_exits_with_one_clear_line(broker, tmp_path):
    """kafka.outage_limit_s 8: a processor whose broker stays away logs the outage (not
    librdkafka's reconnect lines), then exits 2 with one line naming the limit."""
    run = random_name("limit")
    path = tmp_path / "limit.yaml"
    path.write_text(yaml.safe_dump({
        "run": run, "status_interval_s": 1.0,
        "kafka": {"bootstrap_servers": broker.bootstrap(), "outage_limit_s": 8,
                  "outage_log_interval_s": 2},
        "topics": {"tasks.source": {"partitions": 1}, "tasks": {"partitions": 1}},
        "processors": {"fwd": {"kind": "passthrough", "inputs": ["tasks.source"],
                               "outputs": ["tasks"]}}}))
    cli = [sys.executable, "-m", "astraflow.cli.main"]
    # this test's own broker, whatever ASTRAFLOW_BOOTSTRAP says (it overrides the file)
    env = {**os.environ, "ASTRAFLOW_BOOTSTRAP": broker.bootstrap()}
    subprocess.run([*cli, "topics", "apply", str(path)], check=True, cwd=REPO,
                   capture_output=True, timeout=120, env=env)
    log = tmp_path / "fwd.log"
    proc = subprocess.Popen([*cli, "processor", "run", "fwd", "--topology", str(path)],
                            cwd=REPO, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                            env=env)
    try:
        wait_for(lambda: "assigned" in log.read_text(), 120, "the processor to start")
        assert broker.stop()
        assert proc.wait(120) == 2, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    last = text.strip().splitlines()[-1]
    assert last.startswith("astraflow: fwd/") and "has not answered for" in last, text
    assert "over kafka.outage_limit_s=8" in last and "Traceback" not in text, text
    # librdkafka's own lines (one per reconnect) stay in their logger, quiet
    assert "%3|" not in text and "astraflow.librdkafka" not in text, text
    assert 1 <= text.count("not answering") <= 8, text
