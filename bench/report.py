"""The results pages: ``docs/results/<bench>.md`` made from ``bench/results/*.json``.

Every JSON file in ``bench/results/`` belongs to one bench (its ``meta.bench``, else the
bench script whose name begins the file's name) and becomes one section of that bench's
page, headed by the command that made it, the commit, the machine and the date (its
``meta`` block; a fact it lacks is printed as "not recorded"). ``docs/results/README.md``
lists every bench and its page. The pages are made from the JSON alone, so the same
files always give the same pages.

    python bench/report.py           # write the pages
    python bench/report.py --check   # exit 1 naming every page that is stale, missing or
                                     # left over, and every cited results file missing

A bench that writes results calls ``run_meta(bench, argv)`` for its ``meta`` block.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
PAGES = REPO / "docs" / "results"
NOT_RECORDED = "not recorded"
META_FIELDS = ("command", "commit", "machine", "date")
# a results file named in a page of the docs: bench/results/NAME.json
CITED = re.compile(r"bench/results/([\w.-]+\.json)")

# bench script -> (title, what it measures); the index lists them in this order
BENCHES: dict[str, tuple[str, str]] = {
    "processor_throughput": (
        "Processor hot path",
        "one transactional processor hop against raw consume + produce (latency at light "
        "load, throughput at saturation), and AstraFlow's Avro codec against plain fastavro"),
    "outage": (
        "Broker outages",
        "the broker stopped for 10 s to 3 min under the default topology: how long until "
        "every component makes progress again, beside a run without an outage"),
    "cluster_faults": (
        "Faults in a three-broker cluster",
        "a node SIGKILLed, restarted one by one or stopped under the default topology: how "
        "long training stalls, and whether the books balance"),
    "blob_retention": (
        "Weight-blob retention",
        "what a run wrote in weight blobs against what the broker still holds"),
    "backpressure": (
        "Backpressure",
        "a topology with its admission processor (staleness budget counting the groups on "
        "their way to the batcher too, the tasks in flight, or the queued batches alone) "
        "and with a pass-through instead"),
    "remote_pool": (
        "A remote pool over a slow link",
        "one RaaS pool behind a shaped link (300 ms RTT, 4 Gbit/s) beside a local one, "
        "against both pools local"),
    "async_vs_sync": (
        "Asynchronous against synchronous, long tail",
        "one long-tail workload in AstraFlow's asynchronous dataflow and in a synchronous "
        "trainer-centric loop built from the same code"),
    "scale": (
        "Rollout throughput with scale",
        "simulated RaaS nodes (1 to 64) against the real dataflow on 1 to 64 partitions: "
        "trajectories/s, rebalance times, records per trajectory"),
    "data_algorithms": (
        "Data algorithms",
        "the default topology with no filter, dynamic sampling, GRESO and replay, to the "
        "same number of versions"),
    "offpolicy": (
        "Off-policy objectives",
        "the trainer's objectives at several staleness bounds on SmolLM2"),
    "learning": (
        "Learning on a real model",
        "a topology on SmolLM2 (and TRL's GRPOTrainer for the same wall time): held-out "
        "scores at checkpoints"),
    "multipolicy": (
        "Multi-policy at equal compute",
        "a two-policy topology against its solver alone, at equal wall time and training "
        "CPU-seconds, per seed"),
    "judge_probe": (
        "Judge probe",
        "how well the untrained SmolLM2 tells a right answer from a wrong one in each "
        "judge format (ROC AUC)"),
    "forward_on": (
        "What the trainer computes on",
        "the on-policy loop without Kafka with the trainer's forward pass on the fp32 "
        "master, on the published bf16 weights, and on fp32 published weights"),
    "trainer": (
        "Trainer step time",
        "the trainer's step-time breakdown per setting and backend"),
    "trainer_parallel": (
        "Trainer across processes",
        "per process: peak memory at start, step and resume, step time, tokens/s, publishing "
        "on and off the training thread and a trainer state save, for the one-process "
        "trainer (the old publish) and FSDP2 groups of N (and each group as the trainer was "
        "before its sharded load, mixed precision and per-shard checks), on this CPU and at "
        "the SmolLM2-1.7B shape on one H100"),
    "weights_device": (
        "Weight deltas found on the device",
        "one version's delta published the old way (CPU scan, CRC-32, zstd) against found "
        "on the device (prepare) and encoded off the training thread (write)"),
    "image_build": (
        "App image build",
        "the astraflow:dev image built from the package index against from the wheelhouse "
        "(scripts/offline-images wheels): build time and size"),
    "engines": (
        "Rollout engines",
        "the torch and vLLM engines side by side"),
    "matmul_dtypes": (
        "Matmul dtypes",
        "fp32 against bf16 matmuls on this CPU"),
    "weights": (
        "Weight-delta codec",
        "encoding and applying sparse bf16 weight deltas"),
    "fanout": (
        "Weight fan-out",
        "how one trainer's weight versions reach N followers through weights.blobs, on one "
        "broker and on three"),
    "security": (
        "Security protocols",
        "one processor chain over PLAINTEXT, SASL_PLAINTEXT and SASL_SSL"),
    "sandbox": (
        "Code sandbox",
        "how soon the code sandbox stops what it must stop (CPU, wall time, memory, output, "
        "processes): wall-clock and CPU seconds per kind of run"),
    "replay": (
        "Replay",
        "replay train, eval and process on a recorded run, beside baselines from the same run"),
    "agent_endpoint": (
        "Agent endpoint",
        "the openai client through the RaaS node's OpenAI-compatible endpoint against calling "
        "the engine directly: latency per call and tokens per second"),
    "agent_splits": (
        "Agent episodes split into sequences",
        "the shipped agent examples on SmolLM2-135M: sequences per episode and the share of "
        "episodes recorded as more than one sequence, before and after a change of the code"),
    "durable_episodes": (
        "Durable agent episodes",
        "a RaaS node killed mid-episode and its task taken over, the episodes replayed from "
        "the log against started again: tokens sampled again and seconds to the group"),
    "inflight": (
        "Weight updates inside a generation",
        "an agent topology with long generations, updates between chunks of a generation "
        "off and on: token age in versions (mean and max, per token) and tokens per second"),
    "vllm_lora": (
        "vLLM applying LoRA versions",
        "vLLM's own LoRA (a LoRARequest per version) against the adapter merged into the "
        "weights and reloaded: seconds to apply a version and to generate after it"),
    "lora": (
        "LoRA against full fine-tuning",
        "SmolLM2-135M on addition, the whole model against LoRA adapters of two ranks for the "
        "same wall time: versions per minute, bytes per version, weight sync, trainer memory, "
        "held-out accuracy"),
    "ecosystem_agent": (
        "A multi-turn tool agent learning",
        "SmolLM2-135M-Instruct on reasoning-gym arithmetic as a verifiers tool environment: "
        "held-out success over wall time, with the calculator, without it (the control) and "
        "under TRL's GRPOTrainer with the same tool, mean and 95 % interval over seeds"),
}


# --------------------------------------------------------------------------- meta


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


# CPU flags that set what a run computes and how fast: "AMD EPYC" alone names both Zen 3
# (AVX2 only, bf16 emulated) and Zen 4 (AVX512-BF16), whose figures are not comparable
MATMUL_FLAGS = ("amx_bf16", "avx512_bf16", "avx512f")


def machine(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU model, core count and bf16/AVX512 flags of this machine (and the GPU, when
    torch sees one)."""
    model, flags = "", set()
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    desc = f"{model or platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    if flags:
        have = [f for f in MATMUL_FLAGS if f in flags]
        desc += ", " + (" ".join(have) if have else "no AVX512")
    torch = sys.modules.get("torch")  # only when the bench loaded it: no import for this
    if torch is not None and torch.cuda.is_available():
        desc += f", {torch.cuda.get_device_name(0)}"
    return f"{desc} ({platform.system()})"


