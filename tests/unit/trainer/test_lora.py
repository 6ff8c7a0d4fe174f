"""LoRA policies without a broker: the trainer trains the adapter alone on a frozen base,
publishes it by peft's saved names, merging equals peft's own forward, dropout is seeded by
the step, and the publisher stores a version whole when that is smaller than its delta."""

from __future__ import annotations

import re

import pytest
import torch

from astraflow.config.lora import LoraSpec
from astraflow.models import lora
from tests.unit.trainer.test_trainer import make_batch, tiny_model  # noqa: F401 (fixture)

SETTINGS = {"rank": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}


def _trainer(path: str, **lora_over):
    from astraflow.config.sections import TrainerSpec
    from astraflow.trainer.trainer import Trainer

    torch.set_num_threads(1)
    return Trainer(path, TrainerSpec(lr=1e-2), "actor", lora=LoraSpec(**{**SETTINGS, **lora_over}))


def test_the_trainer_trains_the_adapter_alone_and_publishes_it(tiny_model):  # noqa: F811
    tr = _trainer(tiny_model)
    base = {k: v.clone() for k, v in tr.backend.base.state_dict().items() if "lora_" not in k}
    published = tr.published_state()
    # the adapter of q_proj and v_proj in each of the 2 layers, A and B, peft's names
    assert len(published) == 2 * 2 * 2
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert tuple(published[name].shape) == (4, 64)
    assert all(v.dtype == torch.bfloat16 for v in published.values())
    b0 = published[name.replace("lora_A", "lora_B")]
    assert not b0.any()  # version 0: B = 0, the base model's own outputs
    for i in range(3):
        tr.train_step(make_batch(i))
    after = tr.published_state()
    assert after[name.replace("lora_A", "lora_B")].any()  # the adapter learned
    frozen = {k: v for k, v in tr.backend.base.state_dict().items() if "lora_" not in k}
    assert {k: v.tolist() for k, v in frozen.items()} == {k: v.tolist() for k, v in base.items()}
    assert len(tr.optimizer.param_groups[0]["params"]) == 8  # the adapter's masters only


def test_a_trainer_loaded_with_a_published_adapter_continues_identically(tiny_model):  # noqa: F811
    a, b = _trainer(tiny_model), _trainer(tiny_model)
    a.train_step(make_batch(0))
    b.load_master_bytes(a.master_bytes())  # the trainer state a resume restores
    b.load_optimizer_bytes(a.optimizer_bytes())
    b.steps = a.steps
    a.train_step(make_batch(1))
    b.train_step(make_batch(1))
    assert lora_equal(a.published_state(), b.published_state())
    with pytest.raises(ValueError, match="does not fit"):
        b.load_weights({"base_model.model.x.lora_A.weight": torch.zeros(1)})


def lora_equal(x: dict, y: dict) -> bool:
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_dropout_is_drawn_from_the_step_so_a_replayed_step_repeats(tiny_model):  # noqa: F811
    a, b = _trainer(tiny_model, dropout=0.5), _trainer(tiny_model, dropout=0.5)
    for i in range(2):
        a.train_step(make_batch(i))
        b.train_step(make_batch(i))
    assert lora_equal(a.published_state(), b.published_state())
    c = _trainer(tiny_model)  # no dropout: another update
    for i in range(2):
        c.train_step(make_batch(i))
    assert not lora_equal(a.published_state(), c.published_state())


def test_merged_weights_compute_what_the_peft_model_computes(tiny_model):  # noqa: F811
    from transformers import AutoModelForCausalLM

    tr = _trainer(tiny_model)
    tr.train_step(make_batch(0))
    adapter = tr.published_state()
    s = LoraSpec(**SETTINGS)
    peft_model = lora.wrap(AutoModelForCausalLM.from_pretrained(tiny_model).eval(), s)
    lora.load_published(peft_model, adapter)
    plain = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    merged = lora.merged(plain.state_dict(), adapter, s)
    assert sorted(merged) == sorted(f"model.layers.{i}.self_attn.{m}.weight"
                                    for i in range(2) for m in ("q_proj", "v_proj"))
    lora.load_published(plain, {**plain.state_dict(), **merged})
    ids = torch.tensor([[1, 5, 9, 3, 7]])
    with torch.no_grad():
        want, got = peft_model(ids).logits, plain(ids).logits
    assert torch.allclose(want, got, atol=1e-5)


