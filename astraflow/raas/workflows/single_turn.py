"""``single_turn``: one prompt, ``n`` samples, each scored."""

from __future__ import annotations

from typing import Any

from astraflow.config.options import SingleTurnOptions
from astraflow.raas.engine import Engine
from astraflow.raas.workflows.base import Checker
from astraflow.raas.workflows.inputs import prompt_task, sampling_params
from astraflow.raas.workflows.latency import Latency
from astraflow.raas.workflows.registry import register_workflow
from astraflow.raas.workflows.scoring import Scorer
from astraflow.raas.workflows.sequences import SequenceBuilder, prepare_each, unbatched
from astraflow.wire.records import Sequence, Task


@register_workflow("single_turn")
class SingleTurn:
    """One prompt (``payload["prompt"]`` or ``payload["messages"]``, formatted by the
    engine's chat format), ``n`` samples, reward = the ``reward`` spec or the checker.

    Options (``SingleTurnOptions``): the sampling options (``seed``: each sample drawn
    from its own stream of (seed, task id, sample index, weight version)), ``reward`` (a
    name or mapping from ``astraflow.tasks.rewards``), ``env_latency`` (seconds or a
    ``Latency`` mapping: extra delay per rollout, to mimic a slow environment; with
    ``per_task: true`` each task's delay depends on its id alone). ``checker``: a callable
    ``(completion, answer)`` (default ``astraflow.tasks.check_answer``).
    """

    name = "single_turn"
    Options = SingleTurnOptions

    def __init__(self, options: SingleTurnOptions | None = None,
                 checker: Checker | None = None):
        self.options = options = options or SingleTurnOptions()
        self.score = Scorer(options.reward, checker)
        self.env_latency = Latency.from_option(options.env_latency)
        self.sampling = options

    def run(self, task: Task, engines: dict[str, Engine], n: int) -> list[Sequence]:
        return unbatched(self.run_batch([task], engines, n))

    def run_batch(
        self, tasks: list[Task], engines: dict[str, Engine], n: int
    ) -> list[list[Sequence] | Exception]:
        results, ready = prepare_each(tasks, lambda t: prompt_task(t, engines))
        by_engine: dict[int, list[tuple[int, dict[str, Any], Engine, list[int]]]] = {}
        for i, (payload, engine, prompt_ids) in ready:
            by_engine.setdefault(id(engine), []).append((i, payload, engine, prompt_ids))
        for live in by_engine.values():
            engine = live[0][2]
            # keyed by task: with a seed, a task's samples do not depend on its batch
            keys = tuple(tasks[i].task_id for i, *_ in live)
            gens = engine.generate([p for *_, p in live],
                                   sampling_params(self.sampling, engine, n, keys=keys))
            for (i, payload, _, prompt_ids), samples in zip(live, gens):
                out = []
                for j, g in enumerate(samples):
                    b = SequenceBuilder(engine.policy, prompt_ids, j)
                    b.add_generated(g)
                    out.append(b.build(self.score(engine.decode(g.token_ids), payload)))
                results[i] = out
        if self.env_latency is not None and by_engine:
            # the tasks' environments run side by side: the batch waits for the slowest
            self.env_latency.wait_longest(t.task_id for t in tasks)
        return results


__all__ = ["SingleTurn"]
