"""User-facing errors of the cloud package (all are :class:`sakura.errors.SakuraError`).

The CLI prints these as one clean line; library callers can catch the specific subclass.
"""

from __future__ import annotations

from sakura.errors import SakuraError


class CloudError(SakuraError):
    """Base class of the cloud package's errors."""


class StorageError(CloudError):
    """A storage backend failed (I/O error, object store error, truncated object)."""


class ObjectNotFound(StorageError):
    """The storage key does not exist."""


class UnsafeKey(StorageError):
    """A storage key that could escape the storage root (``..``, absolute, backslash, NUL)."""


class ObjectChanged(StorageError):
    """An object changed while a reader held it (S3 ``If-Match`` precondition failed)."""


class ManifestError(CloudError):
    """A manifest or catalog is malformed or inconsistent with its pack."""


class PublishError(CloudError):
    """A pack could not be published; the published catalog is left exactly as it was."""


class AuthConfigError(CloudError):
    """A tokens file or ``SAKURA_TOKENS`` value is malformed."""


class ServeConfigError(CloudError):
    """``sakura serve`` cannot start (missing directory, no catalog.json, bad options)."""
