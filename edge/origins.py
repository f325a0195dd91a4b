"""Where the edge's client reads: the origins and the keys of the published layout.

Every origin serves the published catalog layout (``cloud/layout.py``)::

    catalog.json
    templates/<template_id>/<codec>/manifest.json      the current manifest
    templates/<template_id>/<codec>/<pack_file>        immutable, named by content hash

so the device needs no code of ours on the other side. Three kinds of origin, chosen by the
URL the user gives:

- ``http://`` or ``https://``: ``sakura serve`` (which adds bearer auth, a token-filtered
  catalog and metrics), nginx or any static server or CDN in front of the published folder;
  ``token`` is sent as ``Authorization: Bearer`` when given;
- ``s3://bucket/prefix``: an S3 bucket (or any S3-compatible store), read with presigned GET
  URLs made locally from the standard AWS environment (credentials, ``AWS_ENDPOINT_URL_S3`` /
  ``AWS_ENDPOINT_URL``, ``AWS_DEFAULT_REGION``, read by botocore: ``sakura.s3``;
  ``?endpoint_url=...&region=...`` in the URL override them), or
  with plain URLs when there are no credentials (a public-read bucket).

:class:`PackLocation` is the plain request (URL and headers) that reads byte ranges of one
pack, for anyone else fetching ranges, e.g. the native receiver; :func:`manifest_key` and
:func:`pack_key` check the template id, codec and pack name before they become keys.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import parse_qs, quote, urlsplit

from sakura.codec.manifest import PACK_FILE_PATTERN, TEMPLATE_ID_PATTERN
from sakura.edge.errors import EdgeError

from sakura.s3 import endpoint_of, s3_client

# the published layout (cloud/layout.py; edge does not import cloud)
CATALOG_KEY = "catalog.json"
_ID = re.compile(TEMPLATE_ID_PATTERN)  # (template ids; codec names are checked as loosely)
_PACK_FILE = re.compile(PACK_FILE_PATTERN)
PRESIGN_EXPIRES_S = 3600


@dataclass(frozen=True)
class PackLocation:
    """The plain HTTP request that reads byte ranges of one pack.

    ``GET url`` with ``headers`` plus ``Range: bytes=a-b`` (absolute offsets from the
    manifest's ``ranges``) fetches any configuration; when resuming a dropped body, send
    ``If-Range: etag`` (``None`` until a response from this origin has shown its ETag; then
    use the one the response carried). For S3 the URL is presigned (valid
    ``PRESIGN_EXPIRES_S``) and ``headers`` is empty; for ``sakura serve`` with auth it holds
    the bearer token.
    """

    url: str
    headers: dict[str, str]
    etag: str | None = None


class HttpOrigin:
    """``sakura serve``, nginx or a CDN: the layout under one base URL."""

    def __init__(self, base: str, token: str | None) -> None:
        self.base = base.rstrip("/")
        self.token = token

    def url(self, key: str) -> str:
        return f"{self.base}/{quote(key)}"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def describe(self, url: str) -> str:
        return url


class S3Origin:
    """An S3 bucket prefix, read with presigned GET URLs (made locally by botocore)."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if not parts.netloc:
            raise EdgeError(f"an S3 origin is s3://bucket[/prefix], got {url[:80]!r}")
        self.bucket = parts.netloc
        prefix = parts.path.strip("/")
        self.prefix = f"{prefix}/" if prefix else ""
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        try:
            import boto3
            from botocore import UNSIGNED
            from botocore.config import Config
        except ImportError as exc:  # pragma: no cover - boto3 is a dependency
            raise EdgeError(f"an s3:// origin needs boto3 ({exc})") from None
        session = boto3.session.Session()
        # no credentials: a public-read bucket, read with plain (unsigned) URLs
        self.signed = session.get_credentials() is not None
        config = Config(signature_version="s3v4" if self.signed else UNSIGNED)
        # the endpoint (?endpoint_url=, else AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL, else AWS)
        # and its addressing are botocore's, as for the cloud's storage (sakura.s3)
        self.client = s3_client(query.get("endpoint_url"), query.get("region"), session=session,
                                config=config)
        self.endpoint = endpoint_of(self.client)

    def describe(self, url: str) -> str:
        return f"{url} (S3 endpoint {self.endpoint})"

    def url(self, key: str) -> str:
        return self.client.generate_presigned_url(
            "get_object", Params={"Bucket": self.bucket, "Key": self.prefix + key},
            ExpiresIn=PRESIGN_EXPIRES_S)

    def headers(self) -> dict[str, str]:
        return {}


def manifest_key(template: str, codec: str) -> str:
    _check_ids(template, codec)
    return f"templates/{template}/{codec}/manifest.json"


def pack_key(template: str, codec: str, pack_file: str) -> str:
    _check_ids(template, codec)
    if not isinstance(pack_file, str) or not _PACK_FILE.fullmatch(pack_file):
        raise EdgeError(f"manifest: pack_file {str(pack_file)[:80]!r} is not a pack name")
    return f"templates/{template}/{codec}/{pack_file}"


def _check_ids(template: str, codec: str | None) -> None:
    for what, value in (("template id", template), ("codec", codec)):
        if what == "codec" and value is None:
            continue
        if not isinstance(value, str) or not _ID.fullmatch(value):
            raise EdgeError(f"invalid {what} {str(value)[:80]!r}: use lower-case letters, "
                            "digits, '-' and '_'")
