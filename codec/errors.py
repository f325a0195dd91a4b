"""Codec error types: user-facing subclasses of :class:`sakura.errors.SakuraError`."""

from __future__ import annotations

from sakura.errors import SakuraError


class CodecError(SakuraError):
    """Bad codec name/options or input a codec cannot encode or decode."""


class PackError(SakuraError):
    """A pack file, manifest or shard response is malformed, truncated or corrupted."""


class PackTruncatedError(PackError):
    """The file or response is shorter than its header says."""


class PackCorruptError(PackError):
    """A checksum does not match or the header or manifest is not valid."""


class PackMagicError(PackError):
    """The file does not start with the pack magic ``SAKP``."""


class PackVersionError(PackError):
    """The pack or manifest was written in a version this reader does not support."""