# the packages whose version changes what a bench measures (absent ones are left out)
PACKAGES = ("torch", "transformers", "trl", "peft", "vllm", "confluent-kafka", "fastavro",
            "numpy")


def package_versions(names: Iterable[str] = PACKAGES) -> dict[str, str]:
    """The installed version of each of ``names`` that is installed, read from the package
    metadata (nothing is imported), and Python's own."""
    from importlib import metadata
    out = {"python": platform.python_version()}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> list[str]:
    """The SIMD flags of this CPU that matter to matmuls (AVX, AVX2, FMA, AVX512*, AMX*)."""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("flags"):
                return sorted(f for f in line.split(":", 1)[1].split()
                              if f in ("avx", "avx2", "fma", "f16c")
                              or f.startswith(("avx512", "amx", "avx_vnni")))
    except OSError:
        pass
    return []


def run_meta(bench: str, argv: list[str]) -> dict[str, Any]:
    """The ``meta`` block of a results file: the bench, its command (``argv``), the commit
    (marked when the code differs from it), this machine, today's date (UTC), the versions
    of the packages that set what it measures and the CPU's SIMD flags."""
    args = list(argv)
    for i, a in enumerate(args):  # paths inside the repository, relative to it
        p = Path(a)
        if p.is_absolute() and p.is_relative_to(REPO):
            args[i] = str(p.relative_to(REPO))
    commit = _git("rev-parse", "--short=7", "HEAD") or NOT_RECORDED
    # the code only: a bench's own progress and results files are written as it runs
    if commit != NOT_RECORDED and _git("status", "--porcelain", "--", "astraflow", "bench",
                                       ":!bench/results", ":!bench/progress"):
        commit += " with uncommitted changes"
    return {"bench": bench, "command": " ".join(shlex.quote(a) for a in args),
            "commit": commit, "machine": machine(),
            "date": time.strftime("%Y-%m-%d", time.gmtime()),
            "packages": package_versions(), "cpu_flags": cpu_flags()}


