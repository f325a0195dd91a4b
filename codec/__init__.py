"""KV-cache codecs (SAKURA, SVD, FP16, INTQ, CacheGen-DiT), the progressive pack format and
rate-quality profiles.

Public API::

    from codec import get_codec, CODECS, PackError, ShardLayout
    from codec.pack import write_pack, PackReader, Manifest, decode_config
    from codec.profile import rate_quality_curve
"""

from codec.errors import CodecError, PackError

_LAZY = {  # torch-backed names load on first use, so `sakura --help` starts fast
    "CODECS": "codec.base", "Codec": "codec.base", "EncodedConfig": "codec.base",
    "EncodedShard": "codec.base", "get_codec": "codec.base", "ShardLayout": "codec.shards",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'codec' has no attribute {name!r}")

__all__ = [
    "CODECS",
    "Codec",
    "CodecError",
    "EncodedConfig",
    "EncodedShard",
    "PackError",
    "ShardLayout",
    "get_codec",
]
