"""docker-compose.yml: every service command is a real `astraflow` subcommand."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import yaml

from astraflow.cli.main import build_parser
from astraflow.config.topology import load_topology

REPO = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((REPO / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]


@cache
def _parser() -> argparse.ArgumentParser:
    """The CLI's parser, built once: parsing is stateless, and building one per service
    checked made this module take a minute."""
    return build_parser()


@cache
def _processors(path: str) -> tuple[str, ...]:
    """The processor names of topology file ``path`` (relative to the repository)."""
    return tuple(load_topology(REPO / path).processors)


def _default(value: str) -> str:
    """A compose value with each ``${VAR:-default}`` as its default."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", value)


def test_kafka_service_is_apache_kafka_with_healthcheck():
    kafka = SERVICES["kafka"]
    assert _default(kafka["image"]).startswith("apache/kafka:")
    # ... or the image scripts/offline-images builds, where no registry is reachable
    assert kafka["image"].startswith("${ASTRAFLOW_KAFKA_IMAGE:-")
    assert "healthcheck" in kafka
    assert kafka["environment"]["KAFKA_PROCESS_ROLES"] == "broker,controller"  # KRaft


KAFKA_SERVICES = {n for n, s in SERVICES.items()
                  if _default(s.get("image", "")).startswith("apache/kafka")}
SECURE = "secure"  # the profile of the default run on a secured Kafka
CLUSTER = "cluster"  # the profile of the default run on three Kafka nodes


def _secure(service: dict) -> bool:
    return SECURE in (service.get("profiles") or [])


def _cluster(service: dict) -> bool:
    return CLUSTER in (service.get("profiles") or [])


@pytest.mark.parametrize("name", [n for n in SERVICES if n not in KAFKA_SERVICES])
def test_service_command_is_an_astraflow_subcommand(name):
    command = SERVICES[name]["command"]
    assert isinstance(command, list) and command[0] == "astraflow", command
    try:
        args = _parser().parse_args(command[1:])
    except SystemExit as e:  # argparse exits on an unknown subcommand or option
        pytest.fail(f"service {name}: `{' '.join(command)}` is not a valid command ({e})")
    assert callable(args.func)
    topology = getattr(args, "topology", None)
    if topology:
        topo = load_topology(REPO / topology)
        if getattr(args, "name", None) and args.command == "processor":
            assert args.name in topo.processors, f"{args.name} not in {topology}"


def test_every_processor_of_the_default_topology_has_a_service():
    topo = load_topology(REPO / "topology" / "default.yaml")
    run_services = {
        s["command"][3] for s in SERVICES.values()
        if s.get("command", [None])[:3] == ["astraflow", "processor", "run"]
    }
    assert set(topo.processors) <= run_services


# --- every topology's processors, profiles and start order --------------------------

TOPOLOGY_FILES = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "topology").glob("*.yaml"))
DEFAULT_TOPOLOGY = "topology/default.yaml"


def _parsed(service: dict):
    """The service's command parsed by the real CLI parser (None for non-astraflow ones)."""
    command = service.get("command")
    if not isinstance(command, list) or command[:1] != ["astraflow"]:
        return None
    return _parser().parse_args(command[1:])


def _processor_services(services: dict) -> dict[tuple[str, str], list[str]]:
    """(topology file, processor name) -> names of the services that run it."""
    out: dict[tuple[str, str], list[str]] = {}
    for name, service in services.items():
        args = _parsed(service)
        if _secure(service) or _cluster(service):  # the same again, on another Kafka
            continue
        if args is not None and args.command == "processor" and args.action == "run":
            out.setdefault((args.topology, args.name), []).append(name)
    return out


def _missing_processor_services(services: dict) -> list[str]:
    running = _processor_services(services)
    return [f"{path}: {name}" for path in TOPOLOGY_FILES
            for name in _processors(path) if (path, name) not in running]


def test_topology_files_are_found():
    assert DEFAULT_TOPOLOGY in TOPOLOGY_FILES and len(TOPOLOGY_FILES) >= 2


@pytest.mark.parametrize("path", TOPOLOGY_FILES)
def test_every_processor_of_every_topology_has_its_own_service(path):
    """Each processor of each topology/*.yaml runs as a service with that very topology."""
    running = _processor_services(SERVICES)
    missing = [name for name in _processors(path) if (path, name) not in running]
    assert not missing, f"no docker-compose service runs {missing} with --topology {path}"


