"""Starting a trainer process (``astraflow.trainer.start``), without a broker: who
supervises a local group, the process's torch settings, the signals of each rank, and a
refused service as one start error. The trainer itself on a broker: ``tests/integration/``."""

from __future__ import annotations

import os
import signal
import types

import pytest
import torch

from astraflow.config.sections import PolicySpec, TrainerSpec
from astraflow.trainer import processes, service, start
from astraflow.trainer.start import (
    TrainerRun,
    TrainerStartError,
    join_group,
    prepare_process,
    run_group,
    start_trainer,
)

OPTS = service.ServiceOptions("actor", PolicySpec(model="m"))


@pytest.fixture
def restored():
    """Leave signals and torch's thread count as they were."""
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    threads = torch.get_num_threads()
    yield
    for s, h in handlers.items():
        signal.signal(s, h)
    torch.set_num_threads(threads)


def _no_group(monkeypatch):
    for var in ("WORLD_SIZE", "RANK"):
        monkeypatch.delenv(var, raising=False)


def test_only_a_process_outside_a_group_that_asks_for_several_supervises_one(monkeypatch):
    started = []
    monkeypatch.setattr(processes, "run_local_group",
                        lambda argv, n, port: started.append((argv, n, port)) or 3)
    _no_group(monkeypatch)
    one = TrainerSpec().parallel
    two = TrainerSpec(parallel={"processes": 2, "port": 29555}).parallel
    assert run_group(["trainer", "run"], one) is None and started == []
    assert run_group(["trainer", "run"], two) == 3
    assert started == [(["trainer", "run"], 2, 29555)]
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert run_group(["trainer", "run"], two) is None  # a rank: it trains
    assert len(started) == 1


def test_a_supervisor_returns_its_groups_status_and_starts_no_service(monkeypatch):
    monkeypatch.setattr(processes, "run_local_group", lambda argv, n, port: 7)
    monkeypatch.setattr(service, "TrainerService", None)  # never reached
    _no_group(monkeypatch)
    opts = service.ServiceOptions("actor", PolicySpec(model="m", trainer={
        "parallel": {"processes": 2}}))
    assert start_trainer(None, opts, None, argv=["x"]) == TrainerRun(status=7)


def test_the_process_takes_its_threads_and_seed_from_the_section(restored):
    prepare_process(TrainerSpec(threads=1, seed=5))
    assert torch.get_num_threads() == 1
    drawn = torch.rand(3)
    torch.manual_seed(5)
    assert torch.equal(drawn, torch.rand(3))


def test_outside_a_group_the_process_is_a_group_of_one_and_the_signals_stay(monkeypatch,
                                                                           restored):
    import torch.distributed as dist

    _no_group(monkeypatch)
    before = signal.getsignal(signal.SIGTERM)
    initialized = dist.is_initialized()
    group = join_group("cpu")
    assert (group.rank, group.world, group.backend) == (0, 1, "none")
    assert dist.is_initialized() == initialized  # a group of one joins no torch.distributed
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_rank_above_0_ignores_the_signals_rank_0_does_not(monkeypatch, restored):
    from astraflow.trainer import parallel

    monkeypatch.setattr(processes, "in_group", lambda: True)
    monkeypatch.setattr(parallel, "join", lambda device: types.SimpleNamespace(rank=0))
    assert join_group("cpu").rank == 0
    assert signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN
    monkeypatch.setattr(parallel, "join", lambda device: types.SimpleNamespace(rank=1))
    assert join_group("cpu").rank == 1
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN


class _Service:
    """Stands in for TrainerService: SIGTERM to itself while it runs, as a supervisor
    would send it, and counts the stop it leads to."""

    def __init__(self, topo, opts, config, group):
        self.rank, self.component_id, self.version, self.stops = 0, "trainer.actor/0", 4, 0

    def stop(self):
        self.stops += 1

    def run(self):
        os.kill(os.getpid(), signal.SIGTERM)
        return service.ServiceCounters(steps=self.stops)


def test_rank_0_stops_on_sigterm_and_reports_its_counters(monkeypatch, restored):
    monkeypatch.setattr(service, "TrainerService", _Service)
    _no_group(monkeypatch)
    run = start_trainer(None, OPTS, None, argv=[])
    assert (run.status, run.rank, run.component_id, run.version) == (0, 0, "trainer.actor/0", 4)
    assert run.counters.steps == 1  # the signal reached stop() before run() returned


def test_a_refused_service_is_one_start_error(monkeypatch, restored):
    def refuse(*args, **kwargs):
        raise ValueError("trainer.lr: must be above 0")

    monkeypatch.setattr(service, "TrainerService", refuse)
    _no_group(monkeypatch)
    with pytest.raises(TrainerStartError, match=r"^trainer.lr: must be above 0$"):
        start_trainer(None, OPTS, None, argv=[])
    assert issubclass(TrainerStartError, start.AstraflowError)
