"""Environments from the ecosystems in a RaaS node on a real broker, each trained one step:
a verifiers single-turn environment and a verifiers tool environment (``verifiers``
workflow), a reasoning-gym task (a ``reasoning_gym:`` dataset with its own scorer), and an
OpenEnv environment server reached through OpenEnv's client (``openenv`` workflow). Each
group reaches trajectories.raw, its reward is the environment's own scorer on the answers
the group records (the tokens the policy sampled), and a trainer step runs on it."""

from __future__ import annotations

import json
import math

import pytest

from tests.conftest import running, wait_for
from tests.fakes import ScriptedEngine
from tests.integration.raas.test_raas import node_topology
from tests.unit.raas.test_engine import tiny_model, tiny_tokenizer
from tests.unit.raas.test_workflows import task_of

pytest.importorskip("verifiers", reason="the verifiers extra: pip install '.[test]'")
pytest.importorskip("reasoning_gym", reason="the reasoning-gym extra: pip install '.[test]'")
pytest.importorskip("openenv", reason="the openenv extra: pip install '.[test]'")

ENVS = "astraflow.envs.verifiers_examples"
SMALL = {"size": 4, "eval_size": 4}


def _group(kafka_config, make_topology, engine, workflow: str, options: dict, payload: dict):
    """The group a node with ``engine`` makes of one task of ``workflow`` (2 samples)."""
    from astraflow.kafka.clients import RecordProducer, read_all
    from astraflow.raas.node import NodeOptions, RaaSNode
    from astraflow.wire.records import TrajectoryGroup

    topo, _ = node_topology(make_topology)
    producer = RecordProducer(kafka_config)
    producer.produce(topo.full_name("tasks"), task_of(payload, workflow, "e0"), key="p-e0")
    producer.flush()
    node = RaaSNode(topo, {"actor": engine}, NodeOptions(
        instance="a", n_samples=2, poll_timeout_s=1.0,
        workflow_options={workflow: options}))
    with running(node):
        out, dlq = topo.full_name("trajectories.raw"), topo.full_name("dlq")
        wait_for(lambda: read_all(kafka_config, out, idle_s=0.3)
                 or read_all(kafka_config, dlq, idle_s=0.3), 180, "the group")
        letters = read_all(kafka_config, dlq, idle_s=0.3)
        assert not letters, letters[0].record
        (group,) = [r.record for r in read_all(kafka_config, out, expect=TrajectoryGroup)]
    assert sorted({s.sample_index for s in group.sequences}) == [0, 1]
    return group


def _answers(group, decode) -> dict[int, list[str]]:
    """Each episode's answers as recorded: the runs of trained (sampled) tokens, in order."""
    out: dict[int, list[str]] = {}
    for s in group.sequences:
        run: list[int] = []
        for t, m in [*zip(s.token_ids, s.loss_mask), (None, 0)]:
            if m:
                run.append(t)
            elif run:
                out.setdefault(s.sample_index, []).append(decode(run))
                run = []
    return out


def _rewards(group) -> dict[int, float]:
    return {s.sample_index: s.reward for s in group.sequences}


