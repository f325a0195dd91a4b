"""The one S3 client rule of the cloud storage (``sakura serve --s3-bucket``, ``sakura build
--publish s3://...``) and the edge's ``s3://`` origin.

botocore resolves the endpoint itself: the URL the user names (``--s3-endpoint``,
``?endpoint_url=`` in an ``s3://`` URL), else ``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``
or the profile's ``endpoint_url`` (``AWS_IGNORE_CONFIGURED_ENDPOINT_URLS`` turns those off),
else AWS's own endpoint for the region. It also chooses the addressing: path-style
(``http://host/bucket/key``) for any such configured endpoint -- moto, MinIO and most
S3-compatible stores have no host name per bucket -- and virtual-host style on AWS's own,
unless the profile's ``s3.addressing_style`` says otherwise (``tests/sakura/test_s3.py``
pins it). So the rule left to us is the region's fallback; :func:`endpoint_of` reads back
what botocore chose, for messages.

boto3 is the ``s3`` extra: the caller checks for it (``sakura.extras.require``) or catches
the ``ImportError``.
"""

from __future__ import annotations

from typing import Any

DEFAULT_REGION = "us-east-1"


def s3_client(endpoint_url: str | None = None, region_name: str | None = None, *,
              session: Any = None, config: Any = None, **client_kwargs: Any) -> Any:
    """A boto3 S3 client; ``endpoint_url`` only when the user named one (None: botocore's
    resolution above). The region: ``region_name``, else the session's (``AWS_DEFAULT_REGION``
    or the profile's), else ``us-east-1``. ``session``: a ``boto3.session.Session`` (a new
    one when None); ``config``: a ``botocore.config.Config``."""
    import boto3

    session = session if session is not None else boto3.session.Session()
    return session.client("s3", endpoint_url=endpoint_url or None,
                          region_name=region_name or session.region_name or DEFAULT_REGION,
                          config=config, **client_kwargs)


def endpoint_of(client: Any) -> str:
    """The endpoint URL botocore resolved for ``client`` (AWS's own when none is configured)."""
    return str(client.meta.endpoint_url)


__all__ = ["DEFAULT_REGION", "endpoint_of", "s3_client"]
