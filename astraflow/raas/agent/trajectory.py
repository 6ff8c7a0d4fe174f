"""One episode's requests as token-exact trajectories.

Every request an agent makes is recorded as the prompt token ids the policy saw (the chat
template's rendering of the messages, or the completion prompt) and the tokens it
sampled, with their log-probs and weight versions. Nothing is re-tokenised: a request
whose prompt starts with all the tokens of an earlier sequence of the same policy
(consecutive turns of one conversation: the earlier prompt, the earlier answer, then the
environment's or tool's message) extends that sequence, its new prompt tokens masked out
(``loss_mask`` 0); a prompt that does not extend any (the agent started another
conversation, or edited the history it sends) starts a new sequence. The choices of a
request with ``n > 1`` branch: the first extends the conversation's sequence, each other
one is a sequence of its own whose tokens before its answer are masked, so no sampled
token is trained twice.

A chat request's prompt (``chat_prompt``) continues the conversation as it was sampled:
the episode remembers each assistant message the endpoint returned with the tokens of its
prompt and answer (``remember``), and a request whose messages begin with such a
conversation (the earlier request's messages, then that assistant message as the client
sends it back, compared as ``chat.check_messages`` reads them) is those tokens followed
by the template's rendering of the new messages (``chat.render_after``). So an answer is
rendered back exactly as sampled, whatever the client or the template would make of it,
and the turns of one conversation stay one sequence. A history that matches no returned
answer is rendered whole (``chat.render``).

Every sequence names its episode in ``meta["episode"]`` (its sample index): with the
trainer's ``group_unit: episode`` the sequences of one episode are one member of its
group's statistics (``astraflow.trainer.loss.unit_advantages``).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from astraflow.models.chat import ChatFormat
from astraflow.raas.agent.chat import MessageError, check_messages, render, render_after
from astraflow.raas.engine import Generation
from astraflow.raas.workflows.sequences import SequenceBuilder
from astraflow.wire.records import Sequence


@dataclass
class TrajectoryStats:
    """What stitching did: requests, turns that extended a sequence, sequences started."""

    requests: int = 0
    extended: int = 0
    started: int = 0
    # chat requests whose history began with an answer as sampled (``chat_prompt``)
    continued: int = 0


# the Sequence.meta key naming a sequence's episode (astraflow.trainer.loss.EPISODE_META)
EPISODE_META = "episode"


@dataclass
class _Answered:
    """A conversation the policy answered: the request's messages and the assistant
    message the endpoint returned (as ``check_messages`` reads them), with the tools it
    was offered, and the ids of the prompt and of the sampled answer."""

    policy: str
    tools: list[dict[str, Any]] | None
    messages: list[dict[str, Any]]
    token_ids: list[int]


@dataclass
class EpisodeTrajectory:
    """The sequences of one episode (sample ``sample_index`` of its task)."""

    sample_index: int
    sequences: list[SequenceBuilder] = field(default_factory=list)
    stats: TrajectoryStats = field(default_factory=TrajectoryStats)
    answered: list[_Answered] = field(default_factory=list)

    def chat_prompt(self, policy: str, tokenizer: Any, chat: ChatFormat,
                    messages: list[dict[str, Any]],
                    tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The prompt ids of a chat request of ``policy`` (``messages`` and ``tools``
        checked): the longest conversation this episode answered that the messages begin
        with, as sampled, then the rest rendered (module doc); else all of it rendered."""
        best: _Answered | None = None
        for a in list(self.answered):  # a copy: a concurrent request may append
            n = len(a.messages)
            if (a.policy == policy and a.tools == tools and n <= len(messages)
                    and (best is None or n > len(best.messages)) and messages[:n] == a.messages):
                best = a
        if best is not None:
            ids = render_after(tokenizer, chat, best.token_ids, len(best.messages), messages,
                               tools)
            if ids is not None:
                self.stats.continued += 1
                return ids
        return render(tokenizer, chat, messages, tools)

    def remember(self, policy: str, messages: list[dict[str, Any]],
                 tools: list[dict[str, Any]] | None, prompt_ids: list[int],
                 gens: list[Generation], replies: list[Mapping[str, Any]]) -> None:
        """A chat request of ``policy`` and the assistant message returned for each of its
        choices (``replies``, in the order of ``gens``): what ``chat_prompt`` continues."""
        for g, reply in zip(gens, replies):
            try:
                (said,) = check_messages([reply])
            except MessageError:  # not a message a client could send back
                continue
            self.answered.append(_Answered(policy, tools, [*messages, said],
                                           [*prompt_ids, *g.token_ids]))

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
            b.meta = {**b.meta, **dict(meta or {}), EPISODE_META: str(self.sample_index)}
            out.append(b.build(float(r)))
        return out


__all__ = ["EPISODE_META", "EpisodeTrajectory", "TrajectoryStats"]
