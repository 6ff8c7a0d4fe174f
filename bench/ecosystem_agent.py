"""A multi-turn tool agent that learns: held-out success of SmolLM2-135M-Instruct trained on
reasoning-gym arithmetic as a verifiers tool environment, against the same model trained
without the tool and against TRL's ``GRPOTrainer`` with the same tool, at equal wall-clock
time, seed by seed.

The systems (``--systems``) share the topology (default ``topology/smollm2-rg-tool.yaml``),
the problems (reasoning-gym ``basic_arithmetic`` of the environment's arguments: two terms
of up to two digits, ``+ - * /``), the rubric (the task's own ``score_answer``, plus the
tool environment's ``call_bonus`` for a calculator call that ran) and the model:

* ``tool``: AstraFlow on the topology's ``verifiers`` environment, ``load_tool`` (a
  ``vf.ToolEnv`` with a ``calculate`` tool): the model may call the calculator, sees its
  result, answers;
* ``notool``: the control, AstraFlow on the same topology with ``load_single_turn`` (a
  ``vf.SingleTurnEnv``: the same problems, system prompt without the tool, the same
  ``correct``; no tool, so no call bonus); nothing in either prompt carries the answer;
* ``trl-tool``: TRL's ``GRPOTrainer`` with the calculator as its tool (``tools=``, TRL's own
  tool loop, up to ``max_turns`` - 1 rounds) on the tool environment's rows and reward,
  the topology's group size, groups a step and learning-rate grid, in one process.
  SmolLM2's own chat template has no place for tools and TRL refuses it, so TRL trains
  and is scored with ``trl_template``: SmolLM2's ChatML with the tools and calls rendered
  exactly as AstraFlow's endpoint renders them (``astraflow.raas.agent.chat``: the tools
  in the system message in the Hermes form, a call as a ``<tool_call>`` block, a result as
  a ``tool`` turn), so both systems' prompts are the same tokens. Needs TRL
  (``python3 -m pip install trl``).

Each system runs ``--seeds`` times (seeds ``--seed0`` on; the run's workflow, trainer and
feeder take the seed; TRL's ``set_seed``) for ``--duration`` seconds (AstraFlow: ``astraflow
up`` with no online evaluator, every version's weights kept; TRL: the weights of the last
step before each checkpoint). At every checkpoint time (``--checkpoints``) those weights
are scored on the environment's held-out rows (its ``eval`` dataset, reasoning-gym's eval
split: a seed of its own, never trained on; the first ``--eval-size``) by the tool
environment's (the control: its own) **full rollout**, greedy: the tool systems' episodes
call the calculator as in training. Success is ``correct`` at full marks alone (the call
bonus never counts). The report gives each system's mean and 95 % interval (Student's t
over seeds) at every checkpoint, side by side.

**Validation** (``--lrs``, several learning rates; ``--trl-lrs`` for TRL, default the
same; ``--trl-groups``, TRL's groups a step, each with every rate): each system first runs
each setting for ``--sweep-duration`` seconds (seed ``--sweep-seed``, by default one no
seeded run uses: on a seeded run's own seed the sweep picks what suits that seed's
trajectory), scored at its end on ``--val-size`` validation rows (reasoning-gym problems
of the same config drawn from ``VALIDATION_SEED``, with the eval split's questions
removed), and the seeded runs use the best one (ties: the smaller rate, then the
topology's groups). One setting: no sweep.

Runs resume (``--progress FILE --resume``): a finished run is kept in the progress file,
so the work can be spread over several sessions; ``bench/progress/ecosystem-agent.json``
keeps it where git carries it.

    python bench/ecosystem_agent.py [--systems tool,notool,trl-tool] [--seeds 3]
        [--duration 1800] [--checkpoints 0,600,1200,1800] [--eval-size 100]
        [--lrs 1e-5,3e-5,1e-4] [--trl-groups 4,1] [--sweep-duration 600] [--sweep-seed N]
        [--progress bench/progress/ecosystem-agent.json --resume]
        [--out bench/results/ecosystem_agent.json]

On 2 cores a seed of the three systems takes about 2 hours with the scoring, a sweep of
three rates about 110 minutes; a smoke: ``--seeds 1 --duration 120 --checkpoints 0,120 --eval-size 4
--out /tmp/eco.json``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import learning  # noqa: E402  (bench/learning.py: the runs, seeds, progress, intervals)
from report import run_meta  # noqa: E402

SYSTEMS = {"tool": "astraflow.envs.verifiers_examples:load_tool",
           "notool": "astraflow.envs.verifiers_examples:load_single_turn"}
# TRL's GRPOTrainer with tools, on the environment of the system named: its rows, rubric
# and calculator, in TRL's own tool loop
TRL_SYSTEMS = {"trl-tool": "tool"}
# the TRL system's prompt format (``trl_template``), recorded with its runs: runs made in
# another (Qwen2.5's, before) are not resumed from
TRL_TEMPLATE = "smollm2-chatml-hermes, as astraflow.raas.agent.chat renders it"
VALIDATION_SEED = 10**9  # the validation problems' seed, far from the train seed + index
RUN = "bench-ecosystem-agent"  # the run id (its topics are started over for each run)
SCORE_CONCURRENCY = 16  # held-out episodes scored at once (their requests share batches)
CORRECT = "vf_metric:correct"  # a sequence's meta: the rubric's answer score, bonus apart


def system_topology(doc: dict[str, Any], system: str, lr: float, seed: int,
                    runs_dir: Path) -> Path:
    """``doc`` as ``system`` runs it with ``lr`` and ``seed``: its environment in the
    workflow and the feeder's dataset, run id ``RUN``, no evaluator, every version kept,
    absolute model path."""
    out = copy.deepcopy(doc)
    env = SYSTEMS[system]
    for pool in out["pools"].values():
        options = pool["workflows"]["verifiers"]
        options["environment"] = env
    feed = out["feeder"]["dataset"]
    _, split, args = _parsed(feed["path"])
    feed["path"] = f"verifiers:{env}:{split}?" + _query(args)
    out = learning.seeded_topology(learning.with_lr(out, lr), seed)
    out["run"] = RUN
    for spec in out["policies"].values():
        spec["model"] = str((REPO / spec["model"]).resolve())
        spec.setdefault("trainer", {})["keep_versions"] = 0
    run_dir = runs_dir / RUN
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "topology.yaml"
    body = {k: v for k, v in out.items() if k != "eval"}
    path.write_text(f"# bench/ecosystem_agent.py: {system}, lr {lr:g}, seed {seed}\n"
                    + yaml.safe_dump(body, sort_keys=False))
    return path


def _parsed(path: str) -> tuple[str, str, dict[str, Any]]:
    from astraflow.tasks.verifiers_data import parse_path

    parsed = parse_path(path)
    if parsed is None:
        raise SystemExit(f"ecosystem_agent: the feeder's dataset {path!r} is not verifiers:")
    return parsed


def _query(args: dict[str, Any]) -> str:
    return "&".join(f"{k}={json.dumps(v)}" for k, v in sorted(args.items()))


def env_args(doc: dict[str, Any]) -> dict[str, Any]:
    """The environment's arguments, the same for every system (the workflow's ``args``)."""
    (pool,) = doc["pools"].values()
    return dict(pool["workflows"]["verifiers"].get("args") or {})


def held_out(doc: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """The first ``n`` rows of the environment's eval dataset, as task payloads."""
    from astraflow.tasks.verifiers_data import verifiers_payloads

    env = SYSTEMS["tool"]
    return verifiers_payloads(f"verifiers:{env}:eval?{_query(env_args(doc))}", limit=n)


