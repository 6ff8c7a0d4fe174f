"""``astraflow weights ...``: inspect blobs, plan updates, collect garbage, make a signing key.

``register(subparsers)`` adds the ``weights`` command group to an argparse CLI (each
subcommand's ``func`` is ``run``); ``run(args) -> int`` executes a parsed command;
``astraflow.cli.main`` wires the group in.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from astraflow.weights.errors import WeightsError
from astraflow.wire.records import WeightManifest

# The codec, history and stores import torch; they are imported inside the commands so
# that building the `astraflow` parser stays fast.

_MANIFESTS_HELP = (
    "where the retained manifests are: kafka://<topic> (every WeightManifest on that topic, "
    "e.g. kafka://<run>.weights.<policy>, read with KafkaConfig.from_env(), i.e. "
    "ASTRAFLOW_BOOTSTRAP or --bootstrap) or a directory of manifest JSON files (as written "
    "by astraflow.weights.save_manifest). Repeatable; blobs referenced by any of them are kept"
)

_GC_EXAMPLES = [
    "astraflow weights gc --store file:///var/astraflow/blobs --manifests "
    "kafka://default.weights.actor --keep-last 20 --dry-run",
    "astraflow weights gc --store kafka://default.weights.blobs --manifests "
    "kafka://default.weights.actor --kafka-truncate",
]
_INSPECT_EXAMPLES = ["astraflow weights inspect blobs/actor.v00000012.delta.0a1b2c3d4e5f --tensors",
                     "astraflow weights inspect blobs/actor.v00000010.full.5f4e3d2c1b0a "
                     "--sha256 HEX"]
_PLAN_EXAMPLES = ["astraflow weights plan --manifests kafka://default.weights.actor --held 40",
                  "astraflow weights plan --manifests manifests/ --held 3 --target 9"]


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``weights`` command group to ``subparsers`` (from ``add_subparsers``)."""
    from astraflow.cli.args import add_command, add_group

    wsub = add_group(subparsers, "weights", help="weight blobs: inspect, plan, garbage-collect",
                     dest="weights_command", examples=[_GC_EXAMPLES[0], _INSPECT_EXAMPLES[0]])
    gc = add_command(
        wsub, "gc",
        help="delete blobs no retained manifest references",
        examples=_GC_EXAMPLES,
        description=(
            "Delete blobs of STORE that no retained manifest references. A file:// store "
            "deletes them; a kafka:// store cannot delete single records, so they are only "
            "reported (or, with --kafka-truncate, everything before the oldest needed blob "
            "is deleted per partition). Blobs younger than --min-age are always kept: their "
            "manifest may not be published yet."
        ),
    )
    _add_gc_options(gc)

    ins = add_command(wsub, "inspect", help="header and per-tensor summary of a blob file",
                      examples=_INSPECT_EXAMPLES)
    ins.add_argument("blob", metavar="BLOB_FILE", help="a blob file of a file:// store")
    ins.add_argument("--tensors", action="store_true", help="one line per tensor")
    ins.add_argument("--json", action="store_true", help="print as JSON")
    ins.add_argument(
        "--sha256", metavar="HEX",
        help="the digest its manifest records (BlobRef.sha256): exit 1 if the file differs",
    )
    ins.set_defaults(func=run)

    pl = add_command(wsub, "plan", help="the cheapest fetch plan from a held version",
                     examples=_PLAN_EXAMPLES)
    pl.add_argument(
        "--manifests", required=True, action="append", metavar="SRC", help=_MANIFESTS_HELP
    )
    pl.add_argument("--held", type=int, default=None, help="version held (default: none)")
    pl.add_argument("--target", type=int, default=None, help="target (default: newest)")
    pl.add_argument("--policy", help="only manifests of this policy")
    pl.add_argument("--bootstrap", help="Kafka bootstrap servers (default ASTRAFLOW_BOOTSTRAP)")
    pl.set_defaults(func=run)
    kg = add_command(
        wsub, "keygen", help="make an ed25519 key pair for signed weights",
        examples=["astraflow weights keygen --out ~/.config/astraflow/keys"],
        description=(
            "Write a new ed25519 key pair into DIR: weights-signing.key (the trainers' "
            "private key, mode 0600) and weights-signing.pub (the public key RaaS nodes and "
            "evaluators verify with). Point the topology's weight_signing.private_key and "
            "weight_signing.public_key at them (docs/security.md). Existing keys are never "
            "overwritten."),
    )
    kg.add_argument("--out", required=True, metavar="DIR", help="folder for the two files")
    kg.set_defaults(func=run)
    return subparsers.choices["weights"]


