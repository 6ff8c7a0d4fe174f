"""`astraflow up`'s decisions that need no broker: when, and how, a tiny model is
(re)written -- `model init` for a solver, `model init-role` for a verifier/selector, both
judged by the recipe they leave in INIT_RECIPE."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from astraflow.cli.components import configuration
from astraflow.cli.main import build_parser
from astraflow.config.topology import PolicySpec, load_topology, parse_topology
from astraflow.launch import provision
from astraflow.launch import up as launcher
from astraflow.launch.provision import (
    MissingModel,
    init_options,
    model_init_command,
    tiny_model_outdated,
    write_policy_model,
)
from astraflow.models.recipe import INIT_RECIPE, OLD_ROLE_RECIPE, RoleInit, init_recipe, recipe

REPO = Path(__file__).resolve().parents[3]


def _outdated(spec: PolicySpec) -> str:
    """Why `up` would rewrite ``spec``'s tiny model."""
    return tiny_model_outdated(spec)


def _write_models(topo) -> bool:
    """What `up` does first: write each policy's missing or outdated tiny model."""
    return launcher.write_tiny_models(topo, rewrite_outdated=True)


def _cli_recipe(argv: list[str]) -> dict:
    """The recipe the `astraflow` command line ``argv`` (`model init` or `init-role`)
    leaves."""
    return init_recipe(build_parser().parse_args(argv))


@pytest.mark.parametrize("path", sorted(p.relative_to(REPO).as_posix()
                                        for p in (REPO / "topology").rglob("*.yaml")))
def test_up_writes_the_model_the_command_of_the_same_options_writes(path):
    """`up` writes tiny models in its own process: the recipe it records (and compares)
    is, key for key, the one `astraflow model init` / `init-role` records when run with
    `model_init_command`'s flags, for every policy of every shipped topology."""
    topo = load_topology(REPO / path)
    for policy, spec in topo.policies.items():
        if spec.import_from:
            continue
        cmd = model_init_command(spec)
        assert recipe(init_options(spec)) == _cli_recipe(cmd), (path, policy)
        args = build_parser().parse_args(cmd)
        assert type(init_options(spec)).command == args.model_command


def _warm(spec: PolicySpec, **update) -> PolicySpec:
    """``spec`` with ``update`` applied to its warm start."""
    return spec.model_copy(update={"warm_start": spec.warm_start.model_copy(update=update)})


def _written_by(spec: PolicySpec) -> None:
    """Leave the recipe `model init` would leave for ``spec`` in its model directory."""
    args = build_parser().parse_args(model_init_command(spec))
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    (Path(args.dir) / INIT_RECIPE).write_text(json.dumps(init_recipe(args)))


def test_the_recipe_of_a_default_option_set_is_the_commands():
    assert recipe(RoleInit(role="selector")) == _cli_recipe(
        ["model", "init-role", "/m", "--role", "selector"])
    assert recipe(init_options(PolicySpec(model="/m"))) == _cli_recipe(
        ["model", "init", "/m", "--warm-start-steps", "0", "--carry-slip", "0.0"])


def test_tiny_model_is_rewritten_only_when_its_recipe_changes(tmp_path):
    spec = PolicySpec(model=str(tmp_path / "m"), warm_start={"steps": 2000, "slip": 0.7})
    assert _outdated(spec) == ""  # no recipe: not ours, or not written yet
    _written_by(spec)
    assert _outdated(spec) == ""
    # the recipe records what shapes the model, not where it lives
    recipe = json.loads((tmp_path / "m" / INIT_RECIPE).read_text())
    assert recipe["warm_start_steps"] == 2000 and recipe["carry_slip"] == 0.7
    assert "dir" not in recipe

    for changed in (
        _warm(spec, slip=0.5),
        _warm(spec, steps=100),
        _warm(spec, levels="1"),
    ):
        why = _outdated(changed)
        assert why.startswith("the topology changed how it is made"), why
    assert "carry_slip 0.7 -> 0.5" in _outdated(_warm(spec, slip=0.5))
    # a model the user brought is never rewritten
    assert _outdated(
        _warm(spec, slip=0.5).model_copy(update={"init_tiny": False})) == ""