def test_the_processor_check_fails_when_a_service_is_missing():
    for victim in ("da-greso", "replay-batcher", "batcher"):
        services = {n: s for n, s in SERVICES.items() if n != victim}
        assert _missing_processor_services(services), victim
    # a service running the processor with another topology does not count
    moved = dict(SERVICES)
    moved["da-greso"] = {**SERVICES["da-greso"],
                         "command": [c.replace("data-algorithms", "replay")
                                     for c in SERVICES["da-greso"]["command"]]}
    assert "topology/data-algorithms.yaml: greso" in _missing_processor_services(moved)


def _profiles_of_users(name: str, services: dict) -> set[str | None]:
    """The profiles of the services that depend on ``name`` (None: one without a profile)."""
    return {p for s in services.values() if name in (s.get("depends_on") or {})
            for p in (s.get("profiles") or [None])}


def _profile_mismatch(name: str, services: dict) -> str:
    """Why a service without a topology (model init, a Kafka node, the secure config) does
    not start exactly when the services that use it do; "" when it does: without a profile
    only if a service without one uses it, else with its users' profiles, all of them."""
    own = set(services[name].get("profiles") or [])
    users = _profiles_of_users(name, services)
    if not users:
        return f"{name}: no service depends on it"
    if not own:
        return "" if None in users else f"{name} starts without a profile, used only by {users}"
    if None in users:
        return f"{name} sits behind {sorted(own)}, but a service without a profile uses it"
    named = {p for p in users if p is not None}
    return "" if own == named else f"{name}: profiles {sorted(own)}, its users' {sorted(named)}"


@pytest.mark.parametrize("name", list(SERVICES))
def test_only_default_run_services_start_without_a_profile(name):
    """`docker compose up` runs the default run; other topologies sit behind profiles. A
    service without a topology (model init, Kafka, the secure config) is judged by the
    services that use it: it starts exactly when they do."""
    service = SERVICES[name]
    topology = getattr(_parsed(service), "topology", None)
    if topology is None:
        assert _profile_mismatch(name, SERVICES) == ""
    elif topology == DEFAULT_TOPOLOGY:
        assert service.get("profiles") in (None, [SECURE], [CLUSTER]), \
            f"{name} runs the default topology"
    else:
        assert service.get("profiles"), f"{name} runs {topology} but has no profile"


def test_the_profile_check_fails_for_a_misplaced_setup_service():
    unprofiled = {**SERVICES, "da-model-init": {**SERVICES["da-model-init"], "profiles": None}}
    assert "starts without a profile" in _profile_mismatch("da-model-init", unprofiled)
    elsewhere = {**SERVICES, "sv-model-init-solver": {**SERVICES["sv-model-init-solver"],
                                                      "profiles": ["data-algorithms"]}}
    assert "its users' ['solver-verifier']" in _profile_mismatch("sv-model-init-solver",
                                                                 elsewhere)
    hidden = {**SERVICES, "kafka": {**SERVICES["kafka"], "profiles": [SECURE]}}
    assert "a service without a profile uses it" in _profile_mismatch("kafka", hidden)
    orphan = {**SERVICES, "orphan": {"command": ["astraflow", "model", "init", "x"]}}
    assert _profile_mismatch("orphan", orphan) == "orphan: no service depends on it"


COMPONENTS = {"processor", "trainer", "raas", "feeder", "eval"}


@pytest.mark.parametrize("name", [
    n for n, s in SERVICES.items()
    if n != "kafka" and getattr(_parsed(s), "command", None) in COMPONENTS])
