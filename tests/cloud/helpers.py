"""Helpers shared by the cloud tests (multipart parsing, expected shard bodies)."""

from __future__ import annotations

import re


def parse_multipart(body: bytes, content_type: str) -> list[tuple[str, bytes]]:
    """(Content-Range, data) of each part of a multipart/byteranges body, strictly."""
    match = re.search(r"boundary=([^;\s]+)", content_type)
    assert match, content_type
    boundary = match.group(1).encode()
    assert body.endswith(b"\r\n--" + boundary + b"--\r\n"), body[-80:]
    parts = []
    pos = 0
    delim = b"--" + boundary + b"\r\n"
    while True:
        assert body[pos : pos + len(delim)] == delim, (pos, body[pos : pos + 80])
        pos += len(delim)
        header_end = body.index(b"\r\n\r\n", pos)
        headers = dict(
            line.split(": ", 1) for line in body[pos:header_end].decode("ascii").split("\r\n")
        )
        pos = header_end + 4
        first, last, _total = re.fullmatch(
            r"bytes (\d+)-(\d+)/(\d+)", headers["Content-Range"]
        ).groups()
        length = int(last) - int(first) + 1
        parts.append((headers["Content-Range"], body[pos : pos + length]))
        pos += length
        assert body[pos : pos + 2] == b"\r\n"
        pos += 2
        if body[pos:] == b"--" + boundary + b"--\r\n":
            return parts


def shard_bytes(pack: bytes, manifest: dict, shard: int, config: int) -> bytes:
    from sakura.cloud.synthetic import config_bytes

    return config_bytes(pack, manifest, shard, config)
