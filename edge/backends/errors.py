"""Errors of the execution backends: user-facing :class:`edge.errors.EdgeError` subclasses."""

from __future__ import annotations

from sakura.edge.errors import EdgeError


class BackendError(EdgeError):
    """A backend cannot compile, load or run a shard (the message says why and what to do)."""


class BackendUnavailable(BackendError):
    """The backend's runtime is not installed here (or lacks a library it needs)."""


class GeometryMismatch(BackendError):
    """Inputs do not have the shapes a shard graph was compiled for."""


class AIHubError(BackendError):
    """Qualcomm AI Hub is not configured or a job failed."""
