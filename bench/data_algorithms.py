"""Data algorithms on the embedded default: no filter, dynamic sampling, GRESO, replay.

Builds one variant of a base topology (default ``topology/default.yaml``) per data
algorithm, runs each with ``astraflow up VARIANT.yaml --fresh --versions N`` one after
another from the same warm-started model and seed, then reads the run's topics and reports,
at the version budget ``N`` (the moment the trainer published version N):

* rollouts needed: sequences on ``trajectories.raw`` up to the newest group trained by
  version N (the pool runs ahead of the trainer, so rollouts generated until version N is
  published are reported too), and groups likewise,
* groups trained (fresh ones, and replayed ones separately) in versions 1..N,
* wall seconds from version 0 to version N,
* held-out accuracy of version N (rebuilt from the weights topic and scored like the
  evaluator does), beside that of the shared starting model.

Variants (``--variants``, comma-separated):

* ``baseline``: the base topology unchanged (no filter besides the staleness bound);
* ``dynamic_sampling``: a ``dynamic_sampling`` processor between ``trajectories.raw`` and
  the staleness filter, through ``trajectories.sampled``;
* ``greso``: ``greso`` prompt selection in place of the pass-through ``tasks.source ->
  tasks`` processor (or ahead of whatever reads ``tasks.source``);
* ``replay``: every batcher serves ``--replay-ratio`` (0.25) replayed groups per batch.

Usage (from anywhere; needs Java and Maven for the embedded broker, like ``astraflow up``):

    python bench/data_algorithms.py [--versions 150] [--duration 1800]
        [--variants baseline,dynamic_sampling,greso,replay] [--seed 0] [--keep]
        [--out bench/results/data_algorithms.json]

Every variant's processes run with the same ``--seed`` (feeder order, trainer, GRESO and
replay draws); RaaS sampling and the interleaving of asynchronous processes are not seeded,
so two runs of one variant differ a little. The topologies, logs and ``summary.json`` of
each run stay in ``<runs-dir>/bench-da-<variant>/``; without ``--keep`` the model copies,
trainer state and the variants' topics are deleted after each run.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import run_meta  # noqa: E402  (bench/report.py: command, commit, machine, date)

VARIANTS = ("baseline", "dynamic_sampling", "greso", "replay")
RUN_PREFIX = "bench-da"


# --- variant topologies (plain dicts, no Kafka) -----------------------------------------


def _processors_reading(doc: dict[str, Any], topic: str) -> list[str]:
    return [n for n, p in doc.get("processors", {}).items() if topic in p.get("inputs", [])]


def _insert_before(doc: dict[str, Any], topic: str, name: str, spec: dict[str, Any],
                   via: str) -> None:
    """Put processor ``name`` (reading ``topic``) ahead of every processor that read
    ``topic``; they now read the new intermediate topic ``via``."""
    for reader in _processors_reading(doc, topic):
        inputs = doc["processors"][reader]["inputs"]
        doc["processors"][reader]["inputs"] = [via if t == topic else t for t in inputs]
    base = doc.get("topics", {}).get(topic) or {}
    doc.setdefault("topics", {})[via] = dict(base)
    doc["processors"] = {name: {**spec, "inputs": [topic], "outputs": [via]},
                         **doc.get("processors", {})}


def build_variant(base: dict[str, Any], variant: str, *, model: str, state_dir: str,
                  seed: int = 0, replay_ratio: float = 0.25,
                  replay_selection: str = "max_variance", replay_capacity: int = 64,
                  greso_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The base topology document changed into ``variant`` (a new dict).

    Every variant gets its own run id (``bench-da-<variant>``), every policy the model
    directory ``model`` (already written: ``init_tiny`` off, so ``up`` never rewrites it)
    and the trainer a private ``--state-dir``; feeder and trainer get ``--seed``.
    """
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r} (known: {', '.join(VARIANTS)})")
    doc = copy.deepcopy(base)
    if len(doc.get("policies") or {}) != 1:
        raise ValueError("the bench needs a base topology with exactly one policy")
    doc["run"] = f"{RUN_PREFIX}-{variant.replace('_', '-')}"
    for policy, spec in doc["policies"].items():
        spec["model"] = model
        spec["init_tiny"] = False
        # keep_versions 0: the bench rebuilds version N after the run, which has gone on
        # past N by then; pruning to the last 20 versions could have removed it
        spec["trainer"] = {**spec.get("trainer", {}), "seed": seed, "keep_versions": 0,
                           "state_dir": f"{state_dir}/{policy}"}
    if doc.get("feeder") is not None:
        doc["feeder"]["seed"] = seed
    procs = doc.setdefault("processors", {})
    if variant == "dynamic_sampling":
        _insert_before(doc, "trajectories.raw", "dynamic-sampling",
                       {"kind": "dynamic_sampling"}, via="trajectories.sampled")
    elif variant == "greso":
        options = {"seed": seed, **(greso_options or {})}
        forward = [n for n, p in procs.items() if p.get("kind") == "passthrough"
                   and p.get("inputs") == ["tasks.source"] and p.get("outputs") == ["tasks"]]
        if forward:  # GRESO takes the pass-through's place (and its position)
            doc["processors"] = {
                ("greso" if n == forward[0] else n):
                    ({"kind": "greso", "inputs": ["tasks.source"], "outputs": ["tasks"],
                      "options": options} if n == forward[0] else p)
                for n, p in procs.items()}
        else:
            _insert_before(doc, "tasks.source", "greso",
                           {"kind": "greso", "options": options}, via="tasks.selected")
    elif variant == "replay":
        batchers = [p for p in procs.values() if p.get("kind") == "batcher"]
        if not batchers:
            raise ValueError("the base topology has no batcher to replay from")
        for p in batchers:
            p["options"] = {**p.get("options", {}), "replay_ratio": replay_ratio,
                            "replay_capacity": replay_capacity,
                            "replay_selection": replay_selection, "replay_seed": seed}
    return doc


