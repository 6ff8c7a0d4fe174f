"""Starting a policy's trainer process: what ``astraflow trainer run`` does once its
settings are parsed.

``check_trainer`` runs the checks that need no Kafka client (the model directory, the
backend's preflight). ``start_trainer`` then either supervises a local group
(``trainer.parallel.processes > 1`` and this process is not a rank yet: ``run_group``
starts N copies of the command line, each of which joins the group), or runs one rank:
the process settings first (``torch.set_num_threads``, the seed, deterministic kernels:
``prepare_process``, before any CUDA work), then the group (torchrun's environment), the
signals (rank 0 alone stops the group: the supervisor hands it the signal, the other
ranks ignore theirs), and the ``TrainerService`` until it stops.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from astraflow.errors import AstraflowError
from astraflow.kafka.shutdown import stop_on_signals

if TYPE_CHECKING:
    from astraflow.config.sections import ParallelSpec, TrainerSpec
    from astraflow.config.topology import Topology
    from astraflow.kafka.config import KafkaConfig
    from astraflow.trainer.service import ServiceCounters, ServiceOptions

log = logging.getLogger("astraflow.trainer")


class TrainerStartError(AstraflowError):
    """The trainer service refused its settings (one line, before any step)."""


@dataclass(frozen=True)
class TrainerRun:
    """What one trainer process did: ``status`` is its exit status; ``counters`` are rank
    0's (None in a rank above 0 and in a process that only supervised a local group)."""

    status: int = 0
    rank: int = 0
    component_id: str = ""
    version: int = 0
    counters: ServiceCounters | None = None


def check_trainer(opts: ServiceOptions) -> None:
    """The start-up checks that need no Kafka client: the model directory is one
    (``ModelError``) and the backend can run it (``MegatronUnavailable``)."""
    from astraflow.models.loading import check_model_dir
    from astraflow.trainer.backend import preflight

    spec = opts.spec
    check_model_dir(spec.model, tokenizer=False)
    preflight(spec.trainer.backend, spec.model, spec.trainer.device)


def run_group(argv: Sequence[str], parallel: ParallelSpec) -> int | None:
    """When this process must supervise a local group (``parallel.processes > 1`` and it
    is no rank of one yet): run ``astraflow *argv`` as the group's ranks and return the
    group's exit status (``processes.run_local_group``); else None."""
    from astraflow.trainer.processes import in_group, run_local_group

    if parallel.processes > 1 and not in_group():
        return run_local_group(list(argv), parallel.processes, parallel.port)
    return None


def prepare_process(spec: TrainerSpec) -> None:
    """This process's torch settings from the trainer's section: its thread count
    (``threads``; unset: torch's own), its seed, and deterministic kernels
    (``deterministic``: set before any CUDA work)."""
    import torch

    if spec.threads:
        torch.set_num_threads(spec.threads)
    torch.manual_seed(spec.seed)
    if spec.deterministic:
        from astraflow.trainer.resume import make_deterministic

        make_deterministic()  # kernels, cuBLAS workspace, cuDNN: before any CUDA work


def join_group(device: str) -> Any:
    """This process's place in its trainer group (torchrun's environment), or a group of
    one on ``device`` outside one (``parallel.solo``); a rank above 0 ignores SIGINT and
    SIGTERM (rank 0 alone stops the group)."""
    from astraflow.trainer.parallel import join, solo
    from astraflow.trainer.processes import in_group

    if not in_group():
        return solo(device)
    group = join(device)
    if group.rank > 0:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return group


def start_trainer(topo: Topology, opts: ServiceOptions, config: KafkaConfig, *,
                  argv: Sequence[str]) -> TrainerRun:
    """Run the trainer of ``opts.policy`` (``opts.spec``: its section of ``topo``;
    ``config``: its Kafka configuration) until it stops: a local group's supervisor when
    its ``trainer.parallel`` asks for one (``argv``: the command line its ranks run), else
    one rank (see the module docstring). ``TrainerStartError`` when the service refuses
    its settings."""
    from astraflow.trainer.service import TrainerService

    spec = opts.spec.trainer
    status = run_group(argv, spec.parallel)
    if status is not None:
        return TrainerRun(status=status)
    prepare_process(spec)
    group = join_group(spec.device)
    try:
        service = TrainerService(topo, opts, config=config, group=group)
    except ValueError as e:
        raise TrainerStartError(str(e)) from None
    if service.rank == 0:
        stop_on_signals(service.stop, log, "finishing the current step and its transaction")
    try:
        counters = service.run()
    finally:
        group.close()
    return TrainerRun(rank=service.rank, component_id=service.component_id,
                      version=service.version,
                      counters=counters if service.rank == 0 else None)


__all__ = ["TrainerRun", "TrainerStartError", "check_trainer", "join_group",
           "prepare_process", "run_group", "start_trainer"]
