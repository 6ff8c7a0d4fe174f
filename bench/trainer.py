"""Step-time breakdown of the trainer on a real model, side by side per setting.

Builds GRPO batches shaped like the SmolLM2 run (``topology/smollm2.yaml``): 8 prompts x 8
samples, chat-templated addition questions (about 45 prompt tokens) sampled with the
model itself at temperature 1 (``TorchEngine``, so the behaviour log-probs are real), up to
6 completion tokens (``--shape short``); ``--shape long`` asks longer word problems
(about 110 prompt tokens) with up to 64 completion tokens. Rewards are drawn per step
(Bernoulli 0.5, seeded), so nearly every group carries signal: the worst case for the
forward/backward. Every setting trains on the same batches from the same weights.

Per setting and step it times what the trainer service does per version:

* ``fwd/bwd`` and ``optim``: ``Trainer.train_step`` (its ``trainer/*_seconds`` metrics);
* ``state``: the trainer state (AdamW moments, fp32 master weights) to the blob store
  (``astraflow.trainer.state``) every ``--state-interval`` versions in the background
  (``StateWriter``): per write its snapshot copy and its serialization + file write +
  sha256 (in the background thread, competing with training for the cores), and what the
  training thread spent on it per step (snapshot + waiting), amortised over all steps.
  For comparison one synchronous write per setting is timed at the end: what every version
  cost before states became periodic (the last column adds it to the step instead);
* ``cast``: the fp32 master weights rounded to the published bf16;
* ``encode``: the bf16 delta against the previous version (``iter_encode_delta``);
* ``put``: writing that blob to a ``file://`` blob store (fsync + sha256);

and per version the delta's size and sparsity. It also prints how far bf16 autocast moves
the token log-probs from fp32 on the batch's completion tokens.

The settings run round robin (each takes version v before any takes v+1), so load from
other processes falls on all of them alike; they are in memory together (about 2.2 GB per
setting for a 135M model, plus 1.6 GB while a state is written).

Settings (``--settings``): ``fp32`` (no autocast, 8 sequences per micro-batch, each
sequence's prompt in its own pass: the trainer before real-model support), ``fp32-shared``
(a group's samples share one pass over their prompt, the default), ``fp32-loop``
(``fp32-shared`` with AdamW's for-loop, torch's default on a CPU and AstraFlow's before
``adam_impl: auto`` chose fused), ``bf16``
(``--autocast bf16``), ``bf16-shared``, ``bf16w-shared`` (``--forward-dtype bf16``: the
forward's weights held in bf16 themselves, no autocast), ``bf16w-mb32`` (that, 32
sequences per micro-batch: a batch of 4 groups of 8 in one pass), ``bf16-tokens`` (and
``--micro-batch-tokens``),
``bf16-ckpt`` (and ``--gradient-checkpointing``, which runs prompts per sequence),
``fp32-mb64`` and ``bf16-mb64`` (64 sequences per micro-batch, each prompt in its own
pass: few large kernels, for a GPU, ``--device cuda``), ``bf16-shared-mb64`` (64 sequences
per micro-batch, each of their prompts run once).

Backends (``--backends``): every setting runs under each trainer backend listed,
``torch`` (transformers) and ``megatron`` (megatron-core ``GPTModel``, Llama-family models,
``pip install 'astraflow[megatron]'``), side by side in the table. The megatron backend
runs every prompt itself (a ``-shared`` setting is its plain twin there) and, on a CPU,
has no bf16 autocast (megatron's linear layers keep only CUDA's autocast state for their
backward): those settings are skipped for it there.

Needs a local model directory, e.g. SmolLM2-135M-Instruct imported without internet::

    astraflow model import smollm2 models/smollm2
    python bench/trainer.py --model models/smollm2 --threads 2
    python bench/trainer.py --model models/smollm2 --settings fp32,bf16 \
        --backends torch,megatron
"""


import argparse
import contextlib
import dataclasses
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import torch

try:
    import astraflow.trainer  # noqa: F401
