"""Unpacking a model's files from a tar written by ``pack_model_files``, safely on any
Python.

``tarfile``'s ``filter="data"`` exists only from Python 3.10.12 / 3.11.4 (Debian 12's own
3.11.2 lacks it), and without a filter ``extractall`` trusts the archive. The archive comes
from the weight stream, so it is checked here instead, the same on every Python: only
regular files and directories, each under the destination (no absolute names, no ``..``,
no links, devices or fifos), written with plain modes (0644 files, 0755 directories) and
no owners. Anything else refuses the whole archive before a byte is written. This module
needs the standard library alone (a test runs it under a Python without the filter).
"""

from __future__ import annotations

import io
import os
import shutil
import tarfile
from pathlib import Path, PurePosixPath


class UnsafeArchive(ValueError):
    """A member of a model-files archive that must not be unpacked."""


def _checked_name(member: tarfile.TarInfo) -> PurePosixPath:
    name = PurePosixPath(member.name)
    if name.is_absolute() or not name.parts or ".." in name.parts:
        raise UnsafeArchive(f"model files: refusing member {member.name!r}: its path leaves "
                            "the model directory")
    if not (member.isreg() or member.isdir()):
        raise UnsafeArchive(f"model files: refusing member {member.name!r}: not a regular "
                            "file or directory (a link, device or fifo)")
    return name


def extract_model_files(data: bytes, dest: str | os.PathLike[str]) -> list[Path]:
    """Unpack the tar ``data`` into the directory ``dest``; the files written.
    ``UnsafeArchive`` (nothing written) for a member that is not safe to unpack."""
    root = Path(dest)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        members = [(m, _checked_name(m)) for m in tar.getmembers()]
        written = []
        for member, name in members:
            target = root.joinpath(*name.parts)
            if member.isdir():
                target.mkdir(mode=0o755, parents=True, exist_ok=True)
                continue
            target.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
            src = tar.extractfile(member)
            assert src is not None  # a regular file
            with src, open(target, "wb") as out:
                shutil.copyfileobj(src, out)
            os.chmod(target, 0o644)
            written.append(target)
    return written


__all__ = ["UnsafeArchive", "extract_model_files"]
