"""Weight manifests as values: their identity (``manifest_key``), the dtype a manifest
states for its tensors, and manifests as JSON files (``save_manifest``,
``load_manifests``; what ``astraflow weights`` reads and writes).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

from astraflow.weights.errors import WeightsError
from astraflow.weights.stores.base import blob_id_of
from astraflow.wire.records import WeightManifest

ManifestKey = tuple[int, str, int | None, tuple[str, ...]]


def manifest_key(m: WeightManifest) -> ManifestKey:
    """Identity of a manifest: (version, kind, base version, blob uris)."""
    return (m.version, m.kind, m.base_version, tuple(b.uri for b in m.blobs))


def _common_dtype(dtypes: Iterable[str]) -> str:
    names = set(dtypes)
    return names.pop() if len(names) == 1 else "mixed"


def manifest_to_json(m: WeightManifest) -> str:
    return json.dumps(m.to_dict(), indent=1, sort_keys=True)


def manifest_from_json(text: str) -> WeightManifest:
    try:
        return WeightManifest.from_dict(json.loads(text))
    except (ValueError, TypeError, KeyError) as e:
        raise WeightsError(f"not a WeightManifest JSON document: {e}") from e


def save_manifest(m: WeightManifest, directory: str | os.PathLike[str]) -> Path:
    """Write ``m`` as JSON into ``directory`` (atomically); returns the file's path."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    stem = blob_id_of(m.blobs[0]) if m.blobs else f"{m.policy}.v{m.version:08d}.{m.kind}"
    path = d / f"{stem}.json"
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=d)
    with os.fdopen(fd, "w") as f:
        f.write(manifest_to_json(m))
    os.replace(tmp, path)
    return path


def load_manifests(directory: str | os.PathLike[str]) -> list[WeightManifest]:
    """Every ``*.json`` manifest in ``directory``, by version."""
    out = [manifest_from_json(p.read_text()) for p in sorted(Path(directory).glob("*.json"))]
    return sorted(out, key=lambda m: (m.version, m.kind))
