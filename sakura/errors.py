"""The exception types the CLI turns into a clear message (never a traceback).

Every package raises a subclass of :class:`SakuraError` for bad input a user can fix
(``sakura: error: ...``, exit 1); :class:`UsageError` is a bad argument found after parsing
(usage and exit 2, as argparse's own errors).
"""


class SakuraError(Exception):
    """A user-facing error: the message says what is wrong and what to do."""


class UsageError(SakuraError):
    """A bad command-line argument that could only be checked after parsing (against a
    registry or a catalog loaded on demand); reported like argparse's errors, exit 2."""
