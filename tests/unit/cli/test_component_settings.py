"""One declaration per setting: a component started by hand from the topology file, by
`astraflow up` and by a compose service runs the same configuration, the file's; a flag
only overrides it. No broker: each command line is parsed by the real CLI and its
configuration built as its handler builds it (``astraflow.cli.components``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from astraflow.cli.components import configuration
from astraflow.config.topology import load_topology
from astraflow.launch.plan import plan_processes

REPO = Path(__file__).resolve().parents[3]
DEFAULT = REPO / "topology" / "default.yaml"
COMPOSE = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]


def _write(tmp_path: Path, data: dict, name: str = "t.yaml") -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


def _default() -> dict:
    return yaml.safe_load(DEFAULT.read_text())


def _ways(path: str, process: str, service: str, hand: list[str]) -> dict[str, object]:
    """The configuration of one component of the topology ``path``, started three ways:
    by hand (``hand``), by `astraflow up` (its planned process ``process``) and by the
    compose service ``service`` (its command, on ``path`` instead of its own file)."""
    topo = load_topology(path)
    planned = plan_processes(topo, path)[process][3:]
    command = COMPOSE[service]["command"][1:]
    own = command[command.index("--topology") + 1]
    composed = [path if a == own else a for a in command]
    return {"hand": configuration(hand), "up": configuration(planned),
            "compose": configuration(composed)}


def test_a_hand_started_trainer_trains_with_the_files_lr(tmp_path):
    """`trainer run -t FILE --policy P`, as the README starts one processor next to a
    shared cluster: every setting is the file's; a flag overrides only its own."""
    data = _default()
    data["policies"]["actor"]["trainer"].update(lr=0.00042, state_interval=7)
    data["policies"]["actor"].update(temperature=0.8, max_staleness=2)
    path = _write(tmp_path, data)
    opts = configuration(["trainer", "run", "-t", path, "--policy", "actor"])
    assert opts.spec.trainer.lr == 0.00042
    assert (opts.spec.trainer.state_interval, opts.spec.temperature,
            opts.spec.max_staleness) == (7, 0.8, 2)
    assert opts.spec.model == "runs/default/model"  # the policy's model
    flagged = configuration(["trainer", "run", "-t", path, "--policy", "actor", "--lr", "0.1",
                             "--no-std-normalize", "--model", "elsewhere"])
    trained = flagged.spec.trainer
    assert (trained.lr, trained.std_normalize, flagged.spec.model) == (0.1, False, "elsewhere")
    assert dataclasses.replace(flagged, spec=opts.spec) == opts
    assert flagged.spec.model_dump(exclude={"model": True, "trainer": {"lr", "std_normalize"}}
                                   ) == opts.spec.model_dump(
        exclude={"model": True, "trainer": {"lr", "std_normalize"}})


def test_a_changed_trainer_setting_reaches_every_way_of_starting_the_trainer(tmp_path):
    before = _ways(str(DEFAULT), "trainer-actor", "trainer-actor",
                   ["trainer", "run", "-t", str(DEFAULT), "--policy", "actor"])
    data = _default()
    data["policies"]["actor"]["trainer"].update(lr=0.00042, micro_batch_tokens=256,
                                                keep_versions=5)
    data["policies"]["actor"]["max_staleness"] = 3
    path = _write(tmp_path, data)
    ways = _ways(path, "trainer-actor", "trainer-actor",
                 ["trainer", "run", "-t", path, "--policy", "actor"])
    assert ways["hand"] == ways["up"] == ways["compose"]
    changed = ways["hand"]
    trained = changed.spec.trainer
    assert (trained.lr, trained.micro_batch_tokens, trained.keep_versions,
            changed.spec.max_staleness) == (0.00042, 256, 5, 3)
    assert before["hand"] == before["up"] == before["compose"] != changed


def test_a_changed_pool_setting_reaches_every_way_of_starting_a_raas_node(tmp_path):
    """Samples per task, tasks per transaction and the workflow options (completion length,
    reward) of `raas run -t FILE --pool P` are the file's."""
    hand = ["raas", "run", "-t", "PATH", "--pool", "local", "--instance", "local-0"]
    data = _default()
    pool = data["pools"]["local"]
    pool.update(n_samples=5, tasks_per_transaction=3)
    pool["workflows"]["single_turn"].update(max_new_tokens=12, reward="exact_match")
    path = _write(tmp_path, data)
    ways = _ways(path, "raas-local-0", "raas-local-0",
                 [path if a == "PATH" else a for a in hand])
    assert ways["hand"] == ways["up"] == ways["compose"]
    options = ways["hand"].options
    assert (options.n_samples, options.tasks_per_transaction) == (5, 3)
    assert options.workflow_options == {"single_turn": {
        "temperature": 1.0, "max_new_tokens": 12, "reward": "exact_match"}}
    before = _ways(str(DEFAULT), "raas-local-0", "raas-local-0",
                   [str(DEFAULT) if a == "PATH" else a for a in hand])
    assert before["hand"] == before["up"] == before["compose"] != ways["hand"]
    assert before["hand"].options.n_samples == 8  # the shipped file's, not a flag default


