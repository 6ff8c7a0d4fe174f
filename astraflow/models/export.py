"""A published version of a policy as a Hugging Face model directory (``model export``).

The weights of version N are rebuilt from ``weights.<policy>`` (the cheapest chain of
full checkpoints and deltas, every blob checked against its sha256, signatures too when
the run signs its weights) and written next to the model's other files: its config,
tokenizer, chat template and generation config, taken from the policy's model directory
or, when that is absent, from the model files the trainer publishes with its full
checkpoints.

A LoRA policy's version is its adapter (``astraflow.models.lora``): exported in peft's
format (``adapter_config.json``, ``adapter_model.safetensors``, loadable with
``PeftModel.from_pretrained`` over the base model) with the tokenizer beside it, or with
``merge`` added into the base's weights (``W + alpha/rank * B @ A`` in fp32, stored in the
base's dtype) as a plain model directory.

A version whose blobs were pruned cannot be rebuilt: the export is refused, naming the
newest version that can.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from astraflow.config.lora import LoraSpec
from astraflow.errors import AstraflowError
from astraflow.kafka.config import KafkaConfig
from astraflow.models import lora as lora_mod
from astraflow.models.share import WEIGHT_SUFFIXES, fetch_model
from astraflow.models.staging import staged_dir
from astraflow.weights.errors import NoPlanError, WeightsError
from astraflow.wire.records import WeightManifest

EXPORT_RECORD = "astraflow_export.json"


class ExportError(AstraflowError):
    """A version that cannot be exported, with the reason (and what can be)."""


@dataclass
class Exported:
    """What ``export_version`` wrote: the directory, the version, its kind ("model",
    "adapter" or "merged") and the weights' bytes."""

    path: Path
    version: int
    kind: str
    weight_bytes: int


def published(config: KafkaConfig, topic: str, policy: str,
              verifier: Any = None) -> tuple[Any, list[WeightManifest]]:
    """A ``WeightFollower`` that has observed the policy's trusted manifests on ``topic``
    (not yet updated), and those manifests; ``ExportError`` when there are none."""
    from astraflow.weights.follower import WeightFollower
    from astraflow.weights.stores.kafka import read_manifests

    follower = WeightFollower(policy=policy, kafka_config=config, inplace=False,
                              verifier=verifier)
    follower.observe([m for m in read_manifests(config, topic) if m.policy == policy])
    manifests = follower.manifests
    if not manifests:
        why = (f"every manifest was refused: {next(iter(follower.refused.values()))}"
               if follower.refused else "nothing is published there")
        raise ExportError(f"{topic}: no version of {policy} to export ({why})")
    return follower, manifests


def rebuild(follower: Any, version: int | None, topic: str) -> tuple[int, dict]:
    """``(version, state)``: the weights of ``version`` (default: the newest published),
    or ``ExportError`` naming the newest version that can be rebuilt when its blobs are
    gone."""
    newest = follower.latest_version
    target = newest if version is None else version
    if target > newest or not any(m.version == target for m in follower.manifests):
        raise ExportError(f"{topic}: no version {target} (published: 0..{newest})")
    try:
        follower.update(target)
    except (NoPlanError, WeightsError) as e:
        raise ExportError(f"{topic}: version {target} cannot be rebuilt, its blobs were "
                          f"pruned or are unusable ({e}); the newest exportable version is "
                          f"{_newest_exportable(follower)}") from None
    return target, follower.state


def _newest_exportable(follower: Any) -> str:
    try:
        result = follower.update_reachable()
    except (NoPlanError, WeightsError):
        return "none"
    return str(result.version) if result.version is not None else "none"


