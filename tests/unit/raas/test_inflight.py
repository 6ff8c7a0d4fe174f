"""Weight updates inside a generation (``TorchEngine.follow_inflight``), without a broker:
a generation that spans three versions records, per token, the version that sampled it and
the log-probability under the weights in force when it was sampled (with the KV cache kept
across the swap), and a generation that gets no new version is the one it would be
without chunks."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from astraflow.config.sections import PoolSpec
from astraflow.raas.engine import Generation, SamplingParams, TorchEngine
from astraflow.raas.node import NodeOptions
from tests.unit.raas.test_engine import nucleus_logprob, tiny_model, tiny_tokenizer


class Offers:
    """An ``InflightWeights`` source that hands over ``versions`` (version -> state) at the
    chunk boundaries ``at`` (1 = the first boundary), and nothing at the others."""

    def __init__(self, versions: dict[int, dict[str, torch.Tensor]], at: tuple[int, ...]):
        self.queue = sorted(versions.items())
        self.at = at
        self.boundaries = 0
        self.currents: list[int] = []

    def take_ready(self, current, load):
        self.boundaries += 1
        self.currents.append(current)
        if self.boundaries not in self.at or not self.queue:
            return None
        version, state = self.queue.pop(0)
        load(state, version)
        return version


def perturbed(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in state.items()}


def replay(model, states: dict[int, dict[str, torch.Tensor]], g: Generation, temperature: float,
           top_p: float) -> list[float]:
    """The log-probs of ``g``'s tokens recomputed one prompt at a time, the cache kept: the
    logits of token i come from feeding token i-1 through the weights of ``g.versions[i]``
    (token 0's from the prompt's prefill under ``g.versions[0]``)."""
    with torch.no_grad():
        model.load_state_dict(states[g.versions[0]])
        out = model(input_ids=torch.tensor([g.prompt_ids]), use_cache=True)
        cache, logits = out.past_key_values, out.logits[0, -1].double()
        lps = []
        for i, tok in enumerate(g.token_ids):
            if i and g.versions[i] != g.versions[i - 1]:
                model.load_state_dict(states[g.versions[i]])
            if i:
                out = model(input_ids=torch.tensor([[g.token_ids[i - 1]]]),
                            past_key_values=cache, use_cache=True)
                cache, logits = out.past_key_values, out.logits[0, -1].double()
            lps.append(nucleus_logprob(logits.tolist(), tok, temperature, top_p))
    return lps


@pytest.fixture()
def engine() -> TorchEngine:
    return TorchEngine(tiny_model(), tiny_tokenizer(), policy="actor", version=0)


def test_a_generation_spanning_three_versions_records_each_tokens_version(engine):
    v0 = {k: v.clone() for k, v in engine.model.state_dict().items()}
    states = {0: v0, 3: perturbed(v0, 1), 5: perturbed(v0, 2)}
    source = Offers({3: states[3], 5: states[5]}, at=(1, 3))
    engine.follow_inflight(source, every=4)
    prompts = [engine.encode("12*7="), engine.encode("what is 9+9?")]  # padded batch
    params = SamplingParams(max_new_tokens=16, temperature=0.8, n=2, seed=5)
    out = engine.generate(prompts, params)

    # boundaries after tokens 4, 8, 12: v3 taken at the first, v5 at the third
    assert source.boundaries == 3 and source.currents == [0, 3, 3]
    assert engine.version == 5 and engine.inflight_updates == 2
    expected = [0] * 4 + [3] * 8 + [5] * 4
    reference = tiny_model()
    for samples in out:
        for g in samples:
            assert g.versions == expected
            mine = replay(reference, states, g, 0.8, 1.0)
            assert max(abs(a - b) for a, b in zip(mine, g.logprobs)) < 1e-4
            # and the swaps mattered: v0's weights throughout give other log-probs after
            # the first swap, the same before it
            flat = replay(reference, states, Generation(g.prompt_ids, g.token_ids,
                                                         versions=[0] * 16), 0.8, 1.0)
            assert max(abs(a - b) for a, b in zip(flat[:4], g.logprobs[:4])) < 1e-4
            assert max(abs(a - b) for a, b in zip(flat[4:], g.logprobs[4:])) > 1e-2
    # the mixed rows are not kept as a prefix of the new version
    assert engine.prefix_cache is not None and len(engine.prefix_cache) == 0


def test_the_first_token_and_a_finished_batch_see_no_boundary(engine):
    source = Offers({1: perturbed(engine.model.state_dict(), 3)}, at=(1,))
    engine.follow_inflight(source, every=4)
    out = engine.generate([engine.encode("1+1=")],
                          SamplingParams(max_new_tokens=4, temperature=1.0, seed=1))
    # 4 tokens of a 4-token limit: the generation ends before any boundary
    assert source.boundaries == 0 and out[0][0].versions == [0] * 4 and engine.version == 0


def test_chunks_without_a_new_version_sample_what_one_chunk_samples():
    params = SamplingParams(max_new_tokens=12, temperature=1.0, n=3, seed=11)
    plain = TorchEngine(tiny_model(), tiny_tokenizer(), prefix_cache_bytes=0)
    chunked = TorchEngine(tiny_model(), tiny_tokenizer(), prefix_cache_bytes=0)
    source = Offers({}, at=())
    chunked.follow_inflight(source, every=2)
    prompt = [plain.encode("2*3=")]
    a, b = plain.generate(prompt, params), chunked.generate(prompt, params)
    assert source.boundaries == 5  # after tokens 2, 4, ..., 10
    for x, y in zip(a[0], b[0]):
        assert x.token_ids == y.token_ids and x.versions == y.versions == [0] * 12
        assert all(math.isclose(p, q, abs_tol=1e-6) for p, q in zip(x.logprobs, y.logprobs))


def test_follow_inflight_off_and_bad_settings(engine):
    engine.follow_inflight(Offers({}, at=()), every=0)
    assert engine.inflight is None and engine.update_every_tokens == 0
    with pytest.raises(ValueError, match="update_every_tokens -1"):
        engine.follow_inflight(Offers({}, at=()), every=-1)
    with pytest.raises(ValueError, match="update_every_tokens -2"):
        NodeOptions(update_every_tokens=-2)
    with pytest.raises(ValidationError, match="update_every_tokens"):
        PoolSpec(update_every_tokens=-1)
    assert PoolSpec().update_every_tokens == NodeOptions().update_every_tokens == 0


def test_the_watcher_hands_over_only_a_fetched_newer_version_and_never_waits():
    """``WeightWatcher.take_ready`` without Kafka: its follower's copy is handed over when
    newer than the engine's version; while a fetch holds the lock it answers None at once;
    a version the engine refused is not offered again."""
    import threading

    from astraflow.raas.weights_follow import WeightWatcher
    from astraflow.weights import WeightFollower

    state = {"w": torch.ones(2)}
    watcher = object.__new__(WeightWatcher)  # its Kafka table left out
    watcher.topic, watcher._lock, watcher._refused_inflight = "r.weights.actor", \
        threading.RLock(), None
    watcher.updates = watcher.inflight_updates = 0
    watcher.update_s = watcher.last_update_s = 0.0
    watcher.follower = WeightFollower(state=state, version=4, policy="actor")
    loads: list[int] = []

    def load(s, v):
        assert s["w"] is watcher.follower.state["w"]
        loads.append(v)

    assert watcher.take_ready(4, load) is None and watcher.take_ready(5, load) is None
    assert watcher.take_ready(2, load) == 4 and loads == [4]
    assert watcher.inflight_updates == watcher.updates == 1

    held, release = threading.Event(), threading.Event()

    def fetching():  # a prefetch writing the follower's copy
        with watcher._lock:
            held.set()
            release.wait(30)

    t = threading.Thread(target=fetching)
    t.start()
    held.wait(30)
    try:
        assert watcher.take_ready(2, load) is None and loads == [4]
    finally:
        release.set()
        t.join(30)

    def refuse(s, v):
        raise ValueError("does not fit")

    assert watcher.take_ready(2, refuse) is None
    assert watcher.take_ready(2, load) is None and loads == [4]  # v4 is not offered again
    watcher.follower.version = 5
    assert watcher.take_ready(2, load) == 5