# --------------------------------------------------------------------------- formatting


def fmt(v: Any) -> str:
    """A cell: integers with separators, floats to about three significant digits."""
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            return str(v)
        if v.is_integer() and abs(v) < 1e15:
            return f"{int(v):,}"
        if abs(v) >= 1000:
            return f"{v:,.0f}"
        if abs(v) >= 100:
            return f"{v:.1f}"
        if abs(v) >= 1:
            return f"{v:.2f}"
        return f"{v:.3g}"
    if isinstance(v, list | tuple):
        return ", ".join(fmt(x) for x in v)
    return str(v)


def pct(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v * 100:.{digits}f} %"


def table(header: list[str], rows: Iterable[list[Any]]) -> str:
    """A Markdown table; cells go through ``fmt`` unless they are strings already."""
    def cell(v: Any) -> str:
        text = v if isinstance(v, str) else fmt(v)
        return text.replace("|", "\\|").replace("\n", " ")
    lines = ["| " + " | ".join(cell(h) for h in header) + " |",
             "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts as ``a.b`` keys; lists of scalars stay, other lists are left out."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        elif not isinstance(v, list) or all(not isinstance(x, dict | list) for x in v):
            out[key] = v
    return out


def records_table(rows: list[dict[str, Any]], columns: list[str] | None = None) -> str:
    """One row a record, one column a (flattened) key, in the order keys first appear."""
    flat = [flatten(r) for r in rows]
    if columns is None:
        columns = list(dict.fromkeys(k for r in flat for k in r))
    return table(columns, ([r.get(c) for c in columns] for r in flat))


def columns_table(d: dict[str, dict[str, Any]], corner: str = "") -> str:
    """One column a key of ``d``, one row a (flattened) key of its values."""
    flat = {k: flatten(v) for k, v in d.items()}
    keys = list(dict.fromkeys(k for v in flat.values() for k in v))
    return table([corner, *flat], ([k, *(v.get(k) for v in flat.values())] for k in keys))


def kv_table(d: dict[str, Any]) -> str:
    return table(["", "value"], ([k, v] for k, v in flatten(d).items()))


# --------------------------------------------------------------------------- renderers


def render_generic(data: Any) -> list[str]:
    """Scalars as settings, ``table`` strings as they are, lists of records and dicts of
    records as tables; anything else is named and left out."""
    if isinstance(data, list):
        return [records_table(data)] if all(isinstance(x, dict) for x in data) else []
    body = {k: v for k, v in data.items() if k != "meta"}
    if body and all(isinstance(v, dict) for v in body.values()):  # variants side by side
        return [columns_table(body)]
    blocks: list[str] = []
    scalars = {k: v for k, v in data.items()
               if k not in ("meta", "table") and not isinstance(v, dict | list)}
    if scalars:
        blocks.append(kv_table(scalars))
    if isinstance(data.get("table"), str):
        blocks.append(data["table"].strip())
    skipped = []
    for k, v in data.items():
        if k in ("meta", "table") or k in scalars:
            continue
        if isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            blocks += [f"**{k}**", records_table(v)]
        elif isinstance(v, list) and all(not isinstance(x, dict | list) for x in v):
            blocks.append(f"**{k}**: {fmt(v)}")
        elif isinstance(v, dict) and v and all(isinstance(x, dict) for x in v.values()):
            blocks += [f"**{k}**", columns_table(v)]
        elif isinstance(v, dict) and v and all(isinstance(x, list) for x in v.values()):
            blocks += [f"**{k}**", table(["", "values"], ([n, x] for n, x in v.items()))]
        elif isinstance(v, dict):
            blocks += [f"**{k}**", kv_table(v)]
        else:
            skipped.append(k)
    if skipped:
        blocks.append("Not shown: " + ", ".join(f"`{k}`" for k in skipped) + ".")
    return blocks


def render_learning(data: dict[str, Any]) -> list[str]:
    """``bench/learning.py`` and ``bench/offpolicy.py``: the table the bench made, the
    rollout rewards and the exploration report; from the seeded learning bench also the
    time to its target, each system's pace (updates and samples by checkpoint), the sweep
    and where AstraFlow's time went."""
    blocks = [kv_table({k: v for k, v in data.items()
                        if k in ("bench", "topology", "duration_s", "start_accuracy",
                                 "checkpoints", "objectives", "staleness", "seed", "wall_s",
                                 "seeds", "reward", "metrics", "eval_size", "chosen")})]
    if "curves" in data:
        blocks.append(f"Held-out accuracy ({fmt(data.get('eval_size'))} prompts, greedy), "
                      f"mean and 95 % interval over {len(data.get('seeds', []))} seed(s) "
                      "(Student's t); strict: the number alone, lenient: its first number:")
    blocks.append(data["table"].strip())
    per_seed = seed_rows(data.get("runs"))
    if per_seed:
        blocks += ["Each seed's held-out accuracy, lenient / strict, at each checkpoint:",
                   per_seed]
    if data.get("time_table"):
        times = data.get("time_to_target", {})
        blocks += [f"Seconds to {pct(times.get('level'), 0)} {times.get('metric', '')} "
                   "accuracy (the first checkpoint at or above it):",
                   data["time_table"].strip()]
    if data.get("pace_table"):
        blocks += ["Optimizer updates and the samples they trained by each checkpoint (means "
                   "over the seeds):", data["pace_table"].strip()]
    sweep = data.get("sweep") or {}
    if sweep.get("table"):
        seeds = sweep.get("seeds") or [sweep.get("seed")]
        which = (f"seed {seeds[0]}" if len(seeds) == 1
                 else f"seeds {', '.join(map(str, seeds))} (scores: their mean)")
        blocks += [f"Sweep: {fmt(sweep.get('duration_s'))} s a run, {which}, "
                   f"scored on {fmt(sweep.get('validation_size'))} validation prompts "
                   f"({(data.get('data') or {}).get('how', 'a split of the training set')}); "
                   f"chosen on {sweep.get('metric')} (ties: the smaller learning rate):",
                   sweep["table"].strip()]
        if sweep.get("tied"):
            blocks.append(f"Tied at the top, chosen by the tie rule: {', '.join(sweep['tied'])}.")
    if data.get("where"):
        blocks += ["Where the time went:", "\n".join(f"- {w}" for w in data["where"])]
    res = data.get("results", {})
    versions = res.get("versions") or res.get("astraflow", {}).get("versions")
    if isinstance(versions, dict):
        blocks.append("Versions published: " + ", ".join(f"{p} {fmt(n)}"
                                                          for p, n in versions.items()) + ".")
    elif versions is not None:
        blocks.append(f"Versions published: {fmt(versions)}.")
    if data.get("rollout_rewards"):
        rows = [[p, r.get("sequences"), r.get("mean"), r.get("std"), pct(r.get("nonzero"), 0)]
                for p, r in data["rollout_rewards"].items()]
        blocks += ["Rollout rewards:",
                   table(["policy", "sequences", "mean", "std", "non-zero"], rows)]
    if data.get("exploration"):
        blocks.append("```\n" + data["exploration"].strip() + "\n```")
    return blocks


def seed_rows(runs: Any) -> str:
    """The seeded runs of a learning bench one row each (system, seed, lenient / strict at
    every checkpoint), "" when it kept none."""
    if not isinstance(runs, list) or not runs or not all(
            isinstance(r, dict) and isinstance(r.get("scores"), dict) for r in runs):
        return ""
    checkpoints = sorted({t for r in runs for t in r["scores"]}, key=float)

    def cell(s: Any) -> str:
        if not isinstance(s, dict):
            return "-"
        return " / ".join(pct(s.get(m)) for m in ("lenient", "strict"))
    rows = sorted(runs, key=lambda r: (str(r.get("system")), r.get("seed", 0)))
    return table(["system", "seed", *(f"{t} s" for t in checkpoints)],
                 ([r.get("system"), r.get("seed"), *(cell(r["scores"].get(t))
                                                     for t in checkpoints)] for r in rows))


def render_async_vs_sync(data: dict[str, Any]) -> list[str]:
    blocks = [kv_table({k: v for k, v in data["args"].items()
                        if k in ("duration", "cases", "nodes", "scale_s", "alpha", "max_s",
                                 "seed")})]
    for r in data["results"]:
        blocks.append(f"**case {r['case']}**: {r['nodes']} nodes / rollout slots, "
                      f"{r['tasks_per_iteration']} tasks an iteration, {fmt(r['span_s'])} s "
                      "from version 0 in each mode")
        rows: list[list[Any]] = []
        for p, pr in r["policies"].items():
            v, it = pr["versions"], pr["per_iteration"]
            rows.append([f"**{p}**: versions reached", v.get("sync"), v.get("async"),
                         _ratio(v.get("async"), v.get("sync"))])
            for q in ("mean", "median", "p90"):
                s, a = it["sync"].get(q), it["async"].get(q)
                rows.append([f"time an iteration, {q} (s)", s, a, _ratio(s, a)])
            cmp_ = pr["compare"]
            best = cmp_.get("best", {})
            rows.append(["best accuracy (mean of 3 evaluations)", pct(best.get("sync")),
                         pct(best.get("async")), ""])
            for t in [*cmp_.get("fixed", ()), *([cmp_] if "level" in cmp_ else [])]:
                label = f"time to {pct(t['level'])}" + (" (the lower best)" if t is cmp_
                                                         else "")
                rows.append([label, _reached(t["reached"].get("sync")),
                             _reached(t["reached"].get("async")),
                             f"{t['ratio']:.2f}x" if "ratio" in t else "-"])
        blocks.append(table(["", "sync", "async", "speed-up"], rows))
        b = r.get("sync_breakdown")
        if b:
            blocks.append(
                f"sync, mean an iteration: {b['iteration_s']:.2f} s = rollout "
                f"{b['rollout_s']:.2f} s (waiting on stragglers {b['straggler_s']:.2f} s; "
                f"slots busy {pct(b['slots_busy'], 0)} of the rollout) + train "
                f"{b['train_s']:.2f} s + weight load {b['load_s']:.3f} s")
        s = r.get("async_summary", {})
        waits = ", ".join(f"{p} {pct(t.get('trainer/wait_fraction'), 0)}"
                          for p, t in r.get("async_trainer", {}).items())
        blocks.append(f"async: stale groups dropped {fmt(s.get('staleness_dropped'))}; "
                      f"trainers waiting: {waits}")
    return blocks


def _ratio(num: float | None, den: float | None) -> str:
    return f"{num / den:.2f}x" if num and den else "-"


def _reached(r: list[float] | None) -> str:
    return "never" if not r else f"{r[0]:.0f} s (v{r[1]})"


def render_multipolicy(data: dict[str, Any]) -> list[str]:
    runs = data["runs"]
    blocks = [kv_table({"topology": data["topology"], "duration_s": data["duration_s"],
                        "seeds": data["seeds"]})]
    cps = list(dict.fromkeys(c for r in runs for c in r["solver"].get("at", {})))
    cpu = list(dict.fromkeys(c for r in runs for c in r["solver"].get("at_cpu", {})))
    blocks.append("Solver held-out accuracy at wall time from the start (final: mean of the "
                  "last evaluations):")
    blocks.append(table(
        ["run", *(f"{c} s" for c in cps), "final", "mean", "s to target", "versions",
         "cores in use", "training CPU-s"],
        ([r["name"], *(pct(r["solver"]["at"].get(c)) for c in cps), pct(r["solver"]["final"]),
          pct(r["solver"]["mean"]), r["solver"].get("seconds_to_target"),
          ", ".join(f"{p} {fmt(n)}" for p, n in r["versions"].items()),
          r.get("cores_in_use"), r.get("cpu_training_s")] for r in runs)))
    if cpu:
        blocks.append("Solver held-out accuracy at training CPU-seconds:")
        blocks.append(table(["run", *(f"{c} CPU-s" for c in cpu)],
                            ([r["name"], *(pct(r["solver"].get("at_cpu", {}).get(c))
                                           for c in cpu)] for r in runs)))
    judged = [r for r in runs if "verifier" in r]
    if judged:
        blocks.append("Verifier held-out verdict accuracy:")
        blocks.append(table(["run", "start", "final", "best", "last version"],
                            ([r["name"], pct(r["verifier"]["start"]), pct(r["verifier"]["final"]),
                              pct(r["verifier"]["best"]), r["verifier"]["last_version"]]
                             for r in judged)))
    pairs = _paired(runs)
    if len(pairs) >= 2:
        rows = []
        for label, get in (("final", lambda s: s["final"]), ("mean over the run",
                                                              lambda s: s["mean"])):
            alone = [get(a) for a, _ in pairs]
            together = [get(t) for _, t in pairs]
            diff = [t - a for a, t in zip(alone, together, strict=True)]
            rows.append([label, _ci(alone), _ci(together), _ci(diff)])
        blocks.append(f"Over {len(pairs)} seeds, mean ±95 % interval (Student's t); the "
                      "difference is together - alone, paired by seed:")
        blocks.append(table(["solver", "alone", "together", "difference"], rows))
    return blocks


# two-sided 95 % quantiles of Student's t by degrees of freedom
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
       9: 2.262, 10: 2.228, 11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131,
       16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093, 20: 2.086, 21: 2.080, 22: 2.074,
       23: 2.069, 24: 2.064, 25: 2.060, 26: 2.056, 27: 2.052, 28: 2.048, 29: 2.045,
       30: 2.042}  # beyond 30 degrees of freedom the normal's 1.96 (at most 4 % short)


