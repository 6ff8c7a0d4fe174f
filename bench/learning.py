"""Learning at equal wall-clock time: AstraFlow against TRL's GRPOTrainer.

Runs, one after the other on the same machine, the same model, data, reward, sampling and
batch shape:

* ``astraflow``: ``astraflow up`` on the topology (default ``topology/smollm2.yaml``) with
  its online evaluator removed (evaluation is done afterwards, so it takes no CPU from
  training), for ``--duration`` seconds from the launch of the command;
* ``trl``: TRL's ``GRPOTrainer`` in one process (what a user picks for one machine), with
  the topology's learning rate, samples per prompt, batch of groups, temperature,
  completion length, reward and prompts (built with the same chat template), no KL term
  (as ours), a constant learning rate, all cores, for the same wall time from its launch.
  With a ``downsample`` processor in the topology (AstraFlow rolls out ``n_samples`` per
  prompt and trains on the ``keep`` that vary most), TRL samples and trains ``keep``.

At every checkpoint time ``t`` (``--checkpoints``) it takes the newest weights each system
had published by ``t`` (AstraFlow: the newest manifest on ``weights.<policy>``, rebuilt
from the weights topic; TRL: the state after its last optimizer step finished before
``t``), and scores them afterwards the same way the evaluator does (greedy, the
topology's held-out dataset, size and reward). It prints both curves side by side, where
AstraFlow's time went (versions, trainer busy/waiting, rollout tokens/s, stale drops),
and writes ``bench/results/learning.json``.

A topology with several policies (``topology/smollm2-solver-verifier.yaml``,
``-solver-selector.yaml``, ``-code.yaml``) runs AstraFlow alone (TRL has no multi-policy
counterpart): every policy's checkpoints are scored with its own evaluator's metric
(``astraflow eval run`` as ``astraflow up`` would start it: answers for a solver, verdict
accuracy on balanced candidates for a verifier, pick accuracy for a selector, held-out
specs passed for a coder, the mutation reward for a tester), against its version 0.

Usage:

    python bench/learning.py [--duration 600] [--checkpoints 60,120,240,360,480,600]
        [--systems astraflow,trl] [--topology topology/smollm2.yaml] [--eval-size N]
        [--out FILE.json]

Needs TRL (``python3 -m pip install trl``) for the ``trl`` system, and the model the
topology imports (``astraflow model import smollm2 DIR``; done here when missing).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
RUN = "bench-learning"


def bench_topology(src: Path, runs_dir: Path) -> tuple[Path, dict[str, Any]]:
    """The topology AstraFlow runs in the bench: ``src`` with run id ``bench-learning``,
    absolute paths, no online evaluator (its settings are kept for scoring), and every
    version's weights kept (the checkpoints are scored after the run, from version 0 on)."""
    doc = yaml.safe_load(src.read_text())
    run_dir = runs_dir / RUN
    run_dir.mkdir(parents=True, exist_ok=True)
    out = copy.deepcopy(doc)
    out["run"] = RUN
    for spec in out.get("policies", {}).values():
        spec["model"] = str((REPO / spec["model"]).resolve())
        spec.setdefault("trainer", {})["keep_versions"] = 0
    for part in ("feeder", "eval"):
        ds = (out.get(part) or {}).get("dataset")
        if ds:
            ds["path"] = str((REPO / ds["path"]).resolve())
    evaluation = out.pop("eval", None) or {}
    path = run_dir / "topology.yaml"
    path.write_text(f"# bench/learning.py: {src} without its evaluator\n"
                    + yaml.safe_dump(out, sort_keys=False))
    return path, {**out, "eval": evaluation}


def ensure_model(doc: dict[str, Any]) -> Path:
    policy = next(iter(doc["policies"].values()))
    model = Path(policy["model"])
    if not (model / "config.json").exists():
        source = policy.get("import_from") or "smollm2"
        cmd = ["model", "import", *(["--gguf", source] if source.endswith(".gguf") else [source]),
               str(model)]
        subprocess.run([sys.executable, "-m", "astraflow.cli.main", *cmd], check=True)
    return model