def test_components_wait_for_their_topics_and_model(name):
    """A component depends on the service applying its run's topics (same run id and
    topics) and, where services share ./runs, on the `model init` services writing the
    models it loads, all finished."""
    service = SERVICES[name]
    args = _parsed(service)
    topo = load_topology(REPO / args.topology)
    deps = service.get("depends_on", {})
    setups = {d: _parsed(SERVICES[d]) for d in deps}
    for d in deps:
        assert deps[d].get("condition") == "service_completed_successfully", (name, d)
    applied = [load_topology(REPO / a.topology) for a in setups.values()
               if a is not None and a.command == "topics"]
    assert any(t.run == topo.run and set(t.topics) == set(topo.topics) for t in applied), \
        f"{name} does not wait for a service applying the topics of run {topo.run}"
    if args.command in {"trainer", "eval"}:
        models = [args.model]
    elif args.command == "raas":
        models = [model for _policy, model in args.policy_model]
    else:
        models = []
    if not any("/app/runs" in v for v in service.get("volumes", [])):
        # shares nothing but Kafka: the trainer writes its model as the topology's policy
        # entry says, the others build theirs from weights.<policy> (model_share)
        policies = ([p for p, _ in args.policy_model] if args.command == "raas"
                    else [args.policy] if models else [])
        for policy in policies:
            assert policy in topo.policies and f"weights.{policy}" in topo.topics, name
        return
    written = {a.dir for a in setups.values() if a is not None and a.command == "model"}
    for model in models:
        assert model in written, f"{name} loads {model}, which no service it waits for writes"
        profiles = set(service.get("profiles") or [])
        writers = [d for d, a in setups.items() if a is not None and a.command == "model"
                   and a.dir == model]
        for w in writers:  # the writer starts whenever the component does
            assert set(SERVICES[w].get("profiles") or []) <= profiles, (name, w)


MODEL_SERVICES = [n for n, s in SERVICES.items()
                  if getattr(_parsed(s), "command", None) == "model"
                  and _parsed(s).model_command != "import"]
IMPORT_SERVICES = [n for n, s in SERVICES.items()
                   if getattr(_parsed(s), "command", None) == "model"
                   and _parsed(s).model_command == "import"]


@pytest.mark.parametrize("name", IMPORT_SERVICES)
def test_import_services_import_what_the_topology_names(name):
    """A compose model import writes the model directory of a topology policy from the
    source that policy's ``import_from`` names, as `astraflow up` would."""
    args = _parsed(SERVICES[name])
    sources = {(spec.model, spec.import_from) for path in TOPOLOGY_FILES
               for spec in load_topology(REPO / path).policies.values() if spec.import_from}
    assert (args.dir, args.gguf or args.source) in sources


def _recipe_mismatches(service: dict) -> list[str]:
    """How a model service writes its model differently from `astraflow up` (the recipe
    of `model_init_command` for every topology policy with that model directory)."""
    from astraflow.launch.provision import model_init_command
    from astraflow.models.recipe import init_recipe

    args = _parsed(service)
    have = init_recipe(args)
    out = []
    for path in TOPOLOGY_FILES:
        for policy, spec in load_topology(REPO / path).policies.items():
            if spec.model != args.dir:
                continue
            want = init_recipe(_parser().parse_args(model_init_command(spec)))
            out += [f"{path} {policy}: {k} {have.get(k)} != {v}"
                    for k, v in want.items() if have.get(k) != v]
            out += [f"{path} {policy}: {k} {have[k]} (the topology leaves it out)"
                    for k in have.keys() - want.keys()]
    return out


@pytest.mark.parametrize("name", MODEL_SERVICES)
def test_model_services_write_the_model_the_topology_asks_for(name):
    """A model written by compose is the one `astraflow up` would write: same command
    (`model init` / `model init-role`) and recipe, so `up` on the same directory keeps it."""
    assert not _recipe_mismatches(SERVICES[name])


def test_the_model_service_check_fails_when_they_disagree():
    assert {"sv-model-init-solver", "sv-model-init-verifier"} <= set(MODEL_SERVICES)
    verifier = SERVICES["sv-model-init-verifier"]
    for old, new in (("1600", "1500"), ("init-role", "init")):
        changed = {**verifier, "command": [new if c == old else c for c in verifier["command"]]}
        if new == "init":  # `model init` has no --role, --label-noise nor --blind
            for role_only, n in (("--role", 2), ("--label-noise", 2), ("--blind", 1)):
                if role_only in changed["command"]:
                    i = changed["command"].index(role_only)
                    del changed["command"][i:i + n]
        assert _recipe_mismatches(changed), (old, new)


def _default_services() -> dict:
    return {n: s for n, s in SERVICES.items() if n != "kafka" and not s.get("profiles")}