# --- the shared starting model -------------------------------------------------------------


def warm_start_of(base: dict[str, Any]) -> tuple[int, float]:
    """(warm_start.steps, warm_start.slip) of the base topology's first policy."""
    spec = next(iter(base.get("policies", {}).values()), {})
    ws = spec.get("warm_start") or {}
    return int(ws.get("steps", 0)), float(ws.get("slip", 0.0))


def ensure_shared_model(base: dict[str, Any], runs_dir: Path, *,
                        steps: int | None, slip: float | None) -> Path:
    """The model every variant starts from: the base policy's own model when ``up`` would
    not write one (``init_tiny: false``), else a tiny model written once with the base
    policy's warm start (cached in ``<runs-dir>/bench-da/`` by recipe)."""
    spec = next(iter(base.get("policies", {}).values()), None)
    if spec is None:
        raise SystemExit("bench: the base topology has no policy")
    if spec.get("init_tiny", True) is False:
        path = Path(spec["model"])
        return path if path.is_absolute() else REPO / path
    from astraflow.config.topology import PolicySpec
    from astraflow.launch.provision import model_init_command, tiny_model_outdated

    d_steps, d_slip = warm_start_of(base)
    steps = d_steps if steps is None else steps
    slip = d_slip if slip is None else slip
    path = runs_dir / RUN_PREFIX / f"model-ws{steps}-slip{slip:g}"
    # the base policy's recipe (all of warm_start), only its steps/slip overridable
    policy = PolicySpec(**{**spec, "model": str(path), "warm_start": {
        **(spec.get("warm_start") or {}), "steps": steps, "slip": slip}})
    if (path / "config.json").is_file() and (path / "astraflow_init.json").is_file() \
            and not tiny_model_outdated(policy):
        print(f"[bench] shared model: {path} (cached)", flush=True)
        return path
    shutil.rmtree(path, ignore_errors=True)
    cmd = [sys.executable, "-m", "astraflow.cli.main", *model_init_command(policy)]
    print(f"[bench] writing the shared model: {' '.join(cmd[2:])}", flush=True)
    t0 = time.time()
    subprocess.run(cmd, check=True, env={"OMP_NUM_THREADS": "1", **os.environ})
    print(f"[bench] shared model written in {time.time() - t0:.0f}s", flush=True)
    return path


# --- running one variant ---------------------------------------------------------------


