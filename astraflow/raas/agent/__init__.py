"""Agent programs as rollout workflows (``workflow: agent``).

A user's agent (a command, or a ``module:function``) runs once per episode and talks to an
OpenAI-compatible endpoint that the RaaS node serves on localhost (``server``), answered
by the node's own engines; every request is recorded token for token (``trajectory``) and
the episodes of a task become one ``TrajectoryGroup`` (``astraflow.raas.workflows.agent``).

- ``chat``: chat messages and tools to prompt token ids with the policy's chat template,
  and tool calls parsed back out of generated text;
- ``trajectory``: one episode's requests stitched into token-exact sequences;
- ``server``: the HTTP endpoint (``/v1/chat/completions``, ``/v1/completions``,
  ``/v1/models``, and ``/reward`` to end an episode);
- ``program``: starting the agent program, its limits, its result.
"""
