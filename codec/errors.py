"""Codec error types: user-facing subclasses of :class:`sakura.errors.SakuraError`."""

from __future__ import annotations

from sakura.errors import SakuraError


class CodecError(SakuraError):
    """Bad codec name/options or input a codec cannot encode or decode."""


class PackError(SakuraError):
    """A pack file, manifest or shard response is malformed, truncated or corrupted."""
