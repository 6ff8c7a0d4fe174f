"""``astraflow replay train|eval|process|export``: work from a run's retained topics
(``astraflow.replay.ranges``, ``astraflow.replay.process``)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

_TRAIN_EXAMPLES = [
    "astraflow replay train -t topology/default.yaml                 # all of run default",
    "astraflow replay train -t topology/default.yaml --to-version 50 --into ablation",
    "astraflow replay train -t topology/default.yaml -- --lr 5e-5 --loss gspo",
]
_EVAL_EXAMPLES = [
    "astraflow replay eval -t topology/default.yaml --every 10 --out runs/default/curve.json",
]
_PROCESS_EXAMPLES = [
    "astraflow replay process -t topology/default.yaml --set policies.actor.max_staleness=1",
    "astraflow replay process -t topology/default.yaml --chain topology/data-algorithms.yaml "
    "--into default-dyn",
]
_EXPORT_EXAMPLES = [
    "astraflow replay export -t topology/default.yaml batches.actor --out batches.jsonl",
    "astraflow replay export -t topology/default.yaml trajectories.raw --since "
    "2026-11-24T15:00 --format parquet --out raw.parquet",
]


def register(subparsers: Any) -> None:
    from astraflow.cli.args import add_command, add_group, add_run_options

    verbs = add_group(subparsers, "replay", help="work from a run's retained topics: train, eval, "
                      "process, export", dest="replay_command",
                      examples=[_TRAIN_EXAMPLES[0], _EXPORT_EXAMPLES[0]])
    p = add_command(verbs, "train", help="train again on a run's recorded batches",
                    examples=_TRAIN_EXAMPLES,
                    description="Copy the batches of run RUN (--run, else the topology's) "
                    "into a new run (--into) and train a trainer on them from RUN's version 0, "
                    "with the topology's trainer settings and any trainer flags given after "
                    "--. Prints the sha256 of both runs' weights at the last version they have "
                    "in common: equal when nothing was changed. Running it again continues an "
                    "interrupted copy.")
    add_run_options(p)
    p.add_argument("--policy", help="the policy to train (default: the topology's only one)")
    p.add_argument("--into", metavar="NEW_RUN", help="the new run (default RUN-replay; the "
                   "same command again continues its copy)")
    p.add_argument("--model", help="the model version 0 was (default: fetched from RUN's "
                   "weight stream)")
    p.add_argument("--runs-dir", default="runs", help="where the trainer's log goes")
    _range_options(p, versions=True)
    _key_option(p)
    p.add_argument("trainer_flags", nargs=argparse.REMAINDER,
                   help="after --: `astraflow trainer run` flags that override the topology's")
    p.set_defaults(func=cmd_replay_train)
    v = add_command(verbs, "eval", help="accuracy of every k-th published version",
                    examples=_EVAL_EXAMPLES,
                    description="Evaluate every --every-th version RUN published (rebuilt "
                    "bit-exactly from its weight stream) on the topology's held-out set, "
                    "without rollouts; write the accuracy-versus-version curve to --out "
                    "(JSON, and a PNG beside it).")
    add_run_options(v)
    v.add_argument("--policy", help="the policy (default: the topology's only one)")
    v.add_argument("--every", type=int, help="every k-th version (default: the topology's "
                   "eval every_versions)")
    v.add_argument("--out", help="the curve's file (default RUNS_DIR/RUN/replay-eval.json)")
    v.add_argument("--runs-dir", default="runs")
    _key_option(v)
    v.set_defaults(func=cmd_replay_eval)
    _register_process(verbs)
    e = add_command(verbs, "export", help="a topic's records to JSON lines or Parquet",
                    examples=_EXPORT_EXAMPLES)
    add_run_options(e)
    e.add_argument("topic", metavar="TOPIC", help="logical topic name, e.g. batches.actor")
    e.add_argument("--out", required=True, help="the file to write")
    e.add_argument("--format", choices=["jsonl", "parquet"], default="jsonl")
    _range_options(e, versions=False)
    e.set_defaults(func=cmd_replay_export)


def _register_process(verbs: Any) -> None:
    from astraflow.cli.args import add_command, add_run_options

    p = add_command(verbs, "process", help="run a processor chain again over a run's "
                    "recorded trajectories", examples=_PROCESS_EXAMPLES,
                    description="Copy the recorded trajectories.raw of run RUN (--run, else "
                    "the topology's) into a new run (--into) and run every processor "
                    "downstream of it there: the topology's, or those of --chain FILE, with "
                    "--set overrides. Each record is judged as of its recorded time (the "
                    "weight versions RUN had published then). Prints what each processor "
                    "kept and dropped beside RUN's own figures. Running it again continues.")
    add_run_options(p)
    p.add_argument("--chain", metavar="FILE", help="the topology whose processors make the "
                   "chain (default: the run's own, -t)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a key of the chain's topology, e.g. "
                   "policies.actor.max_staleness=8 or processors.dyn.options.min_std=0.1 "
                   "(repeatable)")
    p.add_argument("--into", metavar="NEW_RUN", help="the new run (default RUN-process; the "
                   "same command again continues it)")
    _range_options(p, versions=True, what="the trajectories recorded before version N+1 "
                   "was published")
    _key_option(p)
    p.set_defaults(func=cmd_replay_process)


def _key_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--public-key", metavar="FILE", help="verify RUN's weight manifests with "
                   "this public key (PEM): one it did not sign is refused, said and never used "
                   "(default: $ASTRAFLOW_WEIGHTS_PUBLIC_KEY, else the topology's "
                   "weight_signing.public_key; none: nothing is verified)")


def _dlq(topo) -> str | None:
    """The full name of ``topo``'s dlq topic, None when it has none."""
    return topo.full_name("dlq") if "dlq" in topo.topics else None