def validation(doc: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """``n`` validation problems: reasoning-gym's of the environment's config drawn from
    ``VALIDATION_SEED``, none of them an eval-split question, as rows of an environment
    built on them (``load_*`` with ``seed`` = ``VALIDATION_SEED``: its train split)."""
    from astraflow.tasks.verifiers_data import verifiers_payloads

    # twice as many drawn: the train split drops the eval split's questions, and two
    # short terms repeat often
    args = {**env_args(doc), "seed": VALIDATION_SEED, "size": 2 * n}
    return verifiers_payloads(f"verifiers:{SYSTEMS['tool']}:train?{_query(args)}", limit=n)


class Scorer:
    """Held-out success of a version with a system's own rollout: its ``verifiers``
    workflow, greedy, one episode per row, against an engine on the policy's model; the
    fraction of rows whose rubric gave full marks."""

    def __init__(self, doc: dict[str, Any]):
        import torch

        from astraflow.models.chat import ChatFormat
        from astraflow.raas.engine import load_torch_engine

        torch.set_num_threads(os.cpu_count() or 1)
        policy = next(iter(doc["policies"].values()))
        self.engine = load_torch_engine(str(REPO / policy["model"]), "actor",
                                        dtype=policy.get("dtype"))
        self.chat = ChatFormat.from_options(policy.get("chat"))
        self.engine.chat = self.chat
        self.base = {k: v.clone() for k, v in self.engine.model.state_dict().items()}
        (pool,) = doc["pools"].values()
        self.options = pool["workflows"]["verifiers"]
        self.workflows: dict[str, Any] = {}

    def workflow(self, system: str, args: dict[str, Any]) -> Any:
        from astraflow.config.options import VerifiersOptions
        from astraflow.raas.workflows.registry import make_workflow

        key = json.dumps([system, args], sort_keys=True)
        if key not in self.workflows:
            # the topology's turn length and timeout, typed (unset: the options' defaults)
            given = VerifiersOptions(**self.options)
            self.workflows[key] = make_workflow(
                "verifiers", environment=SYSTEMS[system], args=args, temperature=0.0,
                max_new_tokens=given.max_new_tokens, timeout_s=given.timeout_s)
        return self.workflows[key]

    def __call__(self, system: str, state: dict[str, Any] | None, version: int,
                 rows: list[dict[str, Any]], chat: Any = None) -> float:
        """``chat``: the prompt format the weights were trained with (default the
        policy's)."""
        from concurrent.futures import ThreadPoolExecutor

        from astraflow.raas.workflows.base import TaskError
        from astraflow.wire.records import Task

        self.engine.load_state_dict(self.base if state is None else state, version)
        self.engine.chat = chat or self.chat

        def one(i: int) -> float:
            row = rows[i]
            ref = row["verifiers"]
            wf = self.workflow(system, ref["args"])
            own = {**row, "verifiers": {**ref, "env": SYSTEMS[system]}}
            task = Task(task_id=f"score-{i}", prompt_id=row["prompt_id"], workflow="verifiers",
                        payload=json.dumps(own), source="bench", policies=["actor"])
            try:
                (seq, *_) = wf.run(task, {"actor": self.engine}, 1)
            except TaskError as e:  # an episode the environment ended with an error (an
                failed.append(str(e))  # empty answer, a malformed call): not solved
                return 0.0
            # solved: the rubric's ``correct`` alone (a tool environment's reward may add
            # a call bonus); the task's score_answer gives partial credit (0.01 for some
            # wrong answers in the asked format), success counts full marks only
            return 1.0 if float(seq.meta[CORRECT]) >= 1.0 else 0.0

        failed: list[str] = []
        for args in {json.dumps(r["verifiers"]["args"], sort_keys=True) for r in rows}:
            self.workflow(system, json.loads(args))  # loaded once, before the threads
        # the rows' episodes at once: the endpoint batches their requests to the engine
        with ThreadPoolExecutor(SCORE_CONCURRENCY) as pool:
            score = statistics.fmean(pool.map(one, range(len(rows))))
        if failed:
            print(f"[bench] {system} v{version}: {len(failed)} of {len(rows)} episodes ended "
                  f"with an error, scored unsolved (first: {failed[0][:200]})", flush=True)
        return score


def versions_state(result: dict[str, Any]):
    """``state_of(version)``: a run's published weights of a version (None: version 0)."""
    from astraflow.weights import WeightFollower

    topo = result.pop("_topology")
    follower = WeightFollower(policy=next(iter(topo.policies)),
                              kafka_config=topo.kafka.effective())
    follower.observe(result.pop("_manifests"))
    result.pop("policies", None)

    def state_of(v: int | None) -> dict[str, Any] | None:
        if v is None or v == 0:
            return None
        follower.update(v)
        return follower.state

    return state_of, follower


def run_one(doc: dict[str, Any], system: str, setting: dict[str, Any], seed: int,
            duration: float, checkpoints: list[float], rows: list[dict[str, Any]],
            scorer: Scorer, runs_dir: Path) -> dict[str, Any]:
    """One run of ``setting`` (its ``lr``): ``astraflow up``, then each checkpoint's
    version scored on ``rows``."""
    path = system_topology(doc, system, setting["lr"], seed, runs_dir)
    t0 = time.time()
    result = learning.run_astraflow(path, duration, checkpoints, runs_dir)
    state_of, follower = versions_state(result)
    scores: dict[str, float] = {}
    try:
        by_version: dict[int | None, float] = {}
        for t, v in result["at"].items():
            if v not in by_version:
                by_version[v] = scorer(system, state_of(v), v or 0, rows)
            scores[learning.key(t)] = by_version[v]
    finally:
        follower.close()
    summary_file = runs_dir / RUN / "summary.json"
    series = (json.loads(summary_file.read_text()).get("series", [])
              if summary_file.exists() else [])
    rewards = [x["reward/actor"] for x in series if "reward/actor" in x]
    return {"system": system, "seed": seed, "setting": dict(setting), "scores": scores,
            "versions": result.get("versions"), "wall_s": round(time.time() - t0, 1),
            # the training reward over the run's second half (the rollouts' own)
            "rollout_reward": learning.late_mean(rewards)}


# --- TRL -----------------------------------------------------------------------------------
# SmolLM2-135M-Instruct's chat template with a place for tools: its ChatML turns, the tool
# definitions after the system message (or as one) and an assistant's calls as <tool_call>
# blocks, exactly as AstraFlow's endpoint renders them for SmolLM2
# (astraflow.raas.agent.chat: tools_prompt, _with_tools_in_system, _calls_in_content);
# TOOLS stands for the tool definitions' text
_TRL_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if loop.first and message['role'] != 'system' -%}"
    "{%- if tools -%}{{ '<|im_start|>system\n' }}{% raw %}TOOLS{% endraw %}"
    "{{ '<|im_end|>\n' }}"
    "{%- else -%}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, "
    "trained by Hugging Face<|im_end|>\n' }}{%- endif -%}"
    "{%- endif -%}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{%- if message['content'] -%}{{ message['content'] }}{%- endif -%}"
    "{%- if message['role'] == 'system' and tools -%}{{ '\n\n' }}{% raw %}TOOLS{% endraw %}"
    "{%- endif -%}"
    "{%- if message['role'] == 'assistant' and message.get('tool_calls') -%}"
    "{%- if message['content'] -%}{{ '\n' }}{%- endif -%}"
    "{%- for call in message['tool_calls'] -%}"
    "{{ '<tool_call>' + {'name': call['function']['name'], "
    "'arguments': call['function']['arguments']} | tojson + '</tool_call>' }}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{ '<|im_end|>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)