def export_version(config: KafkaConfig, topic: str, policy: str, model_dir: str | Path,
                   dest: str | Path, *, version: int | None = None, merge: bool = False,
                   verifier: Any = None) -> Exported:
    """Write ``policy``'s ``version`` (default: the newest) from ``topic`` to ``dest`` as a
    Hugging Face directory (module docstring); ``model_dir``: the policy's model directory
    (the base of a LoRA policy; for a full-weight policy only its files are used, from the
    stream when it is absent)."""
    follower, manifests = published(config, topic, policy, verifier)
    settings = lora_mod.settings_of(max(manifests, key=lambda m: m.version).meta)
    if settings is None and merge:
        raise ExportError(f"--merge: {policy} trains the whole model, not a LoRA adapter; "
                          "export it without --merge")
    v, state = rebuild(follower, version, topic)
    base = Path(model_dir)
    if settings is None and not (base / "config.json").exists():
        # the model's files come off the stream with the same version's weights
        fetch_model(config, topic, policy, dest, version=v, verifier=verifier)
        _record(Path(dest), policy, v, "model", topic)
        return Exported(Path(dest), v, "model", _weight_bytes(Path(dest)))
    if not (base / "config.json").exists():
        raise ExportError(f"{policy} is a LoRA policy: exporting it needs its base model "
                          f"directory {base} (the weight stream carries the adapter only)")
    with staged_dir(dest, label="exporting") as tmp:
        kind = write_version(tmp, base, state, settings, merge)
        _record(tmp, policy, v, kind, topic)
    return Exported(Path(dest), v, kind, _weight_bytes(Path(dest)))


def write_version(dest: Path, base: Path, state: dict, settings: LoraSpec | None,
                  merge: bool = False) -> str:
    """Write a version's weights ``state`` into the directory ``dest`` beside the model
    files of ``base``: the model (``settings`` None), the adapter in peft's format, or
    (``merge``) the base with the adapter merged in. Its kind: model, adapter, merged."""
    _copy_model_files(base, dest)
    if settings is not None and not merge:
        lora_mod.write_adapter(state, settings, base, dest)
        return "adapter"
    _write_model(dest, base, state, settings)
    return "model" if settings is None else "merged"


def _copy_model_files(base: Path, dest: Path) -> None:
    """Everything of the model directory but its weights (config, tokenizer, template)."""
    for path in sorted(p for p in base.rglob("*") if p.is_file()):
        rel = path.relative_to(base)
        if rel.as_posix().endswith(WEIGHT_SUFFIXES) or rel.name.startswith("."):
            continue
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, dest / rel)


def _write_model(dest: Path, base: Path, state: dict,
                 settings: LoraSpec | None) -> None:
    """The full weights: ``state`` itself, or the base's with the adapter merged in."""
    from safetensors.torch import save_file

    if settings is not None:
        weights = _base_weights(base)
        weights.update(lora_mod.merged(weights, state, settings))
        state = weights
    save_file({k: v.contiguous() for k, v in state.items()}, str(dest / "model.safetensors"),
              metadata={"format": "pt"})
    dtypes = {str(v.dtype).removeprefix("torch.") for v in state.values()
              if v.is_floating_point()}
    config_file = dest / "config.json"
    if len(dtypes) == 1 and config_file.exists():  # what the weights are stored as
        config = json.loads(config_file.read_text())
        config["torch_dtype"] = config["dtype"] = dtypes.pop()
        config_file.write_text(json.dumps(config, indent=2) + "\n")


def _base_weights(base: Path) -> dict:
    from safetensors.torch import load_file

    files = sorted(base.glob("*.safetensors"))
    if not files:
        raise ExportError(f"{base}: no safetensors weights to merge the adapter into")
    out: dict = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def _record(dest: Path, policy: str, version: int, kind: str, topic: str) -> None:
    (dest / EXPORT_RECORD).write_text(json.dumps(
        {"policy": policy, "version": version, "kind": kind, "weights_topic": topic},
        indent=2) + "\n")


def _weight_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.glob("*.safetensors"))


__all__ = ["ExportError", "Exported", "export_version", "published", "rebuild",
           "write_version"]
