"""The off-policy objectives of the loss registry on hand-computed cases: values and
gradients (by autograd, against closed forms), edge cases. No model, no broker."""

from __future__ import annotations

import math

import pytest
import torch

from astraflow.trainer.loss import (
    BATCH_STATS,
    LOSSES,
    decoupled_ppo_loss,
    get_loss,
    m2_keep_below,
    m2po_batch_cut,
    m2po_loss,
)


def _new(behaviour: torch.Tensor, log_ratio: list[float]) -> torch.Tensor:
    return (behaviour + torch.tensor(log_ratio)).requires_grad_(True)


def test_the_registry_holds_the_three_objectives():
    assert {"clipped_tis", "decoupled_ppo", "m2po"} <= set(LOSSES)
    assert get_loss("decoupled_ppo") is decoupled_ppo_loss and get_loss("m2po") is m2po_loss
    assert BATCH_STATS.get("m2po") is m2po_batch_cut and "decoupled_ppo" not in BATCH_STATS


# --- decoupled PPO --------------------------------------------------------------------------
def test_decoupled_ppo_with_a_proximal_policy_hand_computed():
    # behaviour weight pi_prox/mu and ratio r = pi_theta/pi_prox per token; clip [0.8, 1.28]
    w = [1.0, 0.5, 3.0, 3.0, 0.5, 1.0]  # 3.0 is truncated at tis_cap 2
    r = [1.1, 1.5, 0.5, 1.5, 0.9, 1.0]
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, 2.0, 5.0])
    mask = torch.tensor([1, 1, 1, 1, 1, 0])
    behaviour = torch.full((6,), -2.0)
    prox = behaviour + torch.log(torch.tensor(w))
    new = (prox + torch.log(torch.tensor(r))).requires_grad_(True)
    out = decoupled_ppo_loss(new, behaviour, adv, mask, clip_low=0.2, clip_high=0.28,
                             tis_cap=2.0, logprobs_proximal=prox)
    # inside | high clip | low clip (min picks 0.8*-1) | open side r*A | inside
    objective = [1.0 * 1.1, 0.5 * 1.28, 2.0 * -0.8, 2.0 * -1.5, 0.5 * 0.9 * 2]
    assert out.loss.item() == pytest.approx(-sum(objective) / 5, rel=1e-5)
    out.loss.backward()
    # d/d new_t = -(w_t * A_t * r_t) / N on the unclipped branch, 0 on the clipped one
    grad = [-1.0 * 1 * 1.1, 0.0, 0.0, -2.0 * -1 * 1.5, -0.5 * 2 * 0.9, 0.0]
    assert torch.allclose(new.grad, torch.tensor(grad) / 5, atol=1e-6)
    m = out.metrics
    assert m["clip_frac_high"] == pytest.approx(1 / 5)
    assert m["clip_frac_low"] == pytest.approx(1 / 5)
    assert m["truncated_frac"] == pytest.approx(2 / 5)


def test_decoupled_ppo_in_one_step_is_the_truncated_importance_weighted_gradient():
    """One optimizer step per batch: pi_prox is the current policy, r = 1, the clip never
    binds, and the gradient is -min(pi/mu, cap) * A * grad log pi / N."""
    behaviour = torch.full((4,), -1.0)
    log_w = [math.log(0.5), 0.0, math.log(3.0), math.log(1.5)]
    adv = torch.tensor([1.0, -1.0, 2.0, -3.0])
    mask = torch.ones(4)
    new = _new(behaviour, log_w)
    out = decoupled_ppo_loss(new, behaviour, adv, mask, tis_cap=2.0)
    weights = [0.5, 1.0, 2.0, 1.5]
    assert out.loss.item() == pytest.approx(-sum(w * a for w, a in zip(weights, adv.tolist()))
                                            / 4, rel=1e-5)
    out.loss.backward()
    assert torch.allclose(new.grad, -torch.tensor(weights) * adv / 4, atol=1e-6)
    assert out.metrics["clip_frac"] == 0.0
    # the same as giving the detached current log-probs as the proximal ones
    again = new.detach().clone().requires_grad_(True)
    decoupled_ppo_loss(again, behaviour, adv, mask, tis_cap=2.0,
                       logprobs_proximal=again.detach()).loss.backward()
    assert torch.allclose(again.grad, new.grad)
    with pytest.raises(ValueError, match="tis_cap"):
        decoupled_ppo_loss(new, behaviour, adv, mask, tis_cap=0.0)


