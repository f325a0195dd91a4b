"""KV-cache codecs (SAKURA, SVD, FP16, INTQ, CacheGen-DiT), the progressive pack format and
rate-quality profiles.

Public API::

    from sakura.codec import get_codec, CODECS, PackError, ShardLayout
    from sakura.codec.pack import write_pack, PackReader, Manifest, decode_config
    from sakura.codec.profile import rate_quality_curve
"""

from sakura.codec.errors import CodecError, PackError

DEFAULT_BLOCKS_PER_SHARD = 4
"""Transformer blocks per shard that ``sakura build`` (``cloud.build.BuildConfig``) and every
tool exporting shard graphs use unless told otherwise: 4 of the shipped model's 8 blocks,
~10-25 ms of masked compute per shard on the 2-core host, so per-request costs (headers,
server time) stay small next to the smallest configurations."""

_LAZY = {  # torch-backed names load on first use, so `sakura --help` starts fast
    "CODECS": "sakura.codec.base", "Codec": "sakura.codec.base", "EncodedConfig": "sakura.codec.base",
    "EncodedShard": "sakura.codec.base", "get_codec": "sakura.codec.base", "ShardLayout": "sakura.codec.shards",
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
