"""One episode's requests as token-exact trajectories.

Every request an agent makes is recorded as the prompt token ids the policy saw (the chat
template's rendering of the messages, or the completion prompt) and the tokens it
sampled, with their log-probs and weight versions. Nothing is re-tokenised: a request
whose prompt starts with all the tokens of an earlier sequence of the same policy
(consecutive turns of one conversation: the earlier prompt, the earlier answer, then the
environment's or tool's message) extends that sequence, its new prompt tokens masked out
(``loss_mask`` 0); a prompt that does not extend any (the template rendered an earlier
answer differently from what was sampled, or the agent started another conversation)
starts a new sequence. The choices of a request with ``n > 1`` branch: the first extends
the conversation's sequence, each other one is a sequence of its own whose tokens before
its answer are masked, so no sampled token is trained twice.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field

from astraflow.raas.engine import Generation
from astraflow.raas.workflows.sequences import SequenceBuilder
from astraflow.wire.records import Sequence


@dataclass
class TrajectoryStats:
    """What stitching did: requests, turns that extended a sequence, sequences started."""

    requests: int = 0
    extended: int = 0
    started: int = 0


@dataclass
class EpisodeTrajectory:
    """The sequences of one episode (sample ``sample_index`` of its task)."""

    sample_index: int
    sequences: list[SequenceBuilder] = field(default_factory=list)
    stats: TrajectoryStats = field(default_factory=TrajectoryStats)

    def record(self, policy: str, prompt_ids: list[int], gens: list[Generation]) -> None:
        """One request of ``policy``: its prompt and its choices (see the module doc)."""
        self.stats.requests += 1
        base = self._extended(policy, prompt_ids)
        for i, g in enumerate(gens):
            if i == 0 and base is not None:
                base.add_external(prompt_ids[len(base.token_ids):])
                base.add_generated(g)
                base.meta["turns"] = str(int(base.meta["turns"]) + 1)
                self.stats.extended += 1
                continue
            b = SequenceBuilder(policy, prompt_ids, self.sample_index)
            b.add_generated(g)
            b.meta["turns"] = "1"  # the requests stitched into it
            self.sequences.append(b)
            self.stats.started += 1

    def _extended(self, policy: str, prompt_ids: list[int]) -> SequenceBuilder | None:
        """The newest sequence of ``policy`` whose tokens begin ``prompt_ids``."""
        for b in reversed(self.sequences):
            n = len(b.token_ids)
            if b.policy == policy and len(prompt_ids) >= n and prompt_ids[:n] == b.token_ids:
                return b
        return None

    @property
    def policies(self) -> list[str]:
        return sorted({b.policy for b in self.sequences})

    def build(self, reward: float | Mapping[str, float],
              meta: Mapping[str, str] | None = None) -> list[Sequence]:
        """The episode's sequences, each with its policy's reward (``reward``: one for all,
        or by policy; a policy it does not name gets 0)."""
        out = []
        for b in self.sequences:
            r = reward.get(b.policy, 0.0) if isinstance(reward, Mapping) else reward
            b = copy.copy(b)
            b.meta = {**b.meta, **dict(meta or {})}
            out.append(b.build(float(r)))
        return out


__all__ = ["EpisodeTrajectory", "TrajectoryStats"]