def test_an_option_added_after_the_model_was_written_counts_as_its_default(tmp_path):
    spec = PolicySpec(model=str(tmp_path / "m"), warm_start={"steps": 2000, "slip": 0.7})
    _written_by(spec)
    recipe_file = tmp_path / "m" / INIT_RECIPE
    recipe = json.loads(recipe_file.read_text())
    for key in ("retry_share", "retry_slip"):  # options a newer `model init` has
        del recipe[key]
    recipe_file.write_text(json.dumps(recipe))
    assert _outdated(spec) == ""
    why = _outdated(_warm(spec, retry_share=0.25))
    assert "retry_share 0.0 -> 0.25" in why, why


def test_a_verifier_is_written_by_init_role_with_the_topologys_slip(tmp_path):
    spec = PolicySpec(model=str(tmp_path / "v"), role="verifier",
                      warm_start={"steps": 300, "levels": "1"})
    cmd = model_init_command(spec)
    assert cmd[:5] == ["model", "init-role", str(tmp_path / "v"), "--role", "verifier"]
    args = build_parser().parse_args(cmd)
    assert args.func.__name__ == "cmd_model_init_role"
    # init-role's own default slip is 0.5; the topology's default, 0, is what counts
    assert args.carry_slip == 0.0 and args.warm_start_steps == 300 and args.levels == "1"
    recipe = init_recipe(args)
    assert recipe["role"] == "verifier" and recipe["model_command"] == "init-role"
    assert {"label_noise", "levels", "seed", "carry_slip", "train_size"} <= set(recipe)
    assert "dir" not in recipe
    solver = model_init_command(spec.model_copy(update={"role": "solver"}))
    assert solver[:3] == ["model", "init", str(tmp_path / "v")] and "--role" not in solver


def test_a_role_model_is_rewritten_only_when_its_recipe_changes(tmp_path):
    spec = PolicySpec(model=str(tmp_path / "v"), role="verifier",
                      warm_start={"steps": 300, "levels": "1"})
    assert _outdated(spec) == ""
    _written_by(spec)
    assert _outdated(spec) == ""
    for changed, change in (
        (spec.model_copy(update={"role": "selector"}), "role verifier -> selector"),
        (_warm(spec, steps=400), "warm_start_steps 300 -> 400"),
        (_warm(spec, slip=0.5), "carry_slip 0.0 -> 0.5"),
        (_warm(spec, levels="1,2"), "levels 1 -> 1,2"),
        (_warm(spec, label_noise=0.1), "label_noise 0.02 -> 0.1"),
        (_warm(spec, seed=3), "seed 0 -> 3"),
        (spec.model_copy(update={"role": "solver"}), "model_command init-role -> init"),
    ):
        why = _outdated(changed)
        assert why.startswith("the topology changed how it is made") and change in why, why
    # a solver's model turned into a verifier's
    solver = spec.model_copy(update={"role": "solver", "model": str(tmp_path / "s")})
    _written_by(solver)
    assert "model_command init -> init-role" in _outdated(
        solver.model_copy(update={"role": "verifier"}))
    # a role model with only the recipe file of an older astraflow is rewritten once
    (tmp_path / "v" / INIT_RECIPE).rename(tmp_path / "v" / OLD_ROLE_RECIPE)
    assert "older `model init-role`" in _outdated(spec)
    assert _outdated(spec.model_copy(update={"init_tiny": False})) == ""
    (tmp_path / "v" / OLD_ROLE_RECIPE).unlink()
    assert _outdated(spec) == ""  # no recipe at all: not ours, left alone


def _solver_verifier(tmp_path) -> dict:
    data = yaml.safe_load((REPO / "topology" / "solver-verifier.yaml").read_text())
    for name, spec in data["policies"].items():
        spec["model"] = str(tmp_path / name)
    return data


