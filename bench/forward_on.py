"""What the trainer's forward pass runs on, when the published weights are bf16.

An on-policy loop without Kafka, so only the weights differ: each step the engine samples
``--groups`` prompts x ``--samples`` from the weights the trainer last published, the
trainer takes one step on them, and the engine loads the new published weights. The
sampling is seeded per step, so every setting sees the same first samples.

Settings (``--settings``):

* ``master``: forward on the fp32 master weights, engine on their bf16 rounding (the
  trainer before ``forward_on``): the rounding drops most of each small AdamW step, so the
  trainer's policy drifts from the one sampled; PPO clipping zeroes many tokens' gradient;
* ``published``: forward on the published (rounded) weights, an fp32 master apart (the
  default): the trainer's log-probs are exactly the sampled policy's;
* ``fp32``: fp32 published (``--publish-dtype same``): no rounding at all, dense deltas
  four times the size of bf16 weights.

It prints, per step and setting, the mean reward of the samples, their mean length, the
trainer's clipped-token fraction and KL to the behaviour policy, and the published delta's
changed fraction. Defaults follow ``topology/smollm2.yaml``.

    python bench/forward_on.py --model runs/smollm2/model [--steps 14] [--lr 3e-5]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import run_meta  # noqa: E402  (bench/report.py: command, commit, machine, date)

from astraflow.models.chat import ChatFormat  # noqa: E402
from astraflow.tasks.rewards import make_reward  # noqa: E402
from astraflow.wire.records import Batch, Sequence, TrajectoryGroup  # noqa: E402

# the training reward of topology/smollm2.yaml
REWARD = yaml.safe_load((REPO / "topology" / "smollm2.yaml").read_text()
                        )["pools"]["local"]["workflows"]["single_turn"]["reward"]
SETTINGS = {"master": ("bf16", "master"), "published": ("bf16", "published"),
            "fp32": ("same", "published")}


def run_setting(name: str, args: argparse.Namespace, rows: list[dict]) -> list[dict]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from astraflow.config.sections import TrainerSpec
    from astraflow.raas.engine import SamplingParams, TorchEngine
    from astraflow.trainer.trainer import Trainer

    publish, forward_on = SETTINGS[name]
    tok = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    trainer = Trainer(args.model, TrainerSpec(lr=args.lr, publish_dtype=publish,
                                              forward_on=forward_on), temperature=1.0)
    engine = TorchEngine(AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32),
                         tok, prefix_cache_bytes=0)
    engine.load_state_dict(trainer.published_state(), 0)
    chat, reward = ChatFormat.from_options({"template": "auto"}), make_reward(REWARD)
    rng, out, prev = random.Random(0), [], trainer.published_state()
    for step in range(args.steps):
        tasks = [rows[rng.randrange(len(rows))] for _ in range(args.groups)]
        ids = [engine.encode(chat.prompt_text(tok, t)) for t in tasks]
        gens = engine.generate(ids, SamplingParams(
            max_new_tokens=8, temperature=1.0, n=args.samples,
            stop_token_ids=(tok.eos_token_id,), seed=1000 + step))
        groups, rewards = [], []
        for j, (task, prompt, per) in enumerate(zip(tasks, ids, gens)):
            seqs = []
            for i, g in enumerate(per):
                r = reward(tok.decode(g.token_ids), task)
                rewards.append(r)
                seqs.append(Sequence(
                    policy="actor", token_ids=prompt + g.token_ids,
                    loss_mask=[0] * len(prompt) + [1] * len(g.token_ids),
                    logprobs=[0.0] * len(prompt) + g.logprobs,
                    versions=[-1] * len(prompt) + [step] * len(g.token_ids), reward=r,
                    sample_index=i, finish_reason=g.finish_reason))
            groups.append(TrajectoryGroup(
                group_id=f"s{step}g{j}", prompt_id=f"p{j}", task_id="t", workflow="single_turn",
                source="bench", raas_id="bench", pool="bench", sequences=seqs,
                rewards=[s.reward for s in seqs]))
        m = trainer.train_step(Batch(policy="actor", batch_id=f"b{step}", groups=groups))
        state = trainer.published_state()
        changed = sum(int((state[k] != prev[k]).sum()) for k in state)
        total = sum(v.numel() for v in state.values())
        prev = {k: v.clone() for k, v in state.items()}
        engine.load_state_dict(state, step + 1)
        out.append({"step": step, "reward": sum(rewards) / len(rewards),
                    "length": sum(len(g.token_ids) for per in gens for g in per)
                    / len(rewards),
                    "clip": m.get("trainer/clip_frac", 0.0), "kl": m.get("trainer/approx_kl", 0.0),
                    "changed": changed / total})
        print(f"[{name}] step {step:2d} reward {out[-1]['reward']:.3f} length "
              f"{out[-1]['length']:.1f} clip {out[-1]['clip']:.3f} kl {out[-1]['kl']:.3f} "
              f"changed {out[-1]['changed']:.4f}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--settings", default="master,published,fp32")
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dataset", default=str(REPO / "data" / "addition.train.jsonl"))
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "forward_on.json")
    args = ap.parse_args(argv)
    meta = run_meta("forward_on", ["python", *sys.argv] if argv is None
                    else ["python", "bench/forward_on.py", *argv])
    torch.set_num_threads(args.threads)
    rows = [json.loads(line) for line in open(args.dataset)]
    t0 = time.time()
    results = {name: run_setting(name, args, rows) for name in args.settings.split(",")}
    print(f"\n# {args.groups} prompts x {args.samples} samples per step, lr {args.lr:g}, "
          f"T 1, at most 8 tokens ({time.time() - t0:.0f}s)")
    names = list(results)
    print("step | " + " | ".join(f"{n}: reward / clip / kl" for n in names))
    for i in range(args.steps):
        cells = [f"{results[n][i]['reward']:.3f} / {results[n][i]['clip']:.2f} / "
                 f"{results[n][i]['kl']:.3f}" for n in names]
        print(f"{i:4d} | " + " | ".join(cells))
    for n in names:
        last = results[n][-4:]
        print(f"{n}: mean reward of the last 4 steps {sum(r['reward'] for r in last) / 4:.3f}, "
              f"published weights changed per step "
              f"{sum(r['changed'] for r in results[n]) / args.steps:.2%}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta,
                                    "args": {k: str(v) for k, v in vars(args).items()},
                                    "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