def verifiers_tools(env: Any) -> list[dict[str, Any]]:
    """The environment's tools as verifiers sends them to an OpenAI endpoint (its client's
    own ``to_native_tool``), so as AstraFlow's endpoint receives them."""
    import asyncio

    from openai import AsyncOpenAI
    from verifiers.clients import OpenAIChatCompletionsClient

    async def convert() -> list[dict[str, Any]]:
        client = AsyncOpenAI(base_url="http://127.0.0.1:9", api_key="unused")  # never called
        try:
            native = OpenAIChatCompletionsClient(client)
            return [dict(await native.to_native_tool(t)) for t in env.tool_defs]
        finally:
            await client.close()

    return asyncio.run(convert())


def tools_text(env: Any) -> str:
    """The tool environment's tool definitions as AstraFlow's endpoint writes them into the
    system message (``tools_prompt`` of ``verifiers_tools``)."""
    from astraflow.raas.agent.chat import tools_prompt

    return tools_prompt(verifiers_tools(env))


def trl_template(tools: str) -> str:
    """The chat template the TRL system trains and is scored with: SmolLM2's own, with the
    tool definitions ``tools`` (``tools_text``) and the calls rendered as AstraFlow's
    endpoint renders them, so that both systems' prompts are the same tokens. SmolLM2's
    template has no place for tools, and TRL refuses a template that does not render
    them. (With the Qwen2.5 template TRL ships, a tool's result is a user turn wrapped in
    ``<tool_response>``: SmolLM2 then wrote ``<tool_response>`` blocks itself and never
    once called the tool in 12 samples.)"""
    if "{%" in tools or "{{" in tools or "{#" in tools:
        raise ValueError("the tool definitions hold template syntax")
    return _TRL_TEMPLATE.replace("TOOLS", tools)