def test_the_default_services_run_what_astraflow_up_runs():
    """The default run's services are the components `astraflow up` starts, with the same
    arguments (bar the instance name `up` gives processors), and mount no shared ./runs."""
    from astraflow.launch.plan import plan_processes

    topo = load_topology(REPO / "topology" / "default.yaml")
    planned = {tuple(c[3:]) for c in plan_processes(topo, "topology/default.yaml").values()}
    planned = {tuple(a for a in c if a not in ("--instance", "up")) if "processor" in c
               else c for c in planned}
    services = _default_services()
    commands = {tuple(s["command"][1:]) for n, s in services.items() if n != "topics"}
    assert commands == planned
    for name, s in services.items():
        assert all("/app/runs" not in v for v in s.get("volumes", [])), name


def _planned(service: dict) -> list[str] | None:
    """What `astraflow up` runs for the component ``service`` runs (its topology's plan;
    a processor without `up`'s instance name), or None for a service that is no component."""
    from astraflow.launch.plan import plan_processes

    args = _parsed(service)
    if args is None or args.command not in COMPONENTS:
        return None
    name = {"processor": f"processor-{getattr(args, 'name', '')}",
            "trainer": f"trainer-{getattr(args, 'policy', '')}",
            "eval": f"eval-{getattr(args, 'policy', '')}", "feeder": "feeder",
            "raas": f"raas-{getattr(args, 'pool', '')}-0"}[args.command]
    plan = plan_processes(load_topology(REPO / args.topology), args.topology)[name][3:]
    if args.command == "processor":
        plan = [a for a in plan if a not in ("--instance", "up")]
    return plan


@pytest.mark.parametrize("name", [n for n, s in SERVICES.items() if _planned(s) is not None])
def test_every_component_service_runs_what_astraflow_up_runs(name):
    """Every profile's components, not only the default run's: the typed topology is the
    one source of their flags."""
    command = SERVICES[name]["command"][1:]
    if command[0] == "processor":  # its instance name is its own
        command = [a for a in command if a not in ("--instance", "up")]
    assert command == _planned(SERVICES[name])


# what a component's service may name besides its topology: who it is and where its model is
IDENTITY = {"model", "policy_model"}


def _copied_settings(service: dict) -> list[str]:
    """The override flags (``astraflow.config.overrides``) a component service gives: a
    setting copied out of its topology, which the component reads from the file."""
    from astraflow.cli.flags import given
    from astraflow.config.overrides import EVAL_FLAGS, FEEDER_FLAGS, NODE_FLAGS, TRAINER_FLAGS

    args = _parsed(service)
    flags = {"trainer": TRAINER_FLAGS, "raas": NODE_FLAGS, "eval": EVAL_FLAGS,
             "feeder": FEEDER_FLAGS}.get(getattr(args, "command", None), ())
    return sorted(set(given(args, flags)) - IDENTITY)


@pytest.mark.parametrize("name", [n for n, s in SERVICES.items() if _planned(s) is not None])
def test_component_services_carry_no_copied_setting_flags(name):
    """A component service names its topology and its identity; every setting (lr,
    samples per task, workflow options ...) comes from the file, so a setting changed
    there reaches the service (tests/unit/cli/test_component_settings.py)."""
    assert _copied_settings(SERVICES[name]) == []


def test_the_copied_flag_check_fails_on_a_copied_setting():
    trainer, raas = SERVICES["trainer-actor"], SERVICES["raas-local-0"]
    assert _copied_settings({**trainer, "command": [*trainer["command"], "--lr", "0.0001"]}) \
        == ["lr"]
    assert _copied_settings({**raas, "command": [*raas["command"], "--n-samples", "8",
                                                 "--workflow-options", "single_turn={}"]}) \
        == ["n_samples", "workflow_options"]


