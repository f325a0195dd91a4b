"""A file's SHA-256, the one rule for every identity taken from file bytes (model weights,
device bundle files, the text encoder's vocabulary). Shared ground: imports nothing of
SAKURA."""

from __future__ import annotations

import hashlib
import os


def file_sha256(path: str | os.PathLike[str]) -> str:
    """The hex SHA-256 of a file's bytes, read in chunks (``hashlib.file_digest``)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


__all__ = ["file_sha256"]