def _train_one_step(model_dir: str, group) -> dict[str, float]:
    from astraflow.config.sections import TrainerSpec
    from astraflow.trainer.trainer import Trainer
    from astraflow.wire.records import Batch

    trainer = Trainer(model_dir, TrainerSpec(), policy="actor")
    metrics = trainer.train_step(Batch(policy="actor", batch_id="b0", groups=[group]))
    assert math.isfinite(metrics["trainer/loss"]), metrics
    return metrics


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-ecosystems")
    tiny_model().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def char_model_dir(tmp_path_factory) -> str:
    """A tiny model over character codes: it trains on what ``ScriptedEngine`` records."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-chars")
    Qwen2ForCausalLM(Qwen2Config(vocab_size=256, hidden_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1,
                                 intermediate_size=64)).save_pretrained(path)
    return str(path)


def _engine(tiny_dir: str):
    from transformers import AutoModelForCausalLM

    from astraflow.raas.engine import TorchEngine

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, local_files_only=True)
    return TorchEngine(model.eval(), tiny_tokenizer(), policy="actor", version=0)


def _decoder(engine):
    return lambda ids: engine.tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.slow
def test_a_verifiers_single_turn_environment_trains_one_step_on_its_rubric(
        kafka_config, make_topology, tiny_dir):
    from astraflow.envs.verifiers_examples import correct
    from astraflow.tasks.verifiers_data import load_environment, row_input, verifiers_payloads

    env = f"{ENVS}:load_single_turn"
    (payload, *_) = verifiers_payloads(f"verifiers:{env}:train?size=4&eval_size=4")
    engine = _engine(tiny_dir)
    group = _group(kafka_config, make_topology, engine, "verifiers",
                   {"environment": env, "args": SMALL, "max_new_tokens": 12}, payload)
    info = row_input(load_environment(env, SMALL), payload["verifiers"])["info"]
    answers = _answers(group, _decoder(engine))
    for j, reward in _rewards(group).items():
        (answer,) = answers[j]  # one turn
        assert reward == correct(answer, info), (j, answer)
    assert group.metrics["verifiers/correct"] == pytest.approx(
        sum(_rewards(group).values()) / 2)
    _train_one_step(tiny_dir, group)


@pytest.mark.slow
def test_a_verifiers_tool_environment_calls_its_tool_and_trains_one_step(
        kafka_config, make_topology, char_model_dir):
    """The policy (scripted: the tiny model writes no tool call) calls the calculator in
    one episode and answers at once in the other; the tool's result is in the recorded
    conversation, not trained, and each reward is the rubric's on the final answer."""
    from astraflow.envs.verifiers_examples import calculate, correct
    from astraflow.tasks.verifiers_data import load_environment, row_input, verifiers_payloads

    env = f"{ENVS}:load_tool"
    (payload, *_) = verifiers_payloads(f"verifiers:{env}:train?size=4&eval_size=4")
    info = row_input(load_environment(env, SMALL), payload["verifiers"])["info"]
    call = '<tool_call>{"name": "calculate", "arguments": {"expression": "6*7"}}</tool_call>'

    class Policy(ScriptedEngine):
        called = False

        def next_reply(self, prompt: str, params) -> str:
            if not self.called:  # the first request of all calls the tool
                self.called = True
                return call
            # after the tool's answer: the right answer; without it: a wrong one
            right = f"<answer>{payload['answer']}</answer>"
            return right if call in prompt else "<answer>0</answer>"

    engine = Policy()
    group = _group(kafka_config, make_topology, engine, "verifiers",
                   {"environment": env, "args": SMALL, "max_new_tokens": 96}, payload)
    answers = _answers(group, engine.decode)
    rewards = _rewards(group)
    called = [j for j, a in answers.items() if a[0] == call]
    assert len(called) == 1, answers
    (j,) = called
    assert len(answers[j]) == 2 and calculate("6*7") == "42"
    text = "".join(chr(t) for s in group.sequences if s.sample_index == j for t in s.token_ids)
    assert "42" in text.split(call, 1)[1]  # the tool's result, masked (not in any answer)
    for k, reward in rewards.items():
        assert reward == correct(answers[k][-1], info), (k, answers[k])
    assert sorted(rewards.values()) == [0.0, 1.0]
    assert group.metrics["verifiers/calculate_calls"] == 0.5
    _train_one_step(char_model_dir, group)


@pytest.mark.slow
def test_a_reasoning_gym_task_trains_one_step_on_its_own_scorer(
        kafka_config, make_topology, tiny_dir):
    from astraflow.dataflow.feeder import load_payloads
    from astraflow.tasks.reasoning_gym import entry_of, extract

    (payload, *_) = load_payloads(
        dataset="reasoning_gym:basic_arithmetic:train?max_terms=2&max_digits=1", size=4)
    engine = _engine(tiny_dir)
    group = _group(kafka_config, make_topology, engine, "single_turn",
                   {"reward": "reasoning_gym", "max_new_tokens": 8}, payload)
    dataset, entry = entry_of(json.loads(json.dumps(payload)))
    answers = _answers(group, _decoder(engine))
    for j, reward in _rewards(group).items():
        (answer,) = answers[j]
        assert reward == dataset.score_answer(extract(answer), entry), (j, answer)
    _train_one_step(tiny_dir, group)


@pytest.mark.slow
def test_an_openenv_server_is_stepped_through_its_client_and_trains_one_step(
        kafka_config, make_topology, tiny_dir):
    """The node serves the OpenEnv app on localhost and steps it through OpenEnv's
    client; each episode's reward is the environment's scorer of the answer that ended it."""
    from astraflow.envs.openenv_arith import _NUMBER, MAX_TRIES, problem, score

    payload = {"prompt": "unused", "answer": "unused", "seed": 7}
    engine = _engine(tiny_dir)
    group = _group(kafka_config, make_topology, engine, "openenv",
                   {"app": "astraflow.envs.openenv_arith:app", "max_new_tokens": 6,
                    "timeout_s": 120}, payload)
    _, answer = problem(7)
    answers = _answers(group, _decoder(engine))
    steps = {s.sample_index: int(s.meta["env_steps"]) for s in group.sequences}
    for j, reward in _rewards(group).items():
        got = answers[j]
        assert len(got) == steps[j] <= MAX_TRIES
        # the environment ends at the first answer with a number, else after MAX_TRIES
        ended = next((i for i, a in enumerate(got) if _NUMBER.search(a)), MAX_TRIES - 1)
        assert ended == len(got) - 1, got
        assert reward == score(got[-1], answer), (j, got)
    _train_one_step(tiny_dir, group)