# --- AstraFlow --------------------------------------------------------------------------
def run_astraflow(path: Path, args: argparse.Namespace) -> dict[str, Any]:
    """``astraflow up`` for ``--duration`` s; the newest version at each checkpoint."""
    from astraflow.config.topology import load_topology
    from astraflow.launch.runs import start_over

    topo = load_topology(path)
    start_over(topo.run)
    cmd = [sys.executable, "-m", "astraflow.cli.main", "up", str(path), "--keep-broker",
           "--duration", str(args.duration), "--runs-dir", str(args.runs_dir)]
    t0 = time.time()
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          bufsize=1) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            if not line.startswith((" ", "{", "}")) or "s |" in line:
                print(f"[astraflow] {line.rstrip()}", flush=True)
    summary_file = args.runs_dir / RUN / "summary.json"
    summary = json.loads(summary_file.read_text()) if summary_file.exists() else {}
    out: dict[str, Any] = {"summary": summary, "_topology": topo, "policies": {}}
    for i, policy in enumerate(topo.policies):
        records, first_at = manifest_times(topo, t0, policy)
        at = {t: max((v for v, s in first_at.items() if s <= t), default=None)
              for t in args.checkpoints}
        mine = {"at": at, "versions": max(first_at, default=0),
                "_manifests": [r.record for r in records]}
        out["policies"][policy] = mine
        if i == 0:  # the one-policy report reads the first policy at the top level
            out.update(at=at, versions=mine["versions"], _manifests=mine["_manifests"])
    return out


def manifest_times(topo: Any, t0: float,
                   policy: str | None = None) -> tuple[list[Any], dict[int, float]]:
    """A policy's (default: the first one's) weight manifests of a finished run, and the
    seconds from ``t0`` at which each version was first published."""
    from astraflow.kafka.clients import read_all
    from astraflow.wire.records import WeightManifest

    policy = policy or next(iter(topo.policies))
    records = read_all(topo.kafka.effective(), topo.full_name(f"weights.{policy}"),
                       idle_s=3.0, timeout_s=300.0, expect=WeightManifest)
    first_at: dict[int, float] = {}
    for r in records:
        v = r.record.version
        first_at[v] = min(first_at.get(v, 1e18), r.timestamp_ms / 1000 - t0)
    return records, first_at


def score_astraflow(result: dict[str, Any], ev: dict[str, Any], doc: dict[str, Any]) -> None:
    from astraflow.weights import WeightFollower

    topo = result.pop("_topology")
    manifests = result.pop("_manifests")
    policy = next(iter(topo.policies))
    follower = WeightFollower(policy=policy, kafka_config=topo.kafka.effective())
    follower.observe(manifests)
    scores: dict[int, float] = {}
    for t, v in result["at"].items():
        if v is None:
            continue
        if v not in scores:
            follower.update(v)
            scores[v] = ev["score"](follower.state)
        result.setdefault("accuracy", {})[t] = scores[v]


# --- TRL ----------------------------------------------------------------------------------
def run_trl(doc: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """TRL's GRPOTrainer in a child process (``--trl-worker``) for ``--duration`` s."""
    out_dir = args.runs_dir / RUN / "trl"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "doc.json").write_text(json.dumps(doc))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--trl-worker", str(out_dir),
           "--duration", str(args.duration),
           "--checkpoints", ",".join(str(t) for t in args.checkpoints)]
    env = {**os.environ, "BENCH_T0": str(time.time())}
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          bufsize=1, env=env) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("[trl]"):
                print(line.rstrip(), flush=True)
    return json.loads((out_dir / "result.json").read_text())


def score_trl(result: dict[str, Any], ev: dict[str, Any]) -> None:
    from safetensors.torch import load_file

    for t, ckpt in result["at"].items():
        if ckpt is not None:
            result.setdefault("accuracy", {})[t] = ev["score"](load_file(ckpt["path"]))


