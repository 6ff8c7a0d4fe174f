"""What the agent tests share: the tiny model's torch engine and an endpoint."""

from __future__ import annotations

import pytest

from astraflow.raas.agent.server import AgentServer


@pytest.fixture(scope="module")
def engine():
    """A torch engine of the tiny model as policy ``actor`` (no prefix cache)."""
    from astraflow.raas.engine import TorchEngine
    from tests.unit.raas.test_engine import tiny_model, tiny_tokenizer

    return TorchEngine(tiny_model(), tiny_tokenizer(), policy="actor", prefix_cache_bytes=0)


@pytest.fixture
def server():
    """An agent endpoint with the default limits, stopped after the test."""
    s = AgentServer()
    yield s
    s.stop()
