"""Errors raised by the weights library.

``BlobError`` and its subclasses mean "this blob cannot be used": a reader that gets one
drops the manifest that points at the blob and tries another plan. ``BaseMismatchError``
means a delta was offered a state that is not its base; nothing has been written when it
is raised.
"""

from __future__ import annotations


class WeightsError(Exception):
    """Base of every error raised by ``astraflow.weights``."""


class BlobError(WeightsError):
    """A blob cannot be used (missing, corrupt, or in a format this code does not read)."""


class CorruptBlobError(BlobError):
    """A blob failed its sha256 check, or its content does not parse or decompress."""


class MissingBlobError(BlobError):
    """The store holds no (complete) blob under the id a ``BlobRef`` names."""


class UnsupportedFormatError(CorruptBlobError):
    """The blob's magic or format version is not one this code reads."""


class BaseMismatchError(WeightsError):
    """A delta was applied to a state that is not the version it was computed against."""


class ManifestSignatureError(WeightsError):
    """A manifest is unsigned, signed by an untrusted key, or its signature does not match:
    it is refused (``astraflow.weights.signing``)."""


class NoPlanError(WeightsError):
    """No chain of known, usable manifests leads from the held version to the target."""
