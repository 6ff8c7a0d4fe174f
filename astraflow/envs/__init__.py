"""Example environments written against the ecosystems' own APIs, on local data.

``verifiers_examples``: verifiers single-turn, multi-turn and tool environments
(``SingleTurnEnv``, ``MultiTurnEnv``, ``ToolEnv`` with a ``Rubric``) on a local dataset;
``openenv_arith``: an OpenEnv environment server (its ``Environment`` and ``create_app``)
that poses arithmetic problems and scores the answer. The docs' one-command examples and
the tests train them; nothing here is downloaded.
"""
