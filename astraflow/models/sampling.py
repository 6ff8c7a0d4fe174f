"""The sampling distribution of a policy: temperature and top-p (nucleus), in one place.

The RaaS engines sample from it and record the log-probability of each sampled token under
it; the trainer recomputes the same log-probabilities from its own logits. Both call the
functions here, so the two sides apply the very same transformation:

1. temperature: ``z = logits / T`` (greedy, ``T == 0``, is reported at ``T = 1``);
2. top-p: the nucleus is the smallest set of most likely tokens whose probability under
   ``softmax(z)`` reaches ``top_p`` -- every token whose scaled logit is at least that of
   the last token needed (tokens tied with it are all kept, so the set does not depend on
   how a sort orders ties);
3. the distribution is ``softmax(z)`` renormalised over the nucleus; tokens outside it
   have probability 0.

``top_p == 1`` skips step 2 (the plain tempered softmax). The nucleus is taken on each
side's own logits: the trainer's nucleus is that of the policy it trains, which a token
sampled by an engine may (rarely, near the boundary, or when the weights moved since) fall
outside. Such a token has log-probability ``-inf`` under the trainer's distribution;
``picked_logprobs`` reports ``LOGPROB_FLOOR`` for it instead, so every ratio and loss stays
finite (its importance ratio is then about 0 and it adds no gradient).
"""

from __future__ import annotations

import torch

# what picked_logprobs reports for a token outside the nucleus. Any token inside has a
# renormalised probability of at least (1 - top_p) / vocabulary size (the tokens from it
# down carry more than 1 - top_p between them), far above exp(-50) for any real vocabulary
LOGPROB_FLOOR = -50.0
_ROWS_PER_CHUNK = 1024  # rows sorted at once for the threshold: bounds the peak memory


def check_top_p(top_p: float) -> None:
    """``ValueError`` unless ``0 < top_p <= 1``."""
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")


def nucleus_threshold(z: torch.Tensor, top_p: float) -> torch.Tensor:
    """The smallest scaled logit kept by top-p, per row: shape ``z.shape[:-1] + (1,)``.

    ``z``: scaled logits ``[..., vocab]``; a token is in the nucleus iff its value is
    ``>=`` the row's threshold. Computed without gradient (the set is discrete)."""
    check_top_p(top_p)
    flat = z.detach().reshape(-1, z.shape[-1])
    out = torch.empty((flat.shape[0], 1), dtype=flat.dtype, device=flat.device)
    with torch.no_grad():
        for i in range(0, flat.shape[0], _ROWS_PER_CHUNK):
            rows = flat[i : i + _ROWS_PER_CHUNK]
            ranked = rows.sort(dim=-1, descending=True).values
            cum = torch.softmax(ranked.float(), dim=-1).cumsum(dim=-1)
            # kept: every token before the cumulative mass reaches top_p, and that one
            kept = ((cum < top_p).sum(dim=-1, keepdim=True) + 1).clamp(max=rows.shape[-1])
            out[i : i + _ROWS_PER_CHUNK] = ranked.gather(-1, kept - 1)
    return out.reshape(*z.shape[:-1], 1)


def sampling_logprobs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Log-probabilities ``[..., vocab]`` of the distribution sampled from (see the module
    doc): ``-inf`` outside the nucleus. ``temperature`` 0 means 1 (greedy)."""
    z = logits.float() / (temperature if temperature > 0 else 1.0)
    if top_p < 1:
        z = z.masked_fill(z < nucleus_threshold(z, top_p), float("-inf"))
    return torch.log_softmax(z, dim=-1)


def picked_logprobs(logits: torch.Tensor, target: torch.Tensor, temperature: float,
                    top_p: float, floor: float = LOGPROB_FLOOR) -> torch.Tensor:
    """Log-probability of ``target[...]`` under the sampling distribution of ``logits
    [..., vocab]`` (float32, differentiable); ``floor`` for a target outside the nucleus.

    Only the picked values are formed (no full log-softmax tensor): with ``top_p == 1``
    this is ``z[target] - logsumexp(z)``, as the trainer always computed it."""
    z = logits.float() / (temperature if temperature > 0 else 1.0)
    picked = z.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    if top_p >= 1:
        return picked - torch.logsumexp(z, dim=-1)
    tau = nucleus_threshold(z, top_p)
    lse = torch.logsumexp(z.masked_fill(z < tau, float("-inf")), dim=-1)
    inside = picked.detach() >= tau.squeeze(-1)
    return torch.where(inside, picked - lse, torch.full_like(picked, floor))


__all__ = ["LOGPROB_FLOOR", "check_top_p", "nucleus_threshold", "picked_logprobs",
           "sampling_logprobs"]