def _ci(values: list[float]) -> str:
    half = T95.get(len(values) - 1, 1.96) * statistics.stdev(values) / math.sqrt(len(values))
    return f"{statistics.fmean(values) * 100:.1f} ±{half * 100:.1f}"


def _paired(runs: list[dict[str, Any]]) -> list[tuple[dict, dict]]:
    by = {(r["kind"], r["seed"]): r["solver"] for r in runs}
    seeds = sorted({r["seed"] for r in runs})
    return [(by[("alone", s)], by[("together", s)]) for s in seeds
            if ("alone", s) in by and ("together", s) in by]


def render_outage(data: Any) -> list[str]:
    rows = data["results"] if isinstance(data, dict) else data
    out = []
    for r in rows:
        comp = r.get("per_component_s") or {}
        slowest = max(comp, key=comp.get) if comp else "-"
        out.append(["none (baseline)" if not r["outage_s"] else f"{fmt(r['outage_s'])} s",
                    r.get("all_components_s"), slowest,
                    sum((r.get("restarts") or {}).values())])
    blocks = [table(["outage", "every component making progress again after (s)",
                     "slowest component", "restarts"], out)]
    blocks += ["Each component, seconds from the broker's return to its first progress:",
               records_table([{"outage s": r["outage_s"], **(r.get("per_component_s") or {})}
                              for r in rows])]
    return blocks


