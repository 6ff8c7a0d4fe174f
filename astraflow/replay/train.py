"""``astraflow replay train``: a policy trained again from a run's retained batches.

The source run's ``batches.<policy>`` (a range of it) are copied into a new run, a trainer
started from the model the source started from trains on them until it has committed every
copied batch, and the weights of both runs are compared at version 0 and at the last
version they have in common (bit-exact when the trainer settings are the same)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from astraflow.config.topology import Topology, with_overrides
from astraflow.kafka.clients import make_admin
from astraflow.kafka.config import KafkaConfig
from astraflow.kafka.lag import LagReader
from astraflow.kafka.topics import apply_topics
from astraflow.launch.plan import trainer_args
from astraflow.models.share import fetch_model
from astraflow.replay.ranges import (
    ReplayError,
    copy_range,
    describe_range,
    digest_at,
    print_progress,
    run_trainer,
    trusted_manifests,
)
from astraflow.weights.stores.kafka import read_manifests


@dataclass
class ReplayTrain:
    """What ``replay train`` does: which policy, into which new run, from which model,
    with which extra trainer flags (overrides of the topology's trainer section)."""

    topology_path: str  # the file the trainer is started with (``-t``)
    policy: str | None = None  # None: the topology's only policy
    into: str | None = None  # the new run; default ``<run>-replay``
    model: str | None = None  # default: the model the source run started from
    runs_dir: Path = Path("runs")
    trainer_flags: list[str] = field(default_factory=list)
    verifier: Any = None  # trusts the source run's manifests (``verifier_for``)


# the range of the source batches to train on: (topic, trusted manifests) -> OffsetRange
ChooseRange = Callable[[str, list[Any]], Any]


def replay_train(topo: Topology, config: KafkaConfig, job: ReplayTrain,
                 choose_range: ChooseRange) -> int:
    """Train ``job.policy`` of ``topo`` again from its retained batches (the range
    ``choose_range`` picks) into a new run; print both runs' weight digests at version 0
    and at the last common version; the newest version the replay published."""
    policy = pick_policy(topo, job.policy)
    src_batches, src_weights = (topo.full_name(f"batches.{policy}"),
                                topo.full_name(f"weights.{policy}"))
    manifests = [m for m in read_manifests(config, src_weights) if m.policy == policy]
    if not manifests:
        raise ReplayError(f"run {topo.run} published no weights on {src_weights}")
    into = job.into or f"{topo.run}-replay"  # again: the same copy continues
    if into == topo.run:
        raise ReplayError(f"--into {into}: that is the run replayed; name a new run")
    new = with_overrides(topo, into)
    apply_topics(make_admin(config), new.resolved_topics())
    dlq = new.full_name("dlq") if "dlq" in new.topics else None
    manifests = trusted_manifests(manifests, job.verifier, src_weights, config, dlq)
    rng = choose_range(src_batches, manifests)
    dst = new.full_name(f"batches.{policy}")
    print(f"replay train: offsets {describe_range(rng)} of {src_batches} into run {into}")
    copied = copy_range(config, src_batches, dst, rng, print_progress("copy"),
                        max_bytes=topo.max_message_bytes(f"batches.{policy}"))
    if not copied:
        raise ReplayError(f"nothing to train: the range of {src_batches} is empty")
    model = job.model or _start_model(topo, policy, config, src_weights,
                                      job.runs_dir / into / "model-v0", job.verifier)
    versions = _train(new, job, policy, model, config, dst)
    _compare(config, policy, (topo.run, src_weights, manifests),
             (into, new.full_name(f"weights.{policy}")), versions, job.verifier)
    return versions


def pick_policy(topo: Topology, policy: str | None) -> str:
    """``policy``, checked against the topology; the only policy when None."""
    if policy is None:
        if len(topo.policies) != 1:
            raise ReplayError(f"--policy: the topology has {sorted(topo.policies)}")
        return next(iter(topo.policies))
    if policy not in topo.policies:
        raise ReplayError(f"--policy {policy}: not one of {sorted(topo.policies)}")
    return policy


def _start_model(topo, policy: str, config, weights_topic: str, dest: Path,
                 verifier: Any = None) -> str:
    """The model the source run's trainer started from: the topology's model directory
    when it is there (its fp32 weights, as the trainer loaded them; version 0 is checked
    against the source's after training), else version 0 rebuilt from the weight stream
    (bf16 when the run published bf16: the replay then starts from the rounded weights),
    from the manifests ``verifier`` trusts."""
    spec_model = Path(topo.policies[policy].model)
    if (spec_model / "config.json").is_file():
        return str(spec_model)
    print(f"no model at {spec_model}: starting from version 0 of {weights_topic}")
    return str(_version0_model(config, weights_topic, policy, dest, verifier))


def _version0_model(config, weights_topic: str, policy: str, dest: Path,
                    verifier: Any = None) -> Path:
    if (dest / "config.json").is_file():
        return dest
    try:
        return fetch_model(config, weights_topic, policy, dest, wait_s=30, version=0,
                           verifier=verifier)
    except Exception as e:  # noqa: BLE001 - pruned blobs, a missing topic: say what to do
        raise ReplayError(f"cannot rebuild version 0 from {weights_topic} ({e}); give the "
                          "model it was trained from with --model DIR") from None


def _train(new: Topology, job: ReplayTrain, policy: str, model: str, config: KafkaConfig,
           dst: str) -> int:
    """Run ``astraflow trainer run`` on the new run until it has committed every copied
    batch; the newest version it published."""
    flags = trainer_args(new, job.topology_path, policy)
    flags[flags.index("--model") + 1] = model
    extra = [f for f in job.trainer_flags if f != "--"]
    run_dir = job.runs_dir / new.run
    cmd = [sys.executable, "-m", "astraflow.cli.main", *flags, "--run", new.run,
           "--state-dir", str(run_dir / f"trainer-state-{policy}"), *extra]
    # one intra-op thread, as `astraflow up` runs its trainers: the same float sums
    env = {"OMP_NUM_THREADS": "1", **os.environ, "ASTRAFLOW_BOOTSTRAP": config.bootstrap_servers}
    log_path = run_dir / "logs" / f"replay-trainer-{policy}.log"
    proc = run_trainer(cmd, env, log_path)
    print(f"trainer started (log {log_path})")
    try:
        _wait_trained(config, new.trainer_group(policy), dst, proc, log_path)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)
    weights = new.full_name(f"weights.{policy}")
    return max((m.version for m in read_manifests(config, weights)), default=0)


