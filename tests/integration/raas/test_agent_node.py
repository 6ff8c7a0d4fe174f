"""The agent workflow in a RaaS node on a real broker: a program written against the
`openai` client alone rolls out through the node's endpoint; the group on
trajectories.raw holds exactly the tokens the engine sampled (prompt masked, answers
trained); a task whose program keeps failing goes to the dlq with the reason, and the
node goes on. An untrusted program sees no reference answer and cannot set its own
reward: printed, returned or posted, the workflow's reward of what the model sampled
wins."""

from __future__ import annotations

import pytest

from tests.conftest import running, wait_for
from tests.integration.raas.test_raas import node_topology
from tests.unit.raas.test_agent import _script
from tests.unit.raas.test_engine import tiny_model, tiny_tokenizer
from tests.unit.raas.test_workflows import task_of

PROGRAM = """
    import json, os
    from openai import OpenAI
    task = json.loads(os.environ["ASTRAFLOW_TASK"])
    if task.get("crash"):
        raise SystemExit("the agent gave up")
    client = OpenAI()
    messages = [{"role": "user", "content": task["prompt"]}]
    first = client.chat.completions.create(model="actor", messages=messages)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "again"}]
    second = client.chat.completions.create(model="actor", messages=messages)
    # the untrained tiny model may end at once: an empty answer is still an answer
    answered = isinstance(second.choices[0].message.content, str)
    print(json.dumps({"reward": 1.0 if answered else 0.5}))
"""


@pytest.mark.slow
def test_a_node_rolls_out_an_openai_program_token_exactly_and_dead_letters_failures(
        kafka_config, make_topology, tmp_path):
    from astraflow.kafka.clients import RecordProducer, read_all
    from astraflow.raas.engine import TorchEngine
    from astraflow.raas.node import NodeOptions, RaaSNode
    from astraflow.wire.records import DeadLetter, TrajectoryGroup

    program = _script(tmp_path, PROGRAM)
    topo, _ = node_topology(make_topology)
    eng = TorchEngine(tiny_model(), tiny_tokenizer(), policy="actor", version=0)
    sampled: list[list[int]] = []
    real = eng.generate

    def generate(prompts, params):  # what the engine sampled, to compare with the group
        out = real(prompts, params)
        sampled.extend(g.token_ids for gs in out for g in gs)
        return out

    eng.generate = generate
    producer = RecordProducer(kafka_config)
    for t in (task_of({"prompt": "1+2=", "answer": "3"}, "agent", "good"),
              task_of({"prompt": "2+2=", "answer": "4", "crash": True}, "agent", "crash")):
        producer.produce(topo.full_name("tasks"), t, key=f"p-{t.task_id}")
    producer.flush()
    node = RaaSNode(topo, {"actor": eng}, NodeOptions(
        instance="a", n_samples=2, poll_timeout_s=1.0,
        # trusted: the program's own reward counts (the next test: when it does not)
        workflow_options={"agent": {"command": list(program), "trusted": True,
                                    "max_new_tokens": 4, "timeout_s": 60, "attempts": 2}}))
    with running(node):
        out, dlq = topo.full_name("trajectories.raw"), topo.full_name("dlq")
        wait_for(lambda: read_all(kafka_config, out, idle_s=0.3)
                 and read_all(kafka_config, dlq, idle_s=0.3), 120, "a group and a letter")
        (group,) = [r.record for r in read_all(kafka_config, out, expect=TrajectoryGroup)]
        (letter,) = [r.record for r in read_all(kafka_config, dlq, expect=DeadLetter)]
    # two episodes of two turns each: every run of trained tokens is exactly one
    # generation (two per episode, in one sequence when the second prompt extends the
    # first turn's sampled tokens, else in two), the prompt and the second message masked
    assert group.task_id == "good" and set(group.rewards) == {1.0}
    assert sorted({s.sample_index for s in group.sequences}) == [0, 1]
    prompt = eng.encode("1+2=")
    runs: dict[int, list[list[int]]] = {0: [], 1: []}
    for s in group.sequences:
        assert s.token_ids[:len(prompt)] == prompt and not any(s.loss_mask[:len(prompt)])
        run: list[int] = []
        for t, m in [*zip(s.token_ids, s.loss_mask), (None, 0)]:
            if m:
                run.append(t)
            elif run:
                runs[s.sample_index].append(run)
                run = []
        assert all(v >= 0 for v, m in zip(s.versions, s.loss_mask) if m)
    assert all(len(r) == 2 and all(x in sampled for x in r) for r in runs.values()), (
        runs, sampled)
    # the second prompt goes on from the first answer as sampled: one sequence an episode,
    # named by its episode (one member of the group's statistics in the trainer)
    assert sorted((s.sample_index, s.meta["turns"], s.meta["episode"])
                  for s in group.sequences) == [(0, "2", "0"), (1, "2", "1")]
    failures = [x.meta.get("agent_failures") for x in group.sequences]
    assert group.metrics["agent/failed_attempts"] == 0.0, failures
    assert letter.error.startswith("TaskError: agent: 2 of 2 episodes failed after 2 "
                                   "attempt(s): attempt 1: exit code 1: the agent gave up")