@pytest.mark.slow
@pytest.mark.kafka
def test_the_default_services_train_sharing_nothing_but_kafka(kafka_bootstrap, kafka_config,
                                                              tmp_path):
    """Every default service of docker-compose.yml as a local process: its own command and
    environment (Kafka address: the test broker's), its own working directory (what the
    image holds: topology/, with a fresh run id) and HOME. The trainer writes the model,
    the RaaS node and the evaluator get it from Kafka; the trainer's versions reach the
    RaaS node and the evaluator scores them (how much it learns is a bench:
    ``python bench/data_algorithms.py --variants baseline``, ``bench/learning.py``)."""
    import os
    import shutil
    import subprocess
    import sys

    from astraflow.kafka.clients import read_all
    from astraflow.wire.records import ComponentStatus
    from tests.conftest import random_name, wait_for

    run = random_name("compose")
    text = (REPO / "topology" / "default.yaml").read_text().replace("run: default", f"run: {run}")
    # a short warm start (the shipped one is about 1000 steps, a minute on 2 cores): what
    # is checked is where the model and its versions come from, not how well it adds
    warm = "warm_start: {steps: 4000, slip: 0.7, until: 0.9, seed: 1}"
    assert warm in text, "topology/default.yaml's warm start changed: update this test"
    text = text.replace(warm, "warm_start: {steps: 200, slip: 0.7, seed: 1}")
    procs: dict[str, subprocess.Popen] = {}

    def start(name: str, service: dict) -> subprocess.Popen:
        home = tmp_path / name
        (home / "topology").mkdir(parents=True)
        shutil.copytree(REPO / "data", home / "data")
        (home / "topology" / "default.yaml").write_text(text)
        env = {**os.environ, **{k: str(v) for k, v in service.get("environment", {}).items()},
               "ASTRAFLOW_BOOTSTRAP": kafka_bootstrap, "HOME": str(home / "home"),
               "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "astraflow.cli.main", *service["command"][1:]]
        return subprocess.Popen(cmd, cwd=home, env=env, stdout=open(home / "log", "wb"),
                                stderr=subprocess.STDOUT)

    def logs() -> str:
        return "\n".join(f"--- {n}\n{(tmp_path / n / 'log').read_text()[-3000:]}" for n in procs)

    services = _default_services()
    try:
        procs["topics"] = start("topics", services.pop("topics"))
        assert procs["topics"].wait(120) == 0, logs()
        for name, service in services.items():
            procs[name] = start(name, service)

        def statuses() -> list:
            return [r.record for r in read_all(kafka_config, f"{run}.status",
                                               expect=ComponentStatus, idle_s=1.0)]

        def evals() -> list[tuple[int, float]]:
            return sorted((int(s.metrics["eval/version"]), s.metrics["eval/accuracy"])
                          for s in statuses() if "eval/accuracy" in s.metrics)

        def scored() -> bool:
            dead = [n for n, p in procs.items() if n != "topics" and p.poll() is not None]
            assert not dead, f"{dead} exited\n{logs()}"
            e = evals()
            assert all(0.0 <= a <= 1.0 for _, a in e), e
            return bool(e) and e[-1][0] >= 5  # every_versions: 5

        wait_for(scored, 900, "the evaluator to score a version from 5 on", step=5.0)

        def raas_version() -> int:
            return max((s.weight_versions.get("actor", -1) for s in statuses()
                        if s.kind == "raas"), default=-1)

        # a node reports every status_interval_s, so its status may trail the evaluator's
        wait_for(lambda: raas_version() >= 5, 60, "a RaaS node to report version 5 or later")
        print("held-out accuracy by version:", evals())
        assert not (tmp_path / "raas-local-0" / "runs" / "default" / "model" /
                    "training_args.json").exists()
        assert "fetching policy actor's model from" in (tmp_path / "raas-local-0" / "log"
                                                        ).read_text()
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.terminate()
        for p in procs.values():
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()


SECURE_SERVICES = {n: s for n, s in SERVICES.items() if _secure(s)}


def test_the_secure_profile_runs_the_default_components_each_as_its_own_user():
    """`docker compose --profile secure`: what `astraflow up --secure` does, on a Kafka of
    its own (parsed here: no Docker engine on the test machines)."""
    from astraflow.launch.secure import component_key

    topo = load_topology(REPO / DEFAULT_TOPOLOGY)
    default = {tuple(s["command"]) for s in _default_services().values()}
    keys = set()
    for name, service in SECURE_SERVICES.items():
        args = _parsed(service)
        if args is None or args.command not in COMPONENTS:
            continue
        assert tuple(service["command"]) in default, name  # the same command
        process = {"processor": f"processor-{getattr(args, 'name', '')}",
                   "trainer": f"trainer-{getattr(args, 'policy', '')}",
                   "eval": f"eval-{getattr(args, 'policy', '')}", "feeder": "feeder",
                   "raas": f"raas-{getattr(args, 'pool', '')}-0"}[args.command]
        key = component_key(topo, process)
        env = service["environment"]
        assert env["ASTRAFLOW_SASL_USERNAME"] == f"{topo.run}.{key}", name
        assert env["ASTRAFLOW_SASL_PASSWORD_FILE"] == f"/secrets/creds/{key}.password", name
        assert env["ASTRAFLOW_SECURITY_PROTOCOL"] == "SASL_SSL"
        assert ("ASTRAFLOW_WEIGHTS_SIGNING_KEY" in env) == (args.command == "trainer"), name
        assert env["ASTRAFLOW_WEIGHTS_PUBLIC_KEY"].startswith("/secrets/keys/")
        assert "secure-acls" in service["depends_on"], name
        assert all(v.endswith(":ro") for v in service["volumes"]), name
        keys.add(key)
    assert keys == set(topo.component_keys())  # every component, once
    acls = _parsed(SECURE_SERVICES["secure-acls"])
    assert acls.apply and acls.credentials_dir == "/secrets/creds"
    config = _parsed(SECURE_SERVICES["secure-config"])
    kafka = SECURE_SERVICES["kafka-secure"]
    assert kafka["hostname"] == config.host and "--add-scram" in kafka["command"][-1]
    assert "secure-config" in kafka["depends_on"] and "healthcheck" in kafka


CLUSTER_SERVICES = {n: s for n, s in SERVICES.items() if _cluster(s)}


def _cluster_problems(services: dict) -> list[str]:
    """How the cluster profile's nodes and components disagree: node ids, one quorum of
    every node's controller, one cluster id, replication 3 with min ISR 2, and components
    that bootstrap from every node and run the default services' commands."""
    nodes = {n: s for n, s in services.items() if n in KAFKA_SERVICES and _cluster(s)}
    envs = {n: s["environment"] for n, s in nodes.items()}
    out = []
    ids = sorted(int(e["KAFKA_NODE_ID"]) for e in envs.values())
    if ids != list(range(1, len(nodes) + 1)) or len(nodes) != 3:
        out.append(f"node ids {ids}: want 1, 2, 3")
    voters = {f"{e['KAFKA_NODE_ID']}@{services[n]['hostname']}:"
              f"{e['KAFKA_LISTENERS'].split('CONTROLLER://:')[1].split(',')[0]}"
              for n, e in envs.items()}
    clients = {e["KAFKA_ADVERTISED_LISTENERS"].removeprefix("PLAINTEXT://")
               for e in envs.values()}
    for n, e in envs.items():
        if set(e["KAFKA_CONTROLLER_QUORUM_VOTERS"].split(",")) != voters:
            out.append(f"{n}: voters {e['KAFKA_CONTROLLER_QUORUM_VOTERS']} != {voters}")
        host = services[n]["hostname"]
        if not e["KAFKA_ADVERTISED_LISTENERS"].startswith(f"PLAINTEXT://{host}:"):
            out.append(f"{n}: advertises {e['KAFKA_ADVERTISED_LISTENERS']}, not its hostname")
        if e["KAFKA_PROCESS_ROLES"] != "broker,controller":
            out.append(f"{n}: roles {e['KAFKA_PROCESS_ROLES']}")
        for key, want in (("KAFKA_DEFAULT_REPLICATION_FACTOR", 3), ("KAFKA_MIN_INSYNC_REPLICAS", 2),
                          ("KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR", 3),
                          ("KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR", 3),
                          ("KAFKA_TRANSACTION_STATE_LOG_MIN_ISR", 2)):
            if int(e.get(key, 0)) != want:
                out.append(f"{n}: {key} {e.get(key)} != {want}")
    out += _rack_problems(services, envs)
    if len({e.get("CLUSTER_ID") for e in envs.values()}) != 1 or None in {
            e.get("CLUSTER_ID") for e in envs.values()}:
        out.append("the nodes must share one CLUSTER_ID")
    default = {tuple(s["command"]) for s in _default_services().values()}
    for n, s in services.items():
        if not _cluster(s) or n in nodes:
            continue
        if set(s["environment"]["ASTRAFLOW_BOOTSTRAP"].split(",")) != clients:
            out.append(f"{n}: bootstraps from {s['environment']['ASTRAFLOW_BOOTSTRAP']}, "
                       f"not every node ({sorted(clients)})")
        if tuple(s["command"]) not in default:
            out.append(f"{n}: {s['command']} is no default service's command")
        waits = set(s["depends_on"])
        if _parsed(s).command == "topics" and waits != set(nodes):
            out.append(f"{n}: waits for {sorted(waits)}, not every node")
    ran = {tuple(s["command"]) for n, s in services.items() if _cluster(s) and n not in nodes}
    if ran != default:
        out.append(f"components missing: {sorted(default - ran)}")
    return out


RACK_SELECTOR = "org.apache.kafka.common.replica.RackAwareReplicaSelector"


def _rack_problems(services: dict, envs: dict[str, dict]) -> list[str]:
    """Each node in a rack of its own with the rack-aware replica selector, and every
    RaaS node of the profile in one of those racks (``ASTRAFLOW_RACK``: its client.rack),
    so that it fetches from the replica in its rack."""
    out = []
    racks = [e.get("KAFKA_BROKER_RACK") for e in envs.values()]
    if None in racks or len(set(racks)) != len(racks):
        out.append(f"node racks {racks}: want one rack a node")
    for n, e in envs.items():
        if e.get("KAFKA_REPLICA_SELECTOR_CLASS") != RACK_SELECTOR:
            out.append(f"{n}: replica selector {e.get('KAFKA_REPLICA_SELECTOR_CLASS')}")
    for n, s in services.items():
        if _cluster(s) and n not in envs and s["command"][1:3] == ["raas", "run"]:
            rack = s["environment"].get("ASTRAFLOW_RACK")
            if rack not in racks:
                out.append(f"{n}: rack {rack}, not a node's ({racks})")
    return out


def test_the_cluster_profile_is_three_kraft_nodes_running_the_default_run():
    """`docker compose --profile cluster`: what `astraflow up --brokers 3` does (parsed
    here: no Docker engine on the test machines)."""
    assert len(CLUSTER_SERVICES) == 3 + 1 + len(_default_services()) - 1
    assert not _cluster_problems(SERVICES)


def test_the_cluster_check_fails_when_the_profile_disagrees():
    def changed(name: str, **env) -> dict:
        service = SERVICES[name]
        return {**SERVICES, name: {**service, "environment": {**service["environment"], **env}}}

    assert _cluster_problems(changed("kafka-2", KAFKA_NODE_ID=1))
    assert _cluster_problems(changed(
        "kafka-3", KAFKA_CONTROLLER_QUORUM_VOTERS="1@kafka-1:9093,2@kafka-2:9093"))
    assert _cluster_problems(changed("kafka-1", CLUSTER_ID="another"))
    assert _cluster_problems(changed("kafka-1", KAFKA_MIN_INSYNC_REPLICAS=1))
    assert _cluster_problems(changed("cluster-feeder", ASTRAFLOW_BOOTSTRAP="kafka-1:9092"))
    assert _cluster_problems({n: s for n, s in SERVICES.items() if n != "cluster-batcher"})
    assert _cluster_problems(changed("kafka-2", KAFKA_BROKER_RACK="r1"))
    assert _cluster_problems(changed("kafka-3", KAFKA_REPLICA_SELECTOR_CLASS=""))
    assert _cluster_problems(changed("cluster-raas-local-0", ASTRAFLOW_RACK="elsewhere"))


HOST = yaml.safe_load((REPO / "docker-compose.host.yml").read_text())


def test_the_host_network_file_is_generated_from_docker_compose_yml():
    run = subprocess.run([sys.executable, str(REPO / "scripts" / "compose-host"), "--check"],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def test_the_host_network_file_dials_localhost_only():
    """Every service of docker-compose.yml but the cluster profile's, on the host's
    network: nothing published, no host names, no service name dialled."""
    kept = {n for n, s in SERVICES.items() if not _cluster(s)}
    assert set(HOST["services"]) == kept
    for name, svc in HOST["services"].items():
        assert svc["network_mode"] == "host", name
        assert not {"ports", "hostname", "networks"} & set(svc), name
        text = yaml.safe_dump(svc)
        assert not re.search(r"(?<![\w./-])(?<!\w/)kafka(-secure)?(:\d|\s)", text), name
    env = HOST["services"]["kafka"]["environment"]
    assert env["KAFKA_ADVERTISED_LISTENERS"] == "PLAINTEXT://localhost:9092,HOST://localhost:19092"
    assert HOST["services"]["trainer-actor"]["environment"]["ASTRAFLOW_BOOTSTRAP"] == (
        "localhost:9092")