def trl_worker(out_dir: Path, duration: float, checkpoints: list[float]) -> int:
    """The TRL run (child process): writes a checkpoint per checkpoint time, in fp32, the
    weights TRL trains (not a bf16 rounding of them)."""
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    t0 = float(os.environ.get("BENCH_T0", time.time()))
    torch.set_num_threads(os.cpu_count() or 1)
    doc = json.loads((out_dir / "doc.json").read_text())
    setup = trl_setup(doc)
    rows = setup["rows"]
    config = GRPOConfig(
        output_dir=str(out_dir / "out"), learning_rate=setup["lr"],
        lr_scheduler_type="constant", per_device_train_batch_size=setup["batch"],
        gradient_accumulation_steps=1, num_generations=setup["n"],
        max_completion_length=setup["max_new_tokens"], temperature=setup["temperature"],
        top_p=1.0, beta=0.0, use_cpu=True, bf16=False, gradient_checkpointing=False,
        max_steps=10**6, save_strategy="no", report_to=[], logging_steps=1,
        disable_dropout=True, seed=0, dataloader_num_workers=0, disable_tqdm=True,
    )
    clock = _TrlClock(t0, duration, checkpoints, out_dir)
    trainer = GRPOTrainer(model=setup["model"], reward_funcs=[setup["reward_fn"]],
                          args=config, train_dataset=Dataset.from_list(rows),
                          processing_class=setup["tokenizer"], callbacks=[clock])
    trainer.train()
    clock.finish(trainer.model)
    (out_dir / "result.json").write_text(json.dumps(
        {"at": clock.at, "steps": clock.steps, "paused_s": round(clock.paused, 1),
         "logged": clock.logged}))
    return 0


def trl_setup(doc: dict[str, Any]) -> dict[str, Any]:
    """Model, tokenizer, prompts and reward of the topology, in TRL's terms."""
    import torch
    from transformers import AutoModelForCausalLM

    from astraflow.models.chat import ChatFormat
    from astraflow.models.loading import load_policy
    from astraflow.tasks.datasets import load_dataset_file
    from astraflow.tasks.rewards import make_reward

    name, policy = next(iter(doc["policies"].items()))
    pool = next(iter(doc["pools"].values()))
    wf = pool.get("workflows", {}).get("single_turn", {})
    _, tokenizer = load_policy(policy["model"])
    model = AutoModelForCausalLM.from_pretrained(policy["model"], dtype=torch.float32)
    chat = ChatFormat.from_options(policy.get("chat"))
    payloads = load_dataset_file(doc["feeder"]["dataset"]["path"])
    rows = [{"prompt": chat.prompt_text(tokenizer, p), "answer": p["answer"]} for p in payloads]
    reward = make_reward(wf.get("reward"))

    def reward_fn(completions: list[str], answer: list[str], **_: Any) -> list[float]:
        return [reward(c, {"answer": a}) for c, a in zip(completions, answer)]

    batch_groups = next(p["options"]["batch_size"] for p in doc["processors"].values()
                        if p["kind"] == "batcher")
    n = trained_group_size(doc)
    return {"model": model, "tokenizer": tokenizer, "rows": rows, "reward_fn": reward_fn,
            "lr": float(policy["trainer"]["lr"]), "n": n, "batch": n * int(batch_groups),
            "max_new_tokens": int(wf.get("max_new_tokens", 64)),
            "temperature": float(wf.get("temperature", 1.0)), "policy": name}


def trained_group_size(doc: dict[str, Any]) -> int:
    """Samples per prompt the trainer trains on: a ``downsample`` processor's ``keep``,
    else the pool's ``n_samples``. TRL samples and trains this many (the same batch
    shape); it has no down-sampling step of its own."""
    n = int(next(iter(doc["pools"].values())).get("n_samples", 8))
    keeps = [int(p["options"]["keep"]) for p in doc["processors"].values()
             if p["kind"] == "downsample"]
    return min([n, *keeps])


def _trl_callback_base():
    from transformers import TrainerCallback

    return TrainerCallback


