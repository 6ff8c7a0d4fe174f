"""Signed weight manifests: ed25519 over a manifest's canonical bytes.

The trainer signs every manifest it publishes with a private key from a file
(``ManifestSigner``); RaaS nodes and evaluators given a public key refuse a manifest that
is unsigned, signed by another key, or changed after signing (``ManifestVerifier``, used
by ``WeightFollower.observe``). The signature covers every field but the two signature
fields, the blobs' sha256 included, so it covers the weights too.

Canonical bytes: ``DOMAIN`` followed by the manifest as JSON with sorted keys and no
spaces, where a field that holds its default (None, "", an empty list or map) is left out
at every level. A field added to the schema later (with a default, as schema evolution
requires) thus leaves the bytes of manifests signed before it unchanged.

Keys are PEM files: the private key PKCS8 (``keygen`` writes it with mode 0600), the public
key SubjectPublicKeyInfo. Configured by the topology's ``weight_signing`` section; the
environment variables ``ENV_SIGNING_KEY`` and ``ENV_PUBLIC_KEY`` override it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from astraflow.errors import AstraflowError
from astraflow.weights.errors import ManifestSignatureError, WeightsError
from astraflow.wire.records import DeadLetter, Record, WeightManifest

log = logging.getLogger(__name__)

DOMAIN = b"astraflow.WeightManifest.v1\n"
SIGNATURE_FIELDS = ("signature", "signing_key")
ENV_SIGNING_KEY = "ASTRAFLOW_WEIGHTS_SIGNING_KEY"  # the trainer's private key file
ENV_PUBLIC_KEY = "ASTRAFLOW_WEIGHTS_PUBLIC_KEY"  # the readers' public key file
PRIVATE_FILE, PUBLIC_FILE = "weights-signing.key", "weights-signing.pub"


class SigningKeyError(WeightsError, AstraflowError):
    """A key file is missing, unreadable or not an ed25519 key (named, never shown); the
    CLI prints it as one line."""


def _plain(value: Any, top: bool = False) -> Any:
    """``value`` as JSON-ready data, fields holding their defaults left out."""
    if isinstance(value, Record):
        out = {}
        for f in dataclasses.fields(value):
            v = getattr(value, f.name)
            if (top and f.name in SIGNATURE_FIELDS) or v is None or v == "" or (
                    isinstance(v, (list, dict)) and not v):
                continue
            out[f.name] = _plain(v)
        return out
    if isinstance(value, (list, tuple)):
        return [_plain(x) for x in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, bytes):
        return value.hex()
    return value


def canonical_bytes(manifest: WeightManifest) -> bytes:
    """What is signed: ``DOMAIN`` and the manifest's canonical JSON (see the module doc)."""
    text = json.dumps(_plain(manifest, top=True), sort_keys=True, separators=(",", ":"),
                      ensure_ascii=True)
    return DOMAIN + text.encode("ascii")


def key_id(public_key: Ed25519PublicKey) -> str:
    """The first 16 hex digits of the sha256 of the raw public key."""
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def _read(path: str | os.PathLike[str], what: str) -> bytes:
    try:
        return Path(path).expanduser().read_bytes()
    except OSError as e:
        raise SigningKeyError(f"{what} {path}: cannot read: {e.strerror}") from None


def load_private_key(path: str | os.PathLike[str]) -> Ed25519PrivateKey:
    """The ed25519 private key of PEM file ``path`` (a warning if others may read it)."""
    data = _read(path, "weight signing key")
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError):
        key = None
    if not isinstance(key, Ed25519PrivateKey):
        raise SigningKeyError(f"weight signing key {path}: not an unencrypted ed25519 "
                              "private key in PEM (make one with `astraflow weights keygen`)")
    if os.name == "posix" and Path(path).expanduser().stat().st_mode & 0o077:
        log.warning("weight signing key %s may be read by others than its owner (chmod 600)",
                    path)
    return key


def load_public_key(path: str | os.PathLike[str]) -> Ed25519PublicKey:
    """The ed25519 public key of PEM file ``path``."""
    data = _read(path, "weight public key")
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError):
        key = None
    if not isinstance(key, Ed25519PublicKey):
        raise SigningKeyError(f"weight public key {path}: not an ed25519 public key in PEM "
                              "(`astraflow weights keygen` writes one)")
    return key


