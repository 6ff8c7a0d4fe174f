"""Off-policy objectives against staleness: held-out accuracy by version and wall time.

For every staleness bound (``--staleness``, default ``0,4,16``) and every objective
(``--objectives``, default ``clipped_tis,decoupled_ppo,m2po``; docs/trainer.md,
"Objectives") it runs ``astraflow up`` on a variant of the topology (default
``topology/smollm2.yaml``, the real model) for ``--duration`` seconds, one cell after the
other from the same starting model and seed. A cell's variant differs from the topology
only in its run id (``bench-op-<objective>-s<bound>``), the policy's ``max_staleness``
(the bound) and ``trainer.loss`` (the objective; ``decoupled_ppo_mask``,
``decoupled_ppo_mb4`` and ``decoupled_ppo_mb4_mask``, named only by ``--objectives``, are
``decoupled_ppo`` with ``tis_mask``, with ``minibatches: 4``, and with both, AReaL's
recipe; ``decoupled_ppo_mb4_lr`` is ``minibatches: 4`` at ``lr`` 7.5e-6), with every
version's weights kept and the online evaluator removed (so it takes no CPU from
training).

At each checkpoint time ``t`` (``--checkpoints``, seconds from the launch of ``up``;
default a quarter, half, three quarters and all of ``--duration``) it takes the newest
version the trainer had published by ``t``, rebuilds it from the run's weights topic and
scores it afterwards on the held-out split with the topology's evaluator settings (the
dataset's, as ``bench/learning.py`` scores; synthetic arithmetic as
``bench/data_algorithms.py`` does). One table shows, per cell, accuracy (version) at each
checkpoint, the versions reached, the staleness the trainer saw and the objective's
figures (clipped, truncated, m2po-masked token shares); ``--out`` gets the JSON
(default ``bench/results/offpolicy.json``).

How a bound is enforced: ``max_staleness K`` (``policies.<p>.max_staleness``) reaches the
staleness filter (drops a group whose oldest token is more than K versions behind the
newest published one), the batcher (the same check before it cuts a batch), the trainer
(the last guard: more than K behind the version being trained) and admission (tasks are
admitted only while at most K batches wait for the trainer, and the RaaS queue is kept to
what the pool rolls out in half the bound's time). **K = 0** is strictly on-policy: only
groups whose every token came from the version being trained are trained; admission
then holds tasks while any batch is queued, and rollouts that still come back a version
late (generated while the trainer stepped) are dropped and counted
(``staleness_dropped``). The staleness actually trained (``trainer/staleness_mean``,
``_max``) is reported beside the bound: with a fast trainer a large bound is not reached.

Usage (needs Java and Maven for the embedded broker, like ``astraflow up``; hours with
the defaults: 9 cells):

    python bench/offpolicy.py [--duration 1800] [--objectives clipped_tis,m2po]
        [--staleness 0,4,16] [--topology topology/smollm2.yaml] [--checkpoints 450,900]
        [--m2-threshold 0.04] [--seed 0] [--keep] [--out bench/results/offpolicy.json]

``--topology topology/default.yaml --duration 60`` runs it on the tiny embedded default
(a smoke run; its tiny model is written once and cached, as bench/data_algorithms.py does).
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import data_algorithms as da  # noqa: E402
import learning  # noqa: E402
from report import run_meta  # noqa: E402  (bench/report.py: command, commit, machine, date)

OBJECTIVES = ("clipped_tis", "decoupled_ppo", "m2po")
# objectives that are a loss with settings of its own (named with --objectives only)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "decoupled_ppo_mask": ("decoupled_ppo", {"tis_mask": True}),
    "decoupled_ppo_mb4": ("decoupled_ppo", {"minibatches": 4}),
    "decoupled_ppo_mb4_mask": ("decoupled_ppo", {"minibatches": 4, "tis_mask": True}),
    # a quarter of smollm2.yaml's lr (3e-5) a step: about one step's movement per batch
    "decoupled_ppo_mb4_lr": ("decoupled_ppo", {"minibatches": 4, "lr": 7.5e-6}),
}
KNOWN = (*OBJECTIVES, *VARIANTS)
STALENESS = (0, 4, 16)
RUN_PREFIX = "bench-op"
TRAINER_FIGURES = ("trainer/staleness_mean", "trainer/staleness_max", "trainer/clip_frac",
                   "trainer/truncated_frac", "trainer/m2_masked_frac",
                   "trainer/outside_nucleus_frac", "trainer/reward_mean",
                   "trainer/zero_advantage_frac", "trainer/approx_kl")


# --- cell topologies (plain dicts, no Kafka) -------------------------------------------------
def cell_name(objective: str, staleness: int) -> str:
    """The run id of one cell."""
    return f"{RUN_PREFIX}-{objective.replace('_', '-')}-s{staleness}"


def build_cell(base: dict[str, Any], objective: str, staleness: int, *, model: str,
               state_dir: str, seed: int = 0, m2_threshold: float | None = None,
               ) -> dict[str, Any]:
    """The base topology document as one cell (a new dict): its own run id, the bound as
    the policy's ``max_staleness``, the objective as ``trainer.loss`` (the base's loss
    hyperparameters that the objective does not read dropped), the model ``model``
    (never rewritten: ``init_tiny`` off), every version kept, no online evaluator,
    absolute dataset paths."""
    from astraflow.config.topology import LOSS_HYPERPARAMETERS

    loss, settings = VARIANTS.get(objective, (objective, {}))
    if loss not in LOSS_HYPERPARAMETERS:
        raise ValueError(f"unknown objective {objective!r} (known: {', '.join(KNOWN)})")
    if staleness < 0:
        raise ValueError(f"a staleness bound is >= 0, got {staleness}")
    doc = copy.deepcopy(base)
    if len(doc.get("policies") or {}) != 1:
        raise ValueError("the bench needs a base topology with exactly one policy")
    doc["run"] = cell_name(objective, staleness)
    doc.pop("eval", None)
    for policy, spec in doc["policies"].items():
        spec.update(model=model, init_tiny=False, max_staleness=staleness)
        spec.pop("import_from", None)
        unread = {n for names in LOSS_HYPERPARAMETERS.values() for n in names} - set(
            LOSS_HYPERPARAMETERS[loss])
        trainer = {k: v for k, v in (spec.get("trainer") or {}).items() if k not in unread}
        trainer.update(loss=loss, seed=seed, keep_versions=0,
                       state_dir=f"{state_dir}/{policy}", **settings)
        if loss == "m2po" and m2_threshold is not None:
            trainer["m2_threshold"] = m2_threshold
        spec["trainer"] = trainer
    if doc.get("feeder") is not None:
        doc["feeder"]["seed"] = seed
    _absolute_datasets(doc)
    return doc


def _absolute_datasets(doc: dict[str, Any]) -> None:
    for part in ("feeder", "eval"):
        ds = (doc.get(part) or {}).get("dataset")
        if ds and not Path(ds["path"]).is_absolute():
            ds["path"] = str((REPO / ds["path"]).resolve())


# --- the starting model and the scorer --------------------------------------------------------
def shared_model(base: dict[str, Any], runs_dir: Path) -> Path:
    """The model every cell starts from: the base policy's (imported when missing, as
    bench/learning.py does), else a tiny model written once (bench/data_algorithms.py)."""
    spec = next(iter(base["policies"].values()))
    if spec.get("init_tiny", True) is False:
        path = Path(spec["model"]) if Path(spec["model"]).is_absolute() \
            else REPO / spec["model"]
        learning.ensure_model({"policies": {"p": {**spec, "model": str(path)}}})
        return path
    return da.ensure_shared_model(base, runs_dir, steps=None, slip=None)


def make_score(base: dict[str, Any], model: Path) -> Callable[[list, int | None], float]:
    """``score(manifests, version) -> accuracy`` (version None: the starting model) with
    the base topology's evaluator settings."""
    from astraflow.config.topology import parse_topology

    doc = copy.deepcopy(base)
    spec = next(iter(doc["policies"].values()))
    spec.update(model=str(model), init_tiny=False)
    spec.pop("import_from", None)
    _absolute_datasets(doc)
    topo = parse_topology(doc)
    if topo.eval is None or topo.eval.dataset is None:  # synthetic: as data_algorithms.py
        return lambda manifests, version: da.eval_version(topo, model, manifests, version)
    scorer = learning.make_scorer(doc)  # a held-out file: as bench/learning.py

    def score(manifests: list, version: int | None) -> float:
        return scorer["score"](None if version is None else _rebuilt(topo, manifests, version))
    return score


