"""The docker-compose stack under a real Docker engine: the default and the secure profile
train, from images built without a registry, on the host's network.

``.ci/run`` installs Docker, docker-compose and mmdebstrap from Debian, starts ``dockerd``
and builds the images (``scripts/offline-images``) while the main suite (``-m "not
docker"``) runs, then runs these tests (``pytest -m docker``); without an engine,
docker-compose or the images they skip, saying which. Each profile runs in a compose
project of its own (``docker-compose.host.yml``) until the trainer has published and the
RaaS node applied at least 5 versions and the evaluator scored one; a failure prints every
service's log; the project is torn down (its containers and volumes only) whatever
happens.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import random_name, wait_for

pytestmark = [pytest.mark.docker, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
HOST_FILE = REPO / "docker-compose.host.yml"
DEFAULT = ["kafka", "topics", "admission", "staleness", "router", "batcher", "trainer-actor",
           "raas-local-0", "feeder", "eval-actor"]
SECURE = ["kafka-secure", "secure-config", "secure-topics", "secure-acls", "secure-admission",
          "secure-staleness", "secure-router", "secure-batcher", "secure-trainer-actor",
          "secure-raas-local-0", "secure-feeder", "secure-eval-actor"]
APPLIED = re.compile(r"engine now at version (\d+)")
ENV_LINES = "{{range .Config.Env}}{{println .}}{{end}}"  # a container's environment
SCORED = re.compile(r"eval actor v(\d+) accuracy ([0-9.]+)")


def _images() -> dict[str, str]:
    """The images the compose files use, as scripts/offline-images names them."""
    out = subprocess.run(["bash", str(REPO / "scripts" / "offline-images"), "--env"],
                         capture_output=True, text=True, check=True).stdout
    return dict(re.findall(r"(ASTRAFLOW_\w+)=(\S+)", out))


@pytest.fixture(scope="module")
def images() -> dict[str, str]:
    if shutil.which("docker") is None or shutil.which("docker-compose") is None:
        pytest.skip("docker and docker-compose are not installed (.ci/run installs them)")
    if subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        pytest.skip("no Docker engine answers (.ci/run starts dockerd)")
    env = _images()
    missing = [v for v in env.values()
               if subprocess.run(["docker", "image", "inspect", v],
                                 capture_output=True).returncode != 0]
    if missing:
        pytest.skip(f"images {missing} are not built: bash scripts/offline-images")
    return env


class Project:
    """One compose project of docker-compose.host.yml."""

    def __init__(self, images: dict[str, str], profile: str | None):
        self.name = random_name("af")
        self.env = {**os.environ, **images, "COMPOSE_PROJECT_NAME": self.name}
        self.args = ["docker-compose", "-f", str(HOST_FILE),
                     *(["--profile", profile] if profile else [])]

    def run(self, *args: str, timeout: float = 600) -> str:
        p = subprocess.run([*self.args, *args], env=self.env, cwd=REPO, capture_output=True,
                           text=True, timeout=timeout)
        assert p.returncode == 0, f"docker-compose {' '.join(args)}:\n{p.stdout}{p.stderr}"
        return p.stdout

    def logs(self, service: str | None = None) -> str:
        p = subprocess.run([*self.args, "logs", "--no-color", *([service] if service else [])],
                           env=self.env, cwd=REPO, capture_output=True, text=True, timeout=120)
        return p.stdout + p.stderr


@pytest.fixture
def project(images) -> Iterator[callable]:
    made: list[Project] = []

    def make(profile: str | None) -> Project:
        made.append(Project(images, profile))
        return made[-1]

    yield make
    for p in made:
        subprocess.run([*p.args, "down", "-v", "--remove-orphans"], env=p.env, cwd=REPO,
                       capture_output=True, timeout=300)


def _trains(p: Project, services: list[str], raas: str, evaluator: str) -> dict[str, float]:
    """Start ``services``; wait until the RaaS node applied version 5 and the evaluator
    scored a version; the seconds each took."""
    t0 = time.monotonic()
    p.run("up", "-d", *services)
    out = {"up_s": time.monotonic() - t0}
    try:
        wait_for(lambda: max(map(int, APPLIED.findall(p.logs(raas))), default=-1) >= 5, 900,
                 f"{raas} to apply version 5", step=5.0)
        out["five_versions_s"] = time.monotonic() - t0
        wait_for(lambda: SCORED.search(p.logs(evaluator)), 300,
                 f"{evaluator} to score a version", step=5.0)
        out["scored_s"] = time.monotonic() - t0
    except Exception:
        print(p.logs()[-30000:])  # every service's log, for the failure
        raise
    return out


def _running(p: Project, services: list[str], setup: set[str]) -> None:
    """Every long-running service still up (not restarting, not exited); every setup
    service exited 0."""
    ids = {svc: p.run("ps", "-q", svc).strip() for svc in services}
    for svc, cid in ids.items():
        state = subprocess.run(["docker", "inspect", "-f",
                                "{{.State.Status}} {{.State.ExitCode}} {{.RestartCount}}", cid],
                               capture_output=True, text=True).stdout.split()
        want = ["exited", "0", "0"] if svc in setup else ["running", "0", "0"]
        assert state == want, (svc, state, p.logs(svc)[-3000:])


def test_the_default_profile_trains_under_docker(project):
    p = project(None)
    took = _trains(p, DEFAULT, "raas-local-0", "eval-actor")
    _running(p, DEFAULT, setup={"topics"})
    print("default profile:", {k: round(v) for k, v in took.items()})


def test_the_secure_profile_trains_under_docker_each_component_its_own_user(project):
    p = project("secure")
    took = _trains(p, SECURE, "secure-raas-local-0", "secure-eval-actor")
    setup = {"secure-config", "secure-topics", "secure-acls"}
    _running(p, SECURE, setup=setup)
    users = {}
    for svc in set(SECURE) - setup - {"kafka-secure"}:
        env = subprocess.run(["docker", "inspect", "-f", ENV_LINES,
                              p.run("ps", "-q", svc).strip()], capture_output=True,
                             text=True).stdout
        users[svc] = re.search(r"^ASTRAFLOW_SASL_USERNAME=(.+)$", env, re.M).group(1)
    assert len(set(users.values())) == len(users), users  # trained, each as its own user
    print("secure profile:", {k: round(v) for k, v in took.items()})
