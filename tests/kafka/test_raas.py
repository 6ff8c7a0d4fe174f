"""RaaS: engine log-probs and versions, workflows, the calculator, and the node on a real
broker (exactly once across a SIGKILL mid-rollout, dead letters, status, weights follow)."""

from __future__ import annotations

import json
import math
import signal
import string
import sys
from pathlib import Path

import pytest
import torch

from astraflow.raas.calc import CalcError, calculate, evaluate
from astraflow.raas.engine import Generation, SamplingParams, TorchEngine
from astraflow.raas.workflows import TaskError, make_workflow
from astraflow.raas.workflows.latency import Latency
from astraflow.wire.records import ComponentStatus, DeadLetter, Task, TrajectoryGroup
from tests.conftest import REPO, running, wait_for
from tests.fakes import ScriptedEngine

CHARS = string.digits + "+-*/()=.?<> " + string.ascii_lowercase


def tiny_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<unk>", *CHARS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def tiny_model(seed: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=64,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
    )
    return Qwen2ForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def engine() -> TorchEngine:
    return TorchEngine(tiny_model(), tiny_tokenizer(), policy="actor", version=0, device="cpu")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-model")
    tiny_model().save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def nucleus_logprob(logits: list[float], token: int, temperature: float, top_p: float) -> float:
    """By hand: the log-probability of ``token`` under softmax(logits / T) renormalised over
    the smallest set of most likely tokens whose probability reaches ``top_p``."""
    scaled = [x / temperature for x in logits]
    top = max(scaled)
    weights = [math.exp(x - top) for x in scaled]
    total = sum(weights)
    probs = [w / total for w in weights]
    kept, mass = set(), 0.0
    for i in sorted(range(len(probs)), key=lambda i: -probs[i]):
        if mass >= top_p:
            break
        kept.add(i)
        mass += probs[i]
    assert token in kept, "a sampled token is always in the nucleus"
    return math.log(probs[token] / sum(probs[i] for i in kept))