def trl_tokenizer(path: str, tools: str) -> Any:
    """SmolLM2's tokenizer with ``trl_template`` and the parser of Hermes ``<tool_call>``
    blocks after ChatML's assistant header (TRL's own for the Qwen templates), which TRL
    reads calls out of completions with."""
    from transformers import AutoTokenizer
    from trl.chat_template_utils import qwen3_schema, qwen3_template

    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = trl_template(tools)
    if hasattr(tokenizer, "response_template"):
        tokenizer.response_template = qwen3_template
    else:
        tokenizer.response_schema = qwen3_schema
    return tokenizer


def trl_chat(tools: str) -> Any:
    """The policy's chat format with ``trl_template``: how the TRL system's weights are
    scored, in the format they were trained on."""
    from astraflow.models.chat import ChatFormat

    return ChatFormat.from_options({"template": "on",
                                    "options": {"chat_template": trl_template(tools)}})


def trl_setting(doc: dict[str, Any], lr: float, groups: int | None = None) -> dict[str, Any]:
    """The TRL run's ``GRPOConfig`` options (``learning.trl_config_kwargs``' setting): the
    topology's group size and turn length, ``groups`` groups (prompts) a step (default:
    the topology's batch), up to ``max_turns`` - 1 tool rounds, ``beta`` 0 and bf16
    autocast as in ``bench/learning.py``. A step's groups are generated together and
    trained one group a micro-batch (gradient accumulation): all at once, the logits of 32
    turns of a few hundred tokens ran 2 cores' 24 GB out of memory."""
    (pool,) = doc["pools"].values()
    options = pool["workflows"]["verifiers"]
    turns = int(env_args(doc).get("max_turns", 3))
    n = int(pool.get("n_samples", 8))
    return {"lr": lr, "num_generations": n, "per_device_train_batch_size": n,
            "gradient_accumulation_steps": groups or learning.batch_groups(doc),
            "max_completion_length": int(options.get("max_new_tokens", 96)) * turns,
            "max_tool_calling_iterations": turns - 1, "beta": 0.0, "bf16": learning.cpu_bf16()}


