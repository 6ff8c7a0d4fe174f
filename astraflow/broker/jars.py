"""Apache Kafka's jars from Maven Central, as a lock file in this package lists them.

``locks/kafka-<version>.lock`` names every jar of a Kafka release's broker (and, for the
container image, of its tools) by ``group:artifact:version`` with its sha256 and size;
``scripts/kafka-lock`` regenerates it for a new release (with Maven, on a maintainer's
machine). Here nothing but HTTPS is used: each jar is downloaded into a temporary file in
the destination folder, checked against the lock, then renamed into place, so an
interrupted fetch (Ctrl-C, a lost connection) leaves only whole, verified jars and no
``COMPLETE`` marker; the next fetch keeps those and downloads the rest. Failed downloads
are retried; a progress bar shows on a terminal, a log line otherwise.

Only the standard library (and ``rich``, when it is there, for the bar): ``python3
astraflow/broker/jars.py --set image --dest DIR`` runs from a checkout without the
project installed (``scripts/offline-images`` builds the Kafka image that way).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import http.client
import os
import shutil
import ssl
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

DEFAULT_KAFKA_VERSION = "4.1.1"  # the release the broker runs: a lock for it ships here
MAVEN_CENTRAL = "https://repo1.maven.org/maven2"
LOCKS = Path(__file__).resolve().with_name("locks")
SETS = ("broker", "image")  # image: the broker's jars and those of Kafka's tools
MARKER = "COMPLETE"
RETRIES = 4  # attempts per jar
DISK_MARGIN = 64 << 20  # bytes left free after the jars: logs and data need room too
TIMEOUT_S = 60.0  # per connection and read


class DownloadError(RuntimeError):
    """The jars cannot be fetched; the message says what to do instead (one line)."""


@dataclass(frozen=True)
class Jar:
    """One jar of a lock file."""

    group: str
    artifact: str
    version: str
    sha256: str
    size: int
    set: str  # "broker" (the broker needs it) or "image" (only the image's tools do)

    @property
    def coords(self) -> str:
        return f"{self.group}:{self.artifact}:{self.version}"

    @property
    def file_name(self) -> str:
        return f"{self.artifact}-{self.version}.jar"

    def url(self, repo: str) -> str:
        return (f"{repo.rstrip('/')}/{self.group.replace('.', '/')}/{self.artifact}/"
                f"{self.version}/{self.file_name}")


@dataclass(frozen=True)
class Lock:
    """A lock file: the Kafka release and its jars."""

    kafka: str
    jars: tuple[Jar, ...]
    digest: str  # sha256 of the file: the COMPLETE marker records it

    def select(self, which: str) -> list[Jar]:
        """The jars of set ``which``: ``broker``, or ``image`` (broker and tools)."""
        if which not in SETS:
            raise ValueError(f"unknown jar set {which!r}: one of {SETS}")
        return [j for j in self.jars if which == "image" or j.set == "broker"]


def lock_path(kafka: str) -> Path:
    return LOCKS / f"kafka-{kafka}.lock"


def parse_lock(text: str, source: str = "lock") -> Lock:
    """A lock file's content: a ``kafka VERSION`` line, then ``SET GROUP:ARTIFACT:VERSION
    SHA256 SIZE`` a jar; ``#`` starts a comment."""
    kafka = None
    jars = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].split()
        if not line:
            continue
        if line[0] == "kafka" and len(line) == 2:
            kafka = line[1]
            continue
        try:
            which, coords, sha, size = line
            group, artifact, version = coords.split(":")
            jar = Jar(group, artifact, version, sha.lower(), int(size), which)
        except ValueError:
            raise ValueError(f"{source}:{n}: expected SET GROUP:ARTIFACT:VERSION SHA256 "
                             f"SIZE, got {raw!r}") from None
        if which not in SETS or len(jar.sha256) != 64:
            raise ValueError(f"{source}:{n}: bad set or sha256 in {raw!r}")
        jars.append(jar)
    if kafka is None or not jars:
        raise ValueError(f"{source}: no `kafka VERSION` line or no jars")
    return Lock(kafka, tuple(jars), hashlib.sha256(text.encode()).hexdigest())


def read_lock(kafka: str) -> Lock:
    """The lock of Kafka release ``kafka``; a ``DownloadError`` when there is none."""
    path = lock_path(kafka)
    if not path.is_file():
        known = sorted(p.stem.removeprefix("kafka-") for p in LOCKS.glob("kafka-*.lock"))
        raise DownloadError(
            f"no lock file for Apache Kafka {kafka} ({path}; locked: {', '.join(known)}): "
            f"regenerate it with `bash scripts/kafka-lock {kafka}`, or set KAFKA_HOME to an "
            "unpacked Apache Kafka")
    return parse_lock(path.read_text(), str(path))