except ImportError:  # running from a checkout without an install
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from astraflow.config.sections import TrainerSpec
from astraflow.trainer.state import StateWriter, write_state
from astraflow.trainer.trainer import Trainer
from astraflow.weights.encode import EncodeStats, iter_encode_delta
from astraflow.weights.stores import FileBlobStore
from astraflow.wire.records import Batch, Sequence, TrajectoryGroup

if os.path.dirname(os.path.abspath(__file__)) not in sys.path:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import run_meta  # noqa: E402  (bench/report.py: command, commit, machine, date)

SETTINGS: dict[str, dict[str, Any]] = {
    "fp32": {"autocast": "none", "micro_batch_size": 8, "share_prompt": False},
    "fp32-shared": {"autocast": "none", "micro_batch_size": 8},
    # AdamW as on a CPU before adam_impl "auto" chose its fused kernel (torch's default)
    "fp32-loop": {"autocast": "none", "micro_batch_size": 8, "adam_impl": "for-loop"},
    "bf16": {"autocast": "bf16", "micro_batch_size": 8, "share_prompt": False},
    "bf16-shared": {"autocast": "bf16", "micro_batch_size": 8},
    "bf16w-shared": {"forward_dtype": "bf16", "micro_batch_size": 8},
    # the batch's 4 prompts x 8 samples in one shared-prompt pass: with bf16-held weights
    # every pass adds its gradients into the fp32 masters, so fewer passes add fewer times
    "bf16w-mb32": {"forward_dtype": "bf16", "micro_batch_size": 32},
    "bf16-tokens": {"autocast": "bf16", "micro_batch_tokens": 2048, "share_prompt": False},
    "bf16-ckpt": {"autocast": "bf16", "micro_batch_size": 8, "gradient_checkpointing": True},
    # the whole batch in one pass (a GPU: few, large kernels)
    "fp32-mb64": {"autocast": "none", "micro_batch_size": 64, "share_prompt": False},
    "bf16-mb64": {"autocast": "bf16", "micro_batch_size": 64, "share_prompt": False},
    # the whole batch in one pass, each prompt once
    "bf16-shared-mb64": {"autocast": "bf16", "micro_batch_size": 64},
}

SHORT = "What is {a} + {b}? Answer with the number only."
LONG = (
    "A shop sells pencils in boxes of {a} and erasers in packs of {b}. On Monday it sold "
    "{c} boxes of pencils and {d} packs of erasers; on Tuesday it sold twice as many boxes "
    "of pencils as on Monday and {e} fewer packs of erasers. How many pencils and how many "
    "erasers did the shop sell on the two days together? Explain your steps briefly, then "
    "give both numbers."
)


