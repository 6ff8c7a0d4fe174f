"""Two agents, two policies: a solver answers, a critic says whether the answer is right.

Written against the `openai` client alone; each agent is a `model` on the same endpoint
(AstraFlow routes it to that policy's engine). The program knows the task's answer and
rewards both: the solver for a right answer, the critic for a right verdict, and prints
{"rewards": {"solver": ..., "critic": ...}}. Knowing the answer and reporting rewards make
it trusted harness code: its topology says so (`trusted: true`); an untrusted program
sees no answer and its printed rewards are ignored. The models' text only chooses the
answer and the verdict, read with fixed patterns.

    OPENAI_BASE_URL=... OPENAI_API_KEY=x \
        ASTRAFLOW_TASK='{"prompt": "37+45=", "answer": "82"}' python solver_critic.py
"""

from __future__ import annotations

import json
import os
import re

from openai import OpenAI


def first_number(text: str) -> str | None:
    m = re.search(r"-?\d+", text or "")
    return m.group(0) if m else None


def main() -> None:
    task = json.loads(os.environ["ASTRAFLOW_TASK"])
    prompt, truth = str(task["prompt"]), str(task["answer"])
    client = OpenAI()
    solved = client.chat.completions.create(
        model="solver", messages=[{"role": "user", "content": prompt}], max_tokens=8)
    answer = first_number(solved.choices[0].message.content or "") or ""
    # the critic is shown the problem and the solver's answer, and asked for y or n
    judged = client.chat.completions.create(
        model="critic", messages=[{"role": "user", "content": f"{prompt}{answer}?"}],
        max_tokens=4)
    verdict = (judged.choices[0].message.content or "").strip().lower()
    says_right = verdict.endswith("y") or verdict.startswith("yes")
    right = answer == truth
    print(json.dumps({"rewards": {"solver": float(right),
                                  "critic": float(says_right == right)}}))


if __name__ == "__main__":
    main()
