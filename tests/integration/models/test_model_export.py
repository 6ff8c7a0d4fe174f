"""``astraflow model export`` on a real broker: a trained version as a Hugging Face
directory that transformers loads and that generates, greedy, the tokens the RaaS engine
generates at that version; a version whose blobs were pruned is refused, naming the newest
one that can be exported."""

from __future__ import annotations

import json

import pytest
import torch

from astraflow.cli.main import main
from astraflow.weights.stores.kafka import read_manifests
from tests.integration.replay.test_replay import _train_source
from tests.unit.trainer.test_trainer import tiny_model  # noqa: F401 - a fixture

PROMPTS = [[3, 9, 4, 11], [7, 7, 2]]


def engine_tokens(model, state=None) -> list[list[int]]:
    """Greedy tokens of a torch RaaS engine on ``model`` holding ``state`` (a published
    version; None: as it is)."""
    from astraflow.raas.engine import SamplingParams, TorchEngine

    engine = TorchEngine(model, None, prefix_cache_bytes=0)
    if state is not None:
        engine.load_state_dict(state, 1)
    out = engine.generate(PROMPTS, SamplingParams(n=1, max_new_tokens=6, temperature=0.0))
    return [g[0].token_ids for g in out]


def exported_tokens(path) -> list[list[int]]:
    """What transformers generates greedy from an exported directory, computing in fp32
    as the engine does (the published bf16 values are exact in fp32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = model.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False,
                                 min_new_tokens=6, pad_token_id=0)
            out.append(ids[0, len(p):].tolist())
    return out


def _state_at(kafka_config, topic: str, version: int) -> dict:
    from astraflow.weights.follower import WeightFollower

    follower = WeightFollower(policy="actor", kafka_config=kafka_config, inplace=False)
    follower.observe(read_manifests(kafka_config, topic))
    follower.update(version)
    return follower.state


@pytest.mark.slow
def test_an_exported_version_generates_what_the_engine_did_and_pruned_ones_are_refused(
        kafka_config, kafka_bootstrap, make_topology, tiny_model, tmp_path, capsys):  # noqa: F811
    from transformers import AutoModelForCausalLM

    topo, path = make_topology(
        topics={"batches.actor": {"partitions": 1}, "weights.actor": {"partitions": 1}},
        policies={"actor": {"model": tiny_model,
                            "trainer": {"lr": 1e-3, "anchor_interval": 2}}})
    _train_source(kafka_config, kafka_bootstrap, path, topo, tiny_model, tmp_path, n=4)
    weights = topo.full_name("weights.actor")
    common = ["model", "export", "-t", str(path), "--bootstrap", kafka_bootstrap]

    for version in (4, 2):
        out = tmp_path / f"v{version}"
        args = [*common, str(out)] + (["--version", str(version)] if version != 4 else [])
        assert main(args) == 0
        assert f"exported actor version {version} as a model" in capsys.readouterr().out
        record = json.loads((out / "astraflow_export.json").read_text())
        assert record == {"policy": "actor", "version": version, "kind": "model",
                          "weights_topic": weights}
        base = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
        want = engine_tokens(base, _state_at(kafka_config, weights, version))
        assert exported_tokens(out) == want, version
    assert exported_tokens(tmp_path / "v4") != exported_tokens(tmp_path / "v2") or \
        exported_tokens(tmp_path / "v4") != engine_tokens(
            AutoModelForCausalLM.from_pretrained(tiny_model).eval())

    # a non-empty directory is kept unless --force
    assert main([*common, str(tmp_path / "v2")]) == 2
    assert "pass --force" in capsys.readouterr().err
    assert main([*common, "--force", str(tmp_path / "v2")]) == 0
    capsys.readouterr()
    # version 1's blobs pruned: refused, naming the newest exportable (4: full at 4)
    store = tmp_path / "source-state" / "blobs"
    v1 = [m for m in read_manifests(kafka_config, weights) if m.version == 1]
    for m in v1:
        for b in m.blobs:
            for f in store.rglob(b.uri.rsplit("/", 1)[-1] + "*"):
                f.unlink()
    assert main([*common, "--version", "1", str(tmp_path / "v1")]) == 2
    err = capsys.readouterr().err
    assert "version 1 cannot be rebuilt" in err and "newest exportable version is 4" in err, err
    assert not (tmp_path / "v1").exists()
    assert main([*common, "--version", "9", str(tmp_path / "v9")]) == 2
    assert "no version 9 (published: 0..4)" in capsys.readouterr().err
    assert main([*common, "--merge", str(tmp_path / "m")]) == 2
    assert "trains the whole model" in capsys.readouterr().err