def render_security(data: dict[str, Any]) -> list[str]:
    rows = []
    for proto, reps in data["runs"].items():
        def spread(key: str, reps: list = reps) -> str:
            xs = sorted(r[key] for r in reps)
            return " / ".join(fmt(x) for x in (xs[0], statistics.median(xs), xs[-1]))
        rows.append([proto, len(reps), spread("rate"), spread("p50"), spread("p99"),
                     spread("start")])
    return [kv_table(data.get("args", {})),
            "min / median / max over the repeats:",
            table(["protocol", "repeats", "records/s", "latency p50 (ms)", "latency p99 (ms)",
                   "start (s)"], rows)]


def render_forward_on(data: dict[str, Any]) -> list[str]:
    res = data["results"]
    steps = sorted({s["step"] for rows in res.values() for s in rows})
    by = {k: {s["step"]: s for s in rows} for k, rows in res.items()}

    def cell(s: dict | None) -> str:
        return "-" if s is None else f"{s['reward']:.3f} / {s['clip']:.2f} / {s['kl']:.3f}"
    return [kv_table(data.get("args", {})),
            "Mean reward of the samples / share of clipped tokens / KL to the behaviour "
            "policy, per step:",
            table(["step", *res], ([s, *(cell(by[k].get(s)) for k in res)] for s in steps)),
            table(["", *res], [["bf16 elements changed a step, mean",
                                *(pct(statistics.fmean(s["changed"] for s in rows[1:]), 2)
                                  if len(rows) > 1 else "-" for rows in res.values())]])]


