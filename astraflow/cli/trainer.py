"""``astraflow trainer run``: the trainer of one policy.

``register(subparsers)`` adds the ``trainer`` command group to an argparse CLI (the ``run``
subcommand sets ``func=handler``); ``astraflow.cli.main`` wires it in.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from astraflow.cli.args import Option, add_command, add_group, add_run_options, add_table
from astraflow.cli.context import component_topology
from astraflow.cli.flags import add_flags, given
from astraflow.config.overrides import TRAINER_FLAGS

_EXAMPLES = [
    "astraflow trainer run -t topology/default.yaml --policy actor",
    "astraflow trainer run -t topology/smollm2.yaml --policy actor --model models/smollm2 "
    "--device cuda --autocast bf16 --lr 1e-6",
    "astraflow trainer run -t topology/default.yaml --run trial2 --policy actor "
    "--max-steps 50",
]

_WHAT: list[Option] = [
    (("--policy",), dict(required=True, help="policy name (topics batches./weights.NAME); "
                         "its trainer's settings are the file's policies.NAME")),
    (("--instance",), dict(help="instance id (transactional id <group>.<instance>); default "
                           "$ASTRAFLOW_INSTANCE or 0")),
    (("-v", "--verbose"), dict(action="store_true", help="debug logging")),
]


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``trainer`` command group to ``subparsers`` (from ``add_subparsers``)."""
    verbs = add_group(subparsers, "trainer", help="train one policy from batches.<policy>",
                      dest="trainer_command", examples=_EXAMPLES[:1])
    r = add_command(
        verbs, "run",
        help="consume batches.<policy>, publish weights.<policy> (until SIGTERM)",
        description=(
            "Consume batches.<policy> (group <run>.trainer.<policy>), take one PPO/GRPO "
            "step per batch, and publish each version's manifest together with the consumed "
            "offsets in one Kafka transaction. Restarting resumes exactly (weights, "
            "optimizer state, data position). Every setting comes from the topology's "
            "policies.<policy> (its trainer:, temperature, top_p, max_staleness, model); a "
            "flag of the same name overrides it."
        ),
        examples=_EXAMPLES,
    )
    add_run_options(r)
    add_table(r, None, _WHAT)
    add_flags(r, TRAINER_FLAGS)
    r.set_defaults(func=handler)
    return subparsers.choices["trainer"]


def handler(args: argparse.Namespace) -> int:
    from astraflow.cli.context import kafka_config
    from astraflow.launch.provision import MissingModel, provide_policy_model
    from astraflow.models.errors import ModelError
    from astraflow.trainer.megatron_shims import MegatronUnavailable
    from astraflow.trainer.start import TrainerStartError, check_trainer, start_trainer

    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.DEBUG if getattr(args, "verbose", False) else logging.INFO,
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        )
    try:
        topo = component_topology(args)
        opts = _options(args, topo)
        provide_policy_model(topo, args.policy, opts.spec.model)
        check_trainer(opts)  # before any Kafka client starts
    except (ValueError, ModelError, MegatronUnavailable, MissingModel) as e:
        # TopologyError: ValueError
        print(f"astraflow: {e}", file=sys.stderr)
        return 2
    args.loaded_topology = topo
    config = kafka_config(args, topo.component_kafka(f"trainer.{opts.policy}"))
    try:
        run = start_trainer(topo, opts, config, argv=sys.argv[1:])
    except TrainerStartError as e:
        print(f"astraflow: {e}", file=sys.stderr)
        return 2
    if run.counters is not None:
        c = run.counters
        print(f"{run.component_id}: {c.steps} steps, version {run.version}, "
              f"consumed {c.consumed}, waited {c.waiting_s:.1f}s, busy {c.busy_s:.1f}s")
    return run.status


def _spec(args: argparse.Namespace, topo: Any) -> Any:
    """The policy's typed section of ``topo`` with the flags given applied (``PolicySpec``;
    ``ValueError`` names a refused flag)."""
    from astraflow.config.components import trainer_spec

    return trainer_spec(topo, args.policy, given(args, TRAINER_FLAGS))


def _options(args: argparse.Namespace, topo: Any = None) -> Any:
    """The ``ServiceOptions`` of ``trainer run``: the policy's typed section of the
    topology (``topo``, else the file of ``--topology``) with the flags given applied,
    validated where it is declared (``ValueError`` names the flag or the key)."""
    from astraflow.trainer.service import ServiceOptions

    topo = component_topology(args, topo)
    return ServiceOptions(args.policy, _spec(args, topo), instance=args.instance)
