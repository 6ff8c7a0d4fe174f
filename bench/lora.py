"""LoRA against full fine-tuning at equal wall time, side by side in one run.

Each variant runs ``astraflow up`` on the same topology (default ``topology/smollm2.yaml``:
SmolLM2-135M-Instruct learning two-digit addition, its online evaluator removed) for
``--duration`` seconds, one after the other on the same machine:

* ``full``: the whole model trains (the topology's learning rate);
* ``lora-r<R>`` for each ``--ranks`` R: peft adapters of rank R (alpha 2R) on every
  attention and MLP projection, the rest frozen, at ``--lora-lr``.

Per variant: versions per minute, bytes per version (each version's smaller blob: the
delta, or for an adapter the whole adapter when that is smaller), the RaaS node's weight
sync time per version (fetch, apply and load into its engine; ``raas/weight_sync_s`` over
``raas/weight_updates``), the trainer's peak resident memory (``trainer/peak_rss_bytes``)
and the held-out accuracy (greedy, the topology's eval set; strict: the number alone,
lenient: its first number) of the newest version at each ``--checkpoints`` time, against
version 0. The variants share the topology's reward.

    python bench/lora.py [--duration 600] [--checkpoints 300,600] [--ranks 8,32]
        [--lora-lr 3e-4] [--topology topology/smollm2.yaml] [--out FILE.json]

The JSON goes to ``bench/results/lora.json``; ``python bench/report.py`` renders it.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import learning  # noqa: E402  (bench/learning.py: the run and the scoring)
from report import run_meta, table  # noqa: E402

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def variants(doc: dict[str, Any], ranks: list[int], lora_lr: float) -> dict[str, dict]:
    """Each variant's topology: ``doc`` as it is (``full``), and with an adapter of each
    rank at ``lora_lr``."""
    out = {"full": doc}
    for r in ranks:
        v = copy.deepcopy(doc)
        policy = next(iter(v["policies"].values()))
        policy["lora"] = {"rank": r, "alpha": 2.0 * r, "target_modules": LORA_TARGETS}
        policy.setdefault("trainer", {})["lr"] = lora_lr
        out[f"lora-r{r}"] = v
    return out


def version_bytes(manifests: list[Any]) -> list[int]:
    """Each version after 0: the bytes of its smaller blob (what a follower one version
    behind fetches)."""
    best: dict[int, int] = {}
    for m in manifests:
        if m.version > 0:
            best[m.version] = min(best.get(m.version, m.encoded_bytes), m.encoded_bytes)
    return [best[v] for v in sorted(best)]


def last_statuses(topo: Any) -> dict[str, dict[str, float]]:
    """The newest status metrics of each component kind (``trainer``, ``raas``)."""
    from astraflow.kafka.clients import read_all
    from astraflow.wire.records import ComponentStatus

    out: dict[str, dict[str, float]] = {}
    for r in read_all(topo.kafka.effective(), topo.full_name("status"), idle_s=2.0,
                      expect=ComponentStatus):
        out[r.record.kind] = dict(r.record.metrics)
    return out


def run_variant(name: str, doc: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """One variant's run and its figures."""
    print(f"[bench] {name}: {args.duration:g} s", flush=True)
    path = learning.write_topology(doc, args.runs_dir, f"bench/lora.py {name}")
    result = learning.run_astraflow(path, args.duration, args.checkpoints, args.runs_dir)
    topo = result["_topology"]
    status = last_statuses(topo)
    sizes = version_bytes(result["_manifests"])
    raas, trainer = status.get("raas", {}), status.get("trainer", {})
    updates = raas.get("raas/weight_updates", 0.0)
    scorer = learning.make_scorer(doc, size=args.eval_size)
    scores = learning.score_astraflow(result, scorer)
    row = {
        "variant": name, "versions": result["versions"],
        "versions_per_min": 60.0 * result["versions"] / args.duration,
        "bytes_per_version": statistics.fmean(sizes) if sizes else None,
        "weight_sync_s": raas.get("raas/weight_sync_s", 0.0) / updates if updates else None,
        "trainer_peak_rss_mb": trainer.get("trainer/peak_rss_bytes", 0.0) / 2**20 or None,
        "trainer_step_s": trainer.get("trainer/step_seconds"),
        "accuracy": scores,  # checkpoint -> {strict, lenient}
        "at": {learning.key(t): v for t, v in result["at"].items()},
        "start_accuracy": scorer["scores"](None),
    }
    print(f"[bench] {name}: {row['versions']} versions, "
          f"{row['bytes_per_version'] or 0:,.0f} B/version, accuracy {row['accuracy']}",
          flush=True)
    return row


def report(rows: list[dict[str, Any]], checkpoints: list[float]) -> str:
    """The variants side by side."""
    head = ["variant", "versions/min", "bytes/version", "sync s/version", "trainer peak MB",
            "step s", "start strict / lenient",
            *[f"@{t:g}s strict / lenient" for t in checkpoints]]

    def both(s: dict[str, float] | None) -> str:
        return "-" if s is None else f"{100 * s['strict']:.1f} % / {100 * s['lenient']:.1f} %"

    body = [[r["variant"], r["versions_per_min"], r["bytes_per_version"], r["weight_sync_s"],
             r["trainer_peak_rss_mb"], r["trainer_step_s"], both(r["start_accuracy"]),
             *[both(r["accuracy"].get(learning.key(t))) for t in checkpoints]] for r in rows]
    return table(head, body)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--topology", type=Path, default=REPO / "topology" / "smollm2.yaml")
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of each variant")
    ap.add_argument("--checkpoints", default="300,600",
                    help="seconds at which each variant's newest version is scored")
    ap.add_argument("--ranks", default="8,32", help="LoRA ranks, comma-separated")
    ap.add_argument("--lora-lr", type=float, default=3e-4,
                    help="the adapters' learning rate (LoRA trains at about ten times a "
                    "full fine-tune's)")
    ap.add_argument("--eval-size", type=int, default=None, metavar="N",
                    help="held-out prompts per score (default: the topology's)")
    ap.add_argument("--runs-dir", type=Path, default=REPO / "runs")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "lora.json")
    args = ap.parse_args(argv)
    try:
        args.checkpoints = [float(x) for x in args.checkpoints.split(",") if x]
        ranks = [int(x) for x in args.ranks.split(",") if x]
    except ValueError:
        ap.error("--checkpoints and --ranks: comma-separated numbers")
    if not args.checkpoints or any(not 0 < t <= args.duration for t in args.checkpoints):
        ap.error(f"--checkpoints must lie in (0, --duration {args.duration:g}]")
    if any(r < 1 for r in ranks):
        ap.error("--ranks: each at least 1")
    meta = run_meta("lora", ["python", *sys.argv] if argv is None
                    else ["python", "bench/lora.py", *argv])
    args.runs_dir = args.runs_dir.resolve()
    _, doc = learning.bench_topology(args.topology, args.runs_dir)
    learning.ensure_model(doc)
    rows = [run_variant(name, v, args)
            for name, v in variants(doc, ranks, args.lora_lr).items()]
    text = report(rows, args.checkpoints)
    print("\n" + text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "bench": "lora", "duration_s": args.duration,
                                    "checkpoints": args.checkpoints, "ranks": ranks,
                                    "lora_lr": args.lora_lr, "rows": rows, "table": text},
                                   indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