def keygen(out_dir: str | os.PathLike[str]) -> tuple[Path, Path]:
    """Write a new key pair into ``out_dir``: ``weights-signing.key`` (mode 0600) and
    ``weights-signing.pub``; refuses to overwrite either. Returns their paths."""
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    private, public = out / PRIVATE_FILE, out / PUBLIC_FILE
    for p in (private, public):
        if p.exists():
            raise SigningKeyError(f"{p} exists: keys are never overwritten; choose another "
                                  "--out or remove it")
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    fd = os.open(private, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    public.write_bytes(key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    return private, public


class ManifestSigner:
    """Signs manifests with one private key."""

    def __init__(self, private_key: Ed25519PrivateKey):
        self._key = private_key
        self.key_id = key_id(private_key.public_key())

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> ManifestSigner:
        return cls(load_private_key(path))

    def sign(self, manifest: WeightManifest) -> WeightManifest:
        """Set ``manifest.signature`` and ``signing_key`` (in place); returns it."""
        manifest.signature = self._key.sign(canonical_bytes(manifest))
        manifest.signing_key = self.key_id
        return manifest

    def __repr__(self) -> str:  # never the key itself
        return f"ManifestSigner(key {self.key_id})"


class ManifestVerifier:
    """Accepts only manifests signed by one of ``public_keys``."""

    def __init__(self, public_keys: Sequence[Ed25519PublicKey]):
        if not public_keys:
            raise ValueError("a verifier needs at least one public key")
        self.keys = {key_id(k): k for k in public_keys}

    @classmethod
    def from_files(cls, paths: Sequence[str | os.PathLike[str]]) -> ManifestVerifier:
        return cls([load_public_key(p) for p in paths])

    def verify(self, manifest: WeightManifest) -> None:
        """Return if ``manifest`` is signed by a trusted key; else raise
        ``ManifestSignatureError`` with the reason."""
        what = f"{manifest.policy} v{manifest.version} ({manifest.kind})"
        if not manifest.signature:
            raise ManifestSignatureError(f"manifest {what} is unsigned; a signed one is "
                                         "required (weight_signing.public_key)")
        key = self.keys.get(manifest.signing_key or "")
        if key is None:
            raise ManifestSignatureError(
                f"manifest {what} is signed by key {manifest.signing_key or '?'}, which is not "
                f"trusted (trusted: {', '.join(sorted(self.keys))})")
        try:
            key.verify(manifest.signature, canonical_bytes(manifest))
        except InvalidSignature:
            raise ManifestSignatureError(
                f"manifest {what}: bad signature for key {manifest.signing_key} (changed "
                "after signing, or signed with another key)") from None

    def __repr__(self) -> str:
        return f"ManifestVerifier(keys {', '.join(sorted(self.keys))})"


def _setting(env: str, spec: Any, name: str) -> str | None:
    return os.environ.get(env) or (getattr(spec, name, None) if spec is not None else None)


def signer_from(spec: Any) -> ManifestSigner | None:
    """The trainer's signer: ``$ASTRAFLOW_WEIGHTS_SIGNING_KEY``, else the topology's
    ``weight_signing.private_key``; None when neither is set. When a public key is set too
    it must belong to the private key (else ``SigningKeyError``)."""
    path = _setting(ENV_SIGNING_KEY, spec, "private_key")
    public = _setting(ENV_PUBLIC_KEY, spec, "public_key")
    if path is None:
        if public:
            log.warning("weights are verified with %s but this trainer has no signing key: "
                        "readers will refuse its manifests", public)
        return None
    signer = ManifestSigner.from_file(path)
    if public and key_id(load_public_key(public)) != signer.key_id:
        raise SigningKeyError(f"weight signing key {path} does not belong to the public key "
                              f"{public}: readers would refuse every manifest")
    return signer


def verifier_from(spec: Any) -> ManifestVerifier | None:
    """The readers' verifier: ``$ASTRAFLOW_WEIGHTS_PUBLIC_KEY``, else the topology's
    ``weight_signing.public_key``; None (nothing verified) when neither is set."""
    path = _setting(ENV_PUBLIC_KEY, spec, "public_key")
    return ManifestVerifier.from_files([path]) if path else None


def verifier_for(spec: Any, public_key: str | os.PathLike[str] | None = None
                 ) -> ManifestVerifier | None:
    """``verifier_from(spec)``, unless a command was given a public key file
    (``--public-key``): that one then, before the environment and the topology."""
    return ManifestVerifier.from_files([public_key]) if public_key else verifier_from(spec)


def refusal(verifier: ManifestVerifier | None, manifest: WeightManifest) -> str | None:
    """Why ``verifier`` refuses ``manifest`` (one line); None when it is trusted, or when
    there is no verifier (nothing is verified)."""
    if verifier is None:
        return None
    try:
        verifier.verify(manifest)
    except ManifestSignatureError as e:
        return str(e)
    return None


def split_trusted(manifests: Iterable[WeightManifest], verifier: ManifestVerifier | None
                  ) -> tuple[list[WeightManifest], list[tuple[WeightManifest, str]]]:
    """``manifests`` as (the trusted ones, the refused ones with the reason), each in the
    order given; all trusted without a verifier."""
    kept: list[WeightManifest] = []
    refused: list[tuple[WeightManifest, str]] = []
    for m in manifests:
        why = refusal(verifier, m)
        if why is None:
            kept.append(m)
        else:
            refused.append((m, why))
    return kept, refused


def refusal_letter(manifest: WeightManifest, reason: str, topic: str, component_id: str,
                   codec: Any, where: tuple[int, int] = (-1, -1)) -> DeadLetter:
    """The ``DeadLetter`` of a refused manifest read from ``topic`` (at ``where``:
    partition and offset, -1 when not known): the reason and the manifest's bytes."""
    return DeadLetter(source_topic=topic, partition=where[0], offset=where[1],
                      component_id=component_id, error=f"refused: {reason}",
                      raw=codec.encode(manifest, topic))


__all__ = [
    "ManifestSigner",
    "ManifestVerifier",
    "SigningKeyError",
    "canonical_bytes",
    "key_id",
    "keygen",
    "load_private_key",
    "load_public_key",
    "refusal",
    "refusal_letter",
    "signer_from",
    "split_trusted",
    "verifier_for",
    "verifier_from",
]
