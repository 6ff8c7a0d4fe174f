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

_EXAMPLES = [
    "astraflow trainer run -t topology/default.yaml --policy actor --model runs/default/model",
    "astraflow trainer run -t topology/smollm2.yaml --policy actor --model models/smollm2 "
    "--device cuda --autocast bf16 --lr 1e-6",
    "astraflow trainer run -t topology/default.yaml --run trial2 --policy actor "
    "--model runs/default/model --max-steps 50",
]

_WHAT: list[Option] = [
    (("--policy",), dict(required=True, help="policy name (topics batches./weights.NAME)")),
    (("--model",), dict(required=True, metavar="PATH",
                        help="local Hugging Face causal-LM directory (initial weights, config)")),
    (("--instance",), dict(help="instance id (transactional id <group>.<instance>); default "
                           "$ASTRAFLOW_INSTANCE or 0")),
    (("--max-steps",), dict(type=int, help="stop cleanly after N steps")),
    (("-v", "--verbose"), dict(action="store_true", help="debug logging")),
]

_OPTIMIZER: list[Option] = [
    (("--lr",), dict(type=float, default=1e-6, help="learning rate (default 1e-6)")),
    (("--weight-decay",), dict(type=float, default=0.0)),
    (("--adam-beta1",), dict(type=float, default=0.9)),
    (("--adam-beta2",), dict(type=float, default=0.999)),
    (("--adam-eps",), dict(type=float, default=1e-8)),
    (("--max-grad-norm",), dict(type=float, default=1.0)),
]

_LOSS: list[Option] = [
    (("--loss",), dict(default="clipped_tis", metavar="NAME", help="policy loss, by its name in "
                       "astraflow.trainer.loss.LOSSES: clipped_tis (default), decoupled_ppo, "
                       "m2po (docs/trainer.md)")),
    (("--clip-low",), dict(type=float, default=0.2, help="PPO ratio clip below 1 (default 0.2)")),
    (("--clip-high",), dict(type=float, default=0.28,
                            help="PPO ratio clip above 1 (default 0.28)")),
    (("--tis-cap",), dict(type=float, default=2.0, help="truncation of the importance weight "
                          "against the behaviour policy (clipped_tis, decoupled_ppo)")),
    (("--tis-mask",), dict(action="store_true", help="decoupled_ppo: mask the tokens whose "
                           "importance weight is above --tis-cap instead of truncating it")),
    (("--m2-threshold",), dict(type=float, default=0.04, metavar="TAU", help="m2po: tokens "
                               "with the largest (log pi/mu)^2 are masked until the mean over "
                               "the rest is at most TAU (default 0.04)")),
    (("--minibatches",), dict(type=int, default=1, metavar="N", help="optimizer steps per "
                              "batch: its groups cut into N parts, one step each; "
                              "decoupled_ppo's proximal policy is the one before the first "
                              "(default 1)")),
    (("--max-staleness",), dict(type=int, default=None, metavar="K", help="drop groups whose "
                                "oldest token is > K versions behind the trained version")),
    (("--no-std-normalize",), dict(action="store_true",
                                   help="group advantages r - mean only (no division by the std)")),
    (("--temperature",), dict(type=float, default=1.0, metavar="T", help="the rollouts' "
                              "sampling temperature: log-probs are log_softmax(logits / T), as "
                              "the engines record them (0, greedy: 1)")),
    (("--top-p",), dict(type=float, default=1.0, metavar="P", help="the rollouts' top-p: "
                        "log-probs are renormalised over the nucleus of the trainer's own "
                        "logits, as the engines record them (default 1.0: no truncation)")),
]

