"""Kafka's jars as the lock lists them: fetched over HTTP from a repository laid out as Maven
Central is (here a local server), checked, atomic, retried; and the shipped lock itself."""

from __future__ import annotations

import hashlib
import http.server
import threading
from collections import Counter
from pathlib import Path

import pytest

from astraflow.broker import jars
from astraflow.broker.embedded import BrokerError, ensure_jars
from astraflow.broker.jars import (
    DEFAULT_KAFKA_VERSION,
    MARKER,
    DownloadError,
    fetch,
    parse_lock,
    read_lock,
)

JARS = {("org.example", "alpha", "1.0"): b"a" * 70_000,
        ("org.example.sub", "beta", "2.1"): b"b" * 150_000,
        ("org.example", "tools", "1.0"): b"t" * 1_000}


class Repo:
    """A Maven-layout repository on 127.0.0.1: ``hits`` counts requests per path;
    ``corrupt`` paths are served with a byte changed, ``fail`` maps a path to HTTP codes
    answered before the real file."""

    def __init__(self, root: Path):
        self.hits: Counter[str] = Counter()
        self.corrupt: set[str] = set()
        self.fail: dict[str, list[int]] = {}
        repo = self

        class Handler(http.server.SimpleHTTPRequestHandler):
            def __init__(self, *a, **kw):
                super().__init__(*a, directory=str(root), **kw)

            def log_message(self, *_a):
                pass

            def do_GET(self):
                repo.hits[self.path] += 1
                if repo.fail.get(self.path):
                    self.send_error(repo.fail[self.path].pop(0))
                    return
                if self.path in repo.corrupt:
                    body = bytearray((root / self.path.lstrip("/")).read_bytes())
                    body[0] ^= 1
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(bytes(body))
                    return
                super().do_GET()

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/maven2"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def repo(tmp_path):
    root = tmp_path / "repo"
    for (group, artifact, version), body in JARS.items():
        where = root / "maven2" / group.replace(".", "/") / artifact / version
        where.mkdir(parents=True)
        (where / f"{artifact}-{version}.jar").write_bytes(body)
    served = Repo(root)
    yield served
    served.server.shutdown()


def make_lock() -> jars.Lock:
    lines = ["# a test lock", "kafka 9.9.9"]
    for (group, artifact, version), body in JARS.items():
        which = "image" if artifact == "tools" else "broker"
        lines.append(f"{which} {group}:{artifact}:{version} "
                     f"{hashlib.sha256(body).hexdigest()} {len(body)}")
    return parse_lock("\n".join(lines) + "\n")


def path_of(artifact: str) -> str:
    group, version = next((g, v) for g, a, v in JARS if a == artifact)
    return f"/maven2/{group.replace('.', '/')}/{artifact}/{version}/{artifact}-{version}.jar"


def test_the_broker_set_is_fetched_checked_and_marked_then_reused(repo, tmp_path):
    dest = tmp_path / "libs"
    lines: list[str] = []
    assert fetch(make_lock(), dest, log=lines.append, repo=repo.url) == dest
    assert sorted(p.name for p in dest.glob("*.jar")) == ["alpha-1.0.jar", "beta-2.1.jar"]
    assert (dest / "beta-2.1.jar").read_bytes() == JARS[("org.example.sub", "beta", "2.1")]
    assert (dest / MARKER).is_file() and not list(dest.glob("*.part"))
    assert "fetching 2 jars" in lines[0] and "fetched 2 jars" in lines[1]
    before = sum(repo.hits.values())
    fetch(make_lock(), dest, log=lines.append, repo=repo.url)
    assert sum(repo.hits.values()) == before and len(lines) == 2  # marked: nothing fetched
    image = tmp_path / "image"
    fetch(make_lock(), image, "image", log=lines.append, repo=repo.url)
    assert sorted(p.name for p in image.glob("*.jar")) == ["alpha-1.0.jar", "beta-2.1.jar",
                                                           "tools-1.0.jar"]


def test_an_interrupted_fetch_leaves_whole_jars_only_and_the_next_one_finishes(
        repo, tmp_path, monkeypatch):
    """Ctrl-C in the middle of the second jar: no temporary file, no marker, the first jar
    whole; the next fetch downloads only the second."""
    seen = {"bytes": 0}

    def progress(total, count):
        def advance(n):
            seen["bytes"] += n
            if seen["bytes"] > 70_000 + 50_000:  # inside beta's 150 000 bytes
                raise KeyboardInterrupt
        return advance, lambda: None

    monkeypatch.setattr(jars, "_progress", progress)
    dest = tmp_path / "libs"
    with pytest.raises(KeyboardInterrupt):
        fetch(make_lock(), dest, log=lambda _m: None, repo=repo.url)
    assert [p.name for p in dest.iterdir() if not p.name.startswith(".fetch")] == [
        "alpha-1.0.jar"]
    monkeypatch.undo()
    fetch(make_lock(), dest, log=lambda _m: None, repo=repo.url)
    assert repo.hits[path_of("alpha")] == 1 and repo.hits[path_of("beta")] == 2
    assert (dest / MARKER).is_file()