def test_up_writes_every_policys_model_the_same_way(tmp_path, monkeypatch):
    """One mechanism for all policies: missing or outdated models are written with the
    options of `model_init_command`, and only those."""
    ran: list[tuple[str, object]] = []

    def fake_write(dir, opts):  # what `model init` / `init-role` leave behind
        ran.append((dir, opts))
        Path(dir).mkdir(parents=True, exist_ok=True)
        (Path(dir) / "config.json").write_text("{}")
        (Path(dir) / INIT_RECIPE).write_text(json.dumps(recipe(opts)))

    monkeypatch.setattr(provision, "write_tiny_model", fake_write)
    data = _solver_verifier(tmp_path)
    topo = parse_topology(data)
    assert _write_models(topo) is True
    assert [type(o).command for _, o in ran] == ["init", "init-role"]
    assert ran[1][1].role == "verifier" and ran[1][1].carry_slip == 0.0
    assert [d for d, _ in ran] == [str(tmp_path / "solver"), str(tmp_path / "verifier")]
    ran.clear()
    assert _write_models(topo) is False and ran == []  # nothing changed

    data["policies"]["verifier"]["warm_start"] = {"steps": 200, "levels": "1"}
    assert _write_models(parse_topology(data)) is True
    verifier = parse_topology(data).policies["verifier"]
    assert ran == [(verifier.model, init_options(verifier))]
    assert recipe(ran[0][1]) == _cli_recipe(model_init_command(verifier))
    ran.clear()

    # a model without a recipe is never rewritten; a missing one up may not write is an error
    (tmp_path / "solver" / INIT_RECIPE).unlink()
    data["policies"]["solver"]["warm_start"]["steps"] = 10
    assert _write_models(parse_topology(data)) is False and ran == []
    data["policies"]["verifier"].update(model=str(tmp_path / "elsewhere"), init_tiny=False)
    with pytest.raises(MissingModel, match="verifier"):
        _write_models(parse_topology(data))
    assert ran == []


def test_an_imported_policy_never_starts_from_a_tiny_model_left_at_its_path(tmp_path,
                                                                          monkeypatch):
    ran: list[tuple] = []
    monkeypatch.setattr(provision, "import_source",
                        lambda source, out, gguf=None: ran.append((source, out, gguf)))
    spec = parse_topology({"run": "r", "policies": {"solver": {
        "model": str(tmp_path / "solver"), "init_tiny": False,
        "import_from": "smollm2"}}}).policies["solver"]
    assert write_policy_model("solver", spec) is True  # nothing there: imported
    assert ran == [("smollm2", str(tmp_path / "solver"), None)]
    (tmp_path / "solver").mkdir()
    (tmp_path / "solver" / "config.json").write_text("{}")
    assert write_policy_model("solver", spec) is False  # a model there: kept
    (tmp_path / "solver" / INIT_RECIPE).write_text("{}")  # ... unless it is a tiny one
    with pytest.raises(MissingModel, match="solver: .* holds a tiny model .* smollm2"):
        write_policy_model("solver", spec)
    assert len(ran) == 1


def test_a_failed_import_or_init_is_a_missing_model_with_the_commands_line(tmp_path, capsys):
    """Run in `up`'s process, a refused import or init reports as the command did (one
    `astraflow: ...` line) and `up` names the policy (MissingModel)."""
    spec = parse_topology({"run": "r", "policies": {"solver": {
        "model": str(tmp_path / "solver"), "init_tiny": False,
        "import_from": str(tmp_path / "absent.gguf")}}}).policies["solver"]
    with pytest.raises(MissingModel, match="solver: importing .*absent.gguf failed"):
        write_policy_model("solver", spec)
    assert capsys.readouterr().err.startswith("astraflow: ")
    other = tmp_path / "notes"
    other.mkdir()
    (other / "todo.txt").write_text("keep me")  # not a model: never replaced
    with pytest.raises(MissingModel, match="solver: writing its tiny model .* failed"):
        write_policy_model("solver", PolicySpec(model=str(other)))
    assert "holds no model" in capsys.readouterr().err
    assert (other / "todo.txt").read_text() == "keep me"


# --- the plan: each component with the file and its identity; the file its settings ------

def _run(cmd: list[str], topo):
    """The configuration the planned command ``cmd`` runs with (``topo``: its file)."""
    assert cmd[:3] == [launcher.sys.executable, "-m", "astraflow.cli.main"]
    return configuration(cmd[3:], topo)


