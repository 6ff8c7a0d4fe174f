"""The engine factory of a RaaS node (``astraflow.raas.engines``): which engine a node's
settings make, with which defaults, and the options refused before anything loads."""

from __future__ import annotations

import pytest

from astraflow.config.components import node_settings
from astraflow.config.options import TorchEngineOptions, VLLMEngineOptions
from astraflow.config.sections import engine_options
from astraflow.config.topology import parse_topology
from astraflow.models.tiny import init_model
from astraflow.raas.engine import TorchEngine
from astraflow.raas.engines import ENGINES, load_engine


def test_each_engine_refuses_an_option_it_does_not_know_before_loading_anything():
    """An engine's options are its typed model's: a bad one fails in one line naming the
    key, before anything is loaded or vLLM imported."""
    engine_options("torch", {k: None for k in TorchEngineOptions.model_fields})
    with pytest.raises(ValueError, match="^torch engine option cpus: Extra inputs"):
        engine_options("torch", {"cpus": 2})
    with pytest.raises(ValueError, match="^vllm engine option kv_cache: Extra inputs"):
        engine_options("vllm", {"kv_cache": 1})
    with pytest.raises(ValueError, match="^vllm engine option lora_mode: Input should be "
                       "'auto', 'native' or 'merge'$"):
        engine_options("vllm", {"lora_mode": "fuse"})
    with pytest.raises(ValueError, match="^openai engine option base_url: Field required$"):
        engine_options("openai", {})
    with pytest.raises(ValueError, match="unknown engine 'tgi' .*torch, vllm, openai"):
        engine_options("tgi", {})
    assert ENGINES == ("torch", "vllm", "openai")
    typed = engine_options("vllm", {"cpus": 1, "enforce_eager": True})
    assert (typed.cpus, typed.enforce_eager, typed.kv_cache_gib) == (1, True, 2)
    assert engine_options("vllm", typed) is typed
    assert VLLMEngineOptions().lora_mode == "auto"  # the one default


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


def test_a_vllm_engine_takes_its_typed_options_with_the_policies_dtype_under_them(
        tmp_path, monkeypatch):
    """load_engine hands vLLM its typed options (the model's defaults where the pool sets
    none); the policies' dtype is the default of the engine's own dtype."""
    from astraflow.raas import vllm_engine

    seen = {}
    monkeypatch.setattr(vllm_engine, "load_vllm_engine",
                        lambda path, policy, lora=None, options=None: seen.update(o=options))
    load_engine(_node(tmp_path, {"engine": "vllm", "engine_options": {"cpus": 2}},
                      {"dtype": "bfloat16"}), "actor", "m")
    assert seen["o"] == VLLMEngineOptions(cpus=2, dtype="bfloat16")
    assert seen["o"].kv_cache_gib == 2 and seen["o"].lora_mode == "auto"
    load_engine(_node(tmp_path, {"engine": "vllm", "engine_options": {"dtype": "float32"}},
                      {"dtype": "bfloat16"}), "actor", "m")
    assert seen["o"].dtype == "float32"