def build_groups(model_dir: str, shape: str, prompts: int, samples: int, seed: int):
    """Prompts sampled with the model itself: (prompt ids, generations) per prompt."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from astraflow.raas.engine import SamplingParams, TorchEngine

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True,
                                                 dtype=torch.float32)
    engine = TorchEngine(model, tok, prefix_cache_bytes=0)
    rng = random.Random(seed)
    texts = []
    for _ in range(prompts):
        a, b, c, d, e = (rng.randint(10, 99) for _ in range(5))
        q = (SHORT if shape == "short" else LONG).format(a=a, b=b, c=c, d=d, e=e)
        texts.append(tok.apply_chat_template([{"role": "user", "content": q}],
                                             add_generation_prompt=True, tokenize=False))
    ids = [engine.encode(t) for t in texts]
    params = SamplingParams(max_new_tokens=6 if shape == "short" else 64, temperature=1.0,
                            n=samples, seed=seed)
    t0 = time.perf_counter()
    gens = engine.generate(ids, params)
    print(f"# {shape}: sampled {prompts} x {samples} in {time.perf_counter() - t0:.1f}s; "
          f"prompt tokens {statistics.mean(len(p) for p in ids):.0f} mean, completion "
          f"{statistics.mean(len(g.token_ids) for gs in gens for g in gs):.1f} mean")
    del engine, model
    return list(zip(ids, gens))


def make_batch(pool, step: int, groups: int) -> Batch:
    """``groups`` prompts of the pool (rotating) with rewards drawn for this step."""
    rng = random.Random(1000 + step)
    out = []
    for j in range(groups):
        idx = (step * groups + j) % len(pool)
        prompt, gens = pool[idx]
        seqs = [
            Sequence(policy="actor", token_ids=prompt + g.token_ids,
                     loss_mask=[0] * len(prompt) + [1] * len(g.token_ids),
                     logprobs=[0.0] * len(prompt) + g.logprobs,
                     versions=[-1] * len(prompt) + [0] * len(g.token_ids),
                     reward=float(rng.random() < 0.5), sample_index=i,
                     finish_reason=g.finish_reason)
            for i, g in enumerate(gens)
        ]
        out.append(TrajectoryGroup(group_id=f"s{step}g{j}", prompt_id=f"p{idx}", task_id="t",
                                   workflow="single_turn", source="bench", raas_id="bench",
                                   pool="bench", sequences=seqs,
                                   rewards=[s.reward for s in seqs]))
    return Batch(policy="actor", batch_id=f"batch-{step}", groups=out)


@dataclass
class Row:
    """One setting's measurements over the steps."""

    name: str
    backend: str = "torch"
    steps: dict[str, list[float]] = field(default_factory=dict)
    writes: list[tuple[float, float]] = field(default_factory=list)  # snapshot, write
    deltas: list[tuple[int, float]] = field(default_factory=list)  # bytes, sparsity
    sync_write: float = 0.0  # one state written synchronously (snapshot included)
    state_bytes: int = 0

    def drop_first(self, n: int) -> None:
        """Forget the timings of the first ``n`` steps (allocator and kernel warm-up)."""
        self.steps = {k: v[n:] for k, v in self.steps.items()}

    def add(self, key: str, value: float) -> None:
        self.steps.setdefault(key, []).append(value)

    def mean(self, key: str) -> float:
        v = self.steps.get(key, [])
        return sum(v) / len(v) if v else 0.0


def publish(trainer: Trainer, prev: dict[str, torch.Tensor] | None, store, v: int, row: Row,
            threads: int) -> dict[str, torch.Tensor]:
    """Cast, encode the delta against ``prev`` and put it; the new published state."""
    t0 = time.perf_counter()
    state = {k: t.clone() for k, t in trainer.published_state().items()}
    t1 = time.perf_counter()
    if prev is not None:
        stats = EncodeStats("delta")
        pieces = [bytes(p) for p in iter_encode_delta(prev, state, threads=threads,
                                                      stats=stats)]
        t2 = time.perf_counter()
        ref = store.put(f"actor.v{v:08d}.delta.bench", pieces)
        t3 = time.perf_counter()
        store.delete(ref)
        row.add("encode", t2 - t1)
        row.add("put", t3 - t2)
        row.deltas.append((ref.bytes, stats.sparsity))
    row.add("cast", t1 - t0)
    return state


def state_step(trainer: Trainer, writer: StateWriter, store, v: int, interval: int,
               row: Row) -> None:
    """The service's state policy: every ``interval`` versions in the background, waited
    for when the next one is due; blobs are deleted once measured."""
    t0 = time.perf_counter()
    done = writer.poll()
    if v % interval == 0:
        done = done or writer.wait()
        writer.start(v)
    row.add("state_main", time.perf_counter() - t0)
    if done is not None:
        row.writes.append((done.snapshot_seconds, done.write_seconds))
        for ref in done.refs:
            store.delete(ref)


@dataclass
class Setting:
    """One trainer under test, with its store, state writer and measurements."""

    trainer: Trainer
    store: FileBlobStore
    writer: StateWriter
    row: Row
    prev: dict[str, torch.Tensor] | None = None


def runnable(name: str, backend: str, device: str = "cpu") -> bool:
    """Whether the trainer takes setting ``name`` under ``backend`` on ``device``
    (megatron: no autocast on a CPU); says why not."""
    try:
        TrainerSpec(backend=backend, device=device, **SETTINGS[name])
    except ValueError as e:
        print(f"# {name} ({backend}) skipped: {e}")
        return False
    return True