FANOUT_COLUMNS = [
    ("brokers", "brokers"), ("variant", "variant"), ("followers", "N"),
    ("fetched_p50_s", "fetch p50 s"), ("fetched_max_s", "fetch max s"),
    ("held_p50_s", "held p50 s"), ("held_max_s", "held max s"), ("apply_p50_s", "apply p50 s"),
    ("served_bytes_per_version", "served MB/v"), ("amplification", "amplification"),
    ("broker_wchar_per_version", "wchar MB/v"),
    ("broker_cpu_s_per_version", "broker CPU s/v"), ("broker_cpu_raw_s_per_version", "raw"),
    ("follower_mb_s_p50", "MB/s a follower (p50)"), ("aggregate_mb_s", "MB/s all"),
    ("machine_busy", "host busy"), ("loopback_p50_s", "loop p50 s"),
    ("loopback_max_s", "loop max s"), ("loopback_mb_s", "loop MB/s")]


def render_fanout(data: dict[str, Any]) -> list[str]:
    mb = {"served_bytes_per_version", "broker_wchar_per_version"}
    rows = [[(r.get(k) or 0) / 1e6 if k in mb else pct(r.get(k), 0) if k == "machine_busy"
             else r.get(k) for k, _ in FANOUT_COLUMNS] for r in data["rows"]]
    v = data.get("versions", {})
    blocks = [kv_table({k: x for k, x in data.get("args", {}).items()
                        if k in ("followers", "brokers", "versions", "remedies", "procs",
                                 "apply_slots", "no_apply", "lr", "seed")}),
              table([h for _, h in FANOUT_COLUMNS], rows)]
    if v.get("versions"):
        blocks += [f"The versions ({v.get('optimizer')}, lr {fmt(v.get('lr'))}, "
                   f"{v.get('batch')}; {fmt(v.get('params'))} published bf16 elements):",
                   table(["version", "delta bytes", "unchanged", "changed elements",
                          "bytes a changed element"],
                         ([x["version"], x["bytes"], f"{x['sparsity']:.4f}", x["changed"],
                           f"{x['bytes'] / x['changed']:.2f}"] for x in v["versions"])),
                   "All versions: {:.2f} bytes a changed element (their bytes over their changed "
                   "elements).".format(sum(x["bytes"] for x in v["versions"])
                                       / sum(x["changed"] for x in v["versions"]))]
    if data.get("notes"):
        blocks.append("\n".join(f"- {n}" for n in data["notes"]))
    if data.get("load_before") is not None:
        blocks.append(f"Load average before the run: {fmt(data['load_before'])}.")
    return blocks