def test_settings_round_trip_through_a_manifests_meta_and_names_map():
    s = LoraSpec(**SETTINGS)
    assert lora.settings_of({lora.META_KEY: s.to_json()}) == s
    assert lora.settings_of({}) is None
    assert s.scale == 2.0
    assert lora.saved_name("base_model.model.model.layers.0.mlp.up_proj.lora_B.default.weight"
                           ) == "base_model.model.model.layers.0.mlp.up_proj.lora_B.weight"
    with pytest.raises(ValueError, match="only one of lora_A/lora_B"):
        lora.adapted_weights(["base_model.model.m.q_proj.lora_A.weight"])
    with pytest.raises(ValueError, match="not a LoRA matrix"):
        lora.adapted_weights(["model.layers.0.q_proj.weight"])


def test_the_publisher_stores_a_version_whole_when_that_is_smaller(tmp_path):
    from astraflow.weights import FileBlobStore, WeightFollower, WeightPublisher

    store = FileBlobStore(tmp_path)
    pub = WeightPublisher(store, "actor", anchor_interval=100, whole_when_smaller=True,
                          meta={"lora": "{}"})
    g = torch.Generator().manual_seed(0)
    state = {"a": torch.randn(64, 32, generator=g).to(torch.bfloat16)}
    manifests = list(pub.publish(state))  # version 0: an anchor
    # every element changes to an unrelated value: the XORs are as random as the values
    dense = {"a": torch.randn(64, 32, generator=g).to(torch.bfloat16)}
    v1 = pub.publish(dense)
    sparse = {"a": dense["a"].clone()}
    sparse["a"][0, 0] += 1  # one element changes
    v2 = pub.publish(sparse)
    assert [m.kind for m in v1] == ["full"] and int(v1[0].meta["delta_bytes"]) > \
        v1[0].encoded_bytes
    assert v1[0].num_changed > 2000 and v1[0].meta["lora"] == "{}"
    assert [m.kind for m in v2] == ["delta"] and v2[0].num_changed == 1
    follower = WeightFollower(policy="actor", stores=[store])
    follower.observe(manifests + v1 + v2)
    follower.update(2)
    assert torch.equal(follower.state["a"], sparse["a"])
    plain = WeightPublisher(store, "other", anchor_interval=100)
    plain.publish(state)
    assert [m.kind for m in plain.publish(dense)] == ["delta"]  # without: always a delta


def test_lora_is_refused_where_it_cannot_train():
    from astraflow.config.sections import PolicySpec

    ok = PolicySpec(model="m", lora={"rank": 8})
    assert ok.lora.alpha == 32.0 and "down_proj" in ok.lora.target_modules
    with pytest.raises(ValueError, match="backend: torch"):
        PolicySpec(model="m", lora={}, trainer={"backend": "megatron"})
    with pytest.raises(ValueError, match="one process"):
        PolicySpec(model="m", lora={}, trainer={"parallel": {"processes": 2}})
    with pytest.raises(ValueError, match="rank"):
        PolicySpec(model="m", lora={"rank": 0})


def test_a_trainer_refuses_to_resume_weights_of_another_kind_naming_both():
    from astraflow.trainer.restore import check_lora
    from astraflow.wire.records import WeightManifest

    def manifest(version: int, meta: dict) -> WeightManifest:
        return WeightManifest(policy="actor", version=version, base_version=None, kind="full",
                              dtype="bfloat16", tensors=[], blobs=[], num_params=0,
                              num_changed=0, sparsity=1.0, encoded_bytes=0, trainer_step=0,
                              meta=meta)

    adapter = LoraSpec(**SETTINGS)
    for mine, published, says in (
            (adapter, {}, "holds the whole model (version 1), this trainer trains a LoRA"),
            (None, {"lora": adapter.to_json()}, "holds a LoRA adapter"),
            (adapter.model_copy(update={"rank": 8}), {"lora": adapter.to_json()}, '"rank": 8')):
        with pytest.raises(RuntimeError, match=re.escape(says)):
            check_lora([manifest(0, published), manifest(1, published)], mine,
                       "r.weights.actor")
    check_lora([manifest(3, {"lora": adapter.to_json()})], adapter, "r.weights.actor")
