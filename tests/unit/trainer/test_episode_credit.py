"""Credit per episode, without a broker: an agent episode recorded as several sequences
is one member of its group's reward mean and std (``group_unit: episode``, the default),
``group_unit: sequence`` keeps the statistics over sequences, and the sequences of the
other workflows (no ``meta["episode"]``) get the same advantages either way."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from astraflow.raas.agent.trajectory import EPISODE_META, EpisodeTrajectory
from astraflow.raas.engine import Generation
from astraflow.trainer import loss
from astraflow.trainer.loss import group_advantages, unit_advantages
from astraflow.wire.records import Batch, Sequence, TrajectoryGroup

VOCAB = 64


def test_the_meta_key_is_the_one_the_agent_trajectory_writes():
    assert loss.EPISODE_META == EPISODE_META == "episode"


def test_unit_advantages_by_hand():
    # episodes a (recorded as 3 sequences, reward 1), b (0), c (0), d (1)
    rewards = [1.0, 1.0, 1.0, 0.0, 0.0, 1.0]
    units = ["a", "a", "a", "b", "c", "d"]
    # over episodes: [1, 0, 0, 1], mean 0.5, std 0.5: +-1
    adv = unit_advantages(rewards, units, eps=0.0)
    assert adv.tolist() == pytest.approx([1.0, 1.0, 1.0, -1.0, -1.0, 1.0])
    # over sequences (today's numbers): mean 2/3, std sqrt(2)/3
    per_seq = unit_advantages(rewards, list(range(6)), eps=0.0)
    s = math.sqrt(2) / 3
    assert per_seq.tolist() == pytest.approx([(1 - 2 / 3) / s] * 3 + [(-2 / 3) / s] * 2
                                             + [(1 - 2 / 3) / s])
    assert torch.equal(per_seq, group_advantages([rewards], eps=0.0)[0])
    # mean-centred only: the episode mean is 0.5, not the sequence mean 2/3
    assert unit_advantages(rewards, units, normalize_std=False).tolist() == pytest.approx(
        [0.5, 0.5, 0.5, -0.5, -0.5, 0.5])
    # one episode however split: no signal
    assert unit_advantages([1.0, 1.0], ["a", "a"]).tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="2 rewards but 1 unit keys"):
        unit_advantages([1.0, 0.0], ["a"])


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
                      max_position_embeddings=64)
    path = tmp_path_factory.mktemp("tiny-qwen2")
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    return str(path)


def trainer(path: str, unit: str | None = None):
    from astraflow.config.sections import TrainerSpec
    from astraflow.trainer.trainer import Trainer

    cfg = TrainerSpec() if unit is None else TrainerSpec(group_unit=unit)
    return Trainer(path, cfg, policy="actor")


def gen(tokens: list[int]) -> Generation:
    return Generation(prompt_ids=[], token_ids=tokens, logprobs=[-0.5] * len(tokens),
                      finish_reason="stop", versions=[0] * len(tokens))


def agent_group() -> TrajectoryGroup:
    """Four episodes of the agent workflow: episode 0 (reward 1) split three ways (its
    second request's prompt does not extend its first, its third is another
    conversation), episodes 1 and 2 (reward 0) and 3 (reward 1) one sequence each."""
    seqs: list[Sequence] = []
    for j, reward in enumerate([1.0, 0.0, 0.0, 1.0]):
        t = EpisodeTrajectory(sample_index=j)
        t.record("actor", [1, 2, 3], [gen([10, 11])])
        if j == 0:
            t.record("actor", [1, 2, 3, 10, 99, 7], [gen([12])])  # re-rendered: a split
            t.record("actor", [4, 5], [gen([13])])  # another conversation
        else:
            t.record("actor", [1, 2, 3, 10, 11, 7], [gen([12])])  # extends
        seqs += t.build(reward)
    assert [s.sample_index for s in seqs] == [0, 0, 0, 1, 2, 3]
    assert {s.meta[EPISODE_META] for s in seqs} == {"0", "1", "2", "3"}
    return TrajectoryGroup(group_id="g", prompt_id="p", task_id="t", workflow="agent",
                           source="test", raas_id="r", pool="p", sequences=seqs,
                           rewards=[s.reward for s in seqs])


def batch(*groups: TrajectoryGroup) -> Batch:
    return Batch(policy="actor", batch_id="b", groups=list(groups))


def test_a_split_episode_counts_once_in_its_group_statistics(tiny_model):
    """The check of the issue: episode 0's three sequences are one member of the group
    (mean and std over the four episodes' rewards 1, 0, 0, 1), and each gets its
    episode's advantage; group_unit: sequence keeps the numbers over six sequences."""
    group = agent_group()
    rows = trainer(tiny_model)._rows(batch(group))  # the default: episode
    adv = [r.advantage for r in rows]
    expected = group_advantages([[1.0, 0.0, 0.0, 1.0]])[0].tolist()  # +-1 over episodes
    assert adv == pytest.approx([expected[0]] * 3 + expected[1:], abs=1e-6)
    assert adv == pytest.approx([1.0, 1.0, 1.0, -1.0, -1.0, 1.0], abs=1e-5)
    old = [r.advantage for r in trainer(tiny_model, "sequence")._rows(batch(group))]
    assert old == pytest.approx(group_advantages([[1, 1, 1, 0, 0, 1]])[0].tolist(), abs=1e-6)
    assert old[0] == pytest.approx(1 / math.sqrt(2), abs=1e-5)  # not 1: split counts 3x
    assert old[3] == pytest.approx(-math.sqrt(2), abs=1e-5)


def test_other_workflows_sequences_are_their_own_episodes(tiny_model):
    """No meta["episode"]: each sequence is one member whatever its sample index, so
    solve_verify's first answer and retry of one sample (same policy, same index,
    different rewards) and two policies sharing indices keep their numbers."""
    def seq(policy: str, index: int, reward: float, role: str = "") -> Sequence:
        return Sequence(policy=policy, token_ids=[1, 2, 3, 4], loss_mask=[0, 0, 1, 1],
                        logprobs=[0.0, 0.0, -0.5, -0.5], versions=[-1, -1, 0, 0],
                        reward=reward, sample_index=index, finish_reason="stop", role=role,
                        meta={"attempt": "1"})

    seqs = [seq("actor", 0, 0.0, "solver"), seq("actor", 1, 1.0, "solver"),
            seq("actor", 0, 1.0, "retry"), seq("actor", 2, 0.0, "solver"),
            seq("verifier", 0, 1.0), seq("verifier", 1, 0.0)]
    group = TrajectoryGroup(group_id="g", prompt_id="p", task_id="t", workflow="solve_verify",
                            source="test", raas_id="r", pool="p", sequences=seqs,
                            rewards=[s.reward for s in seqs])
    new = [r.advantage for r in trainer(tiny_model)._rows(batch(group))]
    old = [r.advantage for r in trainer(tiny_model, "sequence")._rows(batch(group))]
    assert new == old == pytest.approx(
        group_advantages([[0.0, 1.0, 1.0, 0.0]])[0].tolist(), abs=1e-6)


def test_the_setting_is_declared_once_and_checked(tiny_model):
    from astraflow.config.sections import TrainerSpec

    assert TrainerSpec().group_unit == "episode"
    with pytest.raises(ValidationError, match="group_unit"):
        TrainerSpec(group_unit="turn")