def render_lora(data: dict[str, Any]) -> list[str]:
    """``bench/lora.py``: its settings and the variants side by side."""
    settings = {k: data.get(k) for k in ("duration_s", "checkpoints", "ranks", "lora_lr")}
    return [kv_table(settings), data["table"].strip()]


RENDERERS: dict[str, Callable[[Any], list[str]]] = {
    "async_vs_sync": render_async_vs_sync, "multipolicy": render_multipolicy,
    "outage": render_outage, "security": render_security, "forward_on": render_forward_on,
    "fanout": render_fanout, "lora": render_lora,
}


def render(bench: str, data: Any) -> list[str]:
    if isinstance(data, dict) and isinstance(data.get("table"), str) \
            and bench in ("learning", "offpolicy"):
        return render_learning(data)
    return RENDERERS.get(bench, render_generic)(data)


# --------------------------------------------------------------------------- pages


def meta_of(data: Any) -> dict[str, Any]:
    return (data.get("meta") if isinstance(data, dict) else None) or {}


def bench_of(name: str, data: Any) -> str:
    """``meta.bench``, else the longest bench name that begins the file's stem."""
    if meta_of(data).get("bench"):
        return meta_of(data)["bench"]
    stem = name.removesuffix(".json")
    known = sorted({*BENCHES, *(p.stem for p in (REPO / "bench").glob("*.py"))}, key=len,
                   reverse=True)
    for b in known:
        if stem == b or stem.startswith((b + "-", b + "_")):
            return b
    return stem


