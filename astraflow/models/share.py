"""A policy's model directory over Kafka, so that only the trainer needs one on disk.

With every full checkpoint the trainer also stores the model's other files (config,
tokenizer, chat template: everything but the weights) as one blob, named in that
manifest's ``meta`` (``model_files_uri``/``_sha256``/``_bytes``). A RaaS node or an
evaluator whose model directory does not exist builds it from the weight stream instead:
those files plus the weights of the newest version it can reach (``fetch_model``). The
engine then follows the stream from that version as usual.
"""

from __future__ import annotations

import io
import logging
import tarfile
import time
from pathlib import Path
from typing import Any

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient
from safetensors.torch import save_file

from astraflow.errors import AstraflowError
from astraflow.kafka.config import KafkaConfig
from astraflow.models.archive import extract_model_files
from astraflow.models.lora import META_KEY as LORA_META
from astraflow.models.staging import staged_dir
from astraflow.weights.errors import WeightsError
from astraflow.wire.records import BlobRef, WeightManifest

log = logging.getLogger("astraflow.models.share")

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".index.json")
META = "model_files"


class ModelNotPublished(AstraflowError):
    """No version of the policy carries its model files (yet)."""


def pack_model_files(model_dir: str | Path) -> bytes:
    """The model directory minus its weights, as an uncompressed tar (sorted, no times:
    the same directory gives the same bytes)."""
    root = Path(model_dir)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            rel = path.relative_to(root).as_posix()
            if rel.endswith(WEIGHT_SUFFIXES) or rel.startswith("."):
                continue
            info = tarfile.TarInfo(rel)
            data = path.read_bytes()
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def model_files_meta(store, policy: str, version: int, model_dir: str | Path) -> dict[str, str]:
    """Store the model files of ``model_dir``; the manifest ``meta`` that names them."""
    ref = store.put(f"{policy}.v{version:08d}.model-files", pack_model_files(model_dir))
    return {f"{META}_uri": ref.uri, f"{META}_sha256": ref.sha256,
            f"{META}_bytes": str(ref.bytes)}


def files_ref(m: WeightManifest) -> BlobRef | None:
    if f"{META}_uri" not in m.meta:
        return None
    return BlobRef(uri=m.meta[f"{META}_uri"], bytes=int(m.meta[f"{META}_bytes"]),
                   sha256=m.meta[f"{META}_sha256"])


def fetch_model(config: KafkaConfig, weights_topic: str, policy: str, dest: str | Path,
                wait_s: float = 600.0, version: int | None = None,
                verifier: Any = None) -> Path:
    """Build the model directory ``dest`` from ``weights_topic``: the newest model files and
    the weights of the newest reachable version (or of ``version`` and the newest files up
    to it). Waits up to ``wait_s`` for a trainer to publish its first version. With a
    ``verifier`` (signed weights) only trusted manifests, and the files they name, are used."""
    from astraflow.weights.follower import WeightFollower

    published = _published_manifests(config, weights_topic, policy, wait_s)
    follower = WeightFollower(policy=policy, kafka_config=config, inplace=False,
                              verifier=verifier)
    follower.observe(published)
    manifests = follower.manifests  # the trusted ones
    if any(LORA_META in m.meta for m in manifests):
        raise ModelNotPublished(f"{weights_topic} carries {policy}'s LoRA adapter, not a "
                                f"model: its nodes need the base model directory {dest}")
    if not manifests and follower.refused:
        raise ModelNotPublished(f"every manifest on {weights_topic} was refused: "
                                f"{next(iter(follower.refused.values()))}")
    res = follower.update_reachable() if version is None else follower.update(version)
    with_files = sorted((m for m in manifests if files_ref(m)
                         and (version is None or m.version <= version)),
                        key=lambda m: -m.version)
    for m in with_files:
        try:
            with follower.resolver.open(files_ref(m)) as f:  # checks size and sha256
                data = f.read()
            break
        except Exception as e:  # noqa: BLE001 - pruned or corrupt: an older copy may do
            log.warning("model files of version %d unusable (%s)", m.version, e)
    else:
        raise ModelNotPublished(f"the model files on {weights_topic} are all unusable")
    with staged_dir(dest, label="fetching") as tmp:
        extract_model_files(data, tmp)  # checked: the archive comes off the stream
        save_file({k: v.contiguous() for k, v in follower.state.items()},
                  str(tmp / "model.safetensors"), metadata={"format": "pt"})
    log.info("built %s from %s: model files of version %d, weights of version %d",
             dest, weights_topic, m.version, res.version)
    return Path(dest)


def _published_manifests(config: KafkaConfig, weights_topic: str, policy: str,
                         wait_s: float) -> list[WeightManifest]:
    """The manifests of ``policy`` on ``weights_topic`` (read to its end), once one of them
    carries the model files; ``ModelNotPublished`` after ``wait_s`` without."""
    from astraflow.kafka.table import TopicTable
    from astraflow.weights.manifests import manifest_key

    start = time.monotonic()
    with TopicTable.open(config, weights_topic, WeightManifest, client_id="model-fetch",
                         key=lambda e: manifest_key(e.value) if e.value is not None else None,
                         filter=lambda e: e.value.policy == policy) as table:
        table.catch_up(wait_s)

        def published(t: TopicTable) -> bool:
            return any(files_ref(m) for m in t.values())

        if not published(table):
            log.info("waiting for the trainer of %s to publish its model on %s", policy,
                     weights_topic)
        if not table.wait_until(published, max(0.0, wait_s - (time.monotonic() - start))):
            raise ModelNotPublished(
                f"no model for policy {policy} on {weights_topic} after {wait_s:.0f}s: its "
                "trainer publishes it with version 0")
        return table.values()


_FROM_TOPOLOGY: Any = object()  # ensure_model's verifier: the topology's weight_signing


def ensure_model(path: str | Path, config: KafkaConfig, topology, policy: str,
                 verifier: Any = _FROM_TOPOLOGY) -> Path:
    """``path`` when it holds a model; else the model fetched there from the policy's
    weight stream (``fetch_model``), using only manifests ``verifier`` trusts (default:
    the topology's ``weight_signing``; None: every manifest)."""
    p = Path(path)
    if (p / "config.json").is_file():
        return p
    topic = f"weights.{policy}"
    if topology is None or topic not in topology.topics:
        return p  # nothing to fetch from: the caller's check names the missing directory
    full = topology.full_name(topic)
    log.info("no model at %s: fetching policy %s's model from %s", p, policy, full)
    try:
        config = config.effective()
        md = AdminClient(config.admin_conf()).list_topics(full, timeout=5).topics.get(full)
        if md is None or md.error is not None:
            raise ModelNotPublished(f"no topic {full}")
        from astraflow.weights.signing import verifier_from

        if verifier is _FROM_TOPOLOGY:
            verifier = verifier_from(topology.weight_signing)
        return fetch_model(config, full, policy, p, verifier=verifier)
    except (KafkaException, ModelNotPublished, WeightsError) as e:
        from astraflow.models.errors import ModelError

        raise ModelError(f"{p}: no such model directory, and none could be fetched from "
                         f"{full} ({e})") from e


__all__ = ["ModelNotPublished", "ensure_model", "fetch_model", "files_ref", "model_files_meta",
           "pack_model_files"]