def repo_url() -> str:
    """Where the jars come from: ``$ASTRAFLOW_MAVEN_REPO`` (a mirror), else Maven Central."""
    return os.environ.get("ASTRAFLOW_MAVEN_REPO") or MAVEN_CENTRAL


def _ssl_context() -> ssl.SSLContext:
    """The system's CAs; certifi's where the system gives Python none (some macOS
    installs): a proxy's own CA in the system store keeps working."""
    ctx = ssl.create_default_context()
    if not ctx.cert_store_stats().get("x509_ca"):
        with contextlib.suppress(ImportError):
            import certifi

            ctx.load_verify_locations(certifi.where())
    return ctx


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _whole(path: Path, jar: Jar) -> bool:
    return path.is_file() and path.stat().st_size == jar.size and _sha256(path) == jar.sha256


@contextlib.contextmanager
def _exclusive(folder: Path) -> Iterator[None]:
    """One fetch into ``folder`` at a time (two test workers starting brokers at once):
    the second waits, then finds the jars there."""
    try:
        import fcntl
    except ImportError:  # not on Windows: each fetch stays atomic, only duplicated
        yield
        return
    with open(folder / ".fetch.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class _Unreachable(Exception):
    """A network failure worth retrying."""


def _download(jar: Jar, repo: str, folder: Path, ctx: ssl.SSLContext,
              advance: Callable[[int], None]) -> None:
    """One attempt: ``jar`` into ``folder`` through a temporary file there, checked, then
    renamed into place; the temporary file is removed whatever happens."""
    fd, tmp_name = tempfile.mkstemp(prefix=f".{jar.file_name}.", suffix=".part", dir=folder)
    tmp = Path(tmp_name)
    got = 0
    try:
        h = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            try:
                with urllib.request.urlopen(jar.url(repo), timeout=TIMEOUT_S,
                                            context=ctx) as resp:
                    for block in iter(lambda: resp.read(1 << 16), b""):
                        out.write(block)
                        h.update(block)
                        got += len(block)
                        advance(len(block))
            except urllib.error.HTTPError as e:
                if e.code in (429,) or e.code >= 500:
                    raise _Unreachable(f"HTTP {e.code} for {jar.url(repo)}") from None
                raise DownloadError(
                    f"{jar.url(repo)}: HTTP {e.code} {e.reason} ({jar.coords} is in the lock "
                    "but not in that repository: is ASTRAFLOW_MAVEN_REPO a full mirror?)"
                ) from None
            except (urllib.error.URLError, http.client.HTTPException, TimeoutError,
                    ConnectionError) as e:
                reason = getattr(e, "reason", None) or e
                raise _Unreachable(str(reason)) from None
        if got != jar.size or h.hexdigest() != jar.sha256:
            raise _Unreachable(f"{jar.coords} from {jar.url(repo)}: {got} bytes with "
                               f"sha256 {h.hexdigest()}, the lock says {jar.size} bytes, "
                               f"sha256 {jar.sha256}")
        os.replace(tmp, folder / jar.file_name)
    except BaseException:
        advance(-got)
        tmp.unlink(missing_ok=True)
        raise


def _retrying(jar: Jar, repo: str, folder: Path, ctx: ssl.SSLContext,
              advance: Callable[[int], None], retries: int, kafka: str) -> None:
    """``_download`` up to ``retries`` times, backing off; a ``DownloadError`` saying
    where to get the jars instead when every attempt fails."""
    for attempt in range(1, retries + 1):
        try:
            _download(jar, repo, folder, ctx, advance)
            return
        except _Unreachable as e:
            last = str(e)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise DownloadError(_no_room(folder, jar.size)) from None
            raise
        if attempt < retries:
            time.sleep(min(8.0, 0.5 * 2 ** attempt))
    where = "Maven Central" if repo == MAVEN_CENTRAL else "ASTRAFLOW_MAVEN_REPO"
    raise DownloadError(
        f"cannot fetch Apache Kafka {kafka}'s jars from {where} ({repo}) after {retries} "
        f"tries: {last}. Without access to it, set KAFKA_HOME to an unpacked Apache Kafka "
        f"{kafka} (its libs/ are used), or ASTRAFLOW_MAVEN_REPO to a mirror of Maven Central, "
        "or ASTRAFLOW_BOOTSTRAP to a running Kafka")


def _no_room(folder: Path, needed: int) -> str:
    free = shutil.disk_usage(folder).free
    return (f"too little disk for Apache Kafka's jars in {folder}: {needed / 1e6:.0f} MB "
            f"more needed, {free / 1e6:.0f} MB free; free some space, or set "
            "ASTRAFLOW_CACHE to a folder on a disk with room")


def _progress(total: int, count: int) -> tuple[Callable[[int], None], Callable[[], None]]:
    """``(advance(nbytes), close())``: a progress bar on a terminal (rich), else nothing
    (the caller logs a line before and after)."""
    if not sys.stderr.isatty():
        return (lambda _n: None), (lambda: None)
    try:
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )
    except ImportError:
        return (lambda _n: None), (lambda: None)
    bar = Progress(TextColumn(f"Kafka jars ({count})"), BarColumn(), DownloadColumn(),
                   TransferSpeedColumn(), TimeRemainingColumn(), transient=True)
    task = bar.add_task("jars", total=total)
    bar.start()
    return (lambda n: bar.advance(task, n)), bar.stop


