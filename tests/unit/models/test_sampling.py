"""The sampling distribution shared by the engines and the trainer (temperature, top-p),
on hand-made logits: no model, no broker."""

from __future__ import annotations

import math

import pytest
import torch

from astraflow.models.sampling import (
    LOGPROB_FLOOR,
    nucleus_threshold,
    picked_logprobs,
    sampling_logprobs,
)

# probabilities 0.5, 0.25, 0.15, 0.1 at temperature 1
PROBS = [0.5, 0.25, 0.15, 0.1]
LOGITS = torch.tensor([[math.log(p) for p in PROBS]])


def test_the_nucleus_is_the_smallest_prefix_reaching_top_p():
    for top_p, kept in ((0.49, 1), (0.6, 2), (0.74, 2), (0.76, 3), (0.9, 3), (0.95, 4)):
        tau = nucleus_threshold(LOGITS, top_p)
        assert int((LOGITS >= tau).sum()) == kept, top_p
    # tokens tied at the boundary are all kept, whatever a sort does with them
    tied = torch.log(torch.tensor([[0.4, 0.2, 0.2, 0.2]]))
    assert int((tied >= nucleus_threshold(tied, 0.5)).sum()) == 4


def test_sampling_logprobs_renormalise_over_the_nucleus():
    lp = sampling_logprobs(LOGITS, 1.0, 0.8)  # nucleus 0.5 + 0.25 + 0.15 = 0.9
    expected = [math.log(p / 0.9) for p in PROBS[:3]]
    assert torch.allclose(lp[0, :3], torch.tensor(expected), atol=1e-6)
    assert lp[0, 3] == float("-inf")
    t = 0.7  # temperature first, then the nucleus of the tempered distribution
    tempered = torch.softmax(LOGITS[0] / t, dim=-1)
    assert torch.allclose(sampling_logprobs(LOGITS, t, 1.0)[0], tempered.log(), atol=1e-6)
    # greedy (0) is reported at temperature 1
    assert torch.allclose(sampling_logprobs(LOGITS, 0.0, 1.0), torch.log_softmax(LOGITS, -1))


def test_picked_logprobs_match_and_floor_outside_the_nucleus():
    logits = LOGITS.repeat(4, 1).clone().requires_grad_(True)
    target = torch.tensor([0, 1, 2, 3])
    lp = picked_logprobs(logits, target, 1.0, 0.8)
    full = sampling_logprobs(logits.detach(), 1.0, 0.8)
    assert torch.allclose(lp[:3], full[torch.arange(3), target[:3]], atol=1e-6)
    assert lp[3].item() == LOGPROB_FLOOR  # outside: finite, instead of -inf
    lp.sum().backward()
    q = torch.tensor([p / 0.9 for p in PROBS[:3]] + [0.0])
    # d/dz_j of log q_t = [j == t] - q_j over the nucleus; a floored token has no gradient
    for t in range(3):
        assert torch.allclose(logits.grad[t], torch.eye(4)[t] - q, atol=1e-6)
    assert torch.equal(logits.grad[3], torch.zeros(4))
    # top_p 1 is the plain tempered log-softmax
    plain = picked_logprobs(LOGITS, torch.tensor([3]), 2.0, 1.0)
    assert plain.item() == pytest.approx(torch.log_softmax(LOGITS[0] / 2.0, -1)[3].item())


def test_the_threshold_is_the_same_in_chunks_and_batched_shapes():
    torch.manual_seed(0)
    z = torch.randn(3, 1500, 50)  # more rows than one chunk
    tau = nucleus_threshold(z, 0.9)
    assert tau.shape == (3, 1500, 1)
    one = nucleus_threshold(z[2, 1400:1401], 0.9)
    assert torch.equal(tau[2, 1400], one[0])
    with pytest.raises(ValueError, match="top_p"):
        nucleus_threshold(z, 0.0)
