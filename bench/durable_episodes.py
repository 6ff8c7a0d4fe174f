"""Durable agent episodes: a RaaS node killed mid-episode, its task taken over, with the
episodes replayed from the log (``resume: replay``) against started again (``restart``).

Per round and setting, on an embedded broker: one agent task whose program holds a
conversation of ``--turns`` calls (``--tokens`` tokens each, a pause of ``--pause`` s after
each, as a tool or environment would take) with ``--samples`` episodes; node a starts it,
is SIGKILLed once every episode has made ``--turns // 2`` calls, and node b (same pool)
takes the task over and makes its group. Reported per setting: the tokens node b sampled
(the group's generated tokens less those replayed), the tokens it replayed, and the
seconds from the kill to b's group on ``trajectories.raw``. Settings alternate round by
round, so a drift of the machine hits both.

    python bench/durable_episodes.py [--rounds 2] [--turns 6] [--tokens 16] [--pause 1.0]
        [--samples 2] [--out FILE.json]

The JSON goes to ``bench/results/durable_episodes.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from report import run_meta, table  # noqa: E402

PROGRAM = """
    import json, sys, time
    from openai import OpenAI
    turns, tokens, pause = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    client = OpenAI()
    messages = [{"role": "user", "content": "12+30="}]
    for turn in range(turns):
        r = client.chat.completions.create(model="actor", messages=messages,
                                           max_tokens=tokens)
        messages += [{"role": "assistant", "content": r.choices[0].message.content},
                     {"role": "user", "content": "and again"}]
        time.sleep(pause)
    print(json.dumps({"done": True}))