def trl_rows(env: Any) -> list[dict[str, Any]]:
    """The environment's training rows for TRL: its prompt messages (system prompt, the
    worked exchange, the problem) with tool-call arguments as objects, as Hugging Face
    templates read them, and the row's ``info`` for the rubric."""
    def message(m: dict[str, Any]) -> dict[str, Any]:
        out = {"role": m["role"], "content": m.get("content") or ""}
        if m.get("tool_calls"):
            out["tool_calls"] = [{"type": "function", "function": {
                "name": c["function"]["name"],
                "arguments": json.loads(c["function"]["arguments"])}} for c in m["tool_calls"]]
        return out

    return [{"prompt": [message(m) for m in row["prompt"]], "info": row["info"]}
            for row in env.dataset]


def trl_worker(out_dir: Path) -> int:
    """The TRL run (child process): ``GRPOTrainer`` with the environment's calculator as its
    tool and the environment's rubric (each function at its weight) as the reward, for the
    job's duration, a checkpoint per checkpoint time (``learning._TrlClock``)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, set_seed
    from trl import GRPOConfig, GRPOTrainer

    from astraflow.envs.verifiers_examples import calculate, tool_reward
    from astraflow.tasks.verifiers_data import load_environment

    t0 = float(os.environ.get("BENCH_T0", time.time()))
    job = json.loads((out_dir / "job.json").read_text())
    doc = job["doc"]
    torch.set_num_threads(os.cpu_count() or 1)
    set_seed(job["seed"])
    args = env_args(doc)
    env = load_environment(SYSTEMS[TRL_SYSTEMS["trl-tool"]], args)
    funcs, weights = tool_reward(float(args.get("call_bonus", 0.0)))

    def reward(completions: list[Any], info: list[Any], **_: Any) -> list[float]:
        return [sum(w * float(f(completion=c, info=i)) for f, w in zip(funcs, weights))
                for c, i in zip(completions, info)]

    policy = next(iter(doc["policies"].values()))
    path = str(REPO / policy["model"])
    tokenizer = trl_tokenizer(path, tools_text(env))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    temperature = float(policy.get("temperature", 1.0))
    config = GRPOConfig(**learning.trl_config_kwargs(
        {"temperature": temperature}, job["setting"], job["seed"], out_dir))
    clock = learning._TrlClock(t0, job["duration"], job["checkpoints"], out_dir)
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=config, tools=[calculate],
                          train_dataset=Dataset.from_list(trl_rows(env)),
                          processing_class=tokenizer, callbacks=[clock])
    trainer.train()
    clock.finish(trainer.model)
    (out_dir / "result.json").write_text(json.dumps(
        {"at": clock.at, "steps": clock.steps, "first_step_s": clock.first_step_s,
         "logged": clock.logged}))
    return 0


def run_one_trl(doc: dict[str, Any], system: str, setting: dict[str, Any], seed: int,
                duration: float, checkpoints: list[float], rows: list[dict[str, Any]],
                scorer: Scorer, runs_dir: Path) -> dict[str, Any]:
    """One TRL run of ``setting`` (its ``lr`` and ``groups`` a step), then each
    checkpoint's weights scored on ``rows`` by the environment's own rollout in the
    template TRL trained with."""
    from safetensors.torch import load_file

    from astraflow.tasks.verifiers_data import load_environment

    t0 = time.time()
    result = learning.run_trl(doc, trl_setting(doc, setting["lr"], setting.get("groups")),
                              seed, duration, checkpoints, runs_dir,
                              script=Path(__file__).resolve())
    chat = trl_chat(tools_text(load_environment(SYSTEMS[TRL_SYSTEMS[system]],
                                                env_args(doc))))
    scores = {learning.key(float(t)): scorer(TRL_SYSTEMS[system], load_file(c["path"]),
                                             int(c["step"]), rows, chat=chat)
              for t, c in result["at"].items()}
    rewards = [x["reward"] for x in result.get("logged", []) if "reward" in x]
    return {"system": system, "seed": seed, "setting": dict(setting), "scores": scores,
            "versions": result.get("steps"), "wall_s": round(time.time() - t0, 1),
            "rollout_reward": learning.late_mean(rewards)}


def swept(system: str, grid: list[dict[str, Any]], progress: Any, seed: int,
          duration: float) -> dict[str, Any] | None:
    """The setting ``system``'s validation chose: the best score of its finished sweep
    runs at the end of the sweep (ties: the smaller rate, then the topology's own groups a
    step, the setting that names none); the setting itself for a grid of one; None while a
    sweep run is missing."""
    if len(grid) == 1:
        return grid[0]
    rows = [progress.find("sweep", system, g, seed) for g in grid]
    if any(r is None for r in rows):
        return None
    best = max(range(len(grid)), key=lambda i: (
        rows[i]["scores"][learning.key(duration)], -grid[i]["lr"],
        "groups" not in grid[i], -grid[i].get("groups", 0)))
    return grid[best]


def grid_of(system: str, lrs: list[float], groups: list[int], usual_groups: int
            ) -> list[dict[str, Any]]:
    """The settings ``system``'s validation chooses from: each learning rate, and for TRL
    each number of groups a step too (the topology's own, ``usual_groups``, left unnamed,
    as every setting was before the groups were swept)."""
    if system not in TRL_SYSTEMS:
        return [{"lr": lr} for lr in lrs]
    return [{"lr": lr} if g == usual_groups else {"lr": lr, "groups": g}
            for g in groups for lr in lrs]


def setting_text(setting: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}"
                     for k, v in setting.items())


def runner(system: str) -> Any:
    """The function that runs ``system``: ``run_one_trl`` for TRL's, else ``run_one``."""
    return run_one_trl if system in TRL_SYSTEMS else run_one


