"""Data algorithms (GRESO, curriculum, mixer, dynamic sampling, reward norm, rules): logic only.

No broker: every decision is exercised through the plain classes and the processors'
``process``/``flush`` methods. The broker tests are in test_data_algorithms_kafka.py.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections import Counter

import pytest

from astraflow.config.processors import Match, Range
from astraflow.config.topology import TopologyError, parse_topology
from astraflow.dataflow import PROCESSOR_KINDS, Incoming
from astraflow.dataflow.curriculum import Curriculum, CurriculumOptions, CurriculumPolicy, level_of
from astraflow.dataflow.dynamic_sampling import (
    DynamicSampling,
    DynamicSamplingOptions,
    informative,
)
from astraflow.dataflow.follower import StaticObservations
from astraflow.dataflow.greso import Greso, GresoOptions, GresoSelector
from astraflow.dataflow.groups import EASY, HARD, MIXED, classify, unit_hash
from astraflow.dataflow.mixer import Mixer, MixerOptions, RatioMixer
from astraflow.dataflow.reward_norm import (
    RewardNorm,
    normalise,
    normalise_group,
    raw_rewards,
)
from astraflow.dataflow.rules import RuleRouter, RuleRouterOptions, route
from astraflow.wire.records import Sequence, Task, TrajectoryGroup


def seq(reward: float, policy: str = "actor", versions: list[int] | None = None) -> Sequence:
    versions = versions if versions is not None else [-1, 0]
    n = len(versions)
    return Sequence(policy=policy, token_ids=list(range(n)),
                    loss_mask=[int(v >= 0) for v in versions], logprobs=[0.0] * n,
                    versions=versions, reward=reward, sample_index=0, finish_reason="stop")


def group(prompt: str, rewards: list[float], source: str = "s", workflow: str = "w",
          policy: str = "actor", versions: list[int] | None = None, **kw) -> TrajectoryGroup:
    seqs = [seq(r, policy, versions) for r in rewards]
    return TrajectoryGroup(group_id=f"g-{prompt}-{random.random()}", prompt_id=prompt,
                           task_id=prompt, workflow=workflow, source=source, raas_id="r",
                           pool="p", sequences=seqs, rewards=list(rewards), **kw)


def task(prompt: str, n: int = 0, source: str = "s", level: int | None = None) -> Task:
    payload = json.dumps({"prompt": "1+1", "answer": "2", "level": level})
    return Task(task_id=f"{prompt}#{n}", prompt_id=prompt, workflow="w", payload=payload,
                source=source)


def inc(rec, topic: str = "tasks.source", partition: int = 0, offset: int = 0) -> Incoming:
    return Incoming(topic, partition, offset, getattr(rec, "prompt_id", "k").encode(), rec)


def test_every_kind_is_registered_with_strict_options():
    for kind in ("greso", "curriculum", "mixer", "dynamic_sampling", "reward_norm",
                 "rule_router", "class_balance", "downsample"):
        cls = PROCESSOR_KINDS[kind]
        assert cls.Options.model_config.get("extra") == "forbid", kind
        assert cls.__doc__


def test_classify_easy_hard_mixed():
    assert classify([1.0, 1.0, 1.0]) == EASY
    assert classify([0.0, 0.0]) == HARD
    assert classify([0.5, 0.5]) == HARD  # zero variance, but not all correct
    assert classify([0.0, 1.0]) == MIXED
    assert classify([1.0]) is None  # too small to say anything about variance
    assert classify([1.0, 1.0 - 1e-9]) == EASY
    assert 0 <= unit_hash("a", 1) < 1 and unit_hash("a", 1) == unit_hash("a", 1)


# --- GRESO ----------------------------------------------------------------------------
def test_greso_streaks_grow_switch_and_reset():
    sel = GresoSelector(GresoOptions(p_easy=0.5, p_hard=0.8, min_submit_prob=0.0,
                                     adapt_every=10_000))
    assert sel.submit_probability("p") == 1.0  # never seen
    sel.observe(group("p", [1, 1, 1, 1]))
    sel.observe(group("p", [1, 1, 1, 1]))
    assert sel.streak("p") == (EASY, 2)
    assert sel.submit_probability("p") == pytest.approx(0.25)  # 0.5 ** 2
    sel.observe(group("p", [0, 0, 0, 0]))  # kind switches: streak restarts at 1
    assert sel.streak("p") == (HARD, 1)
    assert sel.submit_probability("p") == pytest.approx(0.8)
    sel.observe(group("p", [0, 1, 0, 0]))  # variance: streak reset
    assert sel.streak("p") == (MIXED, 0) and sel.submit_probability("p") == 1.0
    assert "p" not in sel.streaks  # mixed prompts take no memory
    sel.observe(group("q", [1]))  # single sample: not classified, not counted
    assert sel.observed == 4


def test_greso_floor_bounds_the_skip_probability():
    sel = GresoSelector(GresoOptions(p_easy=0.5, min_submit_prob=0.1, adapt_every=10_000))
    for _ in range(20):
        sel.observe(group("p", [1, 1]))
    assert sel.submit_probability("p") == pytest.approx(0.1)  # 0.5**20 is far below
    forwarded = sum(sel.decide(task("p", i)) for i in range(4000))
    assert 0.08 < forwarded / 4000 < 0.12


def test_greso_decisions_are_deterministic_per_task():
    sel = GresoSelector(GresoOptions(p_easy=0.5, adapt_every=10_000))
    for _ in range(2):
        sel.observe(group("p", [1, 1]))
    first = [sel.decide(task("p", i)) for i in range(200)]
    assert first == [sel.decide(task("p", i)) for i in range(200)]
    assert 0 < sum(first) < 200


@pytest.mark.parametrize("mode", ["additive", "multiplicative"])
def test_greso_bases_adapt_toward_targets(mode):
    o = GresoOptions(p_easy=0.5, p_hard=0.5, target_easy_ratio=0.2, target_hard_ratio=0.2,
                     step=0.05, step_mode=mode, window=20, adapt_every=5, min_base=0.1,
                     max_base=0.9)
    sel = GresoSelector(o)
    for i in range(200):  # only easy groups: easy ratio 1 > 0.2, hard ratio 0 < 0.2
        sel.observe(group(f"p{i}", [1, 1]))
    assert sel.p_easy == pytest.approx(0.1)  # stepped down to min_base
    assert sel.p_hard == pytest.approx(0.9)  # stepped up to max_base
    sel2 = GresoSelector(o)
    for i in range(10):
        sel2.observe(group(f"p{i}", [1, 0]))
    # two adaptation steps, both "explore more"
    expected = 0.5 + 2 * 0.05 if mode == "additive" else 0.5 * 1.05**2
    assert sel2.p_easy == pytest.approx(expected) and sel2.p_hard == pytest.approx(expected)


def test_greso_observed_easy_ratio_approaches_target_in_a_simulated_run():
    """A population where 60% of prompts are always solved: GRESO brings the share of
    all-correct groups among rollouts from 0.6 toward the 0.15 target."""
    rng = random.Random(0)
    prompts = {f"p{i}": (1.0 if i < 60 else 0.5) for i in range(100)}
    o = GresoOptions(target_easy_ratio=0.15, target_hard_ratio=0.15, window=200,
                     adapt_every=10, step=0.02, min_submit_prob=0.02, p_easy=0.9)
    sel = GresoSelector(o)
    recent: list[str] = []
    n = 0
    for _epoch in range(150):
        for pid, pass_rate in prompts.items():
            n += 1
            if not sel.decide(task(pid, n)):
                continue
            rewards = [float(rng.random() < pass_rate) for _ in range(8)]
            recent.append(sel.observe(group(pid, rewards)))
    tail = recent[-2000:]
    easy_ratio = tail.count(EASY) / len(tail)
    assert abs(easy_ratio - 0.15) < 0.04, easy_ratio
    assert sel.p_easy < 0.9


def _observations(seed: int) -> list[tuple[int, TrajectoryGroup]]:
    rng = random.Random(seed)
    out = []
    for _ in range(300):
        pid = f"p{rng.randrange(30)}"
        part = int(pid[1:]) % 3  # keyed by prompt: one partition per prompt
        kind = rng.random()
        rewards = [1, 1, 1] if kind < 0.4 else [0, 0, 0] if kind < 0.6 else [0, 1, 1]
        out.append((part, group(pid, rewards)))
    return out


def test_greso_state_rebuild_is_independent_of_partition_interleaving():
    obs = _observations(1)
    o = GresoOptions(window=16, adapt_every=4)
    live = GresoSelector(o)
    for part, g in obs:
        live.observe(g, part)
    # a restart reads the same partitions, in another interleaving (here: one after another)
    rebuilt = GresoSelector(o)
    for part in (2, 0, 1):
        for p, g in obs:
            if p == part:
                rebuilt.observe(g, p)
    assert rebuilt.state() == live.state()
    assert rebuilt.p_easy == live.p_easy and rebuilt.p_hard == live.p_hard  # bit for bit
    assert list(rebuilt.controllers) != list(live.controllers)  # seen in another order
    assert live.state()["observed"] == 300


def test_greso_processor_skips_and_counts():
    obs = StaticObservations()
    g = Greso("greso", ["tasks.source"], ["tasks"],
              GresoOptions(p_easy=0.5, min_submit_prob=0.0, adapt_every=10_000),
              observations=obs)
    for _ in range(30):
        obs.add(group("easy", [1, 1, 1]))
    out = [o for i in range(50) for o in g.process(inc(task("easy", i), offset=i))]
    out += list(g.process(inc(task("fresh", 0), offset=50)))
    m = g.metrics()
    assert m["greso/skipped"] + m["greso/passed"] == 51
    assert m["greso/skipped_easy"] == m["greso/skipped"] >= 49  # 0.5**30: almost never
    assert [o.record.prompt_id for o in out][-1] == "fresh"
    assert m["greso/observed"] == 30 and m["greso/p_easy"] == 0.5
    assert g.snapshot()["streaks"] == {"easy": ("easy", 30)}
    assert all("/" in k and k.startswith("greso/") for k in m)


# --- curriculum -------------------------------------------------------------------------
def test_curriculum_pass_rate_band():
    pol = CurriculumPolicy(CurriculumOptions(low=0.25, high=0.75, in_band_prob=1.0,
                                             out_band_prob=0.0, unseen_prob=0.5, history=2))
    pol.observe(group("mid", [1, 0, 1, 0]))
    pol.observe(group("solved", [1, 1, 1, 1]))
    pol.observe(group("hopeless", [0, 0, 0, 0]))
    assert pol.pass_rate("mid") == 0.5 and pol.pass_rate("new") is None
    assert pol.accept_probability(task("mid")) == 1.0
    assert pol.accept_probability(task("solved")) == 0.0
    assert pol.accept_probability(task("hopeless")) == 0.0
    assert pol.accept_probability(task("new")) == 0.5
    # the estimate follows the last `history` groups: "solved" starts failing
    pol.observe(group("solved", [0, 0, 0, 0]))
    assert pol.pass_rate("solved") == 0.5 and pol.decide(task("solved"))
    pol.observe(group("solved", [0, 0, 0, 0]))
    assert pol.pass_rate("solved") == 0.0


def test_curriculum_level_schedule_moves_with_observed_groups():
    o = CurriculumOptions(by="level", default_weight=0.0, stages=[
        {"until": 3, "weights": {1: 1.0}},
        {"until": 5, "weights": {1: 0.5, 2: 1.0}},
        {"weights": {2: 1.0, 3: 1.0}},
    ])
    obs = StaticObservations()
    c = Curriculum("cur", ["tasks.source"], ["tasks"], o, observations=obs)
    assert level_of(task("a", level=2)) == 2 and level_of(Task("t", "p", "w", "{", "s")) is None
    assert c.policy.accept_probability(task("a", level=1)) == 1.0
    assert c.policy.accept_probability(task("a", level=2)) == 0.0
    for i in range(3):
        obs.add(group(f"x{i}", [1, 0]))
    assert list(c.process(inc(task("b", level=2)))) != []  # drained: stage 2 now
    assert c.metrics()["curriculum/stage"] == 1.0
    for i in range(10):
        obs.add(group(f"y{i}", [1, 0]))
    assert list(c.process(inc(task("c", level=1)))) == []  # last stage: level 1 is out
    assert c.metrics()["curriculum/stage"] == 2.0
    assert c.metrics()["curriculum/skipped"] == 1 and c.metrics()["curriculum/passed"] == 1


def test_curriculum_options_are_checked():
    with pytest.raises(ValueError, match="at least one stage"):
        CurriculumOptions(by="level")
    with pytest.raises(ValueError, match="increasing"):
        CurriculumOptions(by="level", stages=[{"until": 5, "weights": {}},
                                              {"until": 2, "weights": {}}])
    with pytest.raises(ValueError, match="probability"):
        CurriculumOptions(by="level", stages=[{"weights": {1: 2.0}}])
    with pytest.raises(ValueError, match="low"):
        CurriculumOptions(low=0.9, high=0.1)


# --- dynamic sampling -----------------------------------------------------------------
def test_dynamic_sampling_drops_zero_variance_groups_and_counts():
    ds = DynamicSampling("ds", ["trajectories.raw"], ["trajectories"])
    kept = [o for g in (group("a", [1, 0]), group("b", [1, 1]), group("c", [0, 0]),
                        group("d", [0.5]), group("e", [0.2, 0.7, 0.2]))
            for o in ds.process(inc(g, "trajectories.raw"))]
    assert [o.record.prompt_id for o in kept] == ["a", "e"]
    assert kept[0].topic == "trajectories"
    m = ds.metrics()
    assert m["dynamic_sampling/kept"] == 2 and m["dynamic_sampling/dropped"] == 3


def test_dynamic_sampling_per_policy():
    g = group("m", [1, 0])
    g.sequences += [seq(1.0, "verifier"), seq(1.0, "verifier")]
    g.rewards = [s.reward for s in g.sequences]
    assert informative(g) is g  # the whole group varies
    out = informative(g, per_policy=True)
    assert [s.policy for s in out.sequences] == ["actor", "actor"] and out.rewards == [1, 0]
    assert len(g.sequences) == 4  # not modified in place
    ds = DynamicSampling("ds", ["trajectories.raw"], ["trajectories"],
                         DynamicSamplingOptions(per_policy=True))
    list(ds.process(inc(g, "trajectories.raw")))
    assert ds.metrics()["dynamic_sampling/dropped_sequences"] == 2


# --- down-sampling -----------------------------------------------------------------------
def test_max_variance_indices_keep_the_extremes_that_vary_most():
    import itertools
    import statistics

    from astraflow.dataflow.downsample import max_variance_indices

    # one right answer among many wrong: kept with wrong ones (not the middling ones)
    rewards = [0.0, 0.5, 0.0, 1.2, 0.5, 0.0, 0.0, 0.5]
    idx = max_variance_indices(rewards, 4)
    assert 3 in idx and len(idx) == 4 and idx == sorted(idx)
    # brute force over every subset: nothing varies more
    rng = random.Random(3)
    for _ in range(30):
        rs = [rng.choice([0.0, 0.2, 0.5, 1.0, 1.2]) for _ in range(rng.randint(3, 9))]
        keep = rng.randint(2, 4)
        best = max(statistics.pvariance([rs[i] for i in c])
                   for c in itertools.combinations(range(len(rs)), min(keep, len(rs))))
        got = statistics.pvariance([rs[i] for i in max_variance_indices(rs, keep)])
        assert got == pytest.approx(best), (rs, keep)
    assert max_variance_indices([1.0, 0.0], 4) == [0, 1]  # small groups pass
    assert len(max_variance_indices([0.0] * 6, 2)) == 2  # all equal: any two


def test_downsample_cuts_each_policys_samples_and_counts():
    from astraflow.dataflow.downsample import Downsample, DownsampleOptions

    ds = Downsample("ds", ["trajectories.raw"], ["trajectories"], DownsampleOptions(keep=2))
    g = group("m", [0, 0, 1, 0])
    g.sequences += [seq(1.0, "verifier"), seq(0.0, "verifier"), seq(1.0, "verifier")]
    g.rewards = [s.reward for s in g.sequences]
    (out,) = ds.process(inc(g, "trajectories.raw"))
    got = out.record
    assert [(s.policy, s.reward) for s in got.sequences] == [
        ("actor", 0), ("actor", 1), ("verifier", 0.0), ("verifier", 1.0)]
    assert got.rewards == [s.reward for s in got.sequences] and len(g.sequences) == 7
    small = group("s", [1, 0])
    assert next(iter(ds.process(inc(small, "trajectories.raw")))).record is small
    m = ds.metrics()
    assert m == {"downsample/groups": 2.0, "downsample/cut_groups": 1.0,
                 "downsample/dropped_sequences": 3.0}
    with pytest.raises(ValueError):
        DownsampleOptions(keep=1)


# --- class balance -----------------------------------------------------------------------
def verdicts(truths: str, gid: str = "g1") -> TrajectoryGroup:
    """A verifier group: one verdict per character of ``truths`` (1 right answer, 0 wrong),
    plus two solver sequences that must pass untouched."""
    seqs = [dataclasses.replace(seq(float(i % 2), "verifier"), sample_index=i,
                                meta={"truth": t}) for i, t in enumerate(truths)]
    seqs += [seq(1.0, "solver"), seq(0.0, "solver")]
    return TrajectoryGroup(group_id=gid, prompt_id="p", task_id="t", workflow="solve_verify",
                           source="s", raas_id="r", pool="p", sequences=seqs,
                           rewards=[s.reward for s in seqs])


def test_class_balance_keeps_as_many_of_each_class_as_the_smallest_has():
    from astraflow.dataflow.class_balance import balance

    g = verdicts("11110110")  # six verdicts on right answers, two on wrong ones
    out = balance(g, "verifier")
    mine = [s for s in out.sequences if s.policy == "verifier"]
    assert Counter(s.meta["truth"] for s in mine) == {"1": 2, "0": 2}
    assert [s.policy for s in out.sequences].count("solver") == 2
    assert out.rewards == [s.reward for s in out.sequences]
    assert len(g.sequences) == 10  # not modified in place
    # seeded by the group id: a replay decides the same, another group differently
    again = balance(verdicts("11110110"), "verifier")
    assert [s.sample_index for s in again.sequences] == [s.sample_index for s in out.sequences]
    picks = {tuple(s.sample_index for s in balance(verdicts("11110110", f"g{i}"),
                                                   "verifier").sequences) for i in range(20)}
    assert len(picks) > 1
    assert balance(verdicts("1010"), "verifier") is not None
    # one class only: dropped (the solver's sequences stay) or kept
    only = balance(verdicts("1111"), "verifier")
    assert [s.policy for s in only.sequences] == ["solver", "solver"]
    assert balance(verdicts("1111"), "verifier", single_class="keep").sequences == \
        verdicts("1111").sequences
    bare = verdicts("11")
    bare.sequences = bare.sequences[:2]
    assert balance(bare, "verifier") is None


def test_class_balance_processor_counts_and_drops():
    from astraflow.dataflow.class_balance import ClassBalance, ClassBalanceOptions

    cb = ClassBalance("cb", ["samples.verifier"], ["samples.verifier.balanced"],
                      ClassBalanceOptions(policy="verifier"))
    lone = verdicts("111")
    lone.sequences = lone.sequences[:3]
    out = [o for g in (verdicts("110000"), lone) for o in cb.process(inc(g, "samples.verifier"))]
    assert len(out) == 1 and out[0].topic == "samples.verifier.balanced"
    assert cb.metrics() == {"class_balance/kept_fraction": 4 / 9,
                            "class_balance/dropped_groups": 1.0}
    with pytest.raises(ValueError):
        ClassBalanceOptions(policy="verifier", single_class="sometimes")


# --- reward normalisation ---------------------------------------------------------------
def test_normalise_values():
    assert normalise([1, 0, 1, 0], divide_std=False) == [0.5, -0.5, 0.5, -0.5]
    assert normalise([1, 0, 1, 0], eps=0.0) == [1.0, -1.0, 1.0, -1.0]
    assert normalise([3, 3]) == [0.0, 0.0]
    assert normalise([]) == []


def test_reward_norm_writes_rewards_keeps_raw_and_never_mutates():
    g = group("p", [1.0, 0.0, 0.0, 0.0])
    before = g.to_dict()
    rn = RewardNorm("rn", ["trajectories.raw"], ["trajectories"])
    (out,) = rn.process(inc(g, "trajectories.raw"))
    n = out.record
    assert g.to_dict() == before  # input untouched (the runtime would resend its bytes)
    assert n is not g
    assert n.rewards == [s.reward for s in n.sequences]
    assert sum(n.rewards) == pytest.approx(0.0)
    assert n.rewards[0] == pytest.approx(3 ** 0.5, rel=1e-5)  # (1 - .25) / .433
    assert json.loads(n.meta["raw_rewards"]) == [1.0, 0.0, 0.0, 0.0]
    assert n.sequences[0].meta["raw_reward"] == "1.0"
    assert raw_rewards(n) == [1.0, 0.0, 0.0, 0.0]
    twice = normalise_group(n)  # raw rewards survive a second normalisation
    assert raw_rewards(twice) == [1.0, 0.0, 0.0, 0.0]
    assert twice.rewards == pytest.approx(n.rewards, abs=1e-5)
    assert rn.metrics()["reward_norm/normalised"] == 1


def test_reward_norm_per_policy_statistics():
    g = group("p", [1.0, 0.0])
    g.sequences += [seq(5.0, "verifier"), seq(7.0, "verifier")]
    n = normalise_group(g, divide_std=False)
    assert n.rewards == [0.5, -0.5, -1.0, 1.0]
    whole = normalise_group(g, divide_std=False, per_policy=False)
    assert whole.rewards == pytest.approx([-2.25, -3.25, 1.75, 3.75])


def test_reward_norm_leaves_trainer_advantages_unchanged():
    import torch  # a core dependency: its absence fails, not skips

    from astraflow.trainer.loss import group_advantages

    rewards = [1.0, 0.0, 0.5, 0.0, 1.0, 1.0]
    g = normalise_group(group("p", rewards))
    for std in (True, False):
        a_raw = group_advantages([rewards], normalize_std=std)[0]
        a_norm = group_advantages([g.rewards], normalize_std=std)[0]
        if std:
            assert torch.allclose(a_raw, a_norm, atol=1e-5)
        else:  # mean-centred only: advantages are the normalised rewards themselves
            assert torch.allclose(a_norm, torch.tensor(g.rewards, dtype=torch.float32))


# --- rule routing -----------------------------------------------------------------------
def test_rule_conditions():
    g = group("p", [1.0, 0.0, 1.0], source="arith-L2", workflow="single_turn",
              versions=[-1, 4, 6], created_at_ms=1000, meta={"split": "train"})
    assert Match().matches(g)
    assert Match(source=["arith-*"]).matches(g) and not Match(source=["gsm8k"]).matches(g)
    assert Match(workflow=["single_*"]).matches(g)
    assert Match(meta={"split": "tr*"}).matches(g) and not Match(meta={"x": "*"}).matches(g)
    assert Match(reward=Range(min=0.6)).matches(g)  # mean 2/3
    assert not Match(reward=Range(min=0.1), reward_of="min").matches(g)
    assert Match(version=Range(min=4, max=6)).matches(g)
    assert not Match(version=Range(min=5)).matches(g)  # a token of version 4
    assert Match(created_at_ms=Range(max=1000)).matches(g)
    assert not Match(created_at_ms=Range(min=1001)).matches(g)
    assert Match(policy=["actor"]).matches(g) and not Match(policy=["critic"]).matches(g)
    t = task("p", source="arith-L2")
    assert Match(source=["arith-*"]).matches(t)
    assert not Match(reward=Range(min=0)).matches(t)  # a task has no rewards


def test_rule_router_first_match_default_and_drop():
    o = RuleRouterOptions(rules=[
        {"output": "trajectories.math", "match": {"source": ["arith-*"]}},
        {"output": "trajectories.good", "match": {"reward": {"min": 0.5}}},
    ], default="trajectories.rest")
    a = group("a", [1, 1], source="arith-L1")
    b = group("b", [1, 1], source="gsm8k")
    c = group("c", [0, 0], source="gsm8k")
    assert route(a, o) == ["trajectories.math"]
    assert route(a, o.model_copy(update={"all_matches": True})) == ["trajectories.math",
                                                                    "trajectories.good"]
    assert route(b, o) == ["trajectories.good"] and route(c, o) == ["trajectories.rest"]
    outs = ["trajectories.math", "trajectories.good", "trajectories.rest"]
    r = RuleRouter("rr", ["trajectories"], outs, o)
    got = [x.topic for g in (a, b, c) for x in r.process(inc(g, "trajectories"))]
    assert got == ["trajectories.math", "trajectories.good", "trajectories.rest"]
    m = r.metrics()
    assert m["rule_router/matched"] == 2 and m["rule_router/defaulted"] == 1
    assert m["rule_router/routed/trajectories.rest"] == 1
    dropper = RuleRouter("rr", ["trajectories"], outs[:2],
                         o.model_copy(update={"default": None}))
    assert list(dropper.process(inc(c, "trajectories"))) == []
    assert dropper.metrics()["rule_router/dropped"] == 1
    with pytest.raises(ValueError, match="trajectories.rest"):
        RuleRouter("rr", ["trajectories"], outs[:2], o)


# --- mixer ------------------------------------------------------------------------------
def test_ratio_mixer_keeps_ratios_when_both_sources_flow():
    mix = RatioMixer({"a": 3, "b": 1})
    for i in range(40):
        mix.add("a", f"a{i}", 0)
        mix.add("b", f"b{i}", 0)
    out = [k for k, _ in mix.take(0)]
    head = out[:32]
    assert Counter(head) == {"a": 24, "b": 8}
    for i in range(0, 32, 4):  # every window of four is three a's and one b
        assert Counter(head[i:i + 4]) == {"a": 3, "b": 1}
    # a ran out: b got its 14 (one per three a's, and the first), the rest of b waits
    assert Counter(out) == {"a": 40, "b": 14}
    assert mix.held == 26 == mix.counts["b"] and mix.forced == 0


def test_ratio_mixer_waits_then_releases_at_the_bounds():
    mix = RatioMixer({"a": 1, "b": 1}, max_held=5, max_hold_ms=1000)
    for i in range(5):
        mix.add("a", f"a{i}", now=0)
    assert [x for _, x in mix.take(0)] == ["a0"]  # b is due and has nothing: hold the rest
    assert mix.take(500) == []
    mix.add("a", "a5", now=600)
    mix.add("a", "a6", now=600)  # 6 held > max_held 5: one forced out
    assert [x for _, x in mix.take(600)] == ["a1"] and mix.forced == 1
    assert [x for _, x in mix.take(1000)] == ["a2", "a3", "a4"]  # held since 0: too long
    # b was starved: it is not owed a burst once it comes back
    for i in range(4):
        mix.add("b", f"b{i}", now=1000)
    out = [k for k, _ in mix.take(1000)]
    assert out[:4] in (["b", "a", "b", "a"], ["a", "b", "a", "b"])


def test_ratio_mixer_releases_each_lane_in_order():
    """Sources sharing a partition: nothing leaves ahead of an older record of its lane."""
    mix = RatioMixer({"a": 1, "b": 1})
    order = ["b", "b", "a", "b", "a", "a"]
    for off, key in enumerate(order):
        mix.add(key, (0, off), 0, lane=0)
    out = mix.take(0)
    offsets = [x[1] for _, x in out]
    assert offsets == sorted(offsets)  # commit-safe: a prefix of the partition leaves
    assert len(out) == 6 and mix.unblocked >= 1


def test_mixer_processor_by_source_with_unlisted_and_held_offsets():
    m = Mixer("mix", ["tasks.source", "tasks.extra"], ["tasks"],
              MixerOptions(by="source", ratios={"x": 1, "y": 2}, unlisted="pass"))
    recs = [("tasks.source", 0, 0, "x"), ("tasks.source", 0, 1, "x"),
            ("tasks.source", 0, 2, "other"), ("tasks.extra", 1, 0, "y")]
    for topic, part, off, src in recs:
        assert list(m.process(inc(task(f"{src}{off}", source=src), topic, part, off))) == []
    assert m.held_offsets() == {("tasks.source", 0): 0, ("tasks.extra", 1): 0}
    out = list(m.flush(0))
    assert [o.record.source for o in out] == ["x", "y"]  # x1 waits for another y
    assert m.held_offsets() == {("tasks.source", 0): 1}  # "other" stays behind x1
    m.on_revoke([("tasks.source", 0)])
    assert m.held_offsets() == {} and m.mix.held == 0
    assert m.metrics()["mixer/emitted/x"] == 1 and m.metrics()["mixer/unlisted_passed"] == 1
    dropper = Mixer("mix", ["tasks.source"], ["tasks"],
                    MixerOptions(by="source", ratios={"x": 1}, unlisted="drop"))
    dropper.process(inc(task("o", source="other")))
    assert dropper.metrics()["mixer/unlisted_dropped"] == 1 and dropper.mix.held == 0


def test_mixer_options_reject_non_positive_ratios():
    with pytest.raises(ValueError, match="positive"):
        MixerOptions(ratios={"a": 0})


# --- composition in a topology ------------------------------------------------------------
def test_topology_chains_post_rollout_processors_through_intermediate_topics():
    topo = parse_topology({
        "run": "r",
        "topics": {"tasks.source": {}, "tasks.extra": {}, "tasks.mixed": {}, "tasks": {},
                   "trajectories.raw": {}, "trajectories.sampled": {},
                   "trajectories.normed": {}, "trajectories": {}, "weights.actor": {}},
        "processors": {
            "mix": {"kind": "mixer", "inputs": ["tasks.source", "tasks.extra"],
                    "outputs": ["tasks.mixed"],
                    "options": {"ratios": {"tasks.source": 3, "tasks.extra": 1}}},
            "greso": {"kind": "greso", "inputs": ["tasks.mixed"], "outputs": ["tasks"],
                      "options": {"target_easy_ratio": 0.2}},
            "ds": {"kind": "dynamic_sampling", "inputs": ["trajectories.raw"],
                   "outputs": ["trajectories.sampled"]},
            "norm": {"kind": "reward_norm", "inputs": ["trajectories.sampled"],
                     "outputs": ["trajectories.normed"]},
            "stale": {"kind": "staleness_filter", "inputs": ["trajectories.normed"],
                      "outputs": ["trajectories"]},
        }})
    assert topo.topic("trajectories.sampled").schema_type is TrajectoryGroup
    assert topo.topic("tasks.mixed").schema_type is Task
    with pytest.raises(TopologyError, match="processors.g.options.bogus"):
        parse_topology({"run": "r", "topics": {"tasks.source": {}, "tasks": {}},
                        "processors": {"g": {"kind": "greso", "inputs": ["tasks.source"],
                                             "outputs": ["tasks"], "options": {"bogus": 1}}}})