class _TrlClock(_trl_callback_base()):  # type: ignore[misc]
    """Stops TRL at the deadline and keeps, for each checkpoint time, the weights of the
    last step finished before it (the time spent copying and saving is not counted)."""

    def __init__(self, t0: float, duration: float, checkpoints: list[float], out: Path):
        self.t0, self.duration, self.out = t0, duration, out
        self.pending = sorted(checkpoints)
        self.at: dict[str, Any] = {}
        self.paused = 0.0
        self.steps = 0
        self.prev: dict[str, Any] | None = None
        self.prev_step = 0
        self.logged: list[dict[str, Any]] = []

    def elapsed(self) -> float:
        return time.time() - self.t0 - self.paused

    def on_train_begin(self, args, state, control, model=None, **kw):
        self._snapshot(model, 0)

    def on_log(self, args, state, control, logs=None, **kw):
        """TRL's own figures per step (its train reward above all: a flat baseline is
        told apart from one that gets no reward)."""
        keys = ("reward", "reward_std", "frac_reward_zero_std", "completions/mean_length",
                "grad_norm", "loss")
        shown = {k: logs[k] for k in keys if k in (logs or {})}
        if shown:
            self.logged.append({"step": state.global_step, **shown})
            print(f"[trl] step {state.global_step} " + " ".join(
                f"{k} {v:.3g}" for k, v in shown.items()), flush=True)

    def on_step_end(self, args, state, control, model=None, **kw):
        self.steps = state.global_step
        now = self.elapsed()
        self._save_due(now)
        self._snapshot(model, state.global_step)
        print(f"[trl] {now:6.0f}s step {state.global_step}", flush=True)
        if now >= self.duration:
            control.should_training_stop = True

    def _snapshot(self, model, step: int) -> None:
        import torch

        t = time.time()
        self.prev = {k: v.detach().to(torch.float32).clone()
                     for k, v in model.state_dict().items()}
        self.prev_step = step
        self.paused += time.time() - t

    def _save_due(self, now: float) -> None:
        from safetensors.torch import save_file

        while self.pending and self.pending[0] <= now:
            t = time.time()
            cp = self.pending.pop(0)
            path = self.out / f"ckpt-{int(cp)}.safetensors"
            assert self.prev is not None
            save_file({k: v.contiguous() for k, v in self.prev.items()
                       if k != "lm_head.weight"}, str(path))
            self.at[str(cp)] = {"path": str(path), "step": self.prev_step}
            self.paused += time.time() - t

    def finish(self, model) -> None:
        self._save_due(self.elapsed() + 1e9 if self.elapsed() >= self.duration else 0)


# --- scoring and report -------------------------------------------------------------------
def make_scorer(doc: dict[str, Any]) -> dict[str, Any]:
    """``score(state) -> accuracy`` with the topology's evaluator settings."""
    import torch

    from astraflow.models.chat import ChatFormat
    from astraflow.models.evaluation import evaluate
    from astraflow.models.loading import load_policy
    from astraflow.tasks.datasets import load_dataset_file
    from astraflow.tasks.rewards import make_reward

    torch.set_num_threads(os.cpu_count() or 1)
    ev = doc["eval"]
    policy = next(iter(doc["policies"].values()))
    model, tokenizer = load_policy(policy["model"], dtype=policy.get("dtype"))
    base = {k: v.clone() for k, v in model.state_dict().items()}
    tasks = load_dataset_file(ev["dataset"]["path"], limit=int(ev.get("size", 200)))
    chat = ChatFormat.from_options(policy.get("chat"))
    reward = make_reward(ev.get("reward"))

    def score(state: dict[str, Any] | None) -> float:
        model.load_state_dict(base if state is None else state, strict=False)
        return evaluate(model, tokenizer, tasks, max_new_tokens=int(ev.get("max_new_tokens", 16)),
                        chat=chat, reward=reward)

    return {"score": score}