def test_up_starts_each_component_with_the_file_and_its_identity_only():
    """topology/default.yaml's plan: the file, the component (policy, pool and instance,
    where its model is) and nothing else; the settings come from the file."""
    from astraflow.config.topology import load_topology

    path = "topology/default.yaml"
    plan = {n: c[3:] for n, c in launcher.plan_processes(
        load_topology(REPO / path), path).items()}
    assert plan == {
        "trainer-actor": ["trainer", "run", "--topology", path, "--policy", "actor", "--model",
                          "runs/default/model"],
        **{f"processor-{n}": ["processor", "run", n, "--topology", path, "--instance", "up"]
           for n in ("admission", "staleness", "router", "batcher")},
        "raas-local-0": ["raas", "run", "--topology", path, "--pool", "local", "--instance",
                         "local-0", "--policy-model", "actor=runs/default/model"],
        "feeder": ["feeder", "run", "--topology", path],
        "eval-actor": ["eval", "run", "--topology", path, "--policy", "actor", "--model",
                       "runs/default/model"],
    }


def test_the_default_plan_runs_the_configuration_it_ran_before_the_typed_topology():
    """The settings topology/default.yaml's components run with are those `up` passed as
    flags when the file carried argv lists (trainer_args, raas_args, feeder.args)."""
    from astraflow.config.topology import load_topology

    path = "topology/default.yaml"
    topo = load_topology(REPO / path)
    plan = launcher.plan_processes(topo, path)
    trainer = _run(plan["trainer-actor"], topo).spec
    assert (trainer.model, trainer.trainer.lr, trainer.trainer.anchor_interval,
            trainer.temperature, trainer.top_p,
            trainer.max_staleness) == ("runs/default/model", 1e-4, 10, 1.0, 1.0, 4)
    node = _run(plan["raas-local-0"], topo)
    assert (node.options.pool, node.options.instance, node.options.n_samples) == (
        "local", "local-0", 8)
    assert node.options.workflow_options == {
        "single_turn": {"temperature": 1.0, "max_new_tokens": 8}}
    assert node.settings.models == {"actor": "runs/default/model"}
    feeder = _run(plan["feeder"], topo)
    assert (feeder.rate, feeder.epochs, feeder.levels) == (60.0, 0, "1,2")
    ev = _run(plan["eval-actor"], topo)
    assert (ev.every_versions, ev.size, ev.max_new_tokens) == (5, 200, 8)


def test_max_staleness_is_set_once_per_policy():
    from astraflow.config.topology import load_topology

    topo = load_topology(REPO / "topology" / "solver-verifier.yaml")
    plan = launcher.plan_processes(topo, "t.yaml")
    for policy in ("solver", "verifier"):
        assert _run(plan[f"trainer-{policy}"], topo).spec.max_staleness == 16
        assert topo.processors[f"batcher-{policy}"].options["max_staleness"] == 16
    assert topo.processors["staleness"].options["max_staleness"] == 16
    data = _solver_verifier_data()
    data["policies"]["solver"]["max_staleness"] = 3
    data["policies"]["verifier"]["max_staleness"] = 3
    topo = parse_topology(data)
    assert _run(launcher.plan_processes(topo, "t")["trainer-solver"],
                topo).spec.max_staleness == 3
    assert topo.processors["batcher-verifier"].options["max_staleness"] == 3
    del data["policies"]["solver"]["max_staleness"]  # the one default
    with pytest.raises(Exception, match=r"processors.staleness: .*solver 4, verifier 3"):
        parse_topology(data)


def _solver_verifier_data() -> dict:
    return yaml.safe_load((REPO / "topology" / "solver-verifier.yaml").read_text())