def test_decoupled_ppo_masks_the_tokens_over_the_cap_with_tis_mask():
    """tis_mask: the token whose pi/mu (3.0) is above the cap (2.0) gets weight 0, not 2;
    the others keep theirs; the loss still divides by every loss token."""
    behaviour = torch.full((4,), -1.0)
    log_w = [math.log(0.5), 0.0, math.log(3.0), math.log(1.5)]
    adv = torch.tensor([1.0, -1.0, 2.0, -3.0])
    new = _new(behaviour, log_w)
    out = decoupled_ppo_loss(new, behaviour, adv, torch.ones(4), tis_cap=2.0, tis_mask=True)
    weights = [0.5, 1.0, 0.0, 1.5]
    assert out.loss.item() == pytest.approx(-(0.5 * 1 + 1.0 * -1 + 1.5 * -3) / 4, rel=1e-5)
    out.loss.backward()
    assert torch.allclose(new.grad, -torch.tensor(weights) * adv / 4, atol=1e-6)
    assert out.metrics["truncated_frac"] == pytest.approx(1 / 4)


# --- M2PO -------------------------------------------------------------------------------------
def test_m2_cut_masks_the_largest_second_moments_first():
    log_r = torch.tensor([0.0, 0.1, -0.2, 0.5, -1.0])  # (log r)^2: 0 .01 .04 .25 1
    m2 = log_r.double().square().tolist()
    masked = {}
    for tau in (1.0, 0.1, 0.04, 0.01, 0.001):
        cut = m2_keep_below(log_r, tau)
        masked[tau] = [i for i, x in enumerate(m2) if x >= cut]
        kept = [x for x in m2 if x < cut]
        assert sum(kept) / max(len(kept), 1) <= tau
    assert masked == {1.0: [], 0.1: [4], 0.04: [3, 4], 0.01: [2, 3, 4], 0.001: [1, 2, 3, 4]}
    assert m2_keep_below(log_r, 1.0) == math.inf
    assert m2_keep_below(torch.zeros(0), 0.04) == math.inf
    # a tie at the cut is masked as a whole: the kept mean stays within the threshold
    tied = torch.tensor([0.0, 0.1 ** 0.5, -(0.1 ** 0.5)])  # squares 0, .1, .1
    assert m2_keep_below(tied, 0.05) == pytest.approx(0.1)


def test_m2po_gradient_hand_computed():
    behaviour = torch.full((5,), -1.5)
    log_r = [0.0, 0.1, -0.2, 0.5, -1.0]
    adv = torch.tensor([1.0, -2.0, 1.0, 1.0, -1.0])
    mask = torch.ones(5)
    new = _new(behaviour, log_r)
    out = m2po_loss(new, behaviour, adv, mask, m2_threshold=0.04)
    r = [math.exp(x) for x in log_r]
    kept = [1, 1, 1, 0, 0]  # 0.5 and -1.0 masked (see the cut test)
    objective = [k * ri * a for k, ri, a in zip(kept, r, adv.tolist())]
    assert out.loss.item() == pytest.approx(-sum(objective) / 5, rel=1e-5)
    out.loss.backward()
    # unclipped importance-weighted policy gradient on the kept tokens: -r * A / N
    assert torch.allclose(new.grad, -torch.tensor(objective) / 5, atol=1e-6)
    m = out.metrics
    assert m["m2_masked_frac"] == pytest.approx(2 / 5)
    assert m["m2"] == pytest.approx(sum(x * x for x in log_r) / 5, rel=1e-5)
    # no clip: a kept ratio far from 1 keeps its full weight
    wide = _new(torch.zeros(2), [0.15, -0.15])
    m2po_loss(wide, torch.zeros(2), torch.tensor([1.0, 1.0]), torch.ones(2),
              m2_threshold=0.04).loss.backward()
    assert torch.allclose(wide.grad, -torch.tensor([math.exp(0.15), math.exp(-0.15)]) / 2)