_COMPUTE: list[Option] = [
    (("--device",), dict(default="cpu", help="torch device (cpu, cuda, cuda:1, ...)")),
    (("--dtype",), dict(default="fp32", choices=["fp32", "bf16", "fp16"],
                        help="dtype the model trains in (the master weights)")),
    (("--autocast",), dict(default="none", choices=["none", "bf16"], help="bf16: "
                           "forward/backward under torch.autocast(bfloat16) with fp32 master "
                           "weights, optimizer and loss (recommended for real models; default "
                           "none)")),
    (("--forward-on",), dict(default="published", choices=["published", "master"], help="weights "
                             "forward/backward run on when the published ones are rounded "
                             "(--publish-dtype): 'published' (default; the rollouts' own policy, "
                             "the optimizer steps an fp32 master copy) or 'master'")),
    (("--micro-batch-size",), dict(type=int, default=None, metavar="N", help="sequences per "
                                   "forward/backward, gradients accumulated to one step per "
                                   "batch (default 8)")),
    (("--micro-batch-tokens",), dict(type=int, default=None, metavar="N", help="instead of "
                                     "--micro-batch-size: at most N padded tokens per "
                                     "forward/backward (sequences sorted by length; a longer "
                                     "sequence goes alone)")),
    (("--gradient-checkpointing",), dict(action="store_true", help="recompute each layer's "
                                         "activations in the backward pass (less memory, about "
                                         "one more forward of time)")),
    (("--no-share-prompt",), dict(action="store_true", help="run each sequence's prompt through "
                                  "the model itself (default: the sequences of a group share "
                                  "one pass over their prompt; always off with gradient "
                                  "checkpointing)")),
    (("--backend",), dict(default="torch", choices=["torch", "megatron"], help="the model "
                          "implementation: torch (transformers, any causal LM; default) or "
                          "megatron (megatron-core GPTModel, Llama-family models; "
                          "pip install 'astraflow[megatron]')")),
    (("--threads",), dict(type=int, help="torch.set_num_threads")),
    (("--seed",), dict(type=int, default=0)),
    (("--deterministic",), dict(action="store_true",
                                help="torch.use_deterministic_algorithms(True)")),
]

_PUBLISHING: list[Option] = [
    (("--publish-dtype",), dict(default="bf16", choices=["same", "bf16", "fp16"], help="dtype "
                                "of the published weights: each version publishes the master "
                                "weights rounded to it, so deltas between versions are sparse, "
                                "and saves the master weights next to its optimizer state for "
                                "an exact resume; same: publish them as trained (default bf16)")),
    (("--blob-store",), dict(metavar="URI", help="file:///dir or kafka://<topic> (default: "
                             "kafka://<run>.weights.blobs when the topology has that topic, else "
                             "file://<state dir>/blobs)")),
    (("--anchor-interval",), dict(type=int, default=10,
                                  help="full checkpoint every N versions (deltas in between)")),
    (("--keep-versions",), dict(type=int, default=20, metavar="N", help="remove the weight "
                                "blobs of versions older than the newest full checkpoint at or "
                                "below the newest version - N (a Kafka store deletes the records "
                                "before them); 0 keeps every blob (default 20)")),
]

_STATE: list[Option] = [
    (("--state-dir",), dict(metavar="DIR",
                            help="default ~/.local/state/astraflow/trainer/<run>.<policy>")),
    (("--state-interval",), dict(type=int, default=10, metavar="N", help="write the trainer "
                                 "state (optimizer, fp32 master weights) every N versions, in "
                                 "the background; a restart recomputes the versions after the "
                                 "newest one (default 10)")),
    (("--state-max-lag",), dict(type=int, default=None, metavar="K", help="record a state "
                                "write at the latest K versions after it, waiting for it then "
                                "(default: the state interval)")),
    (("--keep-optimizer",), dict(type=int, default=3, metavar="K", help="keep the newest K "
                                 "written trainer states (optimizer and master weights)")),
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
            "optimizer state, data position)."
        ),
        examples=_EXAMPLES,
    )
    add_run_options(r)
    add_table(r, None, _WHAT)
    add_table(r, "optimizer", _OPTIMIZER)
    add_table(r, "loss", _LOSS)
    add_table(r, "compute", _COMPUTE)
    add_table(r, "publishing weights", _PUBLISHING)
    add_table(r, "trainer state (exact resume)", _STATE)
    r.set_defaults(func=handler)
    return subparsers.choices["trainer"]