def test_every_typed_trainer_field_reaches_the_trainer():
    """Each TrainerSpec field set in the file is what the trainer `up` starts runs with
    (its ``ServiceOptions`` hold the policy's section itself); the fields the file leaves
    unset keep their one default."""
    from astraflow.config.sections import ParallelSpec
    from astraflow.config.topology import TrainerSpec

    values = dict(lr=0.5, lr_warmup_steps=4, lr_decay="linear", lr_final=0.1,
                  lr_decay_steps=20, anchor_interval=7, state_interval=3, state_max_lag=2,
                  keep_optimizer=5, keep_versions=0, seed=9, weight_decay=0.1,
                  adam_beta1=0.8, adam_beta2=0.99, adam_eps=1e-6, max_grad_norm=0.5,
                  adam_impl="for-loop",
                  clip_low=0.1, clip_high=0.3, tis_cap=3.0, micro_batch_tokens=512,
                  autocast="bf16", gradient_checkpointing=True, forward_on="master",
                  forward_dtype="best",
                  dtype="bf16", publish_dtype="same", device="cuda", threads=2,
                  deterministic=True, max_steps=11, blob_store="file:///b", state_dir="/s",
                  loss="decoupled_ppo", tis_mask=True, backend="megatron", minibatches=4,
                  std_normalize=False, group_unit="sequence", share_prompt=False,
                  publish_overlap="on",
                  checkpoint_dir="/c", parallel=ParallelSpec(port=29600))
    assert set(values) | {"micro_batch_size", "m2_threshold"} == set(TrainerSpec.model_fields)
    data = _solver_verifier_data()
    data["policies"]["solver"]["trainer"] = dict(values)
    topo = parse_topology(data)
    plan = launcher.plan_processes(topo, "t")
    held = _run(plan["trainer-solver"], topo).spec.trainer
    assert {k: getattr(held, k) for k in values} == values
    # the verifier sets only lr and anchor_interval: the rest is the one default
    verifier = _run(plan["trainer-verifier"], topo).spec.trainer
    default = TrainerSpec()
    assert {k for k in TrainerSpec.model_fields
            if getattr(verifier, k) != getattr(default, k)} == {"lr"}
    # m2po reads m2_threshold (the other losses refuse it: see test_topology)
    data["policies"]["solver"]["trainer"] = {"loss": "m2po", "m2_threshold": 0.01}
    topo = parse_topology(data)
    opts = _run(launcher.plan_processes(topo, "t")["trainer-solver"], topo)
    assert (opts.spec.trainer.loss, opts.spec.trainer.m2_threshold) == ("m2po", 0.01)


def test_warm_start_feeder_pool_and_eval_fields_reach_their_components():
    data = _solver_verifier_data()
    data["policies"]["solver"]["warm_start"].update(levels=[1, 2, 3], lr=0.01, batch_size=16,
                                                    train_size=100, eval_size=10)
    data["feeder"].update(seed=3, count=50, size=10, split="eval", from_start=True,
                          dataset={"path": "d.jsonl", "prompt_field": "q"})
    data["pools"]["local"].update(device="cuda", prefix_cache_mib=0, session_timeout_ms=9000,
                                  follow_weights=False, engine_options={"dtype": "float16"},
                                  speed=0.3)
    data["eval"] = {"levels": "1", "size": 30}
    topo = parse_topology(data)
    init = build_parser().parse_args(model_init_command(topo.policies["solver"]))
    assert (init.levels, init.lr, init.batch_size, init.train_size, init.eval_size,
            init.warm_start_until, init.seed, init.retry_share) == (
        "1,2,3", 0.01, 16, 100, 10, 0.9, 1, 0.25)
    verifier = build_parser().parse_args(model_init_command(topo.policies["verifier"]))
    assert verifier.blind and verifier.label_noise == 0.15 and verifier.carry_slip == 0.0
    plan = launcher.plan_processes(topo, "t")
    feeder = _run(plan["feeder"], topo)
    assert (feeder.seed, feeder.count, feeder.size, feeder.split, feeder.from_start,
            feeder.dataset.path, feeder.dataset.prompt_field, feeder.policies,
            feeder.workflow) == (3, 50, 10, "eval", True, "d.jsonl", "q",
                                 ["solver", "verifier"], "solve_verify")
    raas = _run(plan["raas-local-0"], topo)
    assert (raas.settings.spec.device, raas.settings.spec.prefix_cache_mib,
            raas.options.session_timeout_ms, raas.options.follow_weights,
            raas.settings.engine_options, raas.options.tasks_per_transaction,
            raas.options.speed) == ("cuda", 0.0, 9000, False, {"dtype": "float16"}, 8, 0.3)
    assert raas.options.workflow_options["solve_verify"] == {
        "temperature": 1.0, "max_new_tokens": 8, "blind": True, "verdicts_per_prompt": 4}
    solver, verifier = _run(plan["eval-solver"], topo), _run(plan["eval-verifier"], topo)
    assert (solver.every_versions, solver.size, solver.levels, solver.blind) == (
        5, 30, "1", False)
    assert (verifier.every_versions, verifier.size, verifier.blind, verifier.role) == (
        20, 30, True, "verifier")