GAMER = """
    import json, os, urllib.error, urllib.request
    from openai import OpenAI
    task = json.loads(os.environ["ASTRAFLOW_TASK"])
    if set(task) != {"prompt"}:  # the reference never reaches an untrusted program
        raise SystemExit(f"saw {sorted(task)}")
    client = OpenAI()
    client.chat.completions.create(model="actor",
                                   messages=[{"role": "user", "content": task["prompt"]}])
    url = os.environ.get("ASTRAFLOW_REWARD_URL") or os.environ["OPENAI_BASE_URL"] + "/reward"
    post = urllib.request.Request(url, data=json.dumps({"reward": 1}).encode(), headers={
        "Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
        "Content-Type": "application/json"})
    try:
        urllib.request.urlopen(post, timeout=10)
        raise SystemExit("the endpoint took a reward from an untrusted program")
    except urllib.error.HTTPError as e:
        assert e.code == 403, e.code
    print(json.dumps({"reward": 1.0, "answer": "1000"}))  # claims a reward, and the answer
"""


@pytest.mark.slow
def test_an_untrusted_program_earns_the_workflows_reward_whatever_it_reports(
        kafka_config, make_topology, tmp_path):
    from astraflow.kafka.clients import RecordProducer, read_all
    from astraflow.raas.engine import TorchEngine
    from astraflow.raas.node import NodeOptions, RaaSNode
    from astraflow.wire.records import TrajectoryGroup

    topo, _ = node_topology(make_topology)
    eng = TorchEngine(tiny_model(), tiny_tokenizer(), policy="actor", version=0)
    producer = RecordProducer(kafka_config)
    # 1000 is more tokens than the model may sample: every reward of the workflow is 0
    producer.produce(topo.full_name("tasks"), task_of({"prompt": "999+1=", "answer": "1000"},
                                                      "agent", "gamed"), key="p-gamed")
    producer.flush()
    node = RaaSNode(topo, {"actor": eng}, NodeOptions(
        instance="a", n_samples=2, poll_timeout_s=1.0,
        workflow_options={"agent": {"command": list(_script(tmp_path, GAMER)),
                                    "reward": "exact_match", "max_new_tokens": 1,
                                    "timeout_s": 60, "attempts": 1}}))
    with running(node):
        out = topo.full_name("trajectories.raw")
        wait_for(lambda: read_all(kafka_config, out, idle_s=0.3), 120, "the group")
        (group,) = [r.record for r in read_all(kafka_config, out, expect=TrajectoryGroup)]
    assert group.task_id == "gamed" and group.rewards == [0.0, 0.0]
    assert group.metrics["agent/ignored_rewards"] == 2.0