def test_m2po_masks_stale_tokens_most_stale_first():
    """Tokens generated k versions ago drifted further: |log r| grows with k. Lowering the
    threshold masks the stalest first, and never a fresher token before a staler one."""
    staleness = [0, 0, 1, 2, 4, 8, 16, 16]
    log_r = torch.tensor([0.02 * s * (-1) ** i for i, s in enumerate(staleness)])
    behaviour = torch.full((8,), -2.0)
    adv = torch.ones(8)
    masked_before = 0
    for tau in (1.0, 0.05, 0.01, 0.002, 0.0004, 1e-6):
        out = m2po_loss(_new(behaviour, log_r.tolist()), behaviour, adv, torch.ones(8),
                        m2_threshold=tau)
        n_masked = round(out.metrics["m2_masked_frac"] * 8)
        cut = m2_keep_below(log_r, tau)
        m2 = log_r.double().square().tolist()
        masked = [s for s, x in zip(staleness, m2) if x >= cut]
        kept = [s for s, x in zip(staleness, m2) if x < cut]
        assert len(masked) == n_masked >= masked_before
        assert not kept or not masked or min(masked) > max(kept)
        masked_before = n_masked
    assert masked_before == 6  # in the end only the fresh tokens (log r = 0) are left


def test_m2po_all_masked_and_mask_zeros():
    behaviour = torch.full((3,), -1.0)
    # every token beyond the threshold: all masked, loss 0, no gradient, nothing NaN
    new = _new(behaviour, [0.5, -0.6, 0.0])
    mask = torch.tensor([1, 1, 0])
    out = m2po_loss(new, behaviour, torch.tensor([1.0, -1.0, 3.0]), mask, m2_threshold=0.04)
    out.loss.backward()
    assert out.loss.item() == 0.0 and torch.equal(new.grad, torch.zeros(3))
    assert out.metrics["m2_masked_frac"] == 1.0
    # masked-out positions (padding) may hold anything: they neither enter the cut nor exp()
    garbage = torch.tensor([0.0, 0.0, 0.0])
    behaviour_pad = torch.tensor([-1.0, -1.0, -1000.0])
    new = (behaviour_pad * torch.tensor([1.0, 1.0, 0.0]) + garbage).requires_grad_(True)
    out = m2po_loss(new, behaviour_pad, torch.tensor([1.0, -1.0, 1.0]), mask)
    out.loss.backward()
    assert out.metrics["m2_masked_frac"] == 0.0 and torch.isfinite(new.grad).all()
    assert new.grad[2] == 0.0
    # no loss token at all
    empty = m2po_loss(new, behaviour_pad, torch.ones(3), torch.zeros(3))
    assert empty.loss.item() == 0.0 and empty.tokens == 0
    assert empty.metrics["m2_masked_frac"] == 0.0


def test_m2po_cut_of_the_whole_batch_makes_micro_batches_exact():
    """The trainer passes the batch's cut to every micro-batch: their gradients sum to the
    one of a single call over all tokens (which takes the cut over its own tokens)."""
    torch.manual_seed(3)
    behaviour = -torch.rand(2, 6) * 3
    # fresh tokens in the first sequence, stale ones (further from mu) in the second
    log_r = torch.randn(2, 6) * torch.tensor([[0.01], [0.3]])
    adv = torch.tensor([[1.0], [-0.5]])
    mask = torch.ones(2, 6)
    mask[1, :2] = 0
    whole = (behaviour + log_r).requires_grad_(True)
    m2po_loss(whole, behaviour, adv, mask, m2_threshold=0.03).loss.backward()
    stats = m2po_batch_cut((whole - behaviour).detach()[mask > 0], m2_threshold=0.03)
    parts = (behaviour + log_r).requires_grad_(True)
    for i in range(2):
        out = m2po_loss(parts[i], behaviour[i], adv[i], mask[i], m2_threshold=0.03,
                        num_tokens=int(mask.sum()), **stats)
        out.loss.backward()
    assert torch.allclose(parts.grad, whole.grad, atol=1e-7)
    alone = (behaviour + log_r).requires_grad_(True)  # per-call cuts differ from the batch's
    for i in range(2):
        m2po_loss(alone[i], behaviour[i], adv[i], mask[i], m2_threshold=0.03,
                  num_tokens=int(mask.sum())).loss.backward()
    assert not torch.allclose(alone.grad, whole.grad, atol=1e-7)
    with pytest.raises(ValueError, match="m2_threshold"):
        m2po_loss(whole, behaviour, adv, mask, m2_threshold=0.0)