def test_pool_engine_options_pass_on_only_what_the_file_sets():
    data = _solver_verifier_data()
    data["pools"]["local"].update(engine="vllm", engine_options={"cpus": 1, "kv_cache_gib": 1})
    topo = parse_topology(data)
    raas = _run(launcher.plan_processes(topo, "t")["raas-local-0"], topo).settings
    assert raas.engine == "vllm" and raas.engine_options == {"cpus": 1, "kv_cache_gib": 1}


def test_up_ends_with_a_few_lines_and_where_the_summary_is(tmp_path):
    from astraflow.launch.progress import closing_lines

    summary = {"run": "r-2", "seconds": 61.2, "staleness_dropped": 3.0, "restarts": {},
               "policies": {"actor": {"version": 12, "train_reward": 0.5, "eval_accuracy": 0.25,
                                      "eval_version": 10}},
               "plot": str(tmp_path / "summary.png")}
    text = closing_lines(summary, tmp_path)
    assert len(text.splitlines()) == 4
    assert "actor: version 12, train reward 0.500, held-out accuracy 0.250 at v10" in text
    assert str(tmp_path / "summary.json") in text and "restarts: none" in text


def test_stale_drops_are_counted_per_stage_in_the_line_and_the_closing_lines(tmp_path):
    from astraflow.launch.progress import Progress, closing_lines
    from astraflow.wire.records import ComponentStatus

    progress = Progress()
    for cid, kind, metrics in (
            ("staleness/a", "processor", {"staleness/dropped": 4.0}),
            ("staleness/b", "processor", {"staleness/dropped": 1.0}),
            ("batcher/a", "processor", {"batcher/dropped_stale": 2.0}),
            ("staleness/a", "processor", {"staleness/dropped": 6.0}),  # newer: replaces 4
            ("trainer.actor/0", "trainer", {"trainer/stale_dropped_total": 3.0,
                                            "trainer/stale_dropped_groups": 1.0})):
        progress.fold(ComponentStatus(component_id=cid, kind=kind, host="h", policy="actor",
                                      metrics=metrics))
    assert progress.drops_by_stage() == {"filter": 7.0, "batcher": 2.0, "trainer": 3.0}
    assert progress.stale_dropped == 12.0
    assert "stale drops filter 7 batcher 2 trainer 3" in progress.line(0)
    summary = {"run": "r", "seconds": 1.0, "staleness_dropped": 12.0, "restarts": {},
               "staleness_dropped_by_stage": progress.drops_by_stage(), "policies": {}}
    assert "dropped: 12 (filter 7, batcher 2, trainer 3)" in closing_lines(summary, tmp_path)


def test_a_runs_plots_are_drawn_from_its_summary(tmp_path):
    import json

    from astraflow.cli.main import main

    series = [{"t": 5.0 * i, "version/actor": float(i), "reward/actor": 0.1 * i,
               "staleness_mean/actor": 1.5, "stale_dropped": float(i), "lag/tasks": 30.0 - i}
              for i in range(6)]
    summary = {"run": "r", "versions": {"actor": 5}, "series": series,
               "eval": {"actor": [{"t": 10.0, "version": 2, "accuracy": 0.3}]}}
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "summary.json").write_text(json.dumps(summary))
    assert main(["run", "plot", "r", "--runs-dir", str(tmp_path)]) == 0
    for name in ("summary.png", "plots/versions.png", "plots/staleness.png", "plots/lag.png"):
        assert (tmp_path / "r" / name).stat().st_size > 1000
    assert main(["plot", "missing", "--runs-dir", str(tmp_path)]) == 2


