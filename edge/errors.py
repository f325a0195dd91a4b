"""Edge runtime errors: user-facing subclasses of :class:`sakura.errors.SakuraError`."""

from __future__ import annotations

from sakura.errors import SakuraError


class EdgeError(SakuraError):
    """The edge runtime cannot complete an edit (server unreachable, bad pack, bad input)."""


class ServerUnreachable(EdgeError):
    """No response from the server after all retries."""


class IntegrityError(EdgeError):
    """A shard body kept failing verification (checksum) after all refetches."""


class NativeUnavailable(EdgeError):
    """The native runtime cannot run here (module not built, or a feature it lacks)."""


class OriginError(EdgeError):
    """The origin answered, with an error (its own message is in the text)."""


class VersionGone(OriginError):
    """The origin no longer has the pack version the manifest names (``code:
    version_gone``: republished and collected during the edit): refetch the manifest."""
