"""Payload <-> ``Task`` record helpers shared by every task source."""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Mapping
from typing import Any

from astraflow.wire.records import Task


def prompt_id(prompt: str) -> str:
    """Stable id of a prompt: the first 16 hex digits of its SHA-256."""
    return hashlib.sha256(prompt.encode("utf-8")).hexdigest()[:16]


def make_task(
    payload: Mapping[str, Any],
    *,
    policy: str = "actor",
    policies: list[str] | None = None,
    source: str | None = None,
    workflow: str = "single_turn",
    task_id: str | None = None,
    meta: Mapping[str, str] | None = None,
) -> Task:
    """A ``Task`` record for ``payload`` (needs ``prompt`` and ``answer``).

    ``source`` defaults to ``payload["source"]``, else ``arith-L{level}``. ``task_id``
    defaults to a random id (one prompt may be fed many times; the prompt id stays the same).
    """
    if "prompt" not in payload or "answer" not in payload:
        raise ValueError("a task payload needs 'prompt' and 'answer'")
    prompt = str(payload["prompt"])
    level = int(payload.get("level", 0))
    if source is None:
        source = str(payload.get("source") or f"arith-L{level}")
    pid = str(payload.get("prompt_id") or prompt_id(prompt))
    m = {"level": str(level)}
    if meta:
        m.update({str(k): str(v) for k, v in meta.items()})
    return Task(
        task_id=task_id or f"{pid}-{uuid.uuid4().hex[:12]}",
        prompt_id=pid,
        workflow=workflow,
        payload=json.dumps(dict(payload), sort_keys=True, ensure_ascii=False),
        source=source,
        policies=list(policies) if policies else [policy],
        meta=m,
    )


def payload_of(task: Task | Mapping[str, Any] | str) -> dict[str, Any]:
    """The payload dict of a ``Task``, a payload dict, or a payload JSON string."""
    if isinstance(task, Task):
        return json.loads(task.payload)
    if isinstance(task, str):
        return json.loads(task)
    return dict(task)


def task_from_payload(payload: Mapping[str, Any], **kwargs: Any) -> Task:
    """Alias of ``make_task`` (kept for symmetry with ``payload_of``)."""
    return make_task(payload, **kwargs)