def run_up(topology_file: Path, args: argparse.Namespace, label: str) -> tuple[int, float]:
    """``astraflow up`` on one variant, its output streamed with a ``[label]`` prefix."""
    from astraflow.launch.runs import start_over

    start_over(yaml.safe_load(topology_file.read_text())["run"])
    cmd = [sys.executable, "-m", "astraflow.cli.main", "up", str(topology_file), "--keep-broker",
           "--versions", str(args.versions), "--duration", str(args.duration),
           "--runs-dir", str(args.runs_dir)]
    print(f"[bench] {label}: {' '.join(cmd[2:])}", flush=True)
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            bufsize=1, start_new_session=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # the summary itself is read from summary.json
            print(f"[{label}] {line.rstrip()}", flush=True)
        rc = proc.wait()
    except KeyboardInterrupt:
        proc.send_signal(signal.SIGINT)  # `up` stops its processes and writes its summary
        proc.wait()
        raise
    return rc, time.time() - t0


def _read(config, topic: str, expect=None) -> list:
    from astraflow.kafka.clients import read_all

    return read_all(config, topic, idle_s=3.0, timeout_s=300.0, expect=expect)


def collect(topo, budget: int) -> dict[str, Any]:
    """Counts at the version budget, read back from the run's retained topics."""
    from astraflow.wire.records import Batch, ComponentStatus, TrajectoryGroup, WeightManifest

    config = topo.kafka.effective()
    policy = next(iter(topo.policies))
    manifests = [r for r in _read(config, topo.full_name(f"weights.{policy}"), WeightManifest)]
    if not manifests:
        return {"error": f"no weights published on {topo.full_name(f'weights.{policy}')}"}
    first_at: dict[int, int] = {}
    batch_of: dict[int, str] = {}
    for r in manifests:
        v = r.record.version
        first_at[v] = min(first_at.get(v, r.timestamp_ms), r.timestamp_ms)
        if "batch_id" in r.record.meta:
            batch_of[v] = r.record.meta["batch_id"]
    last = max(first_at)
    target = min(budget, last)
    t_end = first_at[target]
    t_start = first_at.get(0, min(first_at.values()))
    out: dict[str, Any] = {"version": target, "reached_budget": last >= budget,
                           "last_version": last,
                           "seconds_v0_to_budget": round((t_end - t_start) / 1000, 1),
                           "_manifests": [r.record for r in manifests]}
    raw = [r for r in _read(config, topo.full_name("trajectories.raw"), TrajectoryGroup)]
    upto = [r for r in raw if r.timestamp_ms <= t_end]
    out["groups_generated"] = len(upto)
    out["rollouts_generated"] = sum(len(r.record.sequences) for r in upto)
    out["rollouts_generated_until_stop"] = sum(len(r.record.sequences) for r in raw)
    # groups left after each post-rollout stage (trajectories.<x> topics), at the budget
    for name in topo.topics:
        if name.startswith("trajectories.") and name != "trajectories.raw" or \
                name == "trajectories":
            recs = _read(config, topo.full_name(name))
            out.setdefault("groups_on", {})[name] = sum(r.timestamp_ms <= t_end for r in recs)
    trained = {batch_of[v] for v in range(1, target + 1) if v in batch_of}
    fresh = replayed = batches = 0
    raw_at = {r.record.group_id: r.timestamp_ms for r in raw}
    newest = 0  # when the newest group trained by the budget was rolled out
    for r in _read(config, topo.full_name(f"batches.{policy}"), Batch):
        if r.record.batch_id in trained:
            trained.discard(r.record.batch_id)  # count a batch once
            batches += 1
            replayed += r.record.replayed
            fresh += len(r.record.groups) - r.record.replayed
            for g in r.record.groups:
                gid = g.group_id  # the router appends /<policy> (and /<role>)
                while gid not in raw_at and "/" in gid:
                    gid = gid.rsplit("/", 1)[0]
                newest = max(newest, raw_at.get(gid, 0))
    out.update(batches_trained=batches, groups_trained=fresh, groups_replayed=replayed)
    # Without backpressure the RaaS pool rolls out as fast as it can, whatever the trainer
    # needs; what the trained data cost is every rollout up to the newest trained group
    # (the ones before it were trained, filtered out, or still queued behind it).
    needed = [r for r in raw if r.timestamp_ms <= newest]
    out["groups_needed"] = len(needed)
    out["rollouts_needed"] = sum(len(r.record.sequences) for r in needed)
    # the latest status figures of each processor (as last reported) and every evaluation
    metrics: dict[str, float] = {}
    evals: list[tuple[int, float]] = []
    for r in _read(config, topo.full_name("status"), ComponentStatus):
        st = r.record
        if st.kind == "evaluator" and "eval/accuracy" in st.metrics:
            evals.append((st.weight_versions.get(policy, -1), st.metrics["eval/accuracy"]))
        elif st.kind == "processor":
            for k in ("dynamic_sampling/dropped", "dynamic_sampling/kept", "greso/skipped",
                      "greso/passed", "staleness/dropped", "batcher/replayed"):
                if k in st.metrics:
                    metrics[k] = st.metrics[k]
    out["latest_status"] = metrics
    out["evaluator"] = sorted(set(evals))
    return out