def test_a_jar_whose_digest_differs_is_retried_then_refused(repo, tmp_path, monkeypatch):
    monkeypatch.setattr(jars.time, "sleep", lambda _s: None)  # the back-off, not the test
    repo.corrupt.add(path_of("beta"))
    dest = tmp_path / "libs"
    with pytest.raises(DownloadError, match="sha256 .* the lock says 150000 bytes") as e:
        fetch(make_lock(), dest, log=lambda _m: None, repo=repo.url, retries=3)
    assert repo.hits[path_of("beta")] == 3 and "\n" not in str(e.value)
    assert not (dest / "beta-2.1.jar").exists() and not (dest / MARKER).exists()
    assert not list(dest.glob("*.part"))


def test_a_server_error_is_retried(repo, tmp_path, monkeypatch):
    monkeypatch.setattr(jars.time, "sleep", lambda _s: None)
    repo.fail[path_of("alpha")] = [503, 500]
    fetch(make_lock(), tmp_path / "libs", log=lambda _m: None, repo=repo.url)
    assert repo.hits[path_of("alpha")] == 3


def test_a_jar_missing_from_the_repository_is_not_retried(repo, tmp_path):
    repo.fail[path_of("alpha")] = [404]
    with pytest.raises(DownloadError, match="HTTP 404.*org.example:alpha:1.0"):
        fetch(make_lock(), tmp_path / "libs", log=lambda _m: None, repo=repo.url)
    assert repo.hits[path_of("alpha")] == 1


def test_an_unreachable_repository_is_one_line_naming_kafka_home(tmp_path, monkeypatch):
    monkeypatch.setattr(jars.time, "sleep", lambda _s: None)
    with pytest.raises(DownloadError) as e:
        fetch(make_lock(), tmp_path / "libs", log=lambda _m: None,
              repo="http://127.0.0.1:9/maven2", retries=2)  # port 9: nothing listens
    msg = str(e.value)
    assert "\n" not in msg and "cannot fetch Apache Kafka 9.9.9's jars" in msg
    assert "after 2 tries" in msg and "set KAFKA_HOME to an unpacked Apache Kafka" in msg
    assert not (tmp_path / "libs" / MARKER).exists()


def test_too_little_disk_is_said_before_any_download(repo, tmp_path, monkeypatch):
    class Usage:
        free = 10 << 20

    monkeypatch.setattr(jars.shutil, "disk_usage", lambda _p: Usage())
    with pytest.raises(DownloadError, match=r"too little disk for Apache Kafka's jars in .*"
                       r"10 MB free.*ASTRAFLOW_CACHE"):
        fetch(make_lock(), tmp_path / "libs", log=lambda _m: None, repo=repo.url)
    assert not repo.hits


def test_jars_the_lock_no_longer_lists_leave_the_folder(repo, tmp_path):
    dest = tmp_path / "libs"
    dest.mkdir()
    (dest / "old-0.1.jar").write_bytes(b"old")
    (dest / ".alpha-1.0.jar.x.part").write_bytes(b"half")  # a killed fetch's
    fetch(make_lock(), dest, log=lambda _m: None, repo=repo.url)
    assert sorted(p.name for p in dest.iterdir() if not p.name.startswith(".fetch")) == [
        MARKER, "alpha-1.0.jar", "beta-2.1.jar"]


def test_bad_lock_lines_name_the_line():
    with pytest.raises(ValueError, match="lock:2: expected SET"):
        parse_lock("kafka 1\nbroker a:b 00 1\n")
    with pytest.raises(ValueError, match="no `kafka VERSION` line"):
        parse_lock(f"broker a:b:1 {'0' * 64} 1\n")


def test_the_shipped_lock_names_the_pinned_broker_and_the_image_extends_it():
    lock = read_lock(DEFAULT_KAFKA_VERSION)
    broker = {j.coords for j in lock.select("broker")}
    image = {j.coords for j in lock.select("image")}
    assert f"org.apache.kafka:kafka_2.13:{DEFAULT_KAFKA_VERSION}" in broker
    assert f"org.apache.kafka:kafka-tools:{DEFAULT_KAFKA_VERSION}" in image - broker
    assert broker < image and all(j.size > 0 for j in lock.jars)


def test_a_release_without_a_lock_and_a_bare_kafka_home_are_one_line(tmp_path, monkeypatch):
    monkeypatch.delenv("KAFKA_HOME", raising=False)
    monkeypatch.setenv("ASTRAFLOW_CACHE", str(tmp_path / "cache"))
    with pytest.raises(BrokerError, match="no lock file for Apache Kafka 0.0.1 .*kafka-lock"):
        ensure_jars("0.0.1")
    monkeypatch.setenv("KAFKA_HOME", str(tmp_path / "nokafka"))
    with pytest.raises(BrokerError, match="no libs/ folder"):
        ensure_jars()
    (tmp_path / "nokafka" / "libs").mkdir(parents=True)
    assert ensure_jars() == tmp_path / "nokafka" / "libs"  # nothing fetched
