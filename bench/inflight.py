"""Weight updates inside a long generation: token age in versions and throughput, with
updates within generations off and on, side by side in one run.

Both cells, **off** and **on**, run ``astraflow up`` on the agent topology (default
``topology/agent-react.yaml``: the ReAct calculator program of
``examples/agents/react_calc.py`` against the node's OpenAI-compatible endpoint), one
after the other from the same tiny model and seed, for ``--duration`` seconds a run. Each
cell's variant differs from the topology in its run id (``bench-inflight-<cell>``), the
pool's ``update_every_tokens`` (0 for **off**, ``--every`` for **on**) and what makes
generations long and versions frequent: the tiny model is not warm-started (a random
model writes until ``max_new_tokens``, ``--tokens``, instead of answering in a few
tokens), ``n_samples`` is ``--samples``, the batcher cuts a batch every ``--batch``
groups (the trainer publishes a version per batch), ``max_staleness`` is ``--staleness``
(large, so that the filter drops nothing and the ages are not cut off), the pool has
``--nodes`` nodes (a version comes from a group another node finished while one generates:
with one node and a version per group no generation would see one), and there is no
evaluator.

Read back from the run's topics afterwards:

* **token age at the rollout**: for each generated token of each group on
  ``trajectories.raw``, the newest version published when the group was written minus the
  version that sampled the token (what the staleness filter judges, per token);
* **token age at training**: for each trained token, the version its batch was trained
  from (the manifest that names the batch, minus one) minus the token's version (what the
  trainer reports as ``trainer/staleness_mean``, ``_max``);
* **throughput**: generated tokens of the groups written per second between the first and
  the last group, and the node's own ``raas/gen_tokens_per_s`` (tokens over the seconds
  spent in ``generate``, in its last status);
* the versions published, the versions a node took inside a generation
  (``raas/weight_updates_inflight``), the most versions one sequence spanned and the
  groups the staleness filter dropped.

Each cell runs ``--rounds`` times, in the order off, on, on, off, ... (so that a machine
getting busier or quieter weighs on both alike); its token ages pool every token of its
runs, its rates are the mean of its runs. Beside it, the engine alone: tokens per second of
the torch engine on the same model with a version swapped in at every chunk boundary
against none, calls alternating, one thread as a node has (what the mechanism costs,
without the rest of the run).

Usage (needs Java and Maven for the embedded broker, as ``astraflow up`` does; about
``2 x rounds x (--duration + 25)`` seconds):

    python bench/inflight.py [--duration 90] [--rounds 2] [--every 16] [--tokens 256]
        [--samples 2] [--nodes 3] [--batch 1] [--staleness 32] [--seed 0] [--keep]
        [--topology topology/agent-react.yaml] [--out bench/results/inflight.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import data_algorithms as da  # noqa: E402
from report import run_meta, table  # noqa: E402

RUN_PREFIX = "bench-inflight"
CELLS = ("off", "on")


def build_cell(base: dict[str, Any], cell: str, args: argparse.Namespace, model: str,
               state_dir: str) -> dict[str, Any]:
    """The base topology changed into ``cell`` (a new dict; see the module doc)."""
    doc = copy.deepcopy(base)
    if len(doc.get("policies") or {}) != 1:
        raise ValueError("the bench needs a topology with exactly one policy")
    doc["run"] = f"{RUN_PREFIX}-{cell}"
    doc.pop("eval", None)
    for policy, spec in doc["policies"].items():
        spec.update(model=model, init_tiny=False, max_staleness=args.staleness)
        spec.pop("warm_start", None)
        spec["trainer"] = {**spec.get("trainer", {}), "seed": args.seed, "keep_versions": 0,
                           "state_dir": f"{state_dir}/{policy}"}
    if doc.get("feeder") is not None:
        doc["feeder"]["seed"] = args.seed
    for p in doc.get("processors", {}).values():
        if p.get("kind") == "batcher":
            p["options"] = {**p.get("options", {}), "batch_size": args.batch}
    (pool,) = doc["pools"].values()
    pool["n_samples"] = args.samples
    pool["nodes"] = args.nodes
    pool["update_every_tokens"] = args.every if cell == "on" else 0
    for wf in pool.get("workflows", {}).values():
        wf["max_new_tokens"] = args.tokens
    return doc


def _ages(values: list[int]) -> dict[str, Any]:
    return {"tokens": len(values),
            "mean": round(statistics.fmean(values), 3) if values else None,
            "max": max(values) if values else None}


def collect(topo) -> dict[str, Any]:
    """The cell's figures, read back from its topics (see the module doc)."""
    from astraflow.wire.records import Batch, ComponentStatus, TrajectoryGroup, WeightManifest

    config = topo.kafka.effective()
    policy = next(iter(topo.policies))
    manifests = da._read(config, topo.full_name(f"weights.{policy}"), WeightManifest)
    published: dict[int, int] = {}  # version -> when it was first published
    trained_from: dict[str, int] = {}  # batch id -> the version it was trained from
    for r in manifests:
        v = r.record.version
        published[v] = min(published.get(v, r.timestamp_ms), r.timestamp_ms)
        if "batch_id" in r.record.meta:
            trained_from[r.record.meta["batch_id"]] = v - 1
    times = sorted((t, v) for v, t in published.items())
    raw = sorted(da._read(config, topo.full_name("trajectories.raw"), TrajectoryGroup),
                 key=lambda r: r.timestamp_ms)
    at_rollout: list[int] = []
    spans: list[int] = []
    tokens = 0
    for r in raw:
        newest = max((v for t, v in times if t <= r.timestamp_ms), default=0)
        for s in r.record.sequences:
            gen = [v for v, m in zip(s.versions, s.loss_mask) if m and v >= 0]
            tokens += len(gen)
            at_rollout += [newest - v for v in gen]
            if gen:
                spans.append(max(gen) - min(gen))
    at_training: list[int] = []
    for r in da._read(config, topo.full_name(f"batches.{policy}"), Batch):
        base = trained_from.pop(r.record.batch_id, None)  # a batch counted once
        if base is None:
            continue
        for g in r.record.groups:
            for s in g.sequences:
                at_training += [base - v for v, m in zip(s.versions, s.loss_mask)
                                if m and v >= 0]
    nodes: dict[str, dict[str, float]] = {}  # node -> its last status's figures
    dropped = 0.0
    for r in da._read(config, topo.full_name("status"), ComponentStatus):
        st = r.record
        if st.kind == "raas":
            nodes[st.component_id] = st.metrics
        elif st.kind == "processor" and "staleness/dropped" in st.metrics:
            dropped = max(dropped, st.metrics["staleness/dropped"])
    span_s = ((raw[-1].timestamp_ms - raw[0].timestamp_ms) / 1000 if len(raw) > 1 else 0.0)
    return {
        "versions_published": max(published, default=0),
        "groups": len(raw),
        "generated_tokens": tokens,
        "tokens_per_s": round(tokens / span_s, 1) if span_s > 0 else None,
        # per node, summed over the pool's nodes
        "engine_tokens_per_s": round(sum(m.get("raas/gen_tokens_per_s", 0.0)
                                         for m in nodes.values()), 1),
        "age_at_rollout": _ages(at_rollout),
        "age_at_training": _ages(at_training),
        "updates_inflight": int(sum(m.get("raas/weight_updates_inflight", 0)
                                    for m in nodes.values())),
        "updates": int(sum(m.get("raas/weight_updates", 0) for m in nodes.values())),
        "versions_per_sequence_max": max(spans, default=0) + 1 if spans else 0,
        "sequences_spanning_versions": sum(1 for x in spans if x > 0),
        "sequences": len(spans),
        "staleness_dropped": int(dropped),
    }