def _rebuilt(topo: Any, manifests: list, version: int) -> dict:
    """The weights of ``version`` rebuilt from the run's manifests (and its blobs)."""
    from astraflow.weights import WeightFollower

    follower = WeightFollower(policy=next(iter(topo.policies)),
                              kafka_config=topo.kafka.effective())
    follower.observe(manifests)
    follower.update(version)
    return follower.state


# --- one cell ---------------------------------------------------------------------------------
def versions_at(first_at: dict[int, float], checkpoints: list[float]) -> dict[float, int | None]:
    """The newest version published by each checkpoint time (``first_at``: version ->
    seconds from the launch when it was first published)."""
    return {t: max((v for v, s in first_at.items() if s <= t), default=None)
            for t in checkpoints}


def run_cell(path: Path, args: argparse.Namespace, label: str) -> dict[str, Any]:
    """``astraflow up`` on one cell; its versions at the checkpoints and trainer figures."""
    from astraflow.config.topology import load_topology

    topo = load_topology(path)
    t0 = time.time()
    rc, wall = da.run_up(path, args, label)
    records, first_at = learning.manifest_times(topo, t0)
    summary_file = args.runs_dir / topo.run / "summary.json"
    summary = json.loads(summary_file.read_text()) if summary_file.exists() else {}
    trainer = next(iter(summary.get("trainer", {}).values()), {})
    return {"run": topo.run, "up_rc": rc, "up_wall_s": round(wall, 1),
            "versions": max(first_at, default=0),
            "at": versions_at(first_at, args.checkpoints),
            "trainer": {k: trainer[k] for k in TRAINER_FIGURES if k in trainer},
            "staleness_dropped": summary.get("staleness_dropped"),
            "_manifests": [r.record for r in records], "_topology": topo}


