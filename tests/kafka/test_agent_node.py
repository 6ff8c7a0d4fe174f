"""The agent workflow in a RaaS node on a real broker: a program written against the
`openai` client alone rolls out through the node's endpoint; the group on
trajectories.raw holds exactly the tokens the engine sampled (prompt masked, answers
trained); a task whose program keeps failing goes to the dlq with the reason, and the
node goes on."""

from __future__ import annotations

import sys
import textwrap

import pytest

from tests.conftest import running, wait_for
from tests.kafka.test_raas import node_topology, task_of, tiny_model, tiny_tokenizer

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

    program = tmp_path / "agent.py"
    program.write_text(textwrap.dedent(PROGRAM))
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
        workflow_options={"agent": {"command": [sys.executable, str(program)],
                                    "max_new_tokens": 4, "timeout_s": 60, "attempts": 2}}))
    with running(node):
        out, dlq = topo.full_name("trajectories.raw"), topo.full_name("dlq")
        wait_for(lambda: read_all(kafka_config, out, idle_s=0.3)
                 and read_all(kafka_config, dlq, idle_s=0.3), 120, "a group and a letter")
        (group,) = [r.record for r in read_all(kafka_config, out, expect=TrajectoryGroup)]
        (letter,) = [r.record for r in read_all(kafka_config, dlq, expect=DeadLetter)]
    # two episodes of two turns each; the tiny model has no chat template, so its second
    # prompt is the plain text of the first answer (its end token gone): it does not extend
    # the sampled tokens and starts a sequence of its own rather than being re-tokenised
    assert group.task_id == "good" and group.rewards == [1.0] * 4
    assert sorted(s.sample_index for s in group.sequences) == [0, 0, 1, 1]
    prompt = eng.encode("1+2=")
    for s in group.sequences:
        trained = [t for t, m in zip(s.token_ids, s.loss_mask) if m]
        assert s.token_ids[:len(prompt)] == prompt and not any(s.loss_mask[:len(prompt)])
        # the trained tokens are exactly those of one generation, the rest masked
        assert trained in sampled, (trained, sampled)
        assert s.token_ids[len(s.token_ids) - len(trained):] == trained
        assert all(v >= 0 for v, m in zip(s.versions, s.loss_mask) if m)
    failures = [x.meta.get("agent_failures") for x in group.sequences]
    assert group.metrics["agent/failed_attempts"] == 0.0, failures
    assert letter.error.startswith("TaskError: agent: 2 of 2 episodes failed after 2 "
                                   "attempt(s): attempt 1: exit code 1: the agent gave up")
