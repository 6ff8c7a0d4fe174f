"""Data algorithms on a real broker: a post-rollout chain, GRESO's rebuild, the mixer."""

from __future__ import annotations

import json
import threading
from collections import Counter

from astraflow.dataflow.runtime import ProcessorRuntime
from astraflow.kafka.clients import RecordProducer, read_all
from astraflow.wire.records import ComponentStatus, Sequence, Task, TrajectoryGroup, WeightManifest
from tests.conftest import wait_for


def seq(reward: float, versions: list[int]) -> Sequence:
    n = len(versions)
    return Sequence(policy="actor", token_ids=list(range(n)),
                    loss_mask=[int(v >= 0) for v in versions], logprobs=[0.0] * n,
                    versions=versions, reward=reward, sample_index=0, finish_reason="stop")


def group(gid: str, rewards: list[float], versions: list[int] | None = None,
          prompt: str | None = None) -> TrajectoryGroup:
    versions = versions or [-1, 5]
    return TrajectoryGroup(group_id=gid, prompt_id=prompt or gid, task_id=gid, workflow="w",
                           source="s", raas_id="r", pool="p",
                           sequences=[seq(r, versions) for r in rewards], rewards=list(rewards))


def task(prompt: str, n: int, source: str = "s") -> Task:
    return Task(task_id=f"{prompt}#{n}", prompt_id=prompt, workflow="w", payload="{}",
                source=source)


def manifest(version: int) -> WeightManifest:
    return WeightManifest(policy="actor", version=version, base_version=None, kind="full",
                          dtype="float32", tensors=[], blobs=[], num_params=0, num_changed=0,
                          sparsity=0.0, encoded_bytes=0, trainer_step=version)


def start(runtime: ProcessorRuntime) -> threading.Thread:
    t = threading.Thread(target=runtime.run, daemon=True)
    t.start()
    return t


def stop(runtime: ProcessorRuntime, thread: threading.Thread) -> None:
    runtime.stop()
    thread.join(30)
    assert not thread.is_alive()


def latest_metrics(kafka_config, topo, component_prefix: str) -> dict[str, float]:
    statuses = [r.record for r in read_all(kafka_config, topo.full_name("status"), idle_s=0.5,
                                           expect=ComponentStatus)
                if r.record.component_id.startswith(component_prefix)]
    return statuses[-1].metrics if statuses else {}


def test_post_rollout_chain_on_the_broker(kafka_config, make_topology, astraflow_cli, tmp_path):
    """raw -> dynamic_sampling (CLI process) -> reward_norm -> staleness_filter -> trajectories."""
    poll = {"poll_timeout_s": 0.2}
    topo, path = make_topology(
        topics={"trajectories.raw": {}, "trajectories.sampled": {}, "trajectories.normed": {},
                "trajectories": {}, "weights.actor": {"partitions": 1}},
        processors={
            "ds": {"kind": "dynamic_sampling", "inputs": ["trajectories.raw"],
                   "outputs": ["trajectories.sampled"], **poll},
            "norm": {"kind": "reward_norm", "inputs": ["trajectories.sampled"],
                     "outputs": ["trajectories.normed"], "options": {"divide_std": False},
                     **poll},
            "stale": {"kind": "staleness_filter", "inputs": ["trajectories.normed"],
                      "outputs": ["trajectories"], "options": {"max_staleness": 1}, **poll},
        })
    producer = RecordProducer(kafka_config)
    producer.produce(topo.full_name("weights.actor"), manifest(5), key="actor")
    good = [group(f"good{i}", [1.0, 0.0, 0.0, 1.0]) for i in range(6)]
    flat = [group(f"flat{i}", [1.0, 1.0, 1.0, 1.0]) for i in range(4)]
    stale = [group(f"stale{i}", [1.0, 0.0], versions=[-1, 2]) for i in range(3)]
    for g in good + flat + stale:
        producer.produce(topo.full_name("trajectories.raw"), g, key=g.prompt_id)
    producer.flush()

    proc = astraflow_cli("processor", "run", "ds", "--topology", str(path), "--instance", "cli",
                         log=tmp_path / "ds.log")
    runtimes = [ProcessorRuntime(topo, name, instance="t") for name in ("norm", "stale")]
    threads = [start(rt) for rt in runtimes]
    out_topic = topo.full_name("trajectories")
    try:
        wait_for(lambda: len(read_all(kafka_config, out_topic, idle_s=0.5)) >= len(good), 90,
                 "the good groups at the end of the chain")
        wait_for(lambda: latest_metrics(kafka_config, topo, "ds/").get(
            "dynamic_sampling/dropped") == len(flat), 30, "dynamic sampling's counts on status")
    finally:
        proc.terminate()
        for rt, t in zip(runtimes, threads):
            stop(rt, t)
    assert proc.wait(30) == 0, (tmp_path / "ds.log").read_text()[-2000:]
    out = [r.record for r in read_all(kafka_config, out_topic, expect=TrajectoryGroup)]
    assert Counter(g.group_id for g in out) == Counter(g.group_id for g in good)  # exactly once
    for g in out:
        assert g.rewards == [0.5, -0.5, -0.5, 0.5] == [s.reward for s in g.sequences]
        assert json.loads(g.meta["raw_rewards"]) == [1.0, 0.0, 0.0, 1.0]
    ds_metrics = latest_metrics(kafka_config, topo, "ds/")
    assert ds_metrics["dynamic_sampling/kept"] == len(good) + len(stale)
    assert runtimes[1].processor.dropped == len(stale)
    assert runtimes[0].processor.metrics()["reward_norm/normalised"] == len(good) + len(stale)


