"""Loading the Avro schemas of ``schemas/*.avsc`` and earlier versions of them.

Schemas reference each other by full name (``astraflow.Sequence``). ``SchemaSet`` resolves
those references, keeps every known writer schema by its CRC-64-AVRO fingerprint (current
ones and those under ``schemas/history/``) and gives the current reader schema per name.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastavro import parse_schema
from fastavro.schema import fingerprint, to_parsing_canonical_form

PRIMITIVES = {"null", "boolean", "int", "long", "float", "double", "bytes", "string"}


class SchemaError(Exception):
    """A schema file is missing, malformed or references an unknown type."""


def default_schema_dir() -> Path:
    """``$ASTRAFLOW_SCHEMAS``, else ``schemas/`` next to the package (source checkout)."""
    env = os.environ.get("ASTRAFLOW_SCHEMAS")
    if env:
        return Path(env)
    package = Path(__file__).resolve().parents[1]  # astraflow/ (this is astraflow/wire/)
    for candidate in (package.parent / "schemas", package / "_schemas"):
        if candidate.is_dir():
            return candidate
    raise SchemaError(
        "cannot find the Avro schemas: set ASTRAFLOW_SCHEMAS to the repository's schemas/ folder"
    )


@dataclass(frozen=True)
class WriterSchema:
    name: str
    fingerprint: bytes  # 8 bytes, little-endian CRC-64-AVRO
    expanded: dict[str, Any]  # self-contained: every named type defined inline
    parsed: Any  # fastavro parsed form, with the hints that spare fastavro parsing it per call


def _named_refs(node: Any, out: set[str]) -> None:
    if isinstance(node, str):
        if node not in PRIMITIVES:
            out.add(node)
    elif isinstance(node, list):
        for n in node:
            _named_refs(n, out)
    elif isinstance(node, dict):
        t = node.get("type")
        if t in ("record", "error"):
            for f in node["fields"]:
                _named_refs(f["type"], out)
        elif t == "array":
            _named_refs(node["items"], out)
        elif t == "map":
            _named_refs(node["values"], out)
        elif t in ("enum", "fixed"):
            pass
        else:
            _named_refs(t, out)


def _full_name(schema: dict[str, Any]) -> str:
    name = schema["name"]
    if "." in name:
        return name
    ns = schema.get("namespace")
    return f"{ns}.{name}" if ns else name


def expand(schema: dict[str, Any], named: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Inline every referenced named type (its first use defines it, later uses name it)."""
    seen: set[str] = set()

    def walk(node: Any) -> Any:
        if isinstance(node, str):
            if node in PRIMITIVES:
                return node
            if node in seen:
                return node
            if node not in named:
                raise SchemaError(f"unknown type {node!r}")
            return walk(copy.deepcopy(named[node]))
        if isinstance(node, list):
            return [walk(n) for n in node]
        if isinstance(node, dict):
            t = node.get("type")
            if t in ("record", "error", "enum", "fixed"):
                seen.add(_full_name(node))
            if t in ("record", "error"):
                node = dict(node)
                node["fields"] = [dict(f, type=walk(f["type"])) for f in node["fields"]]
                return node
            if t == "array":
                return dict(node, items=walk(node["items"]))
            if t == "map":
                return dict(node, values=walk(node["values"]))
            if t in ("enum", "fixed"):
                return node
            return dict(node, type=walk(t))
        return node

    return walk(copy.deepcopy(schema))


def make_writer_schema(expanded: dict[str, Any]) -> WriterSchema:
    canonical = to_parsing_canonical_form(parse_schema(expanded, _write_hint=False, _force=True))
    parsed = parse_schema(expanded, _force=True)
    # fastavro returns the CRC-64-AVRO bytes little-endian, as the single-object header wants
    fp = bytes.fromhex(fingerprint(canonical, "CRC-64-AVRO"))
    return WriterSchema(_full_name(expanded), fp, expanded, parsed)


def _read_files(folder: Path) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for path in sorted(folder.glob("*.avsc")):
        try:
            schema = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise SchemaError(f"{path}: not valid JSON: {e}") from e
        if not isinstance(schema, dict) or "name" not in schema:
            raise SchemaError(f"{path}: expected a named record schema")
        out[_full_name(schema)] = schema
    return out


class SchemaSet:
    """Current reader schemas by name and every known writer schema by fingerprint."""

    def __init__(self, folder: Path | str | None = None):
        self.folder = Path(folder) if folder else default_schema_dir()
        if not self.folder.is_dir():
            raise SchemaError(f"schema folder {self.folder} does not exist")
        self.named = _read_files(self.folder)
        if not self.named:
            raise SchemaError(f"no *.avsc files in {self.folder}")
        self.current: dict[str, WriterSchema] = {}
        self.by_fingerprint: dict[bytes, WriterSchema] = {}
        for name, schema in self.named.items():
            ws = make_writer_schema(expand(schema, self.named))
            self.current[name] = ws
            self.by_fingerprint[ws.fingerprint] = ws
        history = self.folder / "history"
        if history.is_dir():
            for path in sorted(history.glob("*.avsc")):
                self.add_writer_schema(json.loads(path.read_text()))

    def add_writer_schema(self, schema: dict[str, Any]) -> WriterSchema:
        """Register an earlier (or foreign) version so records written with it decode."""
        ws = make_writer_schema(expand(schema, self.named))
        self.by_fingerprint.setdefault(ws.fingerprint, ws)
        return ws

    def reader(self, name: str) -> WriterSchema:
        full = name if "." in name else f"astraflow.{name}"
        try:
            return self.current[full]
        except KeyError:
            raise SchemaError(f"no schema named {full!r} in {self.folder}") from None


def history_file(ws: WriterSchema) -> str:
    """The name a writer schema has under ``schemas/history/``."""
    return f"{ws.name.rsplit('.', 1)[-1]}.{ws.fingerprint.hex()}.avsc"


def snapshot_history(folder: Path | str | None = None) -> list[Path]:
    """Copy every current schema, expanded (nested records inlined: the exact writer
    schema), to ``folder/history`` unless that version is there already; the files
    written. Run it whenever a schema changes, before the change ships:
    ``python3 -c 'from astraflow.wire.schemas import snapshot_history; snapshot_history()'``."""
    schemas = SchemaSet(folder)
    history = schemas.folder / "history"
    history.mkdir(exist_ok=True)
    written = []
    for ws in schemas.current.values():
        path = history / history_file(ws)
        if not path.exists():
            path.write_text(json.dumps(ws.expanded, indent=2) + "\n")
            written.append(path)
    return written
