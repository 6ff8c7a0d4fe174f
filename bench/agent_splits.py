"""How often the shipped agent examples' episodes are recorded as more than one sequence
(a split) on SmolLM2-135M-Instruct, before and after a change of the code, in one run.

An episode is split when a request's prompt does not extend the sequence of the turn
before it (``astraflow/raas/agent/trajectory.py``): the template rendered an earlier answer
otherwise than it was sampled. Each example is run by each side's own code, topology and
program: ``topology/agent-react.yaml`` (``examples/agents/react_calc.py``, a tool agent)
and ``topology/agent-solver-critic.yaml`` (``examples/agents/solver_critic.py``, two
policies, one request each). As SmolLM2 needs them (``tests/e2e/test_agents_up.py``): the
worked exchange (``AGENT_DEMO=1``) and room for a call (``--max-new-tokens``, 64: at 40,
most calls SmolLM2-135M starts are cut short); seeded sampling, so both sides sample the
same first turns. Every policy is SmolLM2 (one engine, the policy's ``best`` precision, one
torch thread), on the same ``--tasks`` problems of the topologies' feeder (arithmetic,
levels 1 and 2), ``--episodes`` each. **before** is the code of the git
revision ``--before`` (unpacked with ``git archive`` into a temporary directory), **after**
this checkout; each runs in a process of its own with its code first on ``PYTHONPATH``.

Reported per example and side: episodes, requests per episode, the share of episodes that
made more than one request of a policy (only those can split), sequences per episode and
policy, and the share of episodes (and of multi-request ones) split. A program that
reports its own rewards (solver-critic) is marked ``trusted`` where the code has the
setting: what is measured here does not depend on the reward.

    python bench/agent_splits.py [--model runs/smollm2/model] [--before REV] [--tasks 8]
        [--episodes 8] [--max-new-tokens 64] [--out FILE.json]

The JSON goes to ``bench/results/agent-splits.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from report import run_meta, table  # noqa: E402

EXAMPLES = ("agent-react", "agent-solver-critic")
# the commit before episodes were rendered back as sampled and credited once (issue 76)
BEFORE = "5d97fde"
# tests/e2e/test_agents_up.py: the worked exchange SmolLM2 needs before it writes a call
SMOLLM2_ENV = {"AGENT_DEMO": "1"}
# what is measured does not depend on time: room for a busy machine's slow generations
TIMEOUT_S = 600


def worker(code: Path, example: str, model: str, rows: list[dict[str, Any]], episodes: int,
           seed: int, max_new_tokens: int) -> dict[str, Any]:
    """One side of one example, in this process (whose ``astraflow`` is ``code``'s): the
    sequences of every episode, summarised per episode and policy."""
    import inspect

    import torch
    import yaml

    import astraflow
    from astraflow.raas.engine import load_torch_engine
    from astraflow.raas.workflows.agent import AgentWorkflow
    from astraflow.raas.workflows.registry import make_workflow
    from astraflow.wire.records import Task

    assert Path(astraflow.__file__).resolve().is_relative_to(code.resolve()), astraflow.__file__
    topo = yaml.safe_load((code / "topology" / f"{example}.yaml").read_text())
    options = {**topo["pools"]["local"]["workflows"]["agent"], "env": SMOLLM2_ENV,
               "max_new_tokens": max_new_tokens, "seed": seed, "timeout_s": TIMEOUT_S}
    if "reward" not in options and (hasattr(AgentWorkflow, "Options") or
                                    "trusted" in inspect.signature(AgentWorkflow).parameters):
        options["trusted"] = True  # the program prints its own rewards
    policies = sorted(topo["policies"])
    wf = make_workflow("agent", **options)
    torch.set_num_threads(1)  # on shared cores, more threads spin against each other
    engine = load_torch_engine(model, policies[0], dtype="best", prefix_cache_bytes=0)
    engines = {p: engine for p in policies}
    out: dict[str, Any] = {"episodes": [], "failed": []}
    t0 = time.perf_counter()
    for k, row in enumerate(rows):
        task = Task(task_id=f"splits-{k}", prompt_id=f"p{k}", workflow="agent",
                    payload=json.dumps(row),
                    source="bench", policies=policies)
        try:
            seqs = wf.run(task, engines, episodes)
        except Exception as e:  # noqa: BLE001 - a task whose episodes failed: counted
            out["failed"].append(f"{type(e).__name__}: {e}"[:300])
            continue
        by: dict[tuple[int, str], list[int]] = defaultdict(list)
        for s in seqs:
            by[(s.sample_index, s.policy)].append(int(s.meta.get("turns", "1")))
        for j in sorted({i for i, _ in by}):
            out["episodes"].append({p: by[(j, p)] for p in policies if (j, p) in by})
    out["seconds"] = time.perf_counter() - t0
    return out


def summary(side: dict[str, Any]) -> dict[str, Any]:
    """The figures of one side: ``side["episodes"]`` holds, per episode, each policy's
    sequences as the requests stitched into each."""
    eps = side["episodes"]
    pairs = [turns for e in eps for turns in e.values()]  # (episode, policy)
    multi = [t for t in pairs if sum(t) > 1]
    split = [t for t in pairs if len(t) > 1]
    return {
        "episodes": len(eps), "tasks failed": len(side["failed"]),
        "requests per episode": sum(sum(t) for t in pairs) / max(len(eps), 1),
        "multi-request share": len(multi) / max(len(pairs), 1),
        "sequences per episode and policy": sum(len(t) for t in pairs) / max(len(pairs), 1),
        "split share": len(split) / max(len(pairs), 1),
        "split share of multi-request": (len([t for t in multi if len(t) > 1])
                                         / len(multi)) if multi else None,
        "seconds": side["seconds"],
    }


def unpack(rev: str, into: Path) -> None:
    """The tree of git revision ``rev`` into the directory ``into`` (``git archive``)."""
    archive = subprocess.run(["git", "archive", rev], cwd=REPO, capture_output=True,
                             check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)


def run_side(code: Path, example: str, args: argparse.Namespace, rows_file: Path) -> dict:
    """``worker`` in a process whose ``astraflow`` is ``code``'s, in ``code``."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(code),
               "--example", example, "--model", str(args.model.resolve()),
               "--rows", str(rows_file), "--episodes", str(args.episodes),
               "--seed", str(args.seed), "--max-new-tokens", str(args.max_new_tokens),
               "--out", f.name]
        env = {**os.environ, "PYTHONPATH": str(code), "OMP_NUM_THREADS": "1"}
        subprocess.run(cmd, cwd=code, env=env, check=True)
        return json.loads(Path(f.name).read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=REPO / "runs" / "smollm2" / "model")
    ap.add_argument("--before", default=BEFORE, help="git revision of the code before")
    ap.add_argument("--tasks", type=int, default=8)
    ap.add_argument("--episodes", type=int, default=8, help="episodes per task (the "
                    "topologies' n_samples)")
    ap.add_argument("--max-new-tokens", type=int, default=64,
                    help="a request's tokens (the program sets none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--examples", default=",".join(EXAMPLES))
    ap.add_argument("--out", type=Path,
                    default=REPO / "bench" / "results" / "agent-splits.json")
    ap.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--example", help=argparse.SUPPRESS)
    ap.add_argument("--rows", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker is not None:
        rows = json.loads(args.rows.read_text())
        result = worker(args.worker, args.example, str(args.model), rows, args.episodes,
                        args.seed, args.max_new_tokens)
        args.out.write_text(json.dumps(result))
        sys.stdout.flush()
        os._exit(0)  # the endpoint's and torch's threads can abort an orderly exit
    if not (args.model / "config.json").exists():
        ap.error(f"--model {args.model}: no model there (astraflow model import smollm2 DIR)")
    if args.tasks < 1 or args.episodes < 1:
        ap.error("--tasks and --episodes must be at least 1")
    examples = [e for e in args.examples.split(",") if e]
    bad = [e for e in examples if e not in EXAMPLES]
    if bad:
        ap.error(f"--examples: {bad[0]!r} is not one of {', '.join(EXAMPLES)}")
    meta = run_meta("agent_splits", ["python", *sys.argv] if argv is None
                    else ["python", "bench/agent_splits.py", *argv])
    from astraflow.tasks.arithmetic import train_problems

    # the tasks the topologies' feeder sends (levels 1 and 2)
    rows = [p.payload() for p in train_problems((1, 2), n=args.tasks, seed=args.seed)]
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="agent-splits-") as tmp:
        rows_file = Path(tmp) / "rows.json"
        rows_file.write_text(json.dumps(rows))
        before = Path(tmp) / "before"
        before.mkdir()
        unpack(args.before, before)
        for example in examples:
            for side, code in (("before", before), ("after", REPO)):
                print(f"{example}: {side} ...", file=sys.stderr, flush=True)
                results[f"{example}: {side}"] = summary(run_side(code, example, args,
                                                                 rows_file))
    keys = list(next(iter(results.values())))
    text = table(["", *results], ([k, *(results[n][k] for n in results)] for k in keys))
    print(text)
    data = {"meta": meta, "model": "SmolLM2-135M-Instruct", "before": args.before,
            "tasks": args.tasks, "episodes per task": args.episodes, "seed": args.seed,
            "timeout_s": TIMEOUT_S, "max_new_tokens": args.max_new_tokens,
            "env": json.dumps(SMOLLM2_ENV),
            "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
