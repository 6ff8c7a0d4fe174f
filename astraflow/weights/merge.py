"""One version's manifests from a trainer of N processes, merged: each process
publishes its own part (``WeightPublisher`` with ``rows``), and ``merge_parts`` makes of
the N processes' manifests one manifest per kind naming all N blobs. A follower applies
them as one version and refuses a manifest whose parts leave a gap or overlap
(``weights.coverage``).
"""

from __future__ import annotations

from collections.abc import Sequence

from astraflow.weights.manifests import _common_dtype
from astraflow.wire.records import PartitionOffset, TensorInfo, WeightManifest


def merge_parts(per_process: Sequence[Sequence[WeightManifest]]) -> list[WeightManifest]:
    """One manifest per kind from each process's manifests of one version (process
    order): every process's blobs in process order, the full ``tensors`` list (each name
    once), ``num_params``/``num_changed``/``encoded_bytes`` summed, ``sparsity``
    recomputed, ``meta`` merged (the first process's value of a key, the largest
    ``encode_s``/``extract_s``) with ``meta["parts"]`` the number of processes.
    ``trainer_step``, ``created_at_ms`` and each partition's consumed offset are the
    largest; signatures are dropped (sign the merged manifest). ``ValueError`` when the
    processes disagree on policy, version, base version, kinds or a tensor."""
    if not per_process:
        raise ValueError("merge_parts needs the manifests of at least one process")
    kinds = [m.kind for m in per_process[0]]
    if not kinds or len(set(kinds)) != len(kinds):
        raise ValueError(f"process 0 must give one manifest per kind, got {kinds}")
    for i, ms in enumerate(per_process):
        if [m.kind for m in ms] != kinds:
            raise ValueError(f"process {i} gives {[m.kind for m in ms]}, process 0 {kinds}")
    out = []
    for j in range(len(kinds)):
        group = [ms[j] for ms in per_process]
        first = group[0]
        for i, m in enumerate(group):
            got = (m.policy, m.version, m.base_version, m.codec)
            want = (first.policy, first.version, first.base_version, first.codec)
            if got != want:
                raise ValueError(f"process {i}'s {m.kind} manifest is (policy, version, base, "
                                 f"codec) {got}, process 0's {want}")
        tensors = _merge_tensor_infos(group)
        n = sum(m.num_params for m in group)
        changed = sum(m.num_changed for m in group)
        meta: dict[str, str] = {}
        for m in group:
            for k, v in m.meta.items():
                if k in ("encode_s", "extract_s") and k in meta:
                    meta[k] = max(meta[k], v, key=float)
                else:
                    meta.setdefault(k, v)
        meta["parts"] = str(len(group))
        offsets: dict[tuple[str, int], PartitionOffset] = {}
        for m in group:
            for p in m.consumed_offsets:
                cur = offsets.get((p.topic, p.partition))
                if cur is None or p.offset > cur.offset:
                    offsets[(p.topic, p.partition)] = p
        out.append(WeightManifest(
            policy=first.policy,
            version=first.version,
            base_version=first.base_version,
            kind=first.kind,
            dtype=_common_dtype(t.dtype for t in tensors),
            tensors=tensors,
            blobs=[b for m in group for b in m.blobs],
            num_params=n,
            num_changed=changed,
            sparsity=1.0 - changed / n if n else 1.0,
            encoded_bytes=sum(m.encoded_bytes for m in group),
            trainer_step=max(m.trainer_step for m in group),
            consumed_offsets=[offsets[k] for k in sorted(offsets)],
            created_at_ms=max(m.created_at_ms for m in group),
            codec=first.codec,
            meta=meta,
        ))
    return out


def _merge_tensor_infos(group: Sequence[WeightManifest]) -> list[TensorInfo]:
    """Each name once, in an order that keeps every process's order (a name a process
    lacks goes after the names it follows in the process that has it)."""
    order: list[str] = []
    infos: dict[str, TensorInfo] = {}
    for i, m in enumerate(group):
        at = 0
        for t in m.tensors:
            known = infos.get(t.name)
            if known is None:
                infos[t.name] = t
                order.insert(at, t.name)
                at += 1
                continue
            if list(known.shape) != list(t.shape) or known.dtype != t.dtype:
                raise ValueError(f"{t.name} is {known.dtype} {list(known.shape)} in an earlier "
                                 f"process, {t.dtype} {list(t.shape)} in process {i}")
            at = max(at, order.index(t.name) + 1)
    return [infos[name] for name in order]