def run_cell(base: dict[str, Any], cell: str, args: argparse.Namespace, shared: Path,
             topo_dir: Path, round_: int) -> dict[str, Any]:
    """``astraflow up`` on one cell from a fresh copy of the shared model; its figures."""
    from astraflow.config.topology import load_topology

    run_dir = args.runs_dir / f"{RUN_PREFIX}-{cell}"
    shutil.rmtree(run_dir, ignore_errors=True)
    model = run_dir / "model"
    shutil.copytree(shared, model)
    doc = build_cell(base, cell, args, str(model), str(run_dir / "trainer-state"))
    path = topo_dir / f"{cell}.yaml"
    path.write_text(f"# bench/inflight.py: cell {cell} of {args.topology}\n"
                    + yaml.safe_dump(doc, sort_keys=False))
    topo = load_topology(path)
    rc, wall = da.run_up(path, args, f"{cell}-{round_}")
    r = {"cell": cell, "round": round_, **collect(topo), "up_rc": rc,
         "up_wall_s": round(wall, 1)}
    print(f"[bench] {cell} (round {round_}): " + json.dumps(r), flush=True)
    if not args.keep:
        da.delete_topics(topo)
        shutil.rmtree(run_dir, ignore_errors=True)
    return r


def pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One cell's runs together: token ages over all their tokens, throughputs and counts
    as the mean of the runs (``most versions in one sequence``: the most)."""
    out: dict[str, Any] = {"runs": len(runs)}
    for key in ("age_at_rollout", "age_at_training"):
        n = sum(r[key]["tokens"] for r in runs)
        out[key] = {"tokens": n,
                    "mean": round(sum(r[key]["tokens"] * (r[key]["mean"] or 0.0)
                                      for r in runs) / n, 3) if n else None,
                    "max": max((r[key]["max"] for r in runs if r[key]["max"] is not None),
                               default=None)}
    for key in ("tokens_per_s", "engine_tokens_per_s", "versions_published",
                "updates_inflight", "staleness_dropped", "sequences_spanning_versions",
                "sequences", "groups"):
        vals = [r[key] for r in runs if r.get(key) is not None]
        out[key] = round(statistics.fmean(vals), 1) if vals else None
    out["versions_per_sequence_max"] = max(r["versions_per_sequence_max"] for r in runs)
    return out


def engine_overhead(model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The torch engine alone on the bench's model: tokens per second of ``generate``
    (2 prompts x ``--samples``, ``--tokens`` tokens, no stop) with a new version taken at
    every chunk boundary (the worst case: the weights copied in every ``--every`` tokens)
    against chunks off, the modes alternating call by call."""
    import torch

    from astraflow.raas.engine import SamplingParams, load_torch_engine

    torch.set_num_threads(1)  # as `up` runs its nodes (OMP_NUM_THREADS=1): on a shared
    # machine more threads than free cores spin against each other
    engine = load_torch_engine(str(model_dir), "actor", prefix_cache_bytes=0)
    states = [{k: v.clone() for k, v in engine.state_dict().items()}]
    states.append({k: v + 0.01 * torch.randn_like(v) if v.is_floating_point() else v
                   for k, v in states[0].items()})

    class EveryBoundary:  # an InflightWeights with a newer version at every boundary
        def take_ready(self, current, load):
            load(states[(current + 1) % 2], current + 1)
            return current + 1

    prompts = [engine.encode("What is 12+30?"), engine.encode("What is 47+85?")]
    params = SamplingParams(max_new_tokens=args.tokens, temperature=1.0, n=args.samples)
    engine.generate(prompts, params)  # warm-up
    spent = {"off": [0, 0.0], "on": [0, 0.0]}
    swaps = 0
    for i in range(args.engine_reps * 2):
        mode = CELLS[i % 2] if (i // 2) % 2 == 0 else CELLS[1 - i % 2]
        engine.follow_inflight(EveryBoundary() if mode == "on" else None, args.every)
        before = engine.inflight_updates
        t0 = time.perf_counter()
        out = engine.generate(prompts, params)
        spent[mode][1] += time.perf_counter() - t0
        spent[mode][0] += sum(len(g.token_ids) for gs in out for g in gs)
        swaps += engine.inflight_updates - before
    return {"calls_each": args.engine_reps, "tokens_a_call": args.tokens * 2 * args.samples,
            "versions_taken_on": swaps,
            **{f"tokens_per_s_{m}": round(n / t, 1) for m, (n, t) in spent.items()},
            "on_over_off": round((spent["on"][0] / spent["on"][1])
                                 / (spent["off"][0] / spent["off"][1]), 3)}


def side_by_side(cells: dict[str, dict[str, Any]]) -> str:
    """One row a figure, one column a cell."""
    names = list(cells)
    rows = [
        ("token age at the rollout, mean (versions)", "age_at_rollout", "mean"),
        ("token age at the rollout, max", "age_at_rollout", "max"),
        ("token age at training, mean (versions)", "age_at_training", "mean"),
        ("token age at training, max", "age_at_training", "max"),
        ("tokens trained", "age_at_training", "tokens"),
        ("generated tokens / s (groups written)", "tokens_per_s", None),
        ("generated tokens / s (engines, summed)", "engine_tokens_per_s", None),
        ("versions published", "versions_published", None),
        ("versions taken inside a generation", "updates_inflight", None),
        ("most versions in one sequence", "versions_per_sequence_max", None),
        ("sequences spanning versions / sequences", None, None),
        ("groups dropped as stale", "staleness_dropped", None),
    ]
    out = []
    for label, key, sub in rows:
        line: list[Any] = [label]
        for n in names:
            c = cells[n]
            if key is None:
                line.append(f"{c.get('sequences_spanning_versions')} / {c.get('sequences')}")
            else:
                v = c.get(key)
                line.append(v.get(sub) if isinstance(v, dict) else v)
        out.append(line)
    return table(["", *names], out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=90.0, help="seconds per cell run")
    ap.add_argument("--every", type=int, default=16,
                    help="update_every_tokens of the 'on' cell (default 16)")
    ap.add_argument("--tokens", type=int, default=256, help="max_new_tokens of a call")
    ap.add_argument("--samples", type=int, default=2, help="n_samples (episodes a task)")
    ap.add_argument("--nodes", type=int, default=3, help="RaaS nodes of the pool")
    ap.add_argument("--batch", type=int, default=1, help="groups a batch (a version each)")
    ap.add_argument("--staleness", type=int, default=32, help="max_staleness")
    ap.add_argument("--topology", default=str(REPO / "topology" / "agent-react.yaml"))
    ap.add_argument("--rounds", type=int, default=2,
                    help="runs of each cell (off, on, then on, off, ...; default 2)")
    ap.add_argument("--engine-reps", type=int, default=6,
                    help="generate calls a mode in the engine-alone part (default 6)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--runs-dir", type=Path, default=REPO / "runs")
    ap.add_argument("--keep", action="store_true", help="keep each cell's topics and state")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "inflight.json")
    args = ap.parse_args(argv)
    if args.every < 1:
        ap.error("--every must be at least 1")
    args.runs_dir = args.runs_dir.resolve()
    args.versions = 10**6  # `up` runs for --duration, not to a version budget

    from astraflow.config.topology import load_topology

    base = yaml.safe_load(Path(args.topology).read_text())
    load_topology(args.topology)  # the base must be valid as it is
    shared = da.ensure_shared_model(base, args.runs_dir, steps=0, slip=0.0)
    topo_dir = args.runs_dir / RUN_PREFIX / "topologies"
    topo_dir.mkdir(parents=True, exist_ok=True)
    t_all = time.time()
    print("[bench] the engine alone: a version at every chunk boundary against none",
          flush=True)
    engine = engine_overhead(shared, args)
    print(f"[bench] engine: {json.dumps(engine)}", flush=True)
    runs: list[dict[str, Any]] = []
    for i in range(args.rounds):  # off, on, then on, off, ...: drift hits both alike
        for cell in (CELLS if i % 2 == 0 else CELLS[::-1]):
            runs.append(run_cell(base, cell, args, shared, topo_dir, i + 1))
    cells = {cell: pooled([r for r in runs if r["cell"] == cell]) for cell in CELLS}
    text = side_by_side(cells) + "\n\n" + table(
        ["engine alone (same model, same calls)", "off", "on"],
        [["generated tokens / s", engine["tokens_per_s_off"], engine["tokens_per_s_on"]],
         ["versions taken inside the calls", 0, engine["versions_taken_on"]]])
    print()
    print(text)
    report = {
        "meta": run_meta("inflight", sys.argv),
        "topology": str(Path(args.topology).resolve().relative_to(REPO))
        if Path(args.topology).resolve().is_relative_to(REPO) else args.topology,
        "duration_s": args.duration, "update_every_tokens": args.every,
        "max_new_tokens": args.tokens, "n_samples": args.samples, "nodes": args.nodes,
        "batch_size": args.batch,
        "max_staleness": args.staleness, "seed": args.seed,
        "wall_s": round(time.time() - t_all, 1),
        "rounds": args.rounds,
        "table": text,
        "cells": cells,
        "engine": engine,
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nresults: {args.out}")
    return 0 if all(r.get("up_rc") == 0 and r.get("groups") for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