def exploration(doc: dict[str, Any], prompts: int) -> str:
    """How often the starting policy, sampled as the rollouts sample it (the pool's ``n``,
    temperature and completion length), earns each term of the training reward and the
    held-out reward: what RL has to start from. One line per term."""
    import torch

    from astraflow.models.chat import ChatFormat
    from astraflow.raas.engine import SamplingParams, load_torch_engine
    from astraflow.tasks.datasets import load_dataset_file
    from astraflow.tasks.rewards import make_reward

    torch.set_num_threads(os.cpu_count() or 1)
    setup_policy = next(iter(doc["policies"].values()))
    engine = load_torch_engine(setup_policy["model"], "actor", dtype="float32",
                               prefix_cache_bytes=0)
    tok, chat = engine.tokenizer, ChatFormat.from_options(setup_policy.get("chat"))
    pool = next(iter(doc["pools"].values()))
    wf = pool.get("workflows", {}).get("single_turn", {})
    spec = wf.get("reward")
    held_out = doc["eval"].get("reward")
    terms = {f"eval reward {held_out}": make_reward(held_out)}
    for t in (spec.get("terms", []) if isinstance(spec, dict) and spec.get("name") == "sum"
              else [spec]):
        terms[json.dumps(t)] = make_reward({k: v for k, v in t.items() if k != "weight"}
                                           if isinstance(t, dict) else t)
    tasks = load_dataset_file(doc["feeder"]["dataset"]["path"], limit=prompts)
    ids = [tok.encode(chat.prompt_text(tok, t), add_special_tokens=False) for t in tasks]
    n = int(pool.get("n_samples", 8))
    params = SamplingParams(n=n, max_new_tokens=int(wf.get("max_new_tokens", 64)), seed=0,
                            temperature=float(setup_policy.get("temperature", 1.0)),
                            stop_token_ids=(engine.eos_token_id,))
    outs = [(engine.decode(g.token_ids), t) for t, gs in zip(tasks, engine.generate(ids, params))
            for g in gs]
    lines = [f"v0 samples ({len(outs)}: {prompts} prompts x {n}, T {params.temperature:g}) "
             "earning each reward term:"]
    for name, fn in terms.items():
        hits = [fn(c, t) > 0 for c, t in outs]
        groups = sum(any(hits[i * n:(i + 1) * n]) for i in range(len(tasks)))
        lines.append(f"  {name}: {100 * sum(hits) / len(hits):.1f} % of samples, "
                     f"{groups}/{len(tasks)} groups")
    return "\n".join(lines)


