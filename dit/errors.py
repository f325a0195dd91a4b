"""dit's error classes, in one place (as ``codec/errors.py``, ``edge/errors.py``).

Each is a :class:`sakura.errors.SakuraError`, so the CLI prints it as one ``sakura: error:``
line. The model adapters' own family (``AdapterError`` and its kinds) stays in
``dit/adapters/errors.py``, beside the adapters that raise it. The defining modules import
their class from here, so ``from sakura.dit.images import ImageError`` keeps working.
"""

from __future__ import annotations

from sakura.errors import SakuraError


class DataError(SakuraError):
    """Training data cannot be fetched or read."""


class ImageError(SakuraError):
    """A template image (or mask) cannot be used: unreadable, a decompression bomb, or
    smaller than its declared resolution."""


class CatalogError(SakuraError):
    """A catalog file or template entry is missing or malformed."""


class TextEncoderError(SakuraError):
    """The offline MiniLM text encoder is missing or broken."""


class TrainConfigError(SakuraError):
    """A training setting out of range."""


class WeightsError(SakuraError):
    """Model weights are missing or do not match the model."""
