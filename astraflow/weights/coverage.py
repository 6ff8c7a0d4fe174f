"""Whether the blobs of one version cover a state exactly: every element of every tensor in
exactly one of them (whole tensors or rows of dim 0, ``Rows``), judged from their headers
before anything is read or written (``apply_parts``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from astraflow.weights.bits import StateDict
from astraflow.weights.errors import CorruptBlobError

if TYPE_CHECKING:
    from astraflow.weights.blob import _Header


def check_coverage(headers: list[_Header], state: StateDict) -> None:
    """Every element of every tensor of ``state`` in exactly one of the blobs, judged from
    their headers (whole tensors or rows of dim 0); raises ``CorruptBlobError`` naming
    the first tensor with a gap or an overlap."""
    spans: dict[str, list[tuple[int, int, int]]] = {}
    for i, h in enumerate(headers):
        for spec in h.tensors:
            start, stop, _ = spec.row_span()
            spans.setdefault(spec.name, []).append((start, stop, i))
    for name, t in state.items():
        n = t.shape[0] if t.dim() else 1
        at, last = 0, None
        for start, stop, i in sorted(spans.get(name, [])):
            if start == stop:
                continue
            if start < at:
                raise CorruptBlobError(
                    f"parts overlap: rows {start}..{min(at, stop)} of {name} are in parts "
                    f"{last} and {i}"
                )
            if start > at:
                break
            at, last = stop, i
        if at < n:
            nxt = min((s for s, e, _ in spans.get(name, []) if s >= at and e > s), default=n)
            raise CorruptBlobError(f"no part holds rows {at}..{nxt} of {name} ({n} rows)")


__all__ = [
    "check_coverage",
]