def eval_version(topo, model_dir: Path, manifests: list, version: int | None) -> float:
    """Held-out accuracy of ``version`` (None: the model itself), scored with the settings
    of the topology's evaluator (``eval:``) as ``astraflow eval run`` scores it."""
    import torch

    from astraflow.config.components import eval_settings
    from astraflow.models.evaluation import evaluate
    from astraflow.models.loading import load_policy
    from astraflow.tasks.arithmetic import eval_problems
    from astraflow.weights import WeightFollower

    policy = next(iter(topo.policies))
    # as `eval run --policy POLICY --model MODEL_DIR` on the topology
    ev = eval_settings(topo, policy, {"model": str(model_dir)})
    torch.set_num_threads(1)
    model, tokenizer = load_policy(model_dir)
    if version is not None:
        follower = WeightFollower(policy=policy, kafka_config=topo.kafka.effective())
        follower.observe(manifests)
        follower.update(version)
        model.load_state_dict(follower.state)
    tasks = eval_problems(levels=[int(x) for x in ev.levels.split(",")], n=ev.size)
    return evaluate(model, tokenizer, tasks, max_new_tokens=ev.max_new_tokens)


def delete_topics(topo) -> None:
    from astraflow.kafka.clients import make_admin

    admin = make_admin(topo.kafka.effective())
    existing = admin.list_topics(timeout=10).topics
    names = [t.full_name for t in topo.resolved_topics() if t.full_name in existing]
    for fut in (admin.delete_topics(names, operation_timeout=30).values() if names else []):
        fut.result()


# --- report --------------------------------------------------------------------------