def _range_options(p: argparse.ArgumentParser, versions: bool,
                   what: str = "the batches RUN trained into versions up to N") -> None:
    p.add_argument("--offsets", metavar="FROM:TO", help="offsets FROM up to, not including, "
                   "TO in every partition (either may be left out)")
    p.add_argument("--since", metavar="TIME", help="records at or after TIME (ISO, or ms)")
    p.add_argument("--until", metavar="TIME", help="records before TIME (ISO, or ms)")
    if versions:
        p.add_argument("--to-version", type=int, metavar="N", help=what)


def _range(config, topic: str, args: argparse.Namespace, manifests=None,
           by_batches: bool = True):
    """The range of ``topic`` that the range options allow; ``--to-version`` by the
    batches each version consumed (``by_batches``), else left to the caller."""
    from astraflow.kafka.offsets import Offsets
    from astraflow.replay.ranges import clamp_range, parse_offsets, parse_time, version_ends

    offsets = Offsets(config)
    bounds = parse_offsets(args.offsets) if args.offsets else (None, None)
    since = offsets.at_time(topic, parse_time(args.since) if args.since else None)
    until = offsets.at_time(topic, parse_time(args.until) if args.until else None)
    ends = None
    if by_batches and getattr(args, "to_version", None) is not None:
        ends = version_ends(manifests or [], topic, args.to_version)
    return clamp_range(offsets.watermarks(topic), bounds, (since, until), ends)


def cmd_replay_eval(args: argparse.Namespace) -> int:
    from astraflow.cli.context import load_run_topology
    from astraflow.cli.eval import cmd_eval_run
    from astraflow.cli.main import build_parser
    from astraflow.launch.plan import eval_args
    from astraflow.replay.ranges import ReplayError
    from astraflow.replay.train import pick_policy

    topo = args.loaded_topology
    policy = pick_policy(topo, args.policy)
    if topo.eval is None:
        raise ReplayError(f"{topo.source} has no eval: section (the held-out set to score)")
    out = args.out or str(Path(args.runs_dir) / topo.run / "replay-eval.json")
    argv = [*eval_args(topo, args.topology, policy), "--history", out, "--run", topo.run]
    if args.every:
        argv += ["--every", str(args.every)]
    if getattr(args, "bootstrap", None):
        argv += ["--bootstrap", args.bootstrap]
    if args.public_key:
        argv += ["--public-key", args.public_key]
    ns = build_parser().parse_args(argv)
    ns.loaded_topology = load_run_topology(ns)
    return cmd_eval_run(ns)


