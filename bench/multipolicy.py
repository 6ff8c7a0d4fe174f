"""Solver + verifier against the solver alone, at equal wall-clock time (issue 6).

Runs ``astraflow up topology/solver-verifier.yaml`` and its one-policy variant, the solver
alone (``alone_topology``: the same solver model recipe, trainer, pool and feeder, the
``single_turn`` workflow instead of ``solve_verify``, no verifier; written to
``<runs-dir>/solver-alone.yaml``), one after another (``--fresh``, ``--duration`` seconds
each, the pair repeated ``--repeats`` times, alternating which goes first), and reads each
run's ``summary.json``: the evaluator's held-out accuracy of every evaluated version with
the seconds since the run's processes started.

Printed per run and over the repeats:

* the solver's held-out accuracy at each checkpoint (``--checkpoints``, seconds): the
  accuracy of the newest version evaluated by then;
* its final accuracy (mean of the last ``--tail`` evaluations: one evaluation of 200
  prompts moves by 0.5 points a prompt, so a single one is noisy) and its mean over the
  whole run (area under the curve over time);
* the seconds until it first reached ``--target`` (default 0.90);
* versions published, and the verifier's held-out verdict accuracy at version 0, its
  final (tail mean) and its best.

Usage (needs Java and Maven for the embedded broker, like ``astraflow up``):

    python bench/multipolicy.py [--duration 330] [--repeats 1]
        [--out bench/results/multipolicy.json]

Both topologies share the solver's model recipe, so the first run writes the warm-started
model (about 80 s, not timed: the clock of a run starts when its processes do).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
TOGETHER = "topology/solver-verifier.yaml"


def alone_topology(together: dict[str, Any], solver: str = "solver") -> dict[str, Any]:
    """The solver of a two-policy topology (dict) trained alone: every other policy, its
    topics and the processors that serve only it removed, the workflow ``single_turn``."""
    topo = copy.deepcopy(together)
    topo["run"] = f"{solver}-alone"
    others = [p for p in topo["policies"] if p != solver]
    topo["policies"] = {solver: topo["policies"][solver]}
    topo["policies"][solver]["model"] = f"runs/{solver}-alone/{solver}"

    def theirs(topic: str) -> bool:
        return any(topic.startswith(f"{kind}.{p}") for p in others
                   for kind in ("samples", "batches", "weights"))

    topo["topics"] = {t: v for t, v in topo["topics"].items() if not theirs(t)}
    procs = {}
    for name, proc in topo["processors"].items():
        outs = [t for t in proc.get("outputs", []) if not theirs(t)]
        if proc.get("outputs") and not outs or any(theirs(t) for t in proc.get("inputs", [])):
            continue  # serves another policy only
        opts = dict(proc.get("options") or {})
        if "policies" in opts:
            opts["policies"] = [solver]
        procs[name] = {**proc, "outputs": outs, **({"options": opts} if opts else {})}
    topo["processors"] = procs
    for pool in topo["pools"].values():
        pool["workflows"] = {("single_turn" if name == "solve_verify" else name):
                             (_single_turn_options(opts) if name == "solve_verify" else opts)
                             for name, opts in (pool.get("workflows") or {}).items()}
    feeder = topo["feeder"]
    if feeder.get("workflow"):
        feeder["workflow"] = "single_turn"
    if feeder.get("policies"):
        feeder["policies"] = [p for p in feeder["policies"] if p == solver]
    return topo


SAMPLING_OPTIONS = ("max_new_tokens", "temperature", "top_p", "seed")


def _single_turn_options(opts: dict[str, Any]) -> dict[str, Any]:
    """The ``single_turn`` options of a ``solve_verify`` pool: the solver's sampling
    options only."""
    return {k: v for k, v in opts.items() if k in SAMPLING_OPTIONS}


def run_up(topology: str, duration: float, runs_dir: Path, log: Path) -> dict[str, Any]:
    """``astraflow up TOPOLOGY --duration D`` from version 0; its summary.json."""
    run = yaml.safe_load((REPO / topology).read_text())["run"]
    from astraflow.runs import start_over

    start_over(run)
    cmd = [sys.executable, "-m", "astraflow.cli", "up", topology, "--keep-broker",
           "--duration", str(duration), "--runs-dir", str(runs_dir)]
    print(f"$ {' '.join(cmd[2:])}  (log {log})", flush=True)
    t0 = time.time()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise SystemExit(f"`astraflow up {topology}` exited with {rc}; see {log}")
    summary = json.loads((runs_dir / run / "summary.json").read_text())
    print(f"  done in {time.time() - t0:.0f}s wall", flush=True)
    return summary


def accuracy_at(curve: list[dict[str, float]], t: float) -> float | None:
    """The accuracy of the newest version evaluated by ``t`` seconds."""
    seen = [p["accuracy"] for p in curve if p["t"] <= t]
    return seen[-1] if seen else None


def curve_figures(curve: list[dict[str, float]], checkpoints: list[float], tail: int,
                  target: float) -> dict[str, Any]:
    if not curve:
        return {"evaluations": 0}
    accs = [p["accuracy"] for p in curve]
    reached = next((p["t"] for p in curve if p["accuracy"] >= target), None)
    return {
        "evaluations": len(curve),
        "start": accs[0],
        "final": statistics.fmean(accs[-tail:]),
        "best": max(accs),
        "mean": statistics.fmean(accs),
        "last_version": curve[-1]["version"],
        "seconds_to_target": reached,
        "at": {str(int(c)): accuracy_at(curve, c) for c in checkpoints},
    }


def figures(summary: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    ev = summary.get("eval", {})
    out = {"seconds": summary.get("seconds"), "versions": summary.get("versions"),
           "solver": curve_figures(ev.get("solver", []), args.checkpoints, args.tail,
                                   args.target)}
    if "verifier" in ev:
        out["verifier"] = curve_figures(ev["verifier"], args.checkpoints, args.tail, 2.0)
        out["workflow_metrics"] = summary.get("workflow_metrics")
    out["curves"] = {p: [(round(x["t"], 1), x["version"], x["accuracy"]) for x in c]
                     for p, c in ev.items()}
    return out


def _fmt(x: float | None) -> str:
    return "  -  " if x is None else f"{x:5.1%}"


def report(runs: list[dict[str, Any]], args: argparse.Namespace) -> None:
    cps = [str(int(c)) for c in args.checkpoints]
    print(f"\nsolver held-out accuracy (200 prompts) at equal wall-clock time; final = mean "
          f"of the last {args.tail} evaluations")
    print(f"{'run':<22}" + "".join(f"{c + 's':>8}" for c in cps)
          + f"{'final':>8}{'mean':>8}{'to ' + format(args.target, '.0%'):>8}{'versions':>10}")
    for r in runs:
        s = r["solver"]
        to = s.get("seconds_to_target")
        to_txt = "never" if to is None else f"{to:.0f}s"
        print(f"{r['name']:<22}" + "".join(f"{_fmt(s['at'].get(c)):>8}" for c in cps)
              + f"{_fmt(s['final']):>8}{_fmt(s['mean']):>8}"
              + f"{to_txt:>8}"
              + f"{s['last_version']:>10}")
    for r in runs:
        if "verifier" in r:
            v = r["verifier"]
            print(f"{r['name']}: verifier held-out verdict accuracy {v['start']:.1%} at v0 -> "
                  f"{v['final']:.1%} final (best {v['best']:.1%}, v{v['last_version']})")
    for kind in ("alone", "together"):
        sel = [r["solver"] for r in runs if r["kind"] == kind]
        if sel:
            print(f"{kind}: solver final {statistics.fmean(s['final'] for s in sel):.1%}, "
                  f"mean {statistics.fmean(s['mean'] for s in sel):.1%} over {len(sel)} run(s)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=330.0, help="seconds per run")
    ap.add_argument("--repeats", type=int, default=1, help="pairs of runs")
    ap.add_argument("--checkpoints", type=lambda s: [float(x) for x in s.split(",")],
                    default=[30.0, 60.0, 120.0, 200.0, 300.0])
    ap.add_argument("--tail", type=int, default=5)
    ap.add_argument("--target", type=float, default=0.90)
    ap.add_argument("--runs-dir", default="runs")
    ap.add_argument("--out", default="bench/results/multipolicy.json")
    ap.add_argument("--summaries", nargs=2, metavar=("ALONE", "TOGETHER"),
                    help="report on the summary.json of two finished runs instead")
    args = ap.parse_args(argv)
    runs_dir = (REPO / args.runs_dir).resolve()
    runs_dir.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    if args.summaries:
        for kind, f in zip(("alone", "together"), args.summaries):
            fig = figures(json.loads(Path(f).read_text()), args)
            runs.append({"name": f"{kind} ({Path(f).parent.name})", "kind": kind, **fig})
        report(runs, args)
        return 0
    alone = runs_dir / "solver-alone.yaml"
    alone.write_text(yaml.safe_dump(alone_topology(
        yaml.safe_load((REPO / TOGETHER).read_text())), sort_keys=False))
    for i in range(args.repeats):
        order = [("alone", str(alone)), ("together", TOGETHER)]
        if i % 2:
            order.reverse()
        for kind, topo in order:
            log = runs_dir / f"bench-multipolicy-{kind}-{i}.log"
            fig = figures(run_up(topo, args.duration, runs_dir, log), args)
            runs.append({"name": f"{kind} #{i}", "kind": kind, **fig})
    report(runs, args)
    out = REPO / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"duration_s": args.duration, "runs": runs}, indent=1) + "\n")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