def table(results: dict[str, dict[str, Any]], start_accuracy: float | None) -> str:
    base = results.get("baseline", {}).get("rollouts_needed")
    lines = ["| variant | versions | rollouts needed | × baseline | rollouts generated by vN | "
             "groups needed | groups trained (+ replayed) | wall s (v0 → vN) | "
             "final eval accuracy |", "|" + "---|" * 9]
    for name, r in results.items():
        if "error" in r:
            lines.append(f"| {name} | {r['error']} |" + " |" * 7)
            continue
        ratio = f"{r['rollouts_needed'] / base:.2f}" if base else "–"
        acc = r.get("final_accuracy")
        reached = "" if r["reached_budget"] else " (budget not reached)"
        lines.append(
            f"| {name} | {r['version']}{reached} | {r['rollouts_needed']} | {ratio} | "
            f"{r['rollouts_generated']} | {r['groups_needed']} | "
            f"{r['groups_trained']} (+ {r['groups_replayed']}) | "
            f"{r['seconds_v0_to_budget']:.0f} | {'–' if acc is None else f'{acc:.3f}'} |")
    lines.append("\nrollouts needed: sequences rolled out up to the newest group trained by "
                 "version N; rollouts generated: all rolled out until version N was published "
                 "(the pool runs ahead of the trainer: no backpressure in these runs)")
    if start_accuracy is not None:
        lines.append(f"starting model (every variant): held-out accuracy {start_accuracy:.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--versions", type=int, default=150,
                    help="budget: trainer versions per variant (default 150)")
    ap.add_argument("--duration", type=float, default=1800.0,
                    help="cap in seconds per variant (default 1800)")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma-separated, from {','.join(VARIANTS)}")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep", action="store_true",
                    help="keep model copies, trainer state and topics of every variant")
    ap.add_argument("--topology", default=str(REPO / "topology" / "default.yaml"),
                    help="base topology (default topology/default.yaml)")
    ap.add_argument("--runs-dir", type=Path, default=REPO / "runs")
    ap.add_argument("--replay-ratio", type=float, default=0.25)
    ap.add_argument("--replay-selection", default="max_variance",
                    choices=["uniform", "recent", "high_reward", "max_variance"])
    ap.add_argument("--warm-start-steps", type=int, default=None,
                    help="override the base policy's warm_start.steps for the shared model")
    ap.add_argument("--carry-slip", type=float, default=None,
                    help="override the base policy's warm_start_slip for the shared model")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "data_algorithms.json"),
                    help="JSON results file ('-': print to stdout)")
    args = ap.parse_args(argv)
    meta = run_meta("data_algorithms", ["python", *sys.argv] if argv is None
                    else ["python", "bench/data_algorithms.py", *argv])
    args.runs_dir = args.runs_dir.resolve()
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown} (known: {', '.join(VARIANTS)})")

    from astraflow.config.topology import load_topology

    base = yaml.safe_load(Path(args.topology).read_text())
    load_topology(args.topology)  # the base must be valid as it is
    shared = ensure_shared_model(base, args.runs_dir,
                                 steps=args.warm_start_steps, slip=args.carry_slip)
    topo_dir = args.runs_dir / RUN_PREFIX / "topologies"
    topo_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, Any]] = {}
    start_accuracy: float | None = None
    t_all = time.time()
    try:
        for i, variant in enumerate(variants, 1):
            run_dir = args.runs_dir / f"{RUN_PREFIX}-{variant.replace('_', '-')}"
            shutil.rmtree(run_dir, ignore_errors=True)
            model = run_dir / "model"
            shutil.copytree(shared, model)
            doc = build_variant(base, variant, model=str(model),
                                state_dir=str(run_dir / "trainer-state"), seed=args.seed,
                                replay_ratio=args.replay_ratio,
                                replay_selection=args.replay_selection)
            path = topo_dir / f"{variant}.yaml"
            path.write_text(f"# bench/data_algorithms.py: variant {variant} of "
                            f"{args.topology}\n" + yaml.safe_dump(doc, sort_keys=False))
            topo = load_topology(path)
            print(f"[bench] variant {i}/{len(variants)} {variant}: run {topo.run}, "
                  f"processors {', '.join(topo.processors)}", flush=True)
            rc, wall = run_up(path, args, variant)
            r = collect(topo, args.versions)
            manifests = r.pop("_manifests", [])
            r.update(variant=variant, run=topo.run, up_rc=rc, up_wall_s=round(wall, 1),
                     topology=str(path))
            if "error" not in r:
                print(f"[bench] {variant}: scoring version {r['version']} on the held-out "
                      "split", flush=True)
                r["final_accuracy"] = eval_version(topo, model, manifests, r["version"])
                if start_accuracy is None:
                    start_accuracy = eval_version(topo, model, [], None)
            results[variant] = r
            print(f"[bench] {variant} done: " + json.dumps(
                {k: r.get(k) for k in ("version", "rollouts_needed", "rollouts_generated",
                                       "groups_needed", "groups_trained", "groups_replayed",
                                       "seconds_v0_to_budget", "final_accuracy", "error")}),
                flush=True)
            if not args.keep:
                delete_topics(topo)
                shutil.rmtree(model, ignore_errors=True)
                shutil.rmtree(run_dir / "trainer-state", ignore_errors=True)
    except KeyboardInterrupt:
        print("[bench] interrupted; reporting the variants that finished", flush=True)

    report = {
        "bench": "data_algorithms",
        "base_topology": args.topology,
        "budget_versions": args.versions,
        "duration_cap_s": args.duration,
        "seed": args.seed,
        "shared_model": str(shared),
        "start_accuracy": start_accuracy,
        "total_seconds": round(time.time() - t_all, 1),
        "variants": results,
    }
    print()
    print(table(results, start_accuracy))
    text = json.dumps({"meta": meta, **report}, indent=2)
    if args.out == "-":
        print(text)
    else:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
        print(f"\nresults: {args.out}")
    return 0 if results and all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