def handler(args: argparse.Namespace) -> int:
    import torch

    from astraflow.cli.main import kafka_config, stop_on_signals
    from astraflow.config.topology import load_topology
    from astraflow.trainer.service import TrainerService

    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.DEBUG if getattr(args, "verbose", False) else logging.INFO,
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        )
    from astraflow.models.errors import ModelError
    from astraflow.models.loading import check_model_dir
    from astraflow.trainer.backend import preflight
    from astraflow.trainer.megatron_shims import MegatronUnavailable

    topo = getattr(args, "loaded_topology", None)  # `astraflow` loaded it already
    try:
        topo = topo or load_topology(args.topology)
        opts = _options(args)
        _write_missing_model(topo, args.policy, args.model)
        check_model_dir(args.model, tokenizer=False)  # before any Kafka client starts
        preflight(args.backend, args.model, args.device)  # megatron: the fix, named
    except (ValueError, ModelError, MegatronUnavailable) as e:  # TopologyError: ValueError
        print(f"astraflow: {e}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    if args.deterministic:
        torch.use_deterministic_algorithms(True)
    args.loaded_topology = topo
    config = kafka_config(args, topo.component_kafka(f"trainer.{opts.policy}"))
    service = TrainerService(topo, opts, config=config)

    stop_on_signals(service.stop, logging.getLogger("astraflow.trainer"),
                    "finishing the current step and its transaction")
    c = service.run()
    print(
        f"{service.component_id}: {c.steps} steps, version {service.version}, "
        f"consumed {c.consumed}, waited {c.waiting_s:.1f}s, busy {c.busy_s:.1f}s"
    )
    return 0


def _write_missing_model(topo, policy: str, path: str) -> None:
    """A trainer whose model directory does not exist writes it as the topology's policy
    entry says (``model init`` or ``model import``): in a deployment that shares nothing
    but Kafka the trainer is the one component that holds the model on disk."""
    from pathlib import Path

    from astraflow.launch.up import MissingModel, write_policy_model

    spec = topo.policies.get(policy)
    if spec is None or Path(path, "config.json").exists():
        return
    try:
        write_policy_model(policy, spec.model_copy(update={"model": path}))
    except MissingModel as e:
        raise ValueError(str(e)) from None


def _options(args: argparse.Namespace) -> Any:
    """``ServiceOptions`` from the parsed flags, validated (``ValueError`` names the flag)."""
    from astraflow.trainer.service import ServiceOptions
    from astraflow.trainer.trainer import TrainerConfig

    if args.micro_batch_size is not None and args.micro_batch_tokens is not None:
        raise ValueError("give --micro-batch-size or --micro-batch-tokens, not both")
    opts = ServiceOptions(
        policy=args.policy,
        model_path=args.model,
        blob_store=args.blob_store,
        state_dir=args.state_dir,
        instance=args.instance,
        anchor_interval=args.anchor_interval,
        state_interval=args.state_interval,
        state_max_lag=args.state_max_lag,
        keep_optimizer=args.keep_optimizer,
        keep_versions=args.keep_versions,
        max_steps=args.max_steps,
        trainer=TrainerConfig(
            lr=args.lr,
            betas=(args.adam_beta1, args.adam_beta2),
            adam_eps=args.adam_eps,
            weight_decay=args.weight_decay,
            max_grad_norm=args.max_grad_norm,
            loss=args.loss,
            clip_low=args.clip_low,
            clip_high=args.clip_high,
            tis_cap=args.tis_cap,
            tis_mask=args.tis_mask,
            m2_threshold=args.m2_threshold,
            minibatches=args.minibatches,
            normalize_std=not args.no_std_normalize,
            micro_batch_size=args.micro_batch_size if args.micro_batch_size is not None else 8,
            micro_batch_tokens=args.micro_batch_tokens,
            dtype=args.dtype,
            publish_dtype=args.publish_dtype,
            autocast=args.autocast,
            gradient_checkpointing=args.gradient_checkpointing,
            share_prompt=not args.no_share_prompt,
            forward_on=args.forward_on,
            temperature=args.temperature,
            top_p=args.top_p,
            device=args.device,
            backend=args.backend,
            max_staleness=args.max_staleness,
        ),
    )
    opts.validate()
    return opts
