"""``model export``: a published version as a Hugging Face directory; added to the
``model`` command group of ``astraflow.cli.model``."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from astraflow.cli.args import add_command, add_group, add_run_options, verbs_of
from astraflow.errors import AstraflowError

_EXAMPLES = [
    "astraflow model export -t topology/smollm2.yaml --policy actor exports/smollm2",
    "astraflow model export -t topology/smollm2.yaml --policy actor --version 40 exports/v40",
    "astraflow model export -t lora.yaml --policy actor --merge exports/merged",
]


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``model export`` to the ``model`` command group (``astraflow.cli.model``)."""
    msub = verbs_of(subparsers, "model") or add_group(
        subparsers, "model", help="policy models", dest="model_command", examples=_EXAMPLES)
    p = add_command(
        msub, "export",
        help="a published version as a Hugging Face model directory (LoRA: a peft adapter)",
        examples=_EXAMPLES,
        description=(
            "Rebuild version N of a policy (default: the newest) from <run>.weights.<policy>, "
            "every blob checked, and write it to DIR with the model's config, tokenizer and "
            "chat template: a model directory, or for a LoRA policy the adapter in peft's "
            "format (adapter_config.json, adapter_model.safetensors) over the policy's model, "
            "or with --merge the adapter added into the model's weights. A version whose "
            "blobs were pruned is refused, naming the newest one that can be exported."),
    )
    add_run_options(p)
    p.add_argument("dir", metavar="DIR", help="the directory to write")
    p.add_argument("--policy", default="actor", help="policy name (default actor)")
    p.add_argument("--version", type=int, default=None, metavar="N",
                   help="the version to export (default: the newest published)")
    p.add_argument("--merge", action="store_true",
                   help="a LoRA policy: merge the adapter into the base weights")
    p.add_argument("--force", action="store_true", help="replace a non-empty DIR")
    p.add_argument("--public-key", metavar="FILE", help="verify the weights with this public "
                   "key (PEM) (default: $ASTRAFLOW_WEIGHTS_PUBLIC_KEY, else the topology's "
                   "weight_signing)")
    p.set_defaults(func=cmd_model_export)
    return subparsers.choices["model"]


def cmd_model_export(args: argparse.Namespace) -> int:
    from astraflow.cli.context import component_topology, kafka_config
    from astraflow.models.export import export_version
    from astraflow.weights.signing import verifier_for

    topo = component_topology(args)
    dest = Path(args.dir)
    try:
        if args.policy not in topo.policies:
            raise AstraflowError(f"no policy {args.policy!r} in {topo.source} (its policies: "
                                 f"{', '.join(topo.policies) or 'none'})")
        if dest.is_dir() and any(dest.iterdir()) and not args.force:
            raise AstraflowError(f"{dest}: exists and is not empty; pass --force to "
                                 "replace it")
        t0 = time.time()
        out = export_version(
            # the evaluator's credentials: an export reads what an evaluator reads
            kafka_config(args, topo.component_kafka(f"eval.{args.policy}")),
            topo.full_name(f"weights.{args.policy}"), args.policy,
            topo.policies[args.policy].model, dest, version=args.version, merge=args.merge,
            verifier=verifier_for(topo.weight_signing, args.public_key))
    except AstraflowError as e:
        print(f"astraflow model export: {e}", file=sys.stderr)
        return 2
    what = {"model": "model", "adapter": "LoRA adapter (peft format)",
            "merged": "model with its LoRA adapter merged"}[out.kind]
    print(f"exported {args.policy} version {out.version} as a {what} to {out.path} "
          f"({out.weight_bytes / 1e6:.1f} MB of weights, {time.time() - t0:.1f}s)")
    return 0


__all__ = ["cmd_model_export", "register"]
