"""docker-compose.yml: every service command is a real `astraflow` subcommand."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from astraflow.cli import build_parser
from astraflow.topology import load_topology

REPO = Path(__file__).resolve().parents[1]
COMPOSE = yaml.safe_load((REPO / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]


def test_kafka_service_is_apache_kafka_with_healthcheck():
    kafka = SERVICES["kafka"]
    assert kafka["image"].startswith("apache/kafka:")
    assert "healthcheck" in kafka
    assert kafka["environment"]["KAFKA_PROCESS_ROLES"] == "broker,controller"  # KRaft


@pytest.mark.parametrize("name", [n for n in SERVICES if n != "kafka"])
def test_service_command_is_an_astraflow_subcommand(name):
    command = SERVICES[name]["command"]
    assert isinstance(command, list) and command[0] == "astraflow", command
    parser = build_parser()
    try:
        args = parser.parse_args(command[1:])
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
    return build_parser().parse_args(command[1:])


def _processor_services(services: dict) -> dict[tuple[str, str], list[str]]:
    """(topology file, processor name) -> names of the services that run it."""
    out: dict[tuple[str, str], list[str]] = {}
    for name, service in services.items():
        args = _parsed(service)
        if args is not None and args.command == "processor" and args.action == "run":
            out.setdefault((args.topology, args.name), []).append(name)
    return out


def _missing_processor_services(services: dict) -> list[str]:
    running = _processor_services(services)
    return [f"{path}: {name}" for path in TOPOLOGY_FILES
            for name in load_topology(REPO / path).processors if (path, name) not in running]


def test_topology_files_are_found():
    assert DEFAULT_TOPOLOGY in TOPOLOGY_FILES and len(TOPOLOGY_FILES) >= 2


@pytest.mark.parametrize("path", TOPOLOGY_FILES)
def test_every_processor_of_every_topology_has_its_own_service(path):
    """Each processor of each topology/*.yaml runs as a service with that very topology."""
    running = _processor_services(SERVICES)
    missing = [name for name in load_topology(REPO / path).processors
               if (path, name) not in running]
    assert not missing, f"no docker-compose service runs {missing} with --topology {path}"


def test_the_processor_check_fails_when_a_service_is_missing():
    for victim in ("da-greso", "admission-batcher", "batcher"):
        services = {n: s for n, s in SERVICES.items() if n != victim}
        assert _missing_processor_services(services), victim
    # a service running the processor with another topology does not count
    moved = dict(SERVICES)
    moved["da-greso"] = {**SERVICES["da-greso"],
                         "command": [c.replace("data-algorithms", "admission")
                                     for c in SERVICES["da-greso"]["command"]]}
    assert "topology/data-algorithms.yaml: greso" in _missing_processor_services(moved)


@pytest.mark.parametrize("name", [n for n in SERVICES if n != "kafka"])
def test_only_default_run_services_start_without_a_profile(name):
    """`docker compose up` runs the default run; other topologies sit behind profiles."""
    service = SERVICES[name]
    topology = getattr(_parsed(service), "topology", None)
    if topology is None:  # model init: judged by the services that use its model
        return
    if topology == DEFAULT_TOPOLOGY:
        assert not service.get("profiles"), f"{name} runs the default topology"
    else:
        assert service.get("profiles"), f"{name} runs {topology} but has no profile"


COMPONENTS = {"processor", "trainer", "raas", "feeder", "eval"}


@pytest.mark.parametrize("name", [
    n for n, s in SERVICES.items()
    if n != "kafka" and getattr(_parsed(s), "command", None) in COMPONENTS])
def test_components_wait_for_their_topics_and_model(name):
    """A component depends on the service applying its run's topics (same run id and
    topics) and on the `model init` services writing the models it loads, all finished."""
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
    of `_model_init_command` for every topology policy with that model directory)."""
    from astraflow.launcher import _model_init_command
    from astraflow.model import init_recipe

    args = _parsed(service)
    have = init_recipe(args)
    out = []
    for path in TOPOLOGY_FILES:
        for policy, spec in load_topology(REPO / path).policies.items():
            if spec.model != args.dir:
                continue
            want = init_recipe(build_parser().parse_args(_model_init_command(spec)))
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
