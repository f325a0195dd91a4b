"""SAKURA: the `sakura` command-line front door and the shared user-facing error type."""

__version__ = "0.1.0"
