"""The engine factory of a RaaS node (``astraflow.raas.engines``): which engine a node's
settings make, with which defaults, and the options refused before anything loads."""

from __future__ import annotations

import pytest

from astraflow.config.components import node_settings
from astraflow.config.topology import parse_topology
from astraflow.models.tiny import init_model
from astraflow.raas.engine import TorchEngine
from astraflow.raas.engines import ENGINES, TORCH_OPTIONS, check_engine_options, load_engine


def test_each_engine_refuses_an_option_it_does_not_know_before_loading_anything():
    check_engine_options("torch", {k: None for k in TORCH_OPTIONS})
    with pytest.raises(ValueError, match="unknown torch engine option 'cpus'"):
        check_engine_options("torch", {"cpus": 2})
    with pytest.raises(ValueError, match="kv_cache"):
        check_engine_options("vllm", {"kv_cache": 1})
    with pytest.raises(ValueError, match="unknown engine 'tgi' .*torch, vllm, openai"):
        check_engine_options("tgi", {})
    assert ENGINES == ("torch", "vllm", "openai")


def _node(tmp_path, pool: dict, policy: dict | None = None):
    topo = parse_topology({"run": "r", "pools": {"p": pool}, "policies": {
        "actor": {"model": str(tmp_path / "m"), **(policy or {})}}})
    return node_settings(topo, "p")


def test_a_torch_engine_takes_the_pools_defaults_under_its_own_options(tmp_path):
    init_model(tmp_path / "m", seed=0)
    node = _node(tmp_path, {"prefix_cache_mib": 2})
    engine = load_engine(node, "actor", str(tmp_path / "m"))
    assert isinstance(engine, TorchEngine) and engine.policy == "actor"
    assert engine.prefix_cache.max_bytes == 2 * 2**20
    node = _node(tmp_path, {"prefix_cache_mib": 2, "engine_options": {"prefix_cache_mib": 0}})
    assert load_engine(node, "actor", str(tmp_path / "m")).prefix_cache is None


def test_the_openai_engine_refuses_a_lora_policy(tmp_path):
    node = _node(tmp_path, {"engine": "openai", "engine_options": {
        "base_url": "http://127.0.0.1:9/v1"}}, {"lora": {"rank": 4}})
    with pytest.raises(ValueError, match="policy actor trains a LoRA adapter: the openai"):
        load_engine(node, "actor", str(tmp_path / "m"))