def open_setting(model_dir: str, name: str, backend: str, args, root: str) -> Setting:
    cfg = TrainerSpec(lr=args.lr, backend=backend, device=args.device, **SETTINGS[name])
    trainer = Trainer(model_dir, cfg, policy="actor")
    store = FileBlobStore(os.path.join(root, f"{name}-{backend}"))
    st = Setting(trainer, store, StateWriter(store, "actor", trainer),
                 Row(name, backend))
    st.prev = publish(trainer, None, store, 0, st.row, args.threads)
    st.row.steps.clear()
    return st


@contextlib.contextmanager
def saved_for_backward(out: list[int]):
    """Adds to ``out[0]`` the bytes of the tensors autograd saves for the backward pass
    (each storage once): the activation memory gradient checkpointing trades for time.
    Inside a checkpointed layer torch's own hooks take over, so only what stays is seen."""
    seen: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            out[0] += storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield


def step(st: Setting, v: int, batch: Batch, args) -> None:
    """What the service does for version ``v`` (without Kafka), timed."""
    t0 = time.perf_counter()
    saved = [0]
    with saved_for_backward(saved):
        m = st.trainer.train_step(batch, current_version=v - 1)
    st.row.add("saved_mb", saved[0] / 1e6 / max(1.0, m["trainer/micro_batches"]))
    for key, metric in (("fwd_bwd", "forward_backward_seconds"), ("optim", "optimizer_seconds"),
                        ("micro", "micro_batches"), ("padded", "padded_tokens"),
                        ("tokens", "loss_tokens")):
        st.row.add(key, m[f"trainer/{metric}"])
    state_step(st.trainer, st.writer, st.store, v, args.state_interval, st.row)
    st.prev = publish(st.trainer, st.prev, st.store, v, st.row, args.threads)
    st.row.add("wall", time.perf_counter() - t0)


def finish(st: Setting, version: int) -> None:
    """Collect the last background write, then time one synchronous write (snapshot +
    serialize + put), what every version cost before states became periodic."""
    last = st.writer.wait()
    if last is not None:
        st.row.writes.append((last.snapshot_seconds, last.write_seconds))
        for ref in last.refs:
            st.store.delete(ref)
    t0 = time.perf_counter()
    done = write_state(st.store, "actor", st.trainer.snapshot(version))
    st.row.sync_write = time.perf_counter() - t0
    st.row.state_bytes = done.bytes
    for ref in done.refs:
        st.store.delete(ref)


def logprob_error(model_dir: str, batch: Batch, device: str = "cpu") -> str:
    """bf16 autocast against fp32 token log-probs on the batch's completion tokens."""
    out = {}
    for ac in ("none", "bf16"):
        tr = Trainer(model_dir, TrainerSpec(autocast=ac, device=device), policy="actor")
        rows = tr._rows(batch)
        ids, attn, behaviour, mask, _ = tr._tensors(rows)
        with torch.no_grad():
            out[ac] = tr.token_logprobs(ids, attn)
        del tr
    on = mask > 0
    d = (out["bf16"] - out["none"]).abs().cpu()[on]
    e = (out["none"].cpu() - behaviour).abs()[on]
    return (f"# log-prob |bf16 autocast - fp32| on {int(on.sum())} completion tokens: mean "
            f"{float(d.mean()):.4f}, max {float(d.max()):.4f} (|fp32 trainer - engine "
            f"behaviour|: max {float(e.max()):.1e})")