def _add_gc_options(gc: argparse.ArgumentParser) -> None:
    gc.add_argument("--store", required=True, metavar="URI", help="file:///dir or kafka://topic")
    gc.add_argument(
        "--manifests", required=True, action="append", metavar="SRC", help=_MANIFESTS_HELP
    )
    gc.add_argument(
        "--keep-last",
        type=int,
        default=None,
        metavar="K",
        help="retain only what the newest K versions need (default: every manifest read)",
    )
    gc.add_argument(
        "--min-age",
        type=float,
        default=3600.0,
        metavar="SECONDS",
        help="never delete blobs younger than this (default 3600)",
    )
    gc.add_argument("--dry-run", action="store_true", help="report, delete nothing")
    gc.add_argument(
        "--kafka-truncate",
        action="store_true",
        help="kafka:// store: DeleteRecords below the oldest blob still needed",
    )
    gc.add_argument("--bootstrap", help="Kafka bootstrap servers (default ASTRAFLOW_BOOTSTRAP)")
    gc.add_argument("--json", action="store_true", help="print the result as JSON")
    gc.set_defaults(func=run)


def _kafka_config(args: argparse.Namespace) -> Any:
    from astraflow.kafka.config import KafkaConfig

    if getattr(args, "bootstrap", None):
        return KafkaConfig.from_env(bootstrap_servers=args.bootstrap)
    return KafkaConfig.from_env()


def _read_manifests(sources: list[str], args: argparse.Namespace) -> list[WeightManifest]:
    from astraflow.weights.manifests import load_manifests

    out: list[WeightManifest] = []
    for src in sources:
        if src.startswith("kafka://"):
            from astraflow.weights.stores.kafka import read_manifests

            topic = src[len("kafka://") :].strip("/")
            out.extend(read_manifests(_kafka_config(args), topic))
        else:
            path = src[len("file://") :] if src.startswith("file://") else src
            if not os.path.isdir(path):
                raise WeightsError(f"manifest source {src}: not a directory or kafka:// topic")
            out.extend(load_manifests(path))
    return out