"""


def _wait(what: str, cond: Any, timeout_s: float) -> Any:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        got = cond()
        if got:
            return got
        time.sleep(0.2)
    raise SystemExit(f"durable_episodes: {what}: not within {timeout_s:.0f} s")


def one_round(resume: str, args: argparse.Namespace, bootstrap: str, model: Path,
              work: Path) -> dict[str, Any]:
    """One kill and takeover with ``resume``; what node b did."""
    from astraflow.config.topology import parse_topology
    from astraflow.kafka.clients import RecordProducer, make_admin, read_all
    from astraflow.kafka.config import KafkaConfig
    from astraflow.kafka.topics import apply_topics
    from astraflow.wire.records import EpisodeCall, Task, TrajectoryGroup

    config = KafkaConfig(bootstrap_servers=bootstrap)
    run = f"durable-{resume}-{uuid.uuid4().hex[:6]}"
    data = {"run": run, "kafka": {"bootstrap_servers": bootstrap}, "status_interval_s": 1.0,
            "topics": {"tasks": {"partitions": 1}, "trajectories.raw": {"partitions": 1},
                       "episodes": {"partitions": 1}, "dlq": {}, "status": {}},
            "processors": {}}
    path = work / f"{run}.yaml"
    path.write_text(yaml.safe_dump(data))
    topo = parse_topology(data, source=str(path))
    apply_topics(make_admin(config), topo.resolved_topics())
    script = work / "agent" / "program.py"
    producer = RecordProducer(config)
    producer.produce(topo.full_name("tasks"), Task(
        task_id="long", prompt_id="p-long", workflow="agent", source="bench",
        payload=json.dumps({"prompt": "12+30=", "answer": "42"}), policies=["actor"]),
        key="p-long")
    producer.flush()
    options = {"command": [sys.executable, str(script), str(args.turns), str(args.tokens),
                           str(args.pause)],
               "reward": "exact_match", "timeout_s": 600, "attempts": 1, "resume": resume,
               "temperature": 1.0}
    episodes, out = topo.full_name("episodes"), topo.full_name("trajectories.raw")

    def node(name: str) -> subprocess.Popen:
        env = {**os.environ, "ASTRAFLOW_BOOTSTRAP": bootstrap, "PYTHONUNBUFFERED": "1"}
        return subprocess.Popen(
            [sys.executable, "-m", "astraflow.cli.main", "raas", "run", "--topology",
             str(path), "--policy-model", f"actor={model}", "--instance", name,
             "--n-samples", str(args.samples), "--session-timeout-ms", "6000",
             "--workflow-options", f"agent={json.dumps(options)}"],
            env=env, cwd=REPO, stdout=open(work / f"{run}.{name}.log", "ab"),
            stderr=subprocess.STDOUT)

    def calls() -> list[EpisodeCall]:
        return [r.record for r in read_all(config, episodes, idle_s=0.3, expect=EpisodeCall,
                                           isolation="read_uncommitted")]

    a, started = node("a"), time.monotonic()
    try:
        if resume == "replay":
            half = args.samples * (args.turns // 2)
            _wait("node a's calls", lambda: len(calls()) >= half, 600)
        else:  # nothing is logged: as long as the replay rounds take to get there
            time.sleep(args.kill_after_s)
        a.send_signal(signal.SIGKILL)
        a.wait(30)
        killed = time.monotonic()
        a_ran = killed - started
        b = node("b")
        try:
            (group,) = _wait("node b's group", lambda: [
                r.record for r in read_all(config, out, idle_s=0.3, expect=TrajectoryGroup)],
                900)
            seconds = time.monotonic() - killed
        finally:
            b.send_signal(signal.SIGTERM)
            b.wait(60)
    finally:
        if a.poll() is None:
            a.kill()
    m = group.metrics
    replayed = m.get("agent/replayed_tokens", 0.0)
    return {"resume": resume, "sampled_by_b": m["rollout/gen_tokens"] - replayed,
            "replayed_by_b": replayed, "replayed_calls": m.get("agent/replayed_calls", 0.0),
            "diverged": m.get("agent/replays_diverged", 0.0), "seconds_to_group": seconds,
            "gen_tokens": m["rollout/gen_tokens"], "a_ran_s": a_ran}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--pause", type=float, default=1.0)
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--out", type=Path,
                    default=REPO / "bench" / "results" / "durable_episodes.json")
    args = ap.parse_args(argv)
    if args.turns < 2 or args.rounds < 1:
        ap.error("--turns must be at least 2 and --rounds at least 1")
    from astraflow.broker.embedded import EmbeddedBroker, free_port
    from astraflow.models.tiny import init_model

    meta = run_meta("durable_episodes", ["python", *sys.argv] if argv is None
                    else ["python", "bench/durable_episodes.py", *argv])
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-durable-") as tmp:
        work = Path(tmp)
        (work / "agent").mkdir(mode=0o755)
        os.chmod(work, 0o755)  # a root node runs the program as another uid
        (work / "agent" / "program.py").write_text(textwrap.dedent(PROGRAM))
        model = init_model(work / "model")
        broker = EmbeddedBroker(work / "broker")
        bootstrap = broker.start(port=free_port(), log=lambda *_: None).bootstrap
        try:
            args.kill_after_s = 0.0
            for r in range(args.rounds):
                for resume in (("replay", "restart") if r % 2 == 0 else ("restart", "replay")):
                    if resume == "restart" and not args.kill_after_s:
                        args.kill_after_s = 10.0  # until a replay round says how long
                    row = one_round(resume, args, bootstrap, model, work)
                    if resume == "replay":  # kill restart rounds as far into the episode
                        args.kill_after_s = row["a_ran_s"]
                    rows.append({"round": r, **row})
                    print(json.dumps(rows[-1]), flush=True)
        finally:
            broker.destroy()
    summary = {}
    for resume in ("replay", "restart"):
        mine = [x for x in rows if x["resume"] == resume]
        summary[resume] = {k: statistics.fmean(x[k] for x in mine)
                           for k in ("sampled_by_b", "replayed_by_b", "seconds_to_group")}
    text = table(["resume", "tokens sampled by b", "tokens replayed by b",
                  "seconds from the kill to the group"],
                 [[k, v["sampled_by_b"], v["replayed_by_b"], v["seconds_to_group"]]
                  for k, v in summary.items()])
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "meta": meta, "bench": "durable_episodes", "turns": args.turns, "tokens": args.tokens,
        "pause_s": args.pause, "samples": args.samples, "rounds": rows, "mean": summary,
        "table": text}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