def teacher_forced(model, g: Generation, temperature: float, top_p: float = 1.0) -> list[float]:
    ids = torch.tensor([g.prompt_ids + g.token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0].double()
    p = len(g.prompt_ids)
    return [nucleus_logprob(logits[p - 1 + i].tolist(), t, temperature, top_p)
            for i, t in enumerate(g.token_ids)]


# --- engine ------------------------------------------------------------------------------
def test_engine_logprobs_equal_teacher_forced_forward(engine):
    prompts = [engine.encode("1+1="), engine.encode("what is 12*7?"), engine.encode("9")]
    params = SamplingParams(max_new_tokens=24, temperature=0.7, top_p=0.9, n=3, seed=3)
    out = engine.generate(prompts, params)
    assert [len(o) for o in out] == [3, 3, 3]
    for prompt, samples in zip(prompts, out):
        for g in samples:
            assert g.prompt_ids == prompt
            assert len(g.token_ids) == len(g.logprobs) == len(g.versions) >= 1
            assert g.finish_reason in ("stop", "length")
            if g.finish_reason == "length":
                assert len(g.token_ids) == 24
            # the distribution sampled from: tempered, renormalised over the top-0.9 nucleus
            ref = teacher_forced(engine.model, g, 0.7, top_p=0.9)
            assert max(abs(a - b) for a, b in zip(ref, g.logprobs)) < 1e-4
            untruncated = teacher_forced(engine.model, g, 0.7)
            assert min(a - b for a, b in zip(g.logprobs, untruncated)) > 1e-3
    # the same seed gives the same samples
    again = engine.generate(prompts, params)
    assert [[g.token_ids for g in o] for o in again] == [[g.token_ids for g in o] for o in out]


def test_engine_stamps_versions_across_weight_swap(engine):
    prompt = [engine.encode("2*3=")]
    params = SamplingParams(max_new_tokens=8, temperature=1.0, n=2, seed=0)
    first = engine.generate(prompt, params)[0]
    assert all(v == 0 for g in first for v in g.versions)
    old = {k: v.clone() for k, v in engine.model.state_dict().items()}
    new = {k: v + 0.05 * torch.randn_like(v) for k, v in old.items()}
    try:
        engine.load_state_dict(new, version=5)
        assert engine.version == 5
        second = engine.generate(prompt, params)[0]
        assert all(v == 5 for g in second for v in g.versions)
        for g in second:  # behaviour log-probs come from the new weights
            ref = teacher_forced(engine.model, g, 1.0)
            assert max(abs(a - b) for a, b in zip(ref, g.logprobs)) < 1e-4
        with pytest.raises(ValueError, match="does not fit"):
            engine.load_state_dict({"nope": torch.zeros(1)}, version=6)
        assert engine.version == 5
    finally:
        engine.load_state_dict(old, version=0)


def test_engine_samples_a_batch_of_8_in_one_call_to_the_token_limit(engine):
    """Eight independent samples of one prompt, each running to ``max_new_tokens`` (no stop
    token asked for). Tokens per second is a bench: ``bench/engines.py``."""
    prompt = engine.encode("what is 12*7?")
    params = SamplingParams(max_new_tokens=64, temperature=1.0, n=8, seed=1)
    out = engine.generate([prompt], params)
    assert len(out) == 1 and len(out[0]) == 8
    for g in out[0]:
        assert g.prompt_ids == prompt and g.finish_reason == "length"
        assert len(g.token_ids) == len(g.logprobs) == len(g.versions) == 64
        assert all(lp <= 0.0 for lp in g.logprobs) and set(g.versions) == {0}
    # independent draws, not one sample copied eight times
    assert len({tuple(g.token_ids) for g in out[0]}) == 8


# --- calculator --------------------------------------------------------------------------
def test_calculator_parser():
    assert calculate("12*7") == "84"
    assert calculate(" (1 + 2) * -3 ") == "-9"
    assert calculate("2**10 - 2^3") == "1016"
    assert calculate("7/2") == "3.5"
    assert calculate("7//2 + 7%3") == "4"
    assert calculate("1/3") == "0.3333333333"
    assert evaluate("0.1+0.2") == evaluate("0.3")  # exact arithmetic
    for junk in [
        "",
        "1+",
        "(1",
        "1)",
        "a",
        "__import__('os').system('x')",
        "1 2",
        "2**1000",
        "9**9**9",
        "1/0",
        "2**0.5",
        "((((" * 20 + "1" + "))))" * 20,
        "1" * 300,
        "len([])",
        "1e5",
    ]:
        with pytest.raises(CalcError):
            evaluate(junk)
    src = (REPO / "astraflow/raas/calc.py").read_text()
    assert (
        "eval(" not in src.replace("def evaluate(", "").replace("= evaluate(", "")
        and "exec(" not in src
    )


# --- workflows ---------------------------------------------------------------------------
def task_of(payload, workflow="single_turn", tid="t0", policies=("actor",)) -> Task:
    return Task(
        task_id=tid,
        prompt_id=f"p-{tid}",
        workflow=workflow,
        payload=payload if isinstance(payload, str) else json.dumps(payload),
        source="test",
        policies=list(policies),
    )


def check_sequence_invariants(s, prompt_len: int) -> None:
    n = len(s.token_ids)
    assert len(s.loss_mask) == len(s.logprobs) == len(s.versions) == n
    assert s.loss_mask[:prompt_len] == [0] * prompt_len
    for m, lp, v in zip(s.loss_mask, s.logprobs, s.versions):
        if m == 0:
            assert lp == 0.0 and v == -1
        else:
            assert v >= 0


def test_single_turn_rewards_and_masks():
    eng = ScriptedEngine("actor", ["84", " 84 ", "85"], version=3)
    wf = make_workflow("single_turn", checker=lambda c, a: float(c.strip() == a))
    seqs = wf.run(task_of({"prompt": "12*7=", "answer": "84", "level": 1}), {"actor": eng}, 3)
    assert [s.reward for s in seqs] == [1.0, 1.0, 0.0]
    assert [s.sample_index for s in seqs] == [0, 1, 2]
    for s in seqs:
        check_sequence_invariants(s, 5)
        assert s.policy == "actor" and s.token_ids[:5] == eng.encode("12*7=")
        assert s.min_version == 3
    # the default checker works whether or not astraflow.tasks exists yet
    seqs = make_workflow("single_turn").run(
        task_of({"prompt": "x", "answer": "84"}), {"actor": ScriptedEngine("actor", ["84"])}, 1
    )
    assert seqs[0].reward == 1.0
    for bad in [
        "not json",
        json.dumps([1]),
        json.dumps({"prompt": "x"}),
        json.dumps({"prompt": {"a": 1}, "answer": "1"}),
    ]:
        with pytest.raises(TaskError):
            wf.run(task_of(bad), {"actor": eng}, 1)
    with pytest.raises(TaskError, match="no engine"):
        wf.run(task_of({"prompt": "x", "answer": "1"}, policies=["critic"]), {"actor": eng}, 1)
    with pytest.raises(TaskError, match="unknown workflow"):
        make_workflow("nope")


def test_tool_calc_masks_tool_tokens_and_continues():
    eng = ScriptedEngine(
        "actor",
        [
            "let me <calc>12*7</calc>",  # sample 0, turn 1: tool call
            "it is 84",  # sample 1, turn 1: answers directly (wrong format)
            "<calc>2+</calc>",  # sample 0, turn 2: a broken call
            "84",  # sample 0, turn 3: final answer
        ],
        version=3,
    )
    wf = make_workflow(
        "tool_calc",
        checker=lambda c, a: float(c.strip() == a),
        max_turns=3,
        tool_latency={"dist": "pareto", "scale_s": 0.001, "alpha": 2.0, "max_s": 0.01, "seed": 1},
    )
    prompt = "what is 12*7?"
    seqs = wf.run(
        task_of({"prompt": prompt, "answer": "84"}, workflow="tool_calc"), {"actor": eng}, 2
    )
    s0, s1 = seqs
    text0 = eng.decode(s0.token_ids)
    assert text0 == (
        prompt + "let me <calc>12*7</calc><result>84</result>"
        "<calc>2+</calc><result>error: unexpected end of expression</result>84"
    )
    check_sequence_invariants(s0, len(prompt))
    # exactly the tool results are masked out after the prompt
    masked = "".join(chr(t) for t, m in zip(s0.token_ids, s0.loss_mask) if m == 0)
    assert (
        masked == prompt + "<result>84</result><result>error: unexpected end of expression</result>"
    )
    trained = "".join(chr(t) for t, m in zip(s0.token_ids, s0.loss_mask) if m == 1)
    assert trained == "let me <calc>12*7</calc><calc>2+</calc>84"
    assert s0.reward == 1.0 and s0.meta["tool_calls"] == "2"
    assert s1.reward == 0.0 and s1.meta["tool_calls"] == "0"
    assert eng.decode(s1.token_ids) == prompt + "it is 84"
    # turn 2 and 3 continue only sample 0, from its whole context
    assert len(eng.calls[1]) == 1 and eng.decode(eng.calls[1][0]).endswith("<result>84</result>")


def test_latency_distributions_are_seeded_and_long_tailed():
    a = [
        Latency(dist="pareto", scale_s=0.01, alpha=1.1, seed=7, max_s=100).draw() for _ in range(1)
    ]
    b = [
        Latency(dist="pareto", scale_s=0.01, alpha=1.1, seed=7, max_s=100).draw() for _ in range(1)
    ]
    assert a == b
    lat = Latency(dist="lognormal", median_s=0.01, sigma=1.5, seed=0, max_s=100)
    draws = sorted(lat.draw() for _ in range(2000))
    median, p99 = draws[1000], draws[1980]
    assert 0.007 < median < 0.014 and p99 > 10 * median
    assert Latency.from_option(0.5).draw() == 0.5
    with pytest.raises(ValueError):
        Latency(dist="gauss")


# --- the node on a real broker -----------------------------------------------------------
def node_topology(make_topology, **topics):
    return make_topology(
        topics={"tasks": {"partitions": 1}, "trajectories.raw": {"partitions": 1}, **topics}
    )


def start_node(kafka_bootstrap, path, model_dir, instance, log, *extra):
    import os
    import subprocess

    env = {**os.environ, "ASTRAFLOW_BOOTSTRAP": kafka_bootstrap, "PYTHONUNBUFFERED": "1"}
    args = [
        sys.executable,
        "-m",
        "astraflow.cli.main",
        "raas",
        "run",
        "--topology",
        str(path),
        "--policy-model",
        f"actor={model_dir}",
        "--instance",
        instance,
        "--n-samples",
        "2",
        "--session-timeout-ms",
        "6000",
        *extra,
    ]
    return subprocess.Popen(
        args, env=env, stdout=open(log, "ab"), stderr=subprocess.STDOUT, cwd=REPO
    )


@pytest.mark.slow
def test_node_exactly_once_across_sigkill_mid_rollout(
    kafka_config, kafka_bootstrap, make_topology, model_dir, tmp_path
):
    from astraflow.kafka.clients import RecordProducer, read_all

    topo, path = node_topology(make_topology)
    producer = RecordProducer(kafka_config)
    tasks = topo.full_name("tasks")
    producer.produce(tasks, task_of("{not json", tid="bad"), key="p-bad")
    for i in range(2):
        producer.produce(
            tasks,
            task_of({"prompt": f"{i}+{i}=", "answer": str(2 * i)}, tid=f"t{i}"),
            key=f"p-t{i}",
        )
    producer.flush()
    opts = [
        "--workflow-options",
        'single_turn={"max_new_tokens": 12, "env_latency": 2.5, "temperature": 1.0}',
    ]
    procs = []
    try:
        log_a = tmp_path / "a.log"
        a = start_node(kafka_bootstrap, path, model_dir, "a", log_a, *opts)
        procs.append(a)
        wait_for(
            lambda: "rollout of task t1 (" in log_a.read_text(),
            60,
            "node a to start its second task",
        )
        a.send_signal(signal.SIGKILL)
        a.wait(10)
        out = topo.full_name("trajectories.raw")
        done = [r.record for r in read_all(kafka_config, out, idle_s=0.5, expect=TrajectoryGroup)]
        assert [g.task_id for g in done] == ["t0"]

        log_b = tmp_path / "b.log"
        b = start_node(kafka_bootstrap, path, model_dir, "b", log_b, *opts)
        procs.append(b)
        wait_for(
            lambda: "rollout of task t1 done" in log_b.read_text(),
            60,
            "node b to complete the redelivered task",
        )
        # its transaction committed: the group is readable (read_committed) on the output
        wait_for(
            lambda: "t1" in {r.record.task_id for r in read_all(
                kafka_config, out, idle_s=0.5, expect=TrajectoryGroup)},
            60,
            "node b to commit the group of task t1",
        )
        b.send_signal(signal.SIGTERM)
        assert b.wait(30) == 0, log_b.read_text()[-2000:]
        assert "leaving group" in log_b.read_text()

        groups = [r.record for r in read_all(kafka_config, out, idle_s=0.5, expect=TrajectoryGroup)]
        assert sorted(g.task_id for g in groups) == ["t0", "t1"]
        by_task = {g.task_id: g for g in groups}
        assert by_task["t0"].raas_id == "raas.default/a"
        assert by_task["t1"].raas_id == "raas.default/b"
        for g in groups:
            assert g.pool == "default" and g.workflow == "single_turn"
            assert len(g.sequences) == 2 and len(g.rewards) == 2
            assert g.metrics["rollout/seconds"] >= 2.5
            assert g.metrics["rollout/gen_tokens"] == sum(sum(s.loss_mask) for s in g.sequences)
            for s in g.sequences:
                prompt_len = s.loss_mask.index(1)
                check_sequence_invariants(s, prompt_len)
                assert s.min_version == 0 and s.max_version == 0

        dead = [
            r.record
            for r in read_all(kafka_config, topo.full_name("dlq"), idle_s=0.5, expect=DeadLetter)
        ]
        assert len(dead) == 1 and "TaskError" in dead[0].error
        assert dead[0].component_id == "raas.default/a"
        status = [
            r.record
            for r in read_all(
                kafka_config, topo.full_name("status"), idle_s=0.5, expect=ComponentStatus
            )
        ]
        mine = [s for s in status if s.component_id == "raas.default/b"]
        assert mine and all(s.kind == "raas" and s.weight_versions == {"actor": 0} for s in mine)
        assert mine[-1].produced == 1 and mine[-1].busy_s > 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)


