"""A LoRA policy on a broker: a trainer SIGKILLed mid-run resumes exactly, an engine follows its
adapters, model export writes them as a peft adapter and merged, and replay train rebuilds the
same adapters."""

from __future__ import annotations

import pytest
import torch

from astraflow.config.lora import LoraSpec
from astraflow.models import lora
from tests.conftest import wait_for
from tests.unit.trainer.test_lora import SETTINGS
from tests.unit.trainer.test_trainer import tiny_model  # noqa: F401 (fixture)

PROMPTS = [[3, 9, 4, 11], [7, 7, 2]]


def _engine(path: str):
    """A torch engine of the LoRA policy, as ``load_torch_engine(..., lora=SETTINGS)``
    builds it (the tiny model has no tokenizer to load)."""
    from transformers import AutoModelForCausalLM

    from astraflow.raas.engine import TorchEngine

    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()
    return TorchEngine(lora.wrap(model, LoraSpec(**SETTINGS)), None)


@pytest.mark.kafka
@pytest.mark.slow
def test_a_lora_trainer_resumes_exactly_after_sigkill_and_an_engine_follows_it(
        kafka_config, kafka_bootstrap, make_topology, tiny_model, tmp_path):  # noqa: F811
    """``trainer run`` of a LoRA policy, SIGKILLed with version 3's transaction open and
    restarted: every published version (adapters, whole or delta) equals the uninterrupted
    run's bit for bit; a torch engine that follows the topic, and one started after the
    last version, both hold the newest adapter and sample what a peft model with it does;
    ``model export`` writes it as a peft adapter and merged, both generating the engine's
    tokens; ``replay train`` rebuilds the same adapters from the retained batches."""
    from astraflow.config.sections import TrainerSpec
    from astraflow.raas.engine import SamplingParams
    from astraflow.raas.weights_follow import WeightWatcher
    from astraflow.weights.bits import state_bytes_equal
    from astraflow.weights.follower import WeightFollower
    from astraflow.wire.codec import SingleObjectCodec
    from tests.integration.trainer.test_trainer import _crash_then_resume, _reference

    topo, path = make_topology(
        topics={"batches.actor": {"partitions": 1}, "weights.actor": {"partitions": 1}},
        policies={"actor": {"model": tiny_model, "lora": SETTINGS,
                            "trainer": {"lr": 1e-2}}})  # replay train reads it here
    watched = _engine(tiny_model)
    weights = topo.full_name("weights.actor")
    watcher = WeightWatcher(kafka_config, weights, watched, SingleObjectCodec())
    n = 6
    sent, _, manifests, text = _crash_then_resume(
        kafka_config, kafka_bootstrap, topo, path, tiny_model, tmp_path, n=n, crash_at=3,
        args=["--lr", "1e-2", "--state-interval", "1"])
    assert "resumed at version 2" in text, text[-3000:]
    versions = sorted({m.version for m in manifests})
    assert versions == list(range(n + 1))
    s = LoraSpec(**SETTINGS)
    assert all(lora.settings_of(m.meta) == s for m in manifests)
    assert all("lora_" in t.name for m in manifests for t in m.tensors)
    ref = _reference(tiny_model, sent, TrainerSpec(lr=1e-2), lora=LoraSpec(**SETTINGS))
    follower = WeightFollower(policy="actor", kafka_config=kafka_config, inplace=False)
    follower.observe(manifests)
    for v in range(n + 1):
        follower.update(v)
        assert state_bytes_equal(follower.state, ref["published"][v]), v
    # between anchors (4) each version is the smaller of its delta and the adapter whole
    for m in manifests:
        if m.kind == "full" and m.version not in (0, 4):
            assert int(m.meta["delta_bytes"]) > m.encoded_bytes, m.meta

    late = _engine(tiny_model)
    late_watcher = WeightWatcher(kafka_config, weights, late, SingleObjectCodec())
    for w in (watcher, late_watcher):
        wait_for(lambda w=w: (w.refresh(), w.engine.version)[1] == n, 60, "version n", step=0.2)
        held = lora.adapter_state(w.engine.model)
        assert state_bytes_equal({k: v.to(torch.bfloat16) for k, v in held.items()},
                                 ref["published"][n])
    params = SamplingParams(n=1, max_new_tokens=6, temperature=0.0)
    assert watched.generate(PROMPTS, params)[0][0].versions == [n] * 6
    ids = [g[0].token_ids for g in watched.generate(PROMPTS, params)]
    assert [g[0].token_ids for g in late.generate(PROMPTS, params)] == ids

    # model export: the adapter in peft's format, and merged into the model
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from astraflow.cli.main import main
    from tests.integration.models.test_model_export import exported_tokens

    common = ["model", "export", "-t", str(path), "--bootstrap", kafka_bootstrap]
    assert main([*common, str(tmp_path / "adapter")]) == 0
    assert main([*common, "--merge", str(tmp_path / "merged")]) == 0
    assert {"adapter_config.json", "adapter_model.safetensors", "config.json"} <= {
        f.name for f in (tmp_path / "adapter").iterdir()}
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    loaded = PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    assert state_bytes_equal({k: v.to(torch.bfloat16) for k, v in
                              lora.adapter_state(loaded).items()}, ref["published"][n])
    with torch.no_grad():
        got = [loaded.generate(input_ids=torch.tensor([p]), max_new_tokens=6, min_new_tokens=6,
                               do_sample=False, pad_token_id=0)[0, len(p):].tolist()
               for p in PROMPTS]
    assert got == ids
    assert exported_tokens(tmp_path / "merged") == ids

    # replay train from the retained batches: the same adapters, bit for bit
    from astraflow.replay.ranges import digest_at

    assert main(["replay", "train", "-t", str(path), "--bootstrap", kafka_bootstrap,
                 "--runs-dir", str(tmp_path), "--into", f"{topo.run}-replay"]) == 0
    want = digest_at(kafka_config, weights, "actor", n)
    assert digest_at(kafka_config, f"{topo.run}-replay.weights.actor", "actor", n) == want