def test_a_raas_flag_overrides_only_its_own_setting(tmp_path):
    path = str(DEFAULT)
    base = ["raas", "run", "-t", path, "--pool", "local"]
    node = configuration([*base, "--n-samples", "3", "--workflow-options",
                          'single_turn={"max_new_tokens": 4}', "--dtype", "bfloat16"])
    assert node.options.n_samples == 3 and node.settings.dtype == "bfloat16"
    # over the file's options of that workflow (and the policies' sampling)
    assert node.options.workflow_options == {
        "single_turn": {"temperature": 1.0, "max_new_tokens": 4}}
    plain = configuration(base)
    assert dataclasses.replace(node.options, n_samples=8, workflow_options=plain.options
                               .workflow_options) == plain.options
    # a pool the file lacks takes the one default of each setting; the policies are the file's
    other = configuration(["raas", "run", "-t", path, "--pool", "elsewhere"])
    assert other.options.n_samples == 8 and other.settings.models == {
        "actor": "runs/default/model"}
    with pytest.raises(ValueError, match="--n-samples: Input should be greater than or equal"):
        configuration([*base, "--n-samples", "0"])
    with pytest.raises(ValueError, match="--speed"):
        configuration([*base, "--speed", "2"])


def test_a_changed_eval_or_feeder_setting_reaches_every_way_of_starting_them(tmp_path):
    data = _default()
    data["eval"].update(size=40, max_new_tokens=6)
    data["feeder"].update(rate=7.0, levels="1")
    path = _write(tmp_path, data)
    ev = _ways(path, "eval-actor", "eval-actor",
               ["eval", "run", "-t", path, "--policy", "actor"])
    assert ev["hand"] == ev["up"] == ev["compose"]
    assert (ev["hand"].size, ev["hand"].max_new_tokens, ev["hand"].model) == (
        40, 6, "runs/default/model")
    feeder = _ways(path, "feeder", "feeder", ["feeder", "run", "-t", path])
    assert feeder["hand"] == feeder["up"] == feeder["compose"]
    assert (feeder["hand"].rate, feeder["hand"].levels, feeder["hand"].epochs) == (7.0, "1", 0)
    assert configuration(["feeder", "run", "-t", path, "--rate", "2"]).rate == 2.0


def test_a_policy_the_file_lacks_needs_its_model():
    with pytest.raises(ValueError, match="policy 'other' is not declared in .*--model PATH"):
        configuration(["trainer", "run", "-t", str(DEFAULT), "--policy", "other"])
    opts = configuration(["trainer", "run", "-t", str(DEFAULT), "--policy", "other",
                          "--model", "m"])
    assert (opts.spec.model, opts.spec.trainer.lr, opts.spec.max_staleness) == ("m", 1e-5, 4)


def test_the_flags_are_the_typed_settings():
    """Each override flag takes its setting's type, choices, description and default from
    the typed model: nothing about a setting is written twice."""
    from astraflow.cli.main import build_parser
    from astraflow.config.overrides import TRAINER_FLAGS
    from astraflow.config.sections import ParallelSpec
    from astraflow.config.topology import TrainerSpec

    parser = build_parser()
    trainer = parser._subparsers._group_actions[0].choices["trainer"]
    run = trainer._subparsers._group_actions[0].choices["run"]
    actions = {a.dest: a for a in run._actions}
    assert {f.field for f in TRAINER_FLAGS if f.model is TrainerSpec} == set(
        TrainerSpec.model_fields) - {"parallel"}  # a section: its fields are flags
    assert {f.field for f in TRAINER_FLAGS if f.model is ParallelSpec} == set(
        ParallelSpec.model_fields)
    for flag in TRAINER_FLAGS:
        action = actions[flag.dest]
        assert action.default is None, flag.name  # not given: the file's
        assert flag.description.replace("%", "%%") in action.help, flag.name
    assert actions["dtype"].choices == ["fp32", "bf16", "fp16"]
    assert "else 1e-05" in actions["lr"].help
    args = parser.parse_args(["trainer", "run", "-t", "f", "--policy", "p", "--lr", "2e-5"])
    assert args.lr == 2e-5 and args.max_staleness is None
    args = parser.parse_args(["trainer", "run", "-t", "f", "--policy", "p", "--processes", "2"])
    assert args.processes == 2
