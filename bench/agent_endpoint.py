"""The agent endpoint's cost per call: the `openai` client through the RaaS node's
OpenAI-compatible endpoint against calling the engine directly, in one run.

The same torch engine (default SmolLM2-135M-Instruct, the policy's ``best`` precision)
answers ``--calls`` chat requests of the addition task both ways, alternating so that any
drift of the machine hits both: **direct** renders the messages with the chat template and
calls ``engine.generate``; **endpoint** sends the messages with ``openai``'s
``chat.completions.create`` to an episode of ``AgentServer`` (HTTP on localhost, JSON,
template rendering, recording the trajectory, parsing the answer). Both sample greedily
``--tokens`` tokens at most. Reported per way: latency p50 and p99 and generated tokens per
second, and the endpoint's overhead per call (p50 of the paired differences).

    python bench/agent_endpoint.py [--model runs/smollm2/model] [--calls 60] [--tokens 16]
        [--out FILE.json]

The JSON goes to ``bench/results/agent_endpoint.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from report import run_meta, table  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, linear between the nearest ranks."""
    xs = sorted(values)
    k = (len(xs) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def prompts(n: int) -> list[str]:
    rows = [json.loads(line) for line in
            (REPO / "data" / "addition.eval.jsonl").read_text().splitlines()[:n]]
    return [str(r["prompt"]) for r in rows]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=REPO / "runs" / "smollm2" / "model")
    ap.add_argument("--calls", type=int, default=60)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--out", type=Path,
                    default=REPO / "bench" / "results" / "agent_endpoint.json")
    args = ap.parse_args(argv)
    if not (args.model / "config.json").exists():
        ap.error(f"--model {args.model}: no model there (astraflow model import smollm2 DIR)")
    if args.calls < 2:
        ap.error("--calls must be at least 2")
    from openai import OpenAI

    from astraflow.models.chat import engine_chat
    from astraflow.raas.agent.chat import check_messages, render
    from astraflow.raas.agent.server import AgentServer
    from astraflow.raas.engine import SamplingParams, load_torch_engine

    meta = run_meta("agent_endpoint", ["python", *sys.argv] if argv is None
                    else ["python", "bench/agent_endpoint.py", *argv])
    engine = load_torch_engine(str(args.model), "actor", dtype="best", prefix_cache_bytes=0)
    server = AgentServer()
    ep = server.open({"actor": engine}, 0, {"max_new_tokens": args.tokens,
                                            "temperature": 0.0})
    client = OpenAI(base_url=server.base_url(ep), api_key="x", max_retries=0)
    params = SamplingParams(max_new_tokens=args.tokens, temperature=0.0,
                            stop_token_ids=(engine.eos_token_id,))
    times: dict[str, list[float]] = {"direct": [], "endpoint": []}
    tokens: dict[str, int] = {"direct": 0, "endpoint": 0}
    texts = prompts(args.calls)
    for i, text in enumerate(texts):
        messages = [{"role": "user", "content": text}]
        for way in (("direct", "endpoint") if i % 2 == 0 else ("endpoint", "direct")):
            t0 = time.perf_counter()
            if way == "direct":
                ids = render(engine.tokenizer, engine_chat(engine), check_messages(messages))
                (gens,) = engine.generate([ids], params)
                n = len(gens[0].token_ids)
            else:
                reply = client.chat.completions.create(model="actor", messages=messages)
                n = reply.usage.completion_tokens
            times[way].append(time.perf_counter() - t0)
            tokens[way] += n
    server.stop()
    paired = [e - d for e, d in zip(times["endpoint"], times["direct"])]
    rows: list[dict[str, Any]] = [
        {"way": w, "calls": len(t), "p50_s": percentile(t, 0.5), "p99_s": percentile(t, 0.99),
         "tokens_per_s": tokens[w] / sum(t)} for w, t in times.items()]
    overhead = {"p50_s": percentile(paired, 0.5), "p99_s": percentile(paired, 0.99),
                "mean_s": statistics.fmean(paired)}
    text = table(["way", "calls", "latency p50 s", "latency p99 s", "tokens/s"],
                 [[r["way"], r["calls"], r["p50_s"], r["p99_s"], r["tokens_per_s"]]
                  for r in rows])
    print(text)
    print(f"endpoint overhead per call (endpoint - direct, paired): p50 "
          f"{overhead['p50_s'] * 1000:.1f} ms, p99 {overhead['p99_s'] * 1000:.1f} ms")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "bench": "agent_endpoint",
                                    "model": str(args.model.relative_to(REPO))
                                    if args.model.is_relative_to(REPO) else str(args.model),
                                    "tokens": args.tokens, "rows": rows,
                                    "overhead": overhead, "table": text}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