def cmd_replay_export(args: argparse.Namespace) -> int:
    from astraflow.cli.context import kafka_config
    from astraflow.kafka.offsets import Offsets
    from astraflow.replay.ranges import export_topic

    topo, config = args.loaded_topology, kafka_config(args)
    topic = topo.full_name(args.topic)
    Offsets(config).partitions(topic)  # a clear error when it does not exist
    n = export_topic(config, topic, _range(config, topic, args), Path(args.out), args.format)
    print(f"wrote {n} records of {topic} to {args.out}")
    return 0


def cmd_replay_process(args: argparse.Namespace) -> int:
    from astraflow.cli.context import kafka_config
    from astraflow.kafka.clients import make_admin
    from astraflow.kafka.topics import apply_topics
    from astraflow.replay.process import (
        ROOT,
        ChainRun,
        chain_of,
        load_chain_topology,
        original_figures,
        print_line,
        report,
        version_history,
    )
    from astraflow.replay.ranges import ReplayError, copy_range, describe_range, print_progress
    from astraflow.weights.signing import verifier_for

    src, config = args.loaded_topology, kafka_config(args)
    verifier = verifier_for(src.weight_signing, args.public_key)  # a bad key file: now
    into = args.into or f"{src.run}-process"  # again: the same run continues
    if into == src.run:
        raise ReplayError(f"--into {into}: that is the run replayed; name a new run")
    new = load_chain_topology(args.chain or args.topology, args.set, into)
    chain = chain_of(new)
    apply_topics(make_admin(config), new.resolved_topics())
    history = version_history(config, src, sorted(set(new.policies) | set(src.policies)),
                              verifier, _dlq(new))
    src_raw = src.full_name(ROOT)
    if args.to_version is not None:
        args.until = _until_version(history, args.to_version, args.until)
    rng = _range(config, src_raw, args, by_batches=False)
    print(f"replay process: {' -> '.join(chain)} over offsets {describe_range(rng)} of "
          f"{src_raw} into run {into}", flush=True)
    t0 = time.monotonic()
    copied = copy_range(config, src_raw, new.full_name(ROOT), rng, print_progress("copy"),
                        max_bytes=src.max_message_bytes(ROOT))
    t1 = time.monotonic()
    figures = ChainRun(new, chain, config, history).run(print_line)
    print(f"copied {copied} records in {t1 - t0:.1f} s; the chain ran in "
          f"{time.monotonic() - t1:.1f} s (its processors' start-up included)")
    original = original_figures(config, src, chain)
    print(report(chain, figures, original))
    print(f"replay: this run of the command (run {into}); original: run {src.run}, all of it, "
          "from its components' last status" if original else
          f"run {src.run}'s figures are gone from its status topic (kept an hour by default)")
    return 0


def _until_version(history: dict[str, list[tuple[int, int]]], version: int,
                   until: str | None) -> str | None:
    """``--until`` as the time the first version after ``version`` was published (the
    earlier of it and a given ``until``)."""
    from astraflow.replay.ranges import ReplayError, parse_time

    later = [ts for points in history.values() for ts, v in points if v > version]
    if not any(points for points in history.values()):
        raise ReplayError("--to-version: the run published no weight versions")
    if not later:
        return until  # no later version: up to the end
    ms = min(later)
    return str(min(ms, parse_time(until)) if until else ms)


def cmd_replay_train(args: argparse.Namespace) -> int:
    from astraflow.cli.context import kafka_config
    from astraflow.replay.train import ReplayTrain, replay_train
    from astraflow.weights.signing import verifier_for

    topo, config = args.loaded_topology, kafka_config(args)
    job = ReplayTrain(topology_path=args.topology, policy=args.policy, into=args.into,
                      model=args.model, runs_dir=Path(args.runs_dir),
                      trainer_flags=list(args.trainer_flags or []),
                      verifier=verifier_for(topo.weight_signing, args.public_key))
    replay_train(topo, config, job,
                 lambda topic, manifests: _range(config, topic, args, manifests))
    return 0
