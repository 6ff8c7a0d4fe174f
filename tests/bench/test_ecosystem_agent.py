"""bench/ecosystem_agent.py without Kafka or a model: each system's topology (its
environment in the workflow and the feeder, the seed, no evaluator, every version kept),
the held-out and validation rows (disjoint, the same problems for both systems, no answer
in any prompt), and the table of means with intervals over seeds."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from astraflow.config.topology import load_topology
from tests.conftest import load_bench

pytest.importorskip("verifiers", reason="the verifiers extra")
pytest.importorskip("reasoning_gym", reason="the reasoning-gym extra")

REPO = Path(__file__).resolve().parents[2]
bench = load_bench("ecosystem_agent")
DOC = yaml.safe_load((REPO / "topology" / "smollm2-rg-tool.yaml").read_text())


def small(doc: dict) -> dict:
    """``doc`` with a small environment (the rows load fast)."""
    (pool,) = doc["pools"].values()
    args = {**pool["workflows"]["verifiers"]["args"], "size": 40, "eval_size": 12}
    pool["workflows"]["verifiers"]["args"] = args
    env, split, _ = bench._parsed(doc["feeder"]["dataset"]["path"])
    doc["feeder"]["dataset"]["path"] = f"verifiers:{env}:{split}?" + bench._query(args)
    return doc


@pytest.mark.parametrize("system", ["tool", "notool"])
def test_each_system_runs_its_environment_seeded_without_an_evaluator(system, tmp_path):
    path = bench.system_topology(DOC, system, 3e-5, 2, tmp_path)
    topo = load_topology(path)
    assert topo.eval is None and topo.run == bench.RUN
    doc = yaml.safe_load(path.read_text())
    (pool,) = doc["pools"].values()
    options = pool["workflows"]["verifiers"]
    assert options["environment"] == bench.SYSTEMS[system] and options["seed"] == 2
    env, split, args = bench._parsed(doc["feeder"]["dataset"]["path"])
    assert (env, split) == (bench.SYSTEMS[system], "train")
    assert args == options["args"] == DOC["pools"]["local"]["workflows"]["verifiers"]["args"]
    (policy,) = doc["policies"].values()
    assert policy["trainer"]["lr"] == 3e-5 and policy["trainer"]["seed"] == 2
    assert policy["trainer"]["keep_versions"] == 0 and Path(policy["model"]).is_absolute()
    assert doc["feeder"]["seed"] == 2


@pytest.mark.slow
def test_held_out_and_validation_rows_are_disjoint_and_carry_no_answer():
    doc = small(yaml.safe_load(yaml.safe_dump(DOC)))
    held, val = bench.held_out(doc, 12), bench.validation(doc, 10)
    assert len(held) == 12 and len(val) == 10
    assert not {p["prompt"] for p in held} & {p["prompt"] for p in val}
    for p in held + val:
        # the answer is never in the prompt (a digit string inside a number aside)
        assert f"<answer>{p['answer']}</answer>" not in p["prompt"]
    from astraflow.tasks.verifiers_data import load_environment, row_input

    for system, env in bench.SYSTEMS.items():  # both systems face the same problems
        loaded = load_environment(env, held[0]["verifiers"]["args"])
        assert [row_input(loaded, p["verifiers"])["answer"] for p in held] == \
            [p["answer"] for p in held], system


def test_the_table_gives_each_systems_mean_and_interval_per_checkpoint():
    runs = [{"system": "tool", "scores": {"0": 0.0, "60": 0.5}},
            {"system": "tool", "scores": {"0": 0.0, "60": 0.7}},
            {"system": "notool", "scores": {"0": 0.0, "60": 0.1}}]
    table = bench.report(runs, ["tool", "notool"], [0.0, 60.0]).splitlines()
    assert table[0] == "| t (s) | tool | notool |"
    assert table[2] == "| 0 | 0.0 % ±0.0 | 0.0 % (n=1) |"
    assert table[3].startswith("| 60 | 60.0 % ±") and table[3].endswith("| 10.0 % (n=1) |")


def test_the_trl_system_trains_the_tool_environments_rows_with_its_rubric():
    from astraflow.envs.verifiers_examples import used_tool
    from astraflow.tasks.verifiers_data import load_environment

    doc = small(yaml.safe_load(yaml.safe_dump(DOC)))
    env = load_environment(bench.SYSTEMS[bench.TRL_SYSTEMS["trl-tool"]], bench.env_args(doc))
    rows = bench.trl_rows(env)
    assert len(rows) == len(env.dataset)
    for row, source in zip(rows, env.dataset):
        assert row["info"] == source["info"]
        roles = [m["role"] for m in row["prompt"]]
        assert roles == ["system", "user", "assistant", "tool", "assistant", "user"]
        (call,) = row["prompt"][2]["tool_calls"]  # the worked exchange's call, as an object
        assert call["function"] == {"name": "calculate",
                                    "arguments": {"expression": "214 - 37 + 5"}}
        assert row["prompt"][-1]["content"] == source["question"]
        assert source["answer"] not in {m["content"] for m in row["prompt"]}
    # the reward TRL is given: the environment's own functions at their weights
    (pool,) = doc["pools"].values()
    assert pool["workflows"]["verifiers"]["args"]["call_bonus"] == 0.2
    assert [(f.__name__, w) for r in env.rubric.rubrics for f, w in zip(r.funcs, r.weights)
            if w] == [("correct", 1.0), (used_tool.__name__, 0.2)]


def test_the_trl_setting_is_the_topologys_group_batch_and_turns():
    setting = bench.trl_setting(DOC, 5e-6)
    (pool,) = DOC["pools"].values()
    assert setting["lr"] == 5e-6 and setting["num_generations"] == pool["n_samples"]
    # a step: the batcher's groups, one a micro-batch
    assert setting["gradient_accumulation_steps"] == \
        DOC["processors"]["batcher"]["options"]["batch_size"]
    assert setting["per_device_train_batch_size"] == pool["n_samples"]
    turns = pool["workflows"]["verifiers"]["args"].get("max_turns", 3)
    assert setting["max_tool_calling_iterations"] == turns - 1
    assert setting["max_completion_length"] == \
        pool["workflows"]["verifiers"]["max_new_tokens"] * turns
    assert bench.runner("trl-tool") is bench.run_one_trl
    assert bench.runner("tool") is bench.runner("notool") is bench.run_one


def test_the_trl_system_sees_the_tokens_astraflows_endpoint_renders():
    """The TRL system's template renders the tool environment's prompt (system message,
    the worked exchange with its call and the tool's result, the problem), and a further
    call and result, to the same tokens as AstraFlow's endpoint renders them for SmolLM2
    from what verifiers sends it; it scores with the same; and TRL takes it: it renders
    tools, keeps prefixes and parses the call SmolLM2 writes."""
    import json

    from transformers import AutoTokenizer

    from astraflow.models.chat import ChatFormat
    from astraflow.raas.agent.chat import check_messages, render
    from astraflow.tasks.verifiers_data import load_environment

    model = REPO / DOC["policies"]["actor"]["model"]
    if not (model / "tokenizer.json").exists():
        pytest.skip(f"the SmolLM2 model at {model} (made by the bench's first run)")
    doc = small(DOC)
    env = load_environment(bench.SYSTEMS["tool"], bench.env_args(doc))
    text = bench.tools_text(env)
    own = AutoTokenizer.from_pretrained(str(model))
    chat = ChatFormat.from_options(DOC["policies"]["actor"].get("chat"))
    trl = AutoTokenizer.from_pretrained(str(model))
    trl.chat_template = bench.trl_template(text)
    tools = bench.verifiers_tools(env)  # as verifiers sends them
    assert [t["function"]["name"] for t in tools] == ["calculate"]

    call = {"role": "assistant", "content": "", "tool_calls": [{
        "id": "c1", "type": "function",
        "function": {"name": "calculate", "arguments": json.dumps({"expression": "3 * 4"})}}]}
    sent = [*env.dataset[0]["prompt"], call, {"role": "tool", "content": "12",
                                              "tool_call_id": "c1"}]
    rows = bench.trl_rows(env)
    for messages, trl_messages in ((env.dataset[0]["prompt"], rows[0]["prompt"]),
                                   (sent, [*rows[0]["prompt"], {**call, "tool_calls": [{
                                       "type": "function", "function": {
                                           "name": "calculate",
                                           "arguments": {"expression": "3 * 4"}}}]},
                                       {"role": "tool", "name": "calculate",
                                        "content": "12"}])):
        ours = render(own, chat, check_messages(messages), tools)
        theirs = trl.apply_chat_template(trl_messages, tools=[_calculate()],
                                         add_generation_prompt=True, tokenize=True,
                                         return_dict=False)
        assert theirs == ours, (own.decode(ours), trl.decode(theirs))
        assert render(own, bench.trl_chat(text), check_messages(messages), tools) == ours
    assert "<tool_call>" in own.decode(ours) and "<|im_start|>tool\n12<|im_end|>" in \
        own.decode(ours)

    pytest.importorskip("trl", reason="TRL (the trl-tool system)")
    from trl.chat_template_utils import (
        is_chat_template_prefix_preserving,
        parse_response,
        supports_tool_calling,
    )

    tokenizer = bench.trl_tokenizer(str(model), text)
    assert supports_tool_calling(tokenizer) and is_chat_template_prefix_preserving(tokenizer)
    written = '<tool_call>{"name": "calculate", "arguments": {"expression": "5 + 6"}}' \
        "</tool_call><|im_end|>"
    prefix = tokenizer.apply_chat_template(rows[0]["prompt"], tools=[_calculate()],
                                           add_generation_prompt=True, tokenize=True,
                                           return_dict=False)
    parsed = parse_response(tokenizer, tokenizer.encode(written), prefix=prefix,
                            tools=[_calculate()])
    assert parsed["tool_calls"][0]["function"] == {"name": "calculate",
                                                   "arguments": {"expression": "5 + 6"}}


def _calculate():
    from astraflow.envs.verifiers_examples import calculate

    return calculate


def test_validation_chooses_the_best_setting_once_every_sweep_run_is_in(tmp_path):
    import learning

    progress = learning.Progress(tmp_path / "p.json", {}, {"tool": {"grid": [1e-5, 3e-5]}},
                                 resume=False)
    one = [{"lr": 2e-5}]
    assert bench.swept("tool", one, progress, 0, 600) == {"lr": 2e-5}  # a grid of one
    grid = bench.grid_of("tool", [1e-5, 3e-5], [4, 1], 4)
    assert grid == [{"lr": 1e-5}, {"lr": 3e-5}]  # AstraFlow's systems sweep the rate alone
    assert bench.swept("tool", grid, progress, 0, 600) is None
    for lr, score in ((1e-5, 0.3), (3e-5, 0.3)):
        progress.add("sweep", {"system": "tool", "seed": 0, "setting": {"lr": lr},
                               "scores": {"600": score}})
    assert bench.swept("tool", grid, progress, 0, 600) == {"lr": 1e-5}  # a tie: the smaller
    progress.sweep_rows[1]["scores"]["600"] = 0.5
    assert bench.swept("tool", grid, progress, 0, 600) == {"lr": 3e-5}


def test_trl_sweeps_its_groups_a_step_with_its_rates(tmp_path):
    """TRL's grid crosses the rates with the groups a step; the topology's own count stays
    unnamed (the settings of runs made before), and a tie goes to the smaller rate, then
    to the topology's count; a run's groups reach GRPOConfig's accumulation."""
    import learning

    grid = bench.grid_of("trl-tool", [1e-5, 3e-5], [4, 1], 4)
    assert grid == [{"lr": 1e-5}, {"lr": 3e-5}, {"lr": 1e-5, "groups": 1},
                    {"lr": 3e-5, "groups": 1}]
    progress = learning.Progress(tmp_path / "p.json", {}, {"trl-tool": {"grid": grid}},
                                 resume=False)
    for setting, score in zip(grid, (0.1, 0.0, 0.3, 0.3)):
        progress.add("sweep", {"system": "trl-tool", "seed": 0, "setting": setting,
                               "scores": {"600": score}})
    assert bench.swept("trl-tool", grid, progress, 0, 600) == {"lr": 1e-5, "groups": 1}
    progress.sweep_rows[0]["scores"]["600"] = 0.3  # ties with groups 1 at 1e-5
    assert bench.swept("trl-tool", grid, progress, 0, 600) == {"lr": 1e-5}
    assert bench.trl_setting(DOC, 1e-5, 1)["gradient_accumulation_steps"] == 1
    assert bench.setting_text({"lr": 1e-5, "groups": 1}) == "lr 1e-05, groups 1"