def fetch(lock: Lock, dest: Path, which: str = "broker", log=print,
          repo: str | None = None, retries: int = RETRIES) -> Path:
    """Make ``dest`` hold exactly the jars of set ``which`` of ``lock`` (those there and
    whole are kept), then mark it ``COMPLETE``; ``dest``. Quick once marked."""
    repo = repo or repo_url()
    marker = dest / MARKER
    stamp = f"{lock.digest} {which}\n"
    if marker.is_file() and marker.read_text() == stamp:
        return dest
    try:
        dest.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DownloadError(f"cannot create {dest} for Apache Kafka's jars: {e.strerror}; "
                            "set ASTRAFLOW_CACHE to a writable folder") from None
    with _exclusive(dest):
        if marker.is_file() and marker.read_text() == stamp:
            return dest  # another process fetched them while this one waited
        marker.unlink(missing_ok=True)
        jars = lock.select(which)
        wanted = {j.file_name for j in jars}
        for old in dest.iterdir():  # a killed fetch's leftovers, another lock's jars
            if old.name.endswith(".part") or (old.suffix == ".jar" and old.name not in wanted):
                old.unlink(missing_ok=True)
        missing = [j for j in jars if not _whole(dest / j.file_name, j)]
        total = sum(j.size for j in missing)
        if total and shutil.disk_usage(dest).free < total + DISK_MARGIN:
            raise DownloadError(_no_room(dest, total + DISK_MARGIN))
        if missing:
            log(f"fetching {len(missing)} jars ({total / 1e6:.1f} MB) of Apache Kafka "
                f"{lock.kafka} from {repo} into {dest} (first use only)")
        t0 = time.time()
        ctx = _ssl_context()
        advance, close = _progress(total, len(missing))
        try:
            for jar in missing:
                _retrying(jar, repo, dest, ctx, advance, retries, lock.kafka)
        finally:
            close()
        tmp = dest / f".{MARKER}.part"
        tmp.write_text(stamp)
        os.replace(tmp, marker)
        if missing:
            log(f"fetched {len(missing)} jars ({total / 1e6:.1f} MB) in "
                f"{time.time() - t0:.1f}s, each checked against {lock_path(lock.kafka).name}")
    return dest


USAGE = "usage: python3 astraflow/broker/jars.py [--kafka VERSION] [--set broker|image] --dest DIR"


def _options(argv: list[str]) -> dict[str, str]:
    """``--name value`` pairs (a script run by path, before anything is installed: the
    standard library and no argument parser; the command line is astraflow's CLI)."""
    if len(argv) % 2 or any(k not in ("--kafka", "--set", "--dest") for k in argv[::2]):
        raise ValueError(USAGE)
    return {k[2:]: v for k, v in zip(argv[::2], argv[1::2])}


def main(argv: list[str] | None = None) -> int:
    """Fetch Apache Kafka's jars as the lock lists them (Maven Central over HTTPS,
    checked, atomic): ``python3 astraflow/broker/jars.py [--kafka V] [--set image]
    --dest DIR``."""
    try:
        opts = _options(sys.argv[1:] if argv is None else argv)
        which = opts.get("set", "broker")
        if "dest" not in opts or which not in SETS:
            raise ValueError(USAGE)
        kafka = opts.get("kafka") or os.environ.get("ASTRAFLOW_KAFKA_VERSION") \
            or DEFAULT_KAFKA_VERSION
        fetch(read_lock(kafka), Path(opts["dest"]), which,
              log=lambda m: print(f"jars: {m}", file=sys.stderr))
    except (DownloadError, ValueError) as e:
        print(f"jars: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("jars: interrupted (only whole, checked jars are kept)", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