def _cmd_gc(args: argparse.Namespace) -> int:
    from astraflow.weights.retention import collect_garbage, retained_manifests
    from astraflow.weights.stores import open_store

    manifests = _read_manifests(args.manifests, args)
    retained = retained_manifests(manifests, args.keep_last)
    kcfg = _kafka_config(args) if args.store.startswith("kafka://") else None
    store = open_store(args.store, kcfg)
    try:
        res = collect_garbage(
            store,
            retained,
            min_age_s=args.min_age,
            dry_run=args.dry_run,
            kafka_truncate=args.kafka_truncate,
        )
    finally:
        store.close()
    if args.json:
        print(json.dumps(res.__dict__, indent=1, default=str))
        return 0
    print(
        f"{len(manifests)} manifests read, {len(retained)} retained, "
        f"{res.reachable} blobs referenced"
    )
    if res.too_young:
        print(f"kept {len(res.too_young)} unreferenced blobs younger than {args.min_age:.0f}s")
    if not res.can_delete:
        print(
            f"{len(res.unreachable)} unreachable blobs on a Kafka store (single records "
            "cannot be deleted; space returns by retention or --kafka-truncate):"
        )
        for b in res.unreachable:
            print(f"  {b}")
        if res.truncated:
            print(
                "deleted records below: " + ", ".join(f"p{p}@{o}" for p, o in res.truncated.items())
            )
    elif args.dry_run:
        print(f"would delete {len(res.unreachable)} blobs:")
        for b in res.unreachable:
            print(f"  {b}")
    else:
        print(f"deleted {len(res.removed)} blobs")
        for b in res.removed:
            print(f"  {b}")
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    from astraflow.models.gguf import sha256_of
    from astraflow.weights.blob import inspect_blob

    digest = sha256_of(Path(args.blob))
    if args.sha256 and digest != args.sha256.lower():
        print(f"astraflow: {args.blob}: sha256 {digest} does not match the expected "
              f"{args.sha256}: the blob is corrupt", file=sys.stderr)
        return 1
    with open(args.blob, "rb") as f:
        info = inspect_blob(f)
    size = Path(args.blob).stat().st_size
    if args.json:
        d = dict(info.__dict__)
        d["tensors"] = [t.__dict__ for t in info.tensors]
        d["num_params"], d["num_changed"] = info.num_params, info.num_changed
        d["sha256"] = digest
        print(json.dumps(d, indent=1))
        return 0
    raw = sum(_numel(t.shape) * _itemsize(t.dtype) for t in info.tensors)
    print(f"{args.blob}: {info.kind} blob, format v{info.format_version}, {size:,} bytes, "
          f"sha256 {digest}" + (" (as expected)" if args.sha256 else ""))
    if info.meta:
        print("meta: " + ", ".join(f"{k}={v}" for k, v in sorted(info.meta.items())))
    print(
        f"{len(info.tensors)} tensors, {info.num_params:,} elements ({raw:,} raw bytes), "
        f"{info.num_changed:,} changed, encoded {size / raw:.3%} of raw"
        if raw
        else f"{len(info.tensors)} tensors"
    )
    modes: dict[str, int] = {}
    for t in info.tensors:
        modes[t.mode] = modes.get(t.mode, 0) + 1
    print("tensors by mode: " + ", ".join(f"{k} {v}" for k, v in sorted(modes.items())))
    if args.tensors:
        for t in info.tensors:
            print(
                f"  {t.name:<50} {t.dtype:<9} {str(t.shape):<16} {t.mode:<9} "
                f"changed {t.num_changed:>12,} bytes {t.encoded_bytes:>12,}"
            )
    return 0


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _itemsize(dtype: str) -> int:
    import torch

    dt = getattr(torch, dtype, None)
    return torch.empty(0, dtype=dt).element_size() if isinstance(dt, torch.dtype) else 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from astraflow.weights.planning import plan_bytes, plan_update

    manifests = _read_manifests(args.manifests, args)
    if args.policy:
        manifests = [m for m in manifests if m.policy == args.policy]
    if not manifests:
        print("no manifests", file=sys.stderr)
        return 1
    target = args.target if args.target is not None else max(m.version for m in manifests)
    plan = plan_update(args.held, target, manifests)
    held = "nothing" if args.held is None else f"v{args.held}"
    print(f"{held} -> v{target}: {len(plan)} steps, {plan_bytes(plan):,} bytes")
    for m in plan:
        base = "" if m.base_version is None else f" from v{m.base_version}"
        print(f"  {m.kind:<5} v{m.version}{base}: {m.encoded_bytes:,} bytes")
    return 0


def _cmd_keygen(args: argparse.Namespace) -> int:
    from astraflow.weights.signing import key_id as id_of
    from astraflow.weights.signing import keygen, load_public_key

    private, public = keygen(args.out)
    print(f"wrote {private} (private, mode 0600: only trainers need it) and {public} "
          f"(public); key id {id_of(load_public_key(public))}")
    return 0


def run(args: argparse.Namespace) -> int:
    """Execute a parsed ``weights`` command; returns the exit status."""
    handlers = {"gc": _cmd_gc, "inspect": _cmd_inspect, "plan": _cmd_plan,
                "keygen": _cmd_keygen}
    try:
        return handlers[args.weights_command](args)
    except (WeightsError, OSError, ValueError) as e:
        print(f"astraflow weights: {e}", file=sys.stderr)
        return 2


