"""KV-cache codecs (SAKURA, SVD, FP16, INTQ, CacheGen-DiT), the progressive pack format and
rate-quality profiles.

Public API::

    from codec import get_codec, CODECS, PackError, ShardLayout
    from codec.pack import write_pack, PackReader, Manifest, decode_config
    from codec.profile import rate_quality_curve
"""

from codec.base import CODECS, Codec, EncodedConfig, EncodedShard, get_codec
from codec.errors import CodecError, PackError
from codec.shards import ShardLayout

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