def report(runs: list[dict[str, Any]], systems: list[str], checkpoints: list[float]) -> str:
    """The held-out success per system and checkpoint: mean and 95 % interval over seeds."""
    head = "| t (s) | " + " | ".join(systems) + " |"
    lines = [head, "|" + "---|" * (len(systems) + 1)]
    for t in checkpoints:
        cells = []
        for system in systems:
            values = [r["scores"][learning.key(t)] for r in runs if r["system"] == system]
            cells.append(learning.interval_text(*learning.mean_interval(values))
                         if values else "-")
        lines.append(f"| {learning.key(t)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--trl-worker"]:  # learning.run_trl's child process
        return trl_worker(Path(argv[1]))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--topology", default="topology/smollm2-rg-tool.yaml")
    p.add_argument("--systems", default="tool,notool")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--seed0", type=int, default=0)
    p.add_argument("--duration", type=float, default=1800)
    p.add_argument("--checkpoints", default="0,600,1200,1800")
    p.add_argument("--eval-size", type=int, default=100)
    p.add_argument("--val-size", type=int, default=50)
    p.add_argument("--lrs", default=None, help="learning rates to choose from on the "
                   "validation rows (default: the topology's)")
    p.add_argument("--trl-lrs", default=None, help="the TRL system's (default: --lrs)")
    p.add_argument("--trl-groups", default=None, help="groups (prompts) a TRL step to choose "
                   "from with its rates, e.g. 4,1 (default: the topology's batch alone)")
    p.add_argument("--sweep-duration", type=float, default=300)
    p.add_argument("--sweep-seed", type=int, default=None, help="the seed the validation "
                   "sweep trains with (default: --seed0 + 1000, one no seeded run uses)")
    p.add_argument("--runs-dir", default="runs/bench-ecosystem-agent")
    p.add_argument("--progress", default=None)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--out", default="bench/results/ecosystem_agent.json")
    p.add_argument("--report-only", action="store_true", help="report the runs the "
                   "progress file holds and run none: where a study spread over sessions "
                   "stands (with --progress and --resume)")
    a = p.parse_args(argv)
    systems = [s for s in a.systems.split(",") if s]
    known = [*SYSTEMS, *TRL_SYSTEMS]
    if unknown := [s for s in systems if s not in known]:
        raise SystemExit(f"ecosystem_agent: unknown systems {unknown} (known: "
                         f"{', '.join(known)})")
    if any(s in TRL_SYSTEMS for s in systems):
        try:
            import trl  # noqa: F401
        except ImportError:
            raise SystemExit("ecosystem_agent: the trl-tool system needs TRL: python3 -m pip "
                             "install trl (or --systems tool,notool)") from None
    checkpoints = [float(x) for x in a.checkpoints.split(",")]
    # a sweep on a seeded run's own seed picks the setting that suits that seed's trajectory
    sweep_seed = a.seed0 + 1000 if a.sweep_seed is None else a.sweep_seed
    doc = yaml.safe_load((REPO / a.topology).read_text())
    if len(doc.get("pools", {})) != 1 or "verifiers" not in next(
            iter(doc["pools"].values())).get("workflows", {}):
        raise SystemExit("ecosystem_agent: the topology needs one pool with a verifiers "
                         "workflow")
    learning.ensure_model(doc)
    usual = float(next(iter(doc["policies"].values())).get("trainer", {}).get("lr", 1e-5))
    lrs = [float(x) for x in a.lrs.split(",")] if a.lrs else [usual]
    usual_groups = learning.batch_groups(doc)
    trl_groups = ([int(x) for x in a.trl_groups.split(",")] if a.trl_groups
                  else [usual_groups])
    grids = {s: grid_of(s, [float(x) for x in a.trl_lrs.split(",")]
                        if s in TRL_SYSTEMS and a.trl_lrs else lrs, trl_groups, usual_groups)
             for s in systems}
    runs_dir = (REPO / a.runs_dir).resolve()
    progress = learning.Progress(
        Path(a.progress or runs_dir / "progress.json"),
        {"topology": a.topology, "duration": a.duration, "checkpoints": checkpoints,
         "eval_size": a.eval_size, "val_size": a.val_size,
         "sweep_duration": a.sweep_duration},
        # a rate alone is written as the number, as every grid was before TRL's groups
        {s: {"grid": [g["lr"] if list(g) == ["lr"] else g for g in grids[s]],
             **({"template": TRL_TEMPLATE} if s in TRL_SYSTEMS else {})}
         for s in systems}, a.resume)
    if a.report_only:
        chosen = {s: swept(s, grids[s], progress, sweep_seed, a.sweep_duration)
                  for s in systems}
        runs = [r for r in progress.runs if r["system"] in systems
                and chosen[r["system"]] in (None, r["setting"])]
    else:
        rows, val_rows = held_out(doc, a.eval_size), validation(doc, a.val_size)
        scorer = Scorer(doc)
        chosen = {}
        for system in systems:
            to_sweep = grids[system] if len(grids[system]) > 1 else []  # one: no sweep
            for setting in to_sweep:
                if progress.find("sweep", system, setting, sweep_seed) is None:
                    progress.add("sweep", runner(system)(
                        doc, system, setting, sweep_seed, a.sweep_duration, [a.sweep_duration],
                        val_rows, scorer, runs_dir))
            chosen[system] = swept(system, grids[system], progress, sweep_seed,
                                   a.sweep_duration)
            print(f"[bench] {system}: {setting_text(chosen[system])} on validation",
                  flush=True)
        runs = []
        for seed in range(a.seed0, a.seed0 + a.seeds):
            for system in systems:  # the systems take turns: drift hits both
                run = progress.find("run", system, chosen[system], seed)
                if run is None:
                    run = runner(system)(doc, system, chosen[system], seed, a.duration,
                                         checkpoints, rows, scorer, runs_dir)
                    progress.add("run", run)
                runs.append(run)
                print(f"[bench] {system} seed {seed}: {run['scores']}", flush=True)
    table = report(runs, systems, checkpoints)
    print(f"held-out success ({a.eval_size} problems, the system's own rollout, greedy):")
    print(table)
    out = {"meta": run_meta("ecosystem_agent", [sys.executable, "bench/ecosystem_agent.py",
                                                *argv]),
           "systems": systems, "chosen": chosen, "checkpoints": checkpoints,
           "eval_size": a.eval_size, "runs": runs, "sweep_rows": progress.sweep_rows,
           "seeds": {s: sorted(r["seed"] for r in runs if r["system"] == s)
                     for s in systems},
           "table": table}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1, default=str))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