def score_cell(result: dict[str, Any], score: Callable[[list, int | None], float]) -> None:
    """``result["accuracy"][t]`` for each checkpoint that has a version (each version
    scored once)."""
    manifests = result.pop("_manifests", [])
    result.pop("_topology", None)
    scores: dict[int, float] = {}
    for t, v in result["at"].items():
        if v is None:
            continue
        if v not in scores:
            scores[v] = score(manifests, v)
        result.setdefault("accuracy", {})[t] = scores[v]


# --- report -----------------------------------------------------------------------------------
def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f}"


def _num(x: float | None) -> str:
    return "–" if x is None else f"{x:.3f}"


def table(results: dict[str, dict[str, Any]], checkpoints: list[float],
          start_accuracy: float | None) -> str:
    """One row per cell: held-out accuracy % (version) at each checkpoint time, versions
    reached, trained staleness (mean / max), the objective's token shares, and the
    trainer's last reward mean, share of groups without advantage and KL to the
    behaviour policy (a collapse shows as reward 0 and 100 % without advantage)."""
    head = ["objective", "bound", *[f"t={t:g}s" for t in checkpoints], "versions",
            "staleness mean / max", "clipped %", "truncated %", "m2 masked %",
            "train reward", "no-advantage %", "KL"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results.values():
        if "error" in r:
            lines.append(f"| {r['objective']} | {r['staleness']} | {r['error']} |")
            continue
        cells = []
        for t in checkpoints:
            acc = r.get("accuracy", {}).get(t)
            v = r["at"].get(t)
            cells.append("–" if v is None or acc is None else f"{100 * acc:.1f} (v{v})")
        tr = r.get("trainer", {})
        stale = tr.get("trainer/staleness_mean")
        stale_txt = "–" if stale is None else \
            f"{stale:.2f} / {tr.get('trainer/staleness_max', 0):.0f}"
        lines.append("| " + " | ".join([
            r["objective"], str(r["staleness"]), *cells, str(r["versions"]), stale_txt,
            _pct(tr.get("trainer/clip_frac")), _pct(tr.get("trainer/truncated_frac")),
            _pct(tr.get("trainer/m2_masked_frac")), _num(tr.get("trainer/reward_mean")),
            _pct(tr.get("trainer/zero_advantage_frac")),
            _num(tr.get("trainer/approx_kl"))]) + " |")
    if start_accuracy is not None:
        lines.append(f"\nstarting model (every cell): held-out accuracy "
                     f"{100 * start_accuracy:.1f} %")
    lines.append("accuracy in % (the newest version published by t, seconds from the "
                 "launch of `up`); token shares, train reward, no-advantage share and KL: "
                 "the trainer's last reported step")
    return "\n".join(lines)


# --- main -------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--topology", type=Path, default=REPO / "topology" / "smollm2.yaml",
                    help="base topology, one policy (default topology/smollm2.yaml)")
    ap.add_argument("--duration", type=float, default=1800.0,
                    help="seconds of `astraflow up` per cell (default 1800)")
    ap.add_argument("--objectives", default=",".join(OBJECTIVES),
                    help=f"comma-separated, from {','.join(KNOWN)} (" + "; ".join(
                        f"{name}: {loss} with {settings}"
                        for name, (loss, settings) in VARIANTS.items()) + ")")
    ap.add_argument("--staleness", default=",".join(str(s) for s in STALENESS),
                    help="comma-separated max_staleness bounds (default 0,4,16)")
    ap.add_argument("--checkpoints", default=None, help="comma-separated seconds from the "
                    "launch (default: 1/4, 1/2, 3/4 and all of --duration)")
    ap.add_argument("--m2-threshold", type=float, default=None,
                    help="m2po's threshold (default: the trainer's, 0.04)")
    ap.add_argument("--versions", type=int, default=0,
                    help="also stop a cell after this many versions (0: only --duration)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep", action="store_true",
                    help="keep each cell's topics and trainer state (default: deleted once "
                    "scored)")
    ap.add_argument("--runs-dir", type=Path, default=REPO / "runs")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "offpolicy.json")
    args = ap.parse_args(argv)
    args.objectives = [o.strip() for o in args.objectives.split(",") if o.strip()]
    unknown = [o for o in args.objectives if o not in KNOWN]
    if unknown:
        ap.error(f"unknown objectives {unknown} (known: {', '.join(KNOWN)})")
    try:
        args.staleness = [int(s) for s in args.staleness.split(",") if s.strip()]
    except ValueError:
        ap.error("--staleness: comma-separated integers")
    if any(s < 0 for s in args.staleness):
        ap.error("--staleness: bounds are >= 0")
    args.checkpoints = ([float(x) for x in args.checkpoints.split(",") if x.strip()]
                        if args.checkpoints else
                        [args.duration * f for f in (0.25, 0.5, 0.75, 1.0)])
    args.runs_dir = args.runs_dir.resolve()
    return args