def _wait_trained(config, group: str, dst: str, proc, log_path: Path) -> None:
    reader, last = LagReader(config), 0.0
    try:
        while True:
            rows = reader.lag(group, [dst])
            done = sum(r.committed or 0 for r in rows)
            total = sum(r.end_offset for r in rows)
            if rows and done >= total:
                return
            if proc.poll() is not None:
                raise ReplayError(f"the trainer exited with {proc.returncode} after "
                                  f"{done}/{total} offsets; see {log_path}")
            if time.monotonic() - last >= 5:
                print(f"train: {done}/{total} batch offsets committed", flush=True)
                last = time.monotonic()
            time.sleep(1.0)
    finally:
        reader.close()


def _compare(config, policy: str, source: tuple, replay: tuple, replay_latest: int,
             verifier: Any = None) -> None:
    """Print the sha256 of both runs' weights at version 0 and at the last version they
    have in common (the source run's from the manifests ``verifier`` trusts)."""
    src_run, src_weights, manifests = source
    new_run, new_weights = replay
    common = min(max(m.version for m in manifests), replay_latest)
    for v in sorted({0, common}):
        try:
            a = digest_at(config, src_weights, policy, v, verifier)
            b = digest_at(config, new_weights, policy, v)
        except Exception as e:  # noqa: BLE001 - e.g. a version whose blobs were pruned
            print(f"cannot compare the weights at version {v}: {e}")
            continue
        print(f"version {v}: sha256 {a} (run {src_run})\n"
              f"version {v}: sha256 {b} (run {new_run})\n"
              + ("the same weights, bit for bit" if a == b else "the weights differ"))