class _Table:
    def __init__(self):
        self.polled: list[float] = []

    def poll(self, timeout: float) -> None:
        self.polled.append(timeout)

    def close(self) -> None:
        pass


def _opener(errors: list):
    """Opens a ``_Table`` once ``errors`` is used up, raising each of them first."""
    from confluent_kafka import KafkaException

    def open_table(_timeout: float) -> _Table:
        if errors:
            raise KafkaException(errors.pop(0))
        return _Table()

    return open_table


def test_up_opens_its_progress_once_kafka_answers_and_supervises_meanwhile(capsys):
    """A broker that does not answer while the components start (it timed out after 10 s
    on a loaded machine, and `up` ended the run) is waited for: each poll tries once more."""
    from confluent_kafka import KafkaError

    timed_out = KafkaError(KafkaError._TIMED_OUT, "Failed to get watermark offsets")
    table = launcher.OnceAnswering(_opener([timed_out, timed_out]), "progress", limit_s=60)
    table.poll(0.2)
    table.poll(0.2)
    assert table.table is None
    table.poll(0.2)  # opened: the next poll reads it
    table.poll(0.5)
    assert table.table.polled == [0.5]
    out = capsys.readouterr().out
    assert out.count("Kafka not answering yet: progress follows") == 1, out
    assert "Kafka answers after" in out


def test_up_gives_up_past_the_outage_limit_and_at_once_on_other_errors(monkeypatch):
    from confluent_kafka import KafkaError, KafkaException

    from astraflow.kafka.outage import BrokerUnreachable

    timed_out = KafkaError(KafkaError._TIMED_OUT, "timed out")
    table = launcher.OnceAnswering(_opener([timed_out] * 3), "progress", limit_s=5)
    table.poll(0)
    clock = launcher.time.monotonic() + 6
    monkeypatch.setattr(launcher.time, "monotonic", lambda: clock)
    with pytest.raises(BrokerUnreachable, match=r"kafka.outage_limit_s=5\b"):
        table.poll(0)
    missing = KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART, "topic run.status does not exist")
    with pytest.raises(KafkaException, match="does not exist"):
        launcher.OnceAnswering(_opener([missing]), "progress", limit_s=60).poll(0)


@pytest.mark.slow  # two tiny models written and warm-started
def test_up_writes_a_tiny_model_in_its_process_as_the_command_writes_it(tmp_path, capsys):
    """The model `up` writes in its own process is the one `astraflow model init` writes
    with `model_init_command`'s flags: the same files, recipe and weights, and the same
    lines printed (timings aside)."""
    import re

    from safetensors.torch import load_file

    from astraflow.cli.main import main

    def run(spec: PolicySpec, write) -> list[str]:
        write(spec)
        out = capsys.readouterr().out
        out = out.replace(spec.model, "DIR")
        return [re.sub(r"\d+\.\d+s", "Ts", line) for line in out.splitlines()
                if not line.startswith("writing the tiny")]

    ws = {"steps": 2, "slip": 0.3, "levels": "1", "train_size": 64, "eval_size": 4,
          "batch_size": 8}
    ours = PolicySpec(model=str(tmp_path / "up"), warm_start=ws)
    theirs = ours.model_copy(update={"model": str(tmp_path / "cli")})
    printed = run(ours, lambda s: write_policy_model("solver", s))
    assert run(theirs, lambda s: main(model_init_command(s))) == printed
    assert any(line.startswith("warm start: 2 steps") for line in printed), printed
    up, cli = Path(ours.model), Path(theirs.model)
    assert sorted(p.name for p in up.iterdir()) == sorted(p.name for p in cli.iterdir())
    assert (up / INIT_RECIPE).read_text() == (cli / INIT_RECIPE).read_text()
    a, b = load_file(up / "model.safetensors"), load_file(cli / "model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    assert tiny_model_outdated(ours) == "" and tiny_model_outdated(theirs) == ""
