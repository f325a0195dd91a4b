"""The one exception type the CLI turns into a clear message (never a traceback).

Every package raises a subclass of :class:`SakuraError` for bad input a user can fix.
"""


class SakuraError(Exception):
    """A user-facing error: the message says what is wrong and what to do."""
