"""Directories written whole or not at all: work in a temporary sibling, rename at the end.

A model directory that an interrupted command (Ctrl-C, a crash) left half-written would be
picked up by the next run as if it were complete; writing it under a temporary name next to
its destination and renaming it into place once complete means the destination is either
the old directory or the whole new one.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from astraflow.errors import AstraflowError


def check_replaceable(out: Path) -> None:
    """Refuse to replace a directory that holds files but neither a model (config.json)
    nor a record of ours (``astraflow_*.json``): a wrong ``--dir``."""
    if not out.is_dir() or not any(out.iterdir()) or (out / "config.json").is_file():
        return
    if not any(out.glob("astraflow_*.json")):
        raise AstraflowError(f"{out}: exists and holds no model (no config.json); "
                             "not replacing it: pick an empty or new directory")


def replace_dir(tmp: Path, out: Path, force: bool) -> None:
    """Move the finished ``tmp`` to ``out``; an old ``out`` (empty, or with ``force``) goes
    once ``tmp`` is in its place."""
    old: Path | None = None
    if out.is_dir():
        if any(out.iterdir()):
            if not force:
                raise AstraflowError(f"{out}: exists and is not empty; pass --force to replace it")
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            out.rename(old)
        else:
            out.rmdir()
    try:
        tmp.rename(out)
    except BaseException:
        if old is not None:
            old.rename(out)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def staged_dir(out: str | Path, force: bool = True, label: str = "partial") -> Iterator[Path]:
    """A fresh temporary directory next to ``out``; renamed to ``out`` when the block ends
    normally, removed when it raises (``KeyboardInterrupt`` included)."""
    out = Path(out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.{label}-", dir=out.parent))
    try:
        yield tmp
        replace_dir(tmp, out, force)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


__all__ = ["check_replaceable", "replace_dir", "staged_dir"]