def run_all(args: argparse.Namespace, base: dict[str, Any],
            on_cell: Callable[[dict], None] = lambda results: None,
            ) -> tuple[dict, float | None]:
    """Every cell, one after the other, each scored right after its run (``on_cell``
    gets the results so far after each)."""
    model = shared_model(base, args.runs_dir)
    score = make_score(base, model)
    topo_dir = args.runs_dir / RUN_PREFIX / "topologies"
    topo_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, Any]] = {}
    for staleness in args.staleness:
        for objective in args.objectives:
            name = cell_name(objective, staleness)
            state = args.runs_dir / name / "trainer-state"
            shutil.rmtree(state, ignore_errors=True)
            doc = build_cell(base, objective, staleness, model=str(model),
                             state_dir=str(state), seed=args.seed,
                             m2_threshold=args.m2_threshold)
            path = topo_dir / f"{name}.yaml"
            path.write_text(f"# bench/offpolicy.py: {objective}, max_staleness {staleness}, "
                            f"of {args.topology}\n" + yaml.safe_dump(doc, sort_keys=False))
            print(f"[bench] {name}: {args.duration:g} s", flush=True)
            r = run_cell(path, args, name)
            topo = r["_topology"]
            print(f"[bench] {name}: scoring {len(set(r['at'].values()) - {None})} versions",
                  flush=True)
            score_cell(r, score)
            r.update(objective=objective, staleness=staleness, topology=str(path))
            results[name] = r
            on_cell(results)
            if not args.keep:
                da.delete_topics(topo)
                shutil.rmtree(state, ignore_errors=True)
    return results, score([], None)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.meta = run_meta("offpolicy", ["python", *sys.argv] if argv is None
                         else ["python", "bench/offpolicy.py", *argv])  # before the run
    from astraflow.config.topology import load_topology

    load_topology(args.topology)  # the base must be valid as it is
    base = yaml.safe_load(args.topology.read_text())
    t0 = time.time()
    results, start = run_all(args, base, lambda done: write_out(args, done, None, t0))
    text = write_out(args, results, start, t0)
    print("\nheld-out accuracy by objective and staleness bound:\n" + text, flush=True)
    print(f"[bench] wrote {args.out}", flush=True)
    return 0


def write_out(args: argparse.Namespace, results: dict, start: float | None,
              t0: float) -> str:
    """The JSON of the cells scored so far (rewritten after each cell, so a long bench
    that is stopped keeps what it measured); returns the table."""
    text = table(results, args.checkpoints, start)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "meta": args.meta, "bench": "offpolicy", "topology": str(args.topology),
        "duration_s": args.duration,
        "checkpoints": args.checkpoints, "objectives": args.objectives,
        "staleness": args.staleness, "seed": args.seed, "start_accuracy": start,
        "wall_s": round(time.time() - t0, 1), "results": results, "table": text},
        indent=2, default=str) + "\n")
    return text


if __name__ == "__main__":
    sys.exit(main())
