"""Prompt formats, the reward registry, dataset field mapping, generated datasets, and the
topology fields that carry them to the components (no broker needed)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from astraflow.cli.components import configuration
from astraflow.config.topology import TopologyError, load_topology, parse_topology
from astraflow.launch.plan import plan_processes
from astraflow.models.chat import ChatFormat, PromptError, payload_messages
from astraflow.models.evaluation import evaluate
from astraflow.models.tiny import build_tokenizer
from astraflow.raas.workflows import make_workflow
from astraflow.sandbox import interpreter_and_user
from astraflow.tasks import make_task
from astraflow.tasks.datasets import DatasetError, load_dataset_file
from astraflow.tasks.generate import addition_rows, multistep_rows
from astraflow.tasks.rewards import REWARDS, RewardError, make_reward
from tests.fakes import ScriptedEngine

REPO = Path(__file__).resolve().parents[3]
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>"
            "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")


class TemplateTokenizer:
    """A tokenizer with a chat template, one id per character."""

    chat_template = TEMPLATE

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False, **kw):
        from jinja2 import Template

        assert not tokenize
        return Template(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **kw)

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


def test_chat_template_builds_the_prompt_with_system_prompt_and_options():
    tok = TemplateTokenizer()
    payload = {"prompt": "2+2?", "answer": "4"}
    assert ChatFormat().prompt_text(tok, payload) == "<user>2+2?</user><assistant>"
    chat = ChatFormat(system_prompt="Be brief.")
    assert chat.prompt_text(tok, payload) == \
        "<system>Be brief.</system><user>2+2?</user><assistant>"
    # messages that bring their own system prompt keep it
    own = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]}
    assert chat.prompt_text(tok, own) == "<system>S</system><user>Q</user><assistant>"
    assert ChatFormat(template="off").prompt_text(tok, payload) == "2+2?"
    assert chat.prompt_ids(tok, payload) == [ord(c) for c in chat.prompt_text(tok, payload)]


def test_chat_format_without_a_template_and_bad_payloads():
    tiny = build_tokenizer()  # the character-level tokenizer has no chat template
    payload = {"prompt": "12+7=", "answer": "19"}
    assert ChatFormat().prompt_ids(tiny, payload) == tiny.encode("12+7=", add_special_tokens=False)
    with pytest.raises(PromptError, match="has none"):
        ChatFormat(template="on").prompt_text(tiny, payload)
    for bad in [{}, {"messages": []}, {"messages": [{"role": "user"}]}, {"prompt": {"a": 1}}]:
        with pytest.raises(PromptError):
            payload_messages(bad)
    with pytest.raises(ValueError, match="unknown key 'system'"):
        ChatFormat.from_options({"system": "x"})
    with pytest.raises(ValueError, match="is not one of"):
        ChatFormat(template="maybe")


@pytest.mark.parametrize("spec, completion, answer, expected", [
    ("exact_match", " 82<|im_end|>", "82", 1.0),
    ("exact_match", "The answer is 82", "82", 0.0),
    ({"name": "exact_match", "case_sensitive": False}, "Paris", "paris", 1.0),
    ("numeric", "so 79 + 3 = 82.", "82", 1.0),
    ("numeric", "\\boxed{1,000}", "1000", 1.0),
    ("numeric", "81", "82", 0.0),
    ({"name": "format", "pattern": "-?[0-9]+"}, "81", "82", 1.0),
    ("closeness", "80<|im_end|>", "100", 0.8),
    ("closeness", "so 79 + 3 = 72", "80", 0.9),
    ("closeness", "no number", "80", 0.0),
    ("closeness", "300", "100", 0.0),
    ("closeness", "-2", "0", 0.0),
    ({"name": "closeness", "alone": True}, "79 + 3 = 72", "80", 0.0),
    ({"name": "closeness", "alone": True}, " 1,000 ", "1000", 1.0),
    ({"name": "format", "pattern": "-?[0-9]+"}, "81 apples", "82", 0.0),
    ({"name": "sum", "terms": [{"name": "numeric", "weight": 0.5},
                               {"name": "exact_match", "weight": 0.5},
                               {"name": "format", "weight": 0.2}]}, "82", "82", 1.2),
    ({"name": "sum", "terms": [{"name": "numeric", "weight": 0.5},
                               {"name": "exact_match", "weight": 0.5}]}, "it is 82", "82", 0.5),
])
def test_rewards(spec, completion, answer, expected):
    assert make_reward(spec)(completion, {"answer": answer}) == pytest.approx(expected)


def test_code_tests_reward_runs_the_tests_in_the_sandbox():
    reward = make_reward("code_tests")
    payload = {"answer": "", "func": "f", "tests": [[[2], 5], [[0], 1], [[3], 7]]}
    assert reward("def f(x):\n    return 2*x+1\n", payload) == 1.0
    assert reward("def f(x):\n    return x+3\n", payload) == pytest.approx(1 / 3)
    # passes the first test, then a thread bomb: the process limit makes the reward 0
    bomb = (
        "import threading, time\n"
        "def f(x):\n"
        "    while x != 2:\n"
        "        threading.Thread(target=time.sleep, args=(9,)).start()\n"
        "    return 5\n"
    )
    if (interpreter_and_user()[1] or os.getuid()) != 0:  # uid 0 has no RLIMIT_NPROC
        bombed = make_reward({"name": "code_tests", "mem_mb": 1024, "max_procs": 8})
        assert bombed(bomb, payload) == 0.0
    with pytest.raises(RewardError, match="no 'tests'"):
        reward("def f(x): return x", {"answer": ""})


def test_reward_registry_errors():
    assert {"exact_match", "numeric", "format", "code_tests", "sum"} <= set(REWARDS)
    with pytest.raises(RewardError, match="unknown reward 'nope'"):
        make_reward("nope")
    with pytest.raises(RewardError, match="needs a 'name'"):
        make_reward({"weight": 1})
    with pytest.raises(RewardError, match="bad options"):
        make_reward({"name": "numeric", "pattern": "x"})
    with pytest.raises(RewardError, match="bad pattern"):
        make_reward({"name": "format", "pattern": "("})


def test_single_turn_uses_the_reward_spec_and_the_engines_chat_format():
    eng = ScriptedEngine("actor", ["82", "it is 82"])
    eng.tokenizer = TemplateTokenizer()
    eng.chat = ChatFormat(system_prompt="S")
    wf = make_workflow("single_turn", reward="exact_match")
    seqs = wf.run(make_task({"prompt": "Q", "answer": "82"}), {"actor": eng}, 2)
    assert [s.reward for s in seqs] == [1.0, 0.0]
    assert eng.prompts == ["<system>S</system><user>Q</user><assistant>"]
    with pytest.raises(ValueError, match="reward: .*unknown reward"):  # the key named
        make_workflow("single_turn", reward="nope")


def test_dataset_field_mapping(tmp_path):
    f = tmp_path / "d.jsonl"
    rows = [{"msgs": [{"role": "user", "content": "hi 1"}], "y": "#### 7", "tests": [[[1], 2]],
             "topic": "greet"},
            {"msgs": [{"role": "system", "content": "S"}, {"role": "user", "content": "hi 2"}],
             "y": "8", "tests": [], "topic": "t"}]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = load_dataset_file(f, messages_field="msgs", answer_field="y", tests_field="tests",
                            meta_fields=("topic",))
    assert out[0]["messages"] == rows[0]["msgs"] and out[0]["prompt"] == "hi 1"
    assert out[0]["answer"] == "7" and out[0]["solution"] == "#### 7"
    assert out[0]["tests"] == [[[1], 2]] and out[0]["topic"] == "greet"
    assert out[0]["prompt_id"] != out[1]["prompt_id"]
    make_task(out[1])  # a messages payload is a valid task
    with pytest.raises(DatasetError, match="row 0: no field 'nope'"):
        load_dataset_file(f, messages_field="msgs", answer_field="y", tests_field="nope")
    with pytest.raises(DatasetError, match="no field 'question'"):
        load_dataset_file(f, prompt_field="question", answer_field="y")


def test_generated_datasets_are_disjoint_deterministic_and_shipped():
    train, held = addition_rows("train"), addition_rows("eval")
    assert len(train) + len(held) == 90 * 90
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    for r in held[:50]:
        a, b = r["prompt"].split("What is ")[1].split("?")[0].split("+")
        assert int(r["answer"]) == int(a) + int(b)
    ms = multistep_rows("eval", 50)
    assert ms == multistep_rows("eval", 50) and len({r["prompt"] for r in ms}) == 50
    for r in ms:
        expr = r["prompt"].removeprefix("Compute ").split(".")[0]
        assert str(eval(expr)) == r["answer"]
    # the files the benches use are what the generator writes
    shipped = [json.loads(x) for x in (REPO / "data" / "addition.eval.jsonl").read_text()
               .splitlines()]
    assert shipped == held


def test_evaluate_uses_the_chat_format_and_the_reward(tiny_model):
    model, tok = tiny_model
    tasks = [{"prompt": "1+1=", "answer": "2"}]
    seen = []

    def reward(completion, payload):
        seen.append((completion, payload["answer"]))
        return 0.25

    assert evaluate(model, tok, tasks, max_new_tokens=2, reward=reward) == 0.25
    assert seen and seen[0][1] == "2"


@pytest.fixture
def tiny_model(tmp_path):
    from astraflow.models.loading import load_policy
    from astraflow.models.tiny import init_model

    init_model(tmp_path / "m")
    return load_policy(tmp_path / "m")


def test_smollm2_topology_maps_to_component_settings():
    topo = load_topology(REPO / "topology" / "smollm2.yaml")
    # what each process `up` starts runs with (its command line, as the command builds it)
    procs = {name: configuration(cmd[3:], topo)
             for name, cmd in plan_processes(topo, "topology/smollm2.yaml").items()
             if name in ("raas-local-0", "trainer-actor", "eval-actor", "feeder")}
    raas = procs["raas-local-0"]
    wf = raas.options.workflow_options
    assert list(wf) == ["single_turn"] and wf["single_turn"]["reward"]["name"] == "sum"
    assert raas.settings.dtype == "best"  # bf16 where the hardware computes it natively
    assert procs["trainer-actor"].spec.trainer.autocast == "best"
    assert raas.options.tasks_per_transaction == 4
    assert wf["single_turn"]["temperature"] == 1.0  # the policy's
    assert procs["trainer-actor"].spec.temperature == 1.0
    ev = procs["eval-actor"]
    assert ev.dataset.path == "data/addition.eval.jsonl" and ev.reward == "exact_match"
    assert procs["feeder"].dataset.path == "data/addition.train.jsonl"


def test_topology_engine_and_chat_fields_are_checked():
    base = {"run": "r", "policies": {"a": {"model": "m", "chat": {"template": "on",
                                                                  "system_prompt": "S"}}},
            "pools": {"p": {"engine": "vllm", "engine_options": {"enforce_eager": True}}}}
    topo = parse_topology(base)
    node = configuration(plan_processes(topo, "f.yaml")["raas-p-0"][3:], topo).settings
    assert node.engine == "vllm" and node.engine_options == {"enforce_eager": True}
    assert node.chats["a"].system_prompt == "S"
    with pytest.raises(TopologyError, match="engine"):
        parse_topology({**base, "pools": {"p": {"engine": "tgi"}}})
    with pytest.raises(TopologyError, match="template"):
        parse_topology({**base, "policies": {"a": {"model": "m", "chat": {"template": "x"}}}})