def report(rows: list[Row], interval: int) -> None:
    print(f"\n| setting | backend | micro-batches | padded tokens | saved for backward MB per "
          f"micro-batch | fwd/bwd s | optim s | cast s | "
          f"encode s | put s | state write, every version s | state write in the background "
          f"(snapshot + write) s | state on the step, every {interval} s | step s (state "
          f"every {interval}) | step s (state every version) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        bg = (f"{statistics.mean(a for a, _ in r.writes):.2f} + "
              f"{statistics.mean(b for _, b in r.writes):.2f}" if r.writes else "-")
        sync_wall = r.mean("wall") - r.mean("state_main") + r.sync_write
        print(f"| {r.name} | {r.backend} | {r.mean('micro'):.0f} | {r.mean('padded'):.0f} | "
              f"{r.mean('saved_mb'):.0f} | "
              f"{r.mean('fwd_bwd'):.2f} | {r.mean('optim'):.3f} | {r.mean('cast'):.3f} | "
              f"{r.mean('encode'):.3f} | {r.mean('put'):.3f} | {r.sync_write:.2f} | {bg} | "
              f"{r.mean('state_main'):.3f} | {r.mean('wall'):.2f} | {sync_wall:.2f} |")
    if rows:
        print(f"\nstate per write: {rows[0].state_bytes / 1e9:.2f} GB (AdamW moments + fp32 "
              "master weights)")
    print("\nper version: delta KB (sparsity)")
    for r in rows:
        cells = " ".join(f"v{i}:{b / 1e3:.0f}({s:.4f})" for i, (b, s) in
                         enumerate(r.deltas, start=1))
        print(f"  {r.name} ({r.backend}): {cells}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, metavar="DIR",
                   help="local Hugging Face causal-LM directory (with tokenizer)")
    p.add_argument("--steps", type=int, default=7, help="versions per setting")
    p.add_argument("--warmup", type=int, default=1,
                   help="first versions left out of the step timings (deltas all shown)")
    p.add_argument("--shape", default="short", choices=["short", "long"])
    p.add_argument("--settings", default="fp32,fp32-shared,bf16,bf16-shared",
                   help=f"comma-separated, of {', '.join(SETTINGS)}")
    p.add_argument("--backends", default="torch",
                   help="comma-separated trainer backends, each setting under each: torch, "
                   "megatron (default torch)")
    p.add_argument("--state-interval", type=int, default=3,
                   help="state written every N versions in the background (one synchronous "
                   "write per setting is timed at the end, for every version)")
    p.add_argument("--prompts", type=int, default=8, help="distinct prompts sampled")
    p.add_argument("--groups", type=int, default=8, help="prompts per batch")
    p.add_argument("--samples", type=int, default=8, help="samples per prompt")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu", help="the trainer's torch device (cuda: the "
                   "GPU; the batches are still sampled on the CPU)")
    p.add_argument("--dir", help="blob store directory (default: a temporary one)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, metavar="FILE",
                   help="write every setting's measurements per step as JSON here")
    args = p.parse_args(argv)
    meta = run_meta("trainer", ["python", *sys.argv] if argv is None
                    else ["python", "bench/trainer.py", *argv])  # before the run: its commit
    names = [s for s in args.settings.split(",") if s]
    backends = [b for b in args.backends.split(",") if b]
    bad = [s for s in names if s not in SETTINGS] + [
        b for b in backends if b not in ("torch", "megatron")]
    if bad or args.steps <= args.warmup or args.state_interval < 1:
        p.error(f"--settings/--backends: unknown {bad}" if bad
                else "--steps must exceed --warmup, --state-interval be at least 1")
    runs = [(n, b) for b in backends for n in names if runnable(n, b, args.device)]
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    pool = build_groups(args.model, args.shape, args.prompts, args.samples, args.seed)
    batches = [make_batch(pool, v, args.groups) for v in range(args.steps)]
    print(logprob_error(args.model, batches[0], args.device))
    root = args.dir or tempfile.mkdtemp(prefix="astraflow-bench-trainer-")
    try:
        settings = [open_setting(args.model, n, b, args, root) for n, b in runs]
        # round robin: every setting takes version v before any takes v+1, so load from
        # other processes on the machine falls on all of them alike
        for v, batch in enumerate(batches, start=1):
            for st in settings:
                step(st, v, batch, args)
                print(f"# v{v} {st.row.name} ({st.row.backend}): "
                      f"{st.row.steps['wall'][-1]:.2f}s", flush=True)
        for st in settings:
            finish(st, len(batches))
            st.row.drop_first(args.warmup)
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    report([st.row for st in settings], args.state_interval)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "settings": {k: str(v) for k, v in vars(args).items()},
                       "rows": [dataclasses.asdict(st.row) for st in settings]}, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