def test_greso_state_after_restart_equals_state_before(kafka_config, make_topology):
    topo, _ = make_topology(
        topics={"tasks.source": {}, "tasks": {}, "trajectories": {"partitions": 3}},
        processors={"greso": {"kind": "greso", "inputs": ["tasks.source"], "outputs": ["tasks"],
                              "poll_timeout_s": 0.2,
                              "options": {"window": 8, "adapt_every": 3, "step": 0.05,
                                          "min_submit_prob": 0.0}}})
    producer = RecordProducer(kafka_config)
    traj = topo.full_name("trajectories")

    def feed(start: int, n: int) -> None:
        for i in range(start, start + n):
            prompt = f"p{i % 12}"
            rewards = [1.0, 1.0] if i % 12 < 6 else ([0.0, 0.0] if i % 12 < 9 else [0.0, 1.0])
            producer.produce(traj, group(f"g{i}", rewards, prompt=prompt), key=prompt)
        producer.flush()

    feed(0, 36)  # before the processor starts: read on open
    rt = ProcessorRuntime(topo, "greso", instance="a")
    t = start(rt)
    wait_for(lambda: rt.processor.selector.observed == 36, 60, "catch-up on trajectories")
    feed(36, 24)  # while it runs: drained as it goes
    for i in range(40):
        producer.produce(topo.full_name("tasks.source"), task(f"p{i % 12}", i),
                         key=f"p{i % 12}")
    producer.flush()
    m = rt.processor.metrics
    wait_for(lambda: m()["greso/passed"] + m()["greso/skipped"] == 40, 60, "40 tasks decided")
    wait_for(lambda: rt.processor.selector.observed == 60, 30, "all 60 groups observed")
    before = rt.processor.snapshot()
    stop(rt, t)
    assert before["streaks"]["p0"] == ("easy", 5) and "p10" not in before["streaks"]
    assert m()["greso/skipped_easy"] > 0 and m()["greso/passed"] > 0
    forwarded = read_all(kafka_config, topo.full_name("tasks"), expect=Task)
    assert len(forwarded) == m()["greso/passed"]

    rt2 = ProcessorRuntime(topo, "greso", instance="b")
    t2 = start(rt2)
    try:
        wait_for(lambda: rt2.processor.selector.observed == 60, 60, "rebuild after restart")
        after = rt2.processor.snapshot()
    finally:
        stop(rt2, t2)
    assert after == before
    assert rt2.processor.selector.p_easy == rt.processor.selector.p_easy


def test_mixer_holds_to_keep_ratios_and_a_restart_loses_nothing(kafka_config, make_topology):
    topo, _ = make_topology(
        topics={"tasks.source": {"partitions": 2}, "tasks.extra": {"partitions": 1},
                "tasks": {"partitions": 1}},
        processors={"mix": {"kind": "mixer", "inputs": ["tasks.source", "tasks.extra"],
                            "outputs": ["tasks"], "poll_timeout_s": 0.2,
                            "options": {"ratios": {"tasks.source": 2, "tasks.extra": 1},
                                        "max_hold_ms": None}}})
    producer = RecordProducer(kafka_config)
    for i in range(20):
        producer.produce(topo.full_name("tasks.source"), task(f"a{i}", i, "a"), key=f"a{i}")
    for i in range(4):
        producer.produce(topo.full_name("tasks.extra"), task(f"b{i}", i, "b"), key=f"b{i}")
    producer.flush()
    out_topic = topo.full_name("tasks")
    rt = ProcessorRuntime(topo, "mix", instance="a")
    t = start(rt)
    try:
        # stride order a b a a b a a b ... until b runs out: 9 a's and 4 b's
        wait_for(lambda: len(read_all(kafka_config, out_topic, idle_s=0.5)) == 13, 60,
                 "9 + 4 mixed tasks")
        wait_for(lambda: rt.processor.mix.held == 11, 10, "the other 11 held")
    finally:
        stop(rt, t)
    first = [r.record.source for r in read_all(kafka_config, out_topic, expect=Task)]
    assert Counter(first) == {"a": 9, "b": 4}
    assert rt.processor.metrics()["mixer/forced"] == 0
    # the 11 held tasks were not committed: a new instance gets them with the next b's
    for i in range(4, 10):
        producer.produce(topo.full_name("tasks.extra"), task(f"b{i}", i, "b"), key=f"b{i}")
    producer.flush()
    rt2 = ProcessorRuntime(topo, "mix", instance="b")
    t2 = start(rt2)
    try:
        wait_for(lambda: len(read_all(kafka_config, out_topic, idle_s=0.5)) == 30, 60,
                 "all 30 tasks")
    finally:
        stop(rt2, t2)
    ids = Counter(r.record.task_id for r in read_all(kafka_config, out_topic, expect=Task))
    assert ids == Counter([f"a{i}#{i}" for i in range(20)] + [f"b{i}#{i}" for i in range(10)])
