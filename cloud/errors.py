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


class ErrorCode:
    """The stable ``code`` of every JSON error the server answers (``{"error", "code"}``).

    The one place these strings are defined; ``cloud/README.md`` has the table. Clients
    branch on ``code`` (and the status), never on the message, which is for people and
    may change. ``PERMANENT`` codes will not change on a retry of the same request;
    ``TRANSIENT`` ones may; ``version_gone`` means fetch the current manifest again.
    """

    BAD_REQUEST = "bad_request"  # 400: an invalid id, codec, shard, config, pack, path, query
    BAD_RANGE = "bad_range"  # 400: a Range header refused (too many ranges, too long)
    UNAUTHORIZED = "unauthorized"  # 401: missing or unknown bearer token
    FORBIDDEN = "forbidden"  # 403: the token may not access this template
    NOT_FOUND = "not_found"  # 404: no such route, layout file, shard or config
    UNKNOWN_TEMPLATE = "unknown_template"  # 404: the catalog has no such template id
    UNKNOWN_CODEC = "unknown_codec"  # 404: the template has no such codec
    VERSION_GONE = "version_gone"  # 404: a pinned pack version was superseded and collected
    METHOD_NOT_ALLOWED = "method_not_allowed"  # 405 (501 for unknown methods): GET, HEAD only
    PRECONDITION_FAILED = "precondition_failed"  # 412: If-Match failed
    RANGE_NOT_SATISFIABLE = "range_not_satisfiable"  # 416: no satisfiable range
    PACK_DAMAGED = "pack_damaged"  # 500: checksum, header or size differ from the manifest
    PUBLISH_BROKEN = "publish_broken"  # 500: invalid catalog/manifest, or a named file missing
    INTERNAL = "internal"  # 500: an unexpected server error (logged server-side)
    CATALOG_MISSING = "catalog_missing"  # 503: no catalog.json published yet
    STORAGE_UNAVAILABLE = "storage_unavailable"  # 503: the storage backend failed

    ALL = (BAD_REQUEST, BAD_RANGE, UNAUTHORIZED, FORBIDDEN, NOT_FOUND, UNKNOWN_TEMPLATE,
           UNKNOWN_CODEC, VERSION_GONE, METHOD_NOT_ALLOWED, PRECONDITION_FAILED,
           RANGE_NOT_SATISFIABLE, PACK_DAMAGED, PUBLISH_BROKEN, INTERNAL, CATALOG_MISSING,
           STORAGE_UNAVAILABLE)
    TRANSIENT = (STORAGE_UNAVAILABLE, CATALOG_MISSING)
    PERMANENT = (BAD_REQUEST, BAD_RANGE, UNAUTHORIZED, FORBIDDEN, NOT_FOUND, UNKNOWN_TEMPLATE,
                 UNKNOWN_CODEC, METHOD_NOT_ALLOWED, PRECONDITION_FAILED, RANGE_NOT_SATISFIABLE,
                 PACK_DAMAGED, PUBLISH_BROKEN, INTERNAL)

    @staticmethod
    def for_status(status: int) -> str:
        """The code of an error raised by the framework itself (routing, validation)."""
        return {400: ErrorCode.BAD_REQUEST, 401: ErrorCode.UNAUTHORIZED,
                403: ErrorCode.FORBIDDEN, 404: ErrorCode.NOT_FOUND,
                405: ErrorCode.METHOD_NOT_ALLOWED, 412: ErrorCode.PRECONDITION_FAILED,
                416: ErrorCode.RANGE_NOT_SATISFIABLE, 501: ErrorCode.METHOD_NOT_ALLOWED,
                503: ErrorCode.STORAGE_UNAVAILABLE,
                }.get(status, ErrorCode.INTERNAL if status >= 500 else ErrorCode.BAD_REQUEST)
