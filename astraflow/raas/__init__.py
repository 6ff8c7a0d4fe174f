"""Rollout as a service: engines, workflows and the RaaS node.

``engine``: ``Engine`` protocol, ``SamplingParams``, ``Generation``, ``TorchEngine``.
``workflows``: ``Workflow`` protocol, registry (``register_workflow``, ``make_workflow``),
``single_turn`` and ``tool_calc``. ``calc``: the calculator tool's safe parser.
``node``: ``RaaSNode`` (tasks -> trajectory groups, one transaction per task batch).
``weights_follow``: ``WeightWatcher`` (follows ``weights.<policy>``).

Submodules are imported on use: ``import astraflow.raas`` does not import torch.
"""