@pytest.mark.slow
def test_node_follows_published_weights(kafka_config, make_topology, tmp_path):
    from astraflow.kafka.clients import RecordProducer, read_all
    from astraflow.raas.node import NodeOptions, RaaSNode
    from astraflow.weights import FileBlobStore, WeightPublisher

    topo, _ = node_topology(make_topology, **{"weights.actor": {"partitions": 1}})
    eng = TorchEngine(tiny_model(), tiny_tokenizer(), policy="actor", version=0)
    store = FileBlobStore(str(tmp_path / "blobs"))
    pub = WeightPublisher(store, "actor", anchor_interval=10)
    v0 = {k: v.clone() for k, v in eng.model.state_dict().items()}
    v1 = {k: v + 0.01 * torch.randn_like(v) for k, v in v0.items()}
    producer = RecordProducer(kafka_config)
    for state in (v0, v1):
        for m in pub.publish(state):
            producer.produce(topo.full_name("weights.actor"), m, key="actor")
    producer.produce(
        topo.full_name("tasks"), task_of({"prompt": "1+2=", "answer": "3"}), key="p-t0"
    )
    producer.flush()

    node = RaaSNode(
        topo,
        {"actor": eng},
        NodeOptions(
            instance="w",
            n_samples=2,
            poll_timeout_s=0.2,
            workflow_options={"single_turn": {"max_new_tokens": 6}},
        ),
    )
    with running(node) as thread:
        out = topo.full_name("trajectories.raw")
        wait_for(lambda: read_all(kafka_config, out, idle_s=0.3), 60, "a trajectory group")
        (g,) = [r.record for r in read_all(kafka_config, out, idle_s=0.3, expect=TrajectoryGroup)]
        assert all(s.min_version == 1 and s.max_version == 1 for s in g.sequences)
        assert eng.version == 1
        for k, t in eng.model.state_dict().items():
            assert torch.equal(t, v1[k]), k
    assert not thread.is_alive()
    assert node.status().weight_versions == {"actor": 1}
    m = node.status().metrics  # the update's time, as a remote pool's bench reads it
    assert m["raas/weight_updates"] == 1 and m["raas/weight_sync_s"] == m[
        "raas/weight_sync_last_s"] > 0