def report(results: dict[str, Any], checkpoints: list[float], start: float) -> str:
    systems = list(results)
    head = "| t (s) | " + " | ".join(systems) + " |"
    lines = [head, "|" + "---|" * (len(systems) + 1), "| 0 | " + " | ".join(
        f"{100 * start:.1f} %" for _ in systems) + " |"]
    for t in checkpoints:
        cells = []
        for s in systems:
            acc = results[s].get("accuracy", {}).get(t, results[s].get("accuracy", {}).get(
                str(t)))
            where = results[s]["at"].get(t, results[s]["at"].get(str(t)))
            tag = (f"v{where}" if s == "astraflow" else f"step {where['step']}") \
                if where is not None else "-"
            cells.append(f"{100 * acc:.1f} % ({tag})" if acc is not None else "-")
        lines.append(f"| {t:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def where_time_went(result: dict[str, Any]) -> str:
    s = result.get("summary", {})
    trainer = next(iter(s.get("trainer", {}).values()), {})
    keys = ("trainer/wait_fraction", "trainer/step_seconds", "trainer/zero_advantage_frac",
            "trainer/stale_dropped_groups")
    parts = [f"{k} {trainer[k]:.3g}" for k in keys if k in trainer]
    wm = s.get("workflow_metrics", {})
    parts += [f"{k} {v:.3g}" for k, v in wm.items() if "tokens_per_s" in k or "reward" in k]
    return (f"astraflow: {result['versions']} versions; stale drops "
            f"{s.get('staleness_dropped')}; " + "; ".join(parts))


# --- several policies ---------------------------------------------------------------------
def policy_eval_settings(topology: Path, doc: dict[str, Any], policy: str,
                         size: int | None) -> Any:
    """The ``EvalSettings`` of ``policy``'s evaluator: the ``eval run`` command ``astraflow
    up`` would start for it on ``doc`` (its role's metric), ``size`` (``--size``) overriding
    the held-out size."""
    from astraflow.cli.components import configuration
    from astraflow.config.topology import parse_topology
    from astraflow.launch.plan import eval_args

    topo = parse_topology(doc, source=str(topology))
    command = eval_args(topo, str(topology), policy)
    return configuration([*command, *(["--size", str(size)] if size is not None else [])],
                         topo)


def policy_scorer(topology: Path, doc: dict[str, Any], policy: str,
                  size: int | None) -> Any:
    """``score(state or None) -> accuracy`` of ``policy`` as its evaluator scores it
    (``policy_eval_settings``); ``size`` overrides the held-out size. None = version 0."""
    import torch

    from astraflow.eval.evaluator import held_out_scorer
    from astraflow.models.loading import load_policy

    torch.set_num_threads(os.cpu_count() or 1)
    settings = policy_eval_settings(topology, doc, policy, size)
    scorer, _ = held_out_scorer(settings)
    model, tokenizer = load_policy(settings.model, dtype=settings.dtype)
    base = {k: v.clone() for k, v in model.state_dict().items()}

    def score(state: dict[str, Any] | None) -> float:
        model.load_state_dict(base if state is None else state, strict=False)
        return scorer(model, tokenizer)

    return score


def score_policies(result: dict[str, Any], path: Path, doc: dict[str, Any],
                   size: int | None) -> None:
    """Every policy's held-out score at version 0 (``start``) and at each checkpoint."""
    from astraflow.weights import WeightFollower

    topo = result.pop("_topology")
    result.pop("_manifests", None)
    for policy, mine in result["policies"].items():
        print(f"[bench] scoring {policy}", flush=True)
        score = policy_scorer(path, doc, policy, size)
        follower = WeightFollower(policy=policy, kafka_config=topo.kafka.effective())
        follower.observe(mine.pop("_manifests"))
        scores = {0: score(None)}
        mine["start"] = scores[0]
        for t, v in mine["at"].items():
            if v is None:
                continue
            if v not in scores:
                follower.update(v)
                scores[v] = score(follower.state)
            mine.setdefault("accuracy", {})[t] = scores[v]
        follower.close()


def policies_report(result: dict[str, Any], doc: dict[str, Any],
                    checkpoints: list[float]) -> str:
    """One column per policy (its role's held-out metric): version 0, then each
    checkpoint's score and version."""
    names = list(result["policies"])
    roles = [doc["policies"][p].get("role", "solver") for p in names]
    lines = ["| t (s) | " + " | ".join(f"{p} ({r})" for p, r in zip(names, roles)) + " |",
             "|" + "---|" * (len(names) + 1),
             "| v0 | " + " | ".join(f"{100 * result['policies'][p]['start']:.1f} %"
                                    for p in names) + " |"]
    for t in checkpoints:
        cells = []
        for p in names:
            mine = result["policies"][p]
            acc, v = mine.get("accuracy", {}).get(t), mine["at"].get(t)
            cells.append(f"{100 * acc:.1f} % (v{v})" if acc is not None else "-")
        lines.append(f"| {t:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def rollout_rewards(topo_run: str, doc: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per policy, the rewards of every sequence the run rolled out: count, mean, std
    and the share that is not zero (the reward distribution the trainers saw)."""
    import statistics

    from astraflow.config.topology import parse_topology
    from astraflow.kafka.clients import read_all
    from astraflow.wire.records import TrajectoryGroup

    topo = parse_topology({**doc, "run": topo_run})
    groups = [r.record for r in read_all(topo.kafka.effective(),
                                         topo.full_name("trajectories.raw"), idle_s=3.0,
                                         timeout_s=300.0, expect=TrajectoryGroup)]
    out = {}
    for policy in doc["policies"]:
        rewards = [s.reward for g in groups for s in g.sequences if s.policy == policy]
        if rewards:
            out[policy] = {"sequences": len(rewards), "mean": statistics.fmean(rewards),
                           "std": statistics.pstdev(rewards),
                           "nonzero": sum(r != 0 for r in rewards) / len(rewards)}
    return out


def run_policies(path: Path, doc: dict[str, Any], args: argparse.Namespace) -> int:
    """The multi-policy bench: AstraFlow alone, every policy scored (module doc)."""
    print(f"[bench] astraflow ({', '.join(doc['policies'])}): {args.duration:g} s",
          flush=True)
    result = run_astraflow(path, args)
    run = result["_topology"].run
    rewards = rollout_rewards(run, doc)
    score_policies(result, path, doc, args.eval_size)
    table = policies_report(result, doc, args.checkpoints)
    print("\nheld-out scores against version 0 (greedy; each policy its evaluator's "
          "metric):\n" + table)
    for policy, r in rewards.items():
        print(f"{policy} rollout rewards: {r['sequences']} sequences, mean {r['mean']:.3f}, "
              f"std {r['std']:.3f}, non-zero {100 * r['nonzero']:.0f} %")
    print(where_time_went(result))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"bench": "learning", "duration_s": args.duration,
                                    "topology": str(args.topology), "results": result,
                                    "rollout_rewards": rewards, "table": table}, indent=2,
                                   default=str) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--topology", type=Path, default=REPO / "topology" / "smollm2.yaml")
    ap.add_argument("--duration", type=float, default=600.0)
    ap.add_argument("--checkpoints", default="60,120,240,360,480,600")
    ap.add_argument("--systems", default="astraflow,trl")
    ap.add_argument("--runs-dir", type=Path, default=REPO / "runs")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "learning.json")
    ap.add_argument("--explore", type=int, default=32, metavar="PROMPTS",
                    help="sample this many training prompts with the starting policy and "
                    "report how often each reward term pays (0: skip)")
    ap.add_argument("--eval-size", type=int, default=None, metavar="N",
                    help="held-out prompts per score (default: the topology's eval size)")
    ap.add_argument("--trl-worker", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.checkpoints = [float(x) for x in args.checkpoints.split(",") if x]
    if args.trl_worker:
        return trl_worker(args.trl_worker, args.duration, args.checkpoints)
    args.runs_dir = args.runs_dir.resolve()
    path, doc = bench_topology(args.topology, args.runs_dir)
    if len(doc["policies"]) > 1:
        for policy in doc["policies"]:
            ensure_model({"policies": {policy: doc["policies"][policy]}})
        return run_policies(path, doc, args)
    ensure_model(doc)
    systems = [s for s in args.systems.split(",") if s]
    results: dict[str, Any] = {}
    for system in systems:
        print(f"[bench] {system}: {args.duration:g} s", flush=True)
        results[system] = run_astraflow(path, args) if system == "astraflow" \
            else run_trl(doc, args)
    print("[bench] scoring the checkpoints", flush=True)
    ev = make_scorer(doc)
    start = ev["score"](None)
    for system, result in results.items():
        (score_astraflow(result, ev, doc) if system == "astraflow" else score_trl(result, ev))
    table = report(results, args.checkpoints, start)
    print("\nheld-out accuracy (greedy, " f"{doc['eval'].get('size', 200)} prompts):\n" + table)
    if "astraflow" in results:
        print(where_time_went(results["astraflow"]))
    if "trl" in results:
        print(f"trl: {results['trl']['steps']} optimizer steps")
    explored = exploration(doc, args.explore) if args.explore > 0 else ""
    print(explored)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"bench": "learning", "duration_s": args.duration,
                                    "topology": str(args.topology), "start_accuracy": start,
                                    "results": results, "table": table,
                                    "exploration": explored}, indent=2,
                                   default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
