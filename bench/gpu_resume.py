"""A trainer SIGKILLed mid-step and resumed from its DCP checkpoint, on a GPU or a CPU.

The check ``bench/gpu_check.sh`` runs (no Kafka: the trainer alone, as the one process of
a group of one, which holds the model whole, the state through
``astraflow.trainer.checkpoint``):

1. a child process trains 2 steps, saves the state asynchronously (the stager copies it to
   CPU memory while step 3 trains), trains step 3 and writes version 3's published weights
   to disk, starts step 4 and is SIGKILLed by this process while it runs;
2. a fresh child loads the checkpoint of version 2, trains step 3 again and compares its
   published weights with the killed run's version 3 (``published_difference``: bit for bit;
   on a GPU without ``deterministic`` the backward pass is not bit-reproducible, so the
   largest difference is printed too), then trains step 4.

It prints one line per phase and exits 1 when a phase fails (a resume that does not load or
does not train, or, on a CPU, a recomputed version that differs)::

    python bench/gpu_resume.py --device cuda --model DIR
    python bench/gpu_resume.py --device cpu --model DIR   # the dry run
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__" and __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from astraflow.trainer.processes import free_port, rank_env
from astraflow.wire.records import Batch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trainer_parallel import make_batches  # noqa: E402  (bench/trainer_parallel.py)


def batches(vocab: int) -> list[Batch]:
    """4 synthetic batches (``bench/trainer_parallel.py``'s): 2 prompts of 16 tokens, 4
    completions of 16 each, rewards alternating."""
    return make_batches(4, vocab, {"seed": 0, "groups": 2, "samples": 4, "prompt": 16,
                                   "completion": 16})


def child(phase: str, model: str, device: str, work: Path) -> None:
    """One phase in this process (a group of 1; its state saved through DCP)."""
    from astraflow.config.sections import TrainerSpec
    from astraflow.trainer import checkpoint
    from astraflow.trainer.parallel import join
    from astraflow.trainer.trainer import Trainer

    group = join(device)
    tr = Trainer(model, TrainerSpec(lr=1e-5, autocast="bf16" if device == "cuda" else
                                    "none", micro_batch_size=4, device=device),
                 policy="actor", group=group)
    data = batches(int(tr.model.config.vocab_size))
    if phase == "train":
        for i in range(2):
            tr.train_step(data[i], i)
        handle = checkpoint.save(tr, work / "state", async_=True)
        tr.train_step(data[2], 2)  # overlaps the write; its step waits for the copy
        handle.result()
        torch.save({k: v.cpu() for k, v in tr.published_state().items()}, work / "v3.pt")
        (work / "step4").write_text("started")
        while True:  # step 4 and on, until this process is killed
            tr.train_step(data[3], 3)
    want = torch.load(work / "v3.pt", weights_only=True)
    t0 = time.perf_counter()
    meta = checkpoint.load(tr, work / "state")
    loaded_s = time.perf_counter() - t0
    tr.train_step(data[2], 2)
    bad = tr.published_difference(want)
    diff = max(float((v.float() - want[k].float().to(v.device)).abs().max())
               for k, v in tr.published_state().items())
    m = tr.train_step(data[3], 3)
    (work / "resumed.json").write_text(json.dumps({
        "version": meta.get("version"), "load_s": loaded_s, "differs": bad,
        "max_abs_diff": diff, "step4_loss_tokens": m["trainer/loss_tokens"]}))
    group.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a Hugging Face model directory")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--timeout-s", type=float, default=900.0)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.child, args.model, args.device, args.work)
        return 0
    work = Path(tempfile.mkdtemp(prefix="astraflow-gpu-resume-"))
    try:
        return run(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(args: argparse.Namespace, work: Path) -> int:
    """The two phases (see the module docstring); 0 when both passed."""

    def start(phase: str) -> subprocess.Popen:
        env = {**os.environ, **rank_env(0, 1, free_port())}
        return subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", phase,
                                 "--model", args.model, "--device", args.device,
                                 "--work", str(work)], env=env)

    p = start("train")
    deadline = time.monotonic() + args.timeout_s
    while not (work / "step4").exists():
        if p.poll() is not None or time.monotonic() > deadline:
            p.kill()
            print(f"gpu_resume: the training child ended ({p.poll()}) before step 4")
            return 1
        time.sleep(0.2)
    time.sleep(1.0)  # inside step 4
    p.send_signal(signal.SIGKILL)
    code = p.wait()
    print(f"killed the trainer in step 4 (exit {code}); resuming from the state of version 2")
    r = start("resume")
    try:
        code = r.wait(max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        r.kill()
        print("gpu_resume: the resume did not end in time")
        return 1
    if code != 0 or not (work / "resumed.json").exists():
        print(f"gpu_resume: the resume failed (exit {code})")
        return 1
    got = json.loads((work / "resumed.json").read_text())
    same = "bit for bit" if got["differs"] is None else f"differs at {got['differs']}"
    print(f"resumed from version {got['version']} in {got['load_s']:.2f}s; version 3 "
          f"recomputed: {same} "
          f"(largest difference {got['max_abs_diff']:.3g}); step 4 trained "
          f"{got['step4_loss_tokens']:.0f} tokens")
    exact_needed = args.device == "cpu"  # CUDA's backward is not bit-reproducible
    ok = got["step4_loss_tokens"] > 0 and (got["differs"] is None or not exact_needed)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
