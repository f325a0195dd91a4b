"""User-facing errors of the traces package (all are :class:`sakura.errors.SakuraError`).

The CLI prints these as one clean line; library callers can catch the specific subclass.
"""

from __future__ import annotations

from sakura.errors import SakuraError


class TraceError(SakuraError):
    """A trace cannot be used for what was asked (e.g. an all-zero trace must deliver bytes)."""


class TraceFormatError(TraceError):
    """A trace file is missing, unreadable, or not in one of the supported formats."""


class LinkError(SakuraError):
    """A link emulator could not be started or driven."""


class NetnsUnavailableError(LinkError):
    """Kernel shaping needs root, ``ip netns`` and ``tc`` with tbf; one of them is missing."""
