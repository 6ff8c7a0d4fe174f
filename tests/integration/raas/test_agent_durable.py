"""Durable agent episodes on a real broker: a RaaS node is SIGKILLed in the middle of
multi-turn episodes; the node that takes the task over replays every call the first one
logged (no token of them sampled again, each as first sampled), goes on live, and the
task's group is produced once."""

from __future__ import annotations

import json
import signal

import pytest

from tests.conftest import wait_for
from tests.integration.raas.test_raas import model_dir, node_topology, start_node  # noqa: F401
from tests.unit.raas.test_agent import _script
from tests.unit.raas.test_workflows import task_of  # noqa: F401

TURNS = 4
# a conversation of TURNS calls, a pause after each: a kill lands in the middle of it
PROGRAM = f"""
    import json, time
    from openai import OpenAI
    client = OpenAI()
    messages = [{{"role": "user", "content": "1+2="}}]
    for turn in range({TURNS}):
        r = client.chat.completions.create(model="actor", messages=messages, max_tokens=3)
        messages += [{{"role": "assistant", "content": r.choices[0].message.content}},
                     {{"role": "user", "content": "again"}}]
        time.sleep(1.5)
    print(json.dumps({{"done": True}}))
"""


@pytest.mark.slow
def test_a_node_killed_mid_episode_is_replayed_elsewhere_from_the_log(
        kafka_config, kafka_bootstrap, make_topology, model_dir, tmp_path):  # noqa: F811
    from astraflow.kafka.clients import RecordProducer, read_all
    from astraflow.wire.records import EpisodeCall, TrajectoryGroup

    topo, path = node_topology(make_topology, episodes={"partitions": 1})
    producer = RecordProducer(kafka_config)
    producer.produce(topo.full_name("tasks"), task_of({"prompt": "1+2=", "answer": "3"},
                                                      "agent", "long"), key="p-long")
    producer.flush()
    opts = ["--workflow-options", "agent=" + json.dumps({
        "command": list(_script(tmp_path, PROGRAM)), "reward": "exact_match",
        "timeout_s": 120, "attempts": 1})]
    episodes, out = topo.full_name("episodes"), topo.full_name("trajectories.raw")

    def logged() -> list[EpisodeCall]:
        return [r.record for r in read_all(kafka_config, episodes, idle_s=0.3,
                                           expect=EpisodeCall, isolation="read_uncommitted")]

    procs = []
    try:
        a = start_node(kafka_bootstrap, path, model_dir, "a", tmp_path / "a.log", *opts)
        procs.append(a)
        # both episodes (n_samples 2) half done
        wait_for(lambda: len({(c.episode, c.index) for c in logged()}) >= 4, 120,
                 "node a to log two calls of each episode")
        a.send_signal(signal.SIGKILL)
        a.wait(10)
        before = logged()
        assert {c.raas_id for c in before} == {"raas.default/a"}
        assert not read_all(kafka_config, out, idle_s=0.3)  # nothing committed by a
        b = start_node(kafka_bootstrap, path, model_dir, "b", tmp_path / "b.log", *opts)
        procs.append(b)
        wait_for(lambda: read_all(kafka_config, out, idle_s=0.3), 120, "node b's group")
        b.send_signal(signal.SIGTERM)
        assert b.wait(30) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    (group,) = [r.record for r in read_all(kafka_config, out, idle_s=0.5,
                                           expect=TrajectoryGroup)]
    assert group.raas_id == "raas.default/b" and len({s.sample_index for s in group.sequences}) == 2
    calls = logged()
    mine = [c for c in before if c.kind == "call"]
    # b replayed every call a had logged, sampled none of them again, and diverged nowhere
    assert group.metrics["agent/replayed_calls"] == len(mine)
    assert group.metrics["agent/replayed_tokens"] == sum(len(t) for c in mine for t in c.token_ids)
    assert group.metrics["agent/replays_diverged"] == 0
    by_b = [c for c in calls if c.raas_id == "raas.default/b" and c.kind == "call"]
    assert len(mine) + len(by_b) == 2 * TURNS  # each call sampled once, by one node
    for episode in {c.episode for c in mine}:
        first = sorted(c.index for c in mine if c.episode == episode)
        after = sorted(c.index for c in by_b if c.episode == episode)
        assert first + after == list(range(TURNS))
    # the tokens a sampled are the group's, with their versions, as first sampled
    trained = [[t for t, m in zip(s.token_ids, s.loss_mask) if m] for s in group.sequences]
    for c in mine:
        (tokens,) = c.token_ids
        assert any(_contains(run, tokens) for run in trained), (c.episode, c.index)
    assert [c.kind for c in calls][-1] == "end"  # b's group made: its episodes are over


def _contains(seq: list[int], part: list[int]) -> bool:
    return any(seq[i:i + len(part)] == part for i in range(len(seq) - len(part) + 1))