def _shown(path: Path) -> str:
    """A path as the messages name it: relative to the repository when inside it."""
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def load_results(results: Path = RESULTS) -> dict[str, dict[str, Any]]:
    """Every results file by name: ``{"bench": ..., "data": ...}``; ``ValueError`` names a
    file that is not JSON."""
    out = {}
    for path in sorted(results.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{_shown(path)}: not JSON ({e})") from e
        out[path.name] = {"bench": bench_of(path.name, data), "data": data}
    return out


def section(name: str, bench: str, data: Any) -> str:
    meta = meta_of(data)
    lines = [f"## `{name}`", ""]
    for field in META_FIELDS:
        value = meta.get(field) or NOT_RECORDED
        if field in ("command", "commit") and value != NOT_RECORDED:
            value = f"`{value}`"
        lines.append(f"- {field}: {value}")
    packages = meta.get("packages")
    lines.append("- packages: " + (", ".join(f"{k} {v}" for k, v in packages.items())
                                   if isinstance(packages, dict) and packages
                                   else NOT_RECORDED))
    if meta.get("cpu_flags"):
        lines.append("- CPU flags: " + " ".join(meta["cpu_flags"]))
    if meta.get("note"):
        lines += ["", meta["note"]]
    lines += ["", *("\n\n".join(render(bench, data))).splitlines(), ""]
    return "\n".join(lines)


def bench_page(bench: str, files: dict[str, Any]) -> str:
    title, what = BENCHES.get(bench, (bench, ""))
    script = REPO / "bench" / f"{bench}.py"
    how = (f"The bench is [`bench/{bench}.py`](../../bench/{bench}.py): its docstring says "
           f"how it measures, `python bench/{bench}.py --help` lists its options."
           if script.exists() else "")
    head = [f"# Results: {title}", "",
            "Generated by `python bench/report.py` from the files named below; edit those "
            "or the generator, not this page. Each run's figures hold for its commit and "
            "machine only.", ""]
    if what:
        head += [what[0].upper() + what[1:] + ".", ""]
    if how:
        head += [how, ""]
    body = [section(name, bench, data) for name, data in files.items()]
    return "\n".join(head) + "\n" + "\n".join(body)


def index_page(by_bench: dict[str, dict[str, Any]]) -> str:
    lines = ["# Results", "",
             "Measurements of particular runs, one page per bench, generated by `python "
             "bench/report.py` from `bench/results/*.json`. Every table is headed by the "
             "command that made it, the commit, the machine and the date. The reference "
             "pages in [docs/](..) say how the system works; these say what runs of it "
             "measured.", "",
             "To add or refresh results: run the bench with `--out bench/results/<name>.json` "
             "(a file without a `meta` block shows its missing facts as \"not recorded\"), "
             "then `python bench/report.py`.", "",
             "| bench | what it measures | results |", "|---|---|---|"]
    names = [*BENCHES, *sorted(b for b in by_bench if b not in BENCHES)]
    for b in names:
        what = BENCHES.get(b, ("", ""))[1]
        files = by_bench.get(b, {})
        script = (f"[`bench/{b}.py`](../../bench/{b}.py)"
                  if (REPO / "bench" / f"{b}.py").exists() else f"`{b}`")
        res = (f"[{b}.md]({b}.md) ({len(files)} file{'s' if len(files) > 1 else ''})"
               if files else "none recorded")
        lines.append(f"| {script} | {what} | {res} |")
    return "\n".join(lines) + "\n"


def pages(results: Path = RESULTS) -> dict[str, str]:
    """Every page, by its path relative to ``docs/results``: what the files give now."""
    by_bench: dict[str, dict[str, Any]] = {}
    for name, r in load_results(results).items():
        by_bench.setdefault(r["bench"], {})[name] = r["data"]
    out = {f"{b}.md": bench_page(b, files) for b, files in sorted(by_bench.items())}
    out["README.md"] = index_page(by_bench)
    return out


def cited_results(paths: Iterable[Path], results: Path = RESULTS) -> dict[str, list[str]]:
    """Results files that the given pages cite (``bench/results/NAME.json``) but that do
    not exist: each with the pages that cite it."""
    missing: dict[str, list[str]] = {}
    for page in paths:
        for name in CITED.findall(page.read_text()):
            if not (results / name).exists():
                missing.setdefault(f"bench/results/{name}", []).append(_shown(page))
    return missing


# a JSON file named in a page, with or without a folder: what stands before it decides
NAMED = re.compile(r"(?<![\w.-])((?:[\w.-]+/)*[\w.-]+\.json)\b")
# a page's link to a results page: results/<bench>.md
RESULTS_LINK = re.compile(r"\(results/([\w-]+)\.md(?:#[^)]*)?\)")


def named_results(text: str) -> set[str]:
    """The results files a page names: ``bench/results/NAME.json``, or a bare ``NAME.json``
    whose name begins with a bench's (``bench_of``); a file under another folder
    (``bench/progress/...``) is not one."""
    known = set(BENCHES) | {p.stem for p in (REPO / "bench").glob("*.py")}
    out = set()
    for path in NAMED.findall(text):
        folder, _, name = path.rpartition("/")
        if folder and folder != "bench/results":
            continue
        if bench_of(name, None) in known:
            out.add(name)
    return out


def uncited_results(results: Path = RESULTS,
                    docs: Iterable[Path] | None = None) -> list[str]:
    """The results files no reference page cites: a page cites a file by naming it
    (``named_results``) or by linking the results page that renders it
    (``results/<bench>.md``)."""
    named: set[str] = set()
    linked: set[str] = set()
    for page in (reference_pages() if docs is None else docs):
        text = page.read_text()
        named |= named_results(text)
        linked |= set(RESULTS_LINK.findall(text))
    return [name for name, r in load_results(results).items()
            if name not in named and r["bench"] not in linked]


def missing_named(results: Path = RESULTS,
                  docs: Iterable[Path] | None = None) -> dict[str, list[str]]:
    """Results files a reference page names (``named_results``) that do not exist, each
    with the pages that name it."""
    missing: dict[str, list[str]] = {}
    for page in (reference_pages() if docs is None else docs):
        for name in sorted(named_results(page.read_text())):
            if not (results / name).exists():
                missing.setdefault(name, []).append(_shown(page))
    return missing


def reference_pages() -> list[Path]:
    """README.md and the reference pages of docs/ (not the generated results pages)."""
    return [REPO / "README.md", *sorted(p for p in (REPO / "docs").glob("*.md"))]


def doc_pages() -> list[Path]:
    """README.md and every Markdown page under docs/."""
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def check(results: Path = RESULTS, pages_dir: Path = PAGES,
          docs: Iterable[Path] | None = None) -> list[str]:
    """What is wrong: stale, missing or left-over pages and results files that ``docs``
    (default: README.md and docs/) cite but that do not exist, one line each (empty when
    all is well)."""
    problems = []
    want = pages(results)
    for name, text in want.items():
        path = pages_dir / name
        if not path.exists():
            problems.append(f"docs/results/{name}: missing")
        elif path.read_text() != text:
            problems.append(f"docs/results/{name}: stale")
    for path in sorted(pages_dir.glob("*.md")):
        if path.name not in want:
            problems.append(f"docs/results/{path.name}: no results file makes it")
    for name, cited_by in cited_results(doc_pages() if docs is None else docs,
                                        results).items():
        problems.append(f"{name}: cited by {', '.join(cited_by)}, but there is no such file")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true",
                    help="write nothing; exit 1 naming every page that is out of date")
    args = ap.parse_args(argv)
    try:
        if args.check:
            problems = check()
            for p in problems:
                print(p)
            if problems:
                print("run: python bench/report.py", file=sys.stderr)
            return 1 if problems else 0
        want = pages()
    except ValueError as e:
        print(f"report: {e}", file=sys.stderr)
        return 1
    PAGES.mkdir(parents=True, exist_ok=True)
    for path in PAGES.glob("*.md"):
        if path.name not in want:
            path.unlink()
            print(f"removed docs/results/{path.name}")
    for name, text in want.items():
        path = PAGES / name
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            print(f"wrote docs/results/{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