@pytest.mark.slow
def test_node_rolls_out_several_tasks_per_transaction_as_one_batch(kafka_config, make_topology):
    from astraflow.kafka.clients import RecordProducer, read_all
    from astraflow.raas.node import NodeOptions, RaaSNode

    topo, _ = node_topology(make_topology)
    eng = TorchEngine(tiny_model(), tiny_tokenizer(), policy="actor", version=0)
    calls: list[int] = []
    real = eng.generate
    eng.generate = lambda prompts, params: calls.append(len(prompts)) or real(prompts, params)
    producer = RecordProducer(kafka_config)
    tasks = topo.full_name("tasks")
    bad_workflow = task_of({"prompt": "1+1=", "answer": "2"}, "no_such_workflow", "nowf")
    for t in (task_of({"prompt": "1+2=", "answer": "3"}, tid="t0"),
              task_of("{not json", tid="bad"),
              task_of({"prompt": "2+2=", "answer": "4"}, tid="t1"),
              bad_workflow,
              task_of({"prompt": "3+4=", "answer": "7"}, tid="t2")):
        producer.produce(tasks, t, key=f"p-{t.task_id}")
    producer.flush()
    node = RaaSNode(topo, {"actor": eng}, NodeOptions(
        instance="w", n_samples=2, poll_timeout_s=1.0, tasks_per_transaction=8,
        workflow_options={"single_turn": {"max_new_tokens": 4}}))
    with running(node):
        out = topo.full_name("trajectories.raw")
        wait_for(lambda: len(read_all(kafka_config, out, idle_s=0.3)) >= 3, 60, "three groups")
        groups = [r.record for r in read_all(kafka_config, out, idle_s=0.3,
                                             expect=TrajectoryGroup)]
        dead = [r.record for r in read_all(kafka_config, topo.full_name("dlq"), idle_s=0.5,
                                           expect=DeadLetter)]
    assert [g.task_id for g in groups] == ["t0", "t1", "t2"]
    assert all(len(g.sequences) == 2 for g in groups)
    assert sorted(d.error.split(":")[0] for d in dead) == ["TaskError", "TaskError"]
    assert any("no_such_workflow" in d.error for d in dead)
    # the three good tasks were one generate call of 3 prompts (2 samples each), unless
    # the poll returned them in pieces
    assert sum(calls) == 3 and max(calls) > 1
