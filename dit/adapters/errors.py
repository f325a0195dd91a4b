"""User-facing errors of the model adapters (all are :class:`sakura.errors.SakuraError`).

The CLI prints them as one line; library callers can catch the specific subclass.
"""

from __future__ import annotations

from sakura.errors import SakuraError


class AdapterError(SakuraError):
    """Base class of the adapter errors."""


class UnknownModelError(AdapterError):
    """``--model`` names no adapter."""


class ModelPathError(AdapterError):
    """``--model-path`` does not exist or holds no diffusers transformer checkpoint."""


class CheckpointMismatchError(AdapterError):
    """The checkpoint at ``--model-path`` is not the model that ``--model`` names."""


class UnsupportedError(AdapterError):
    """The model cannot do what was asked exactly (e.g. reference caching on SD3.5)."""


class InputError(AdapterError):
    """Inputs whose shapes or contents do not fit the model or the template."""
