"""``fp16``: the raw cache rounded to FP16, one unit per shard (the uncompressed baseline).

Decoding gives exactly ``TemplateCache.to_fp16_exact()``: ``fp16`` equals ``exact``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from sakura.codec.base import Codec, EncodedConfig, EncodedShard, register
from sakura.codec.errors import PackError
from sakura.codec.shards import ShardData, ShardSpec


class FP16Codec(Codec):
    name = "fp16"

    @property
    def options(self) -> dict[str, Any]:
        return {}

    def encode_shard(self, shard: ShardData) -> EncodedShard:
        stacked = torch.stack([m.float() for m in shard.matrices]).half()
        unit = stacked.numpy().astype("<f2").tobytes()
        return EncodedShard(units=[unit], configs=[EncodedConfig(params={}, units=[0])])

    def decode(self, params: dict[str, Any], data: bytes, spec: ShardSpec) -> list[torch.Tensor]:
        need = spec.num_matrices * spec.tokens * spec.channels * 2
        if len(data) != need:
            raise PackError(f"shard {spec.index}: fp16 needs {need} bytes, got {len(data)}")
        arr = np.frombuffer(data, dtype="<f2").reshape(spec.num_matrices, spec.tokens, spec.channels)
        out = torch.from_numpy(arr.astype(np.float32))
        return list(out.unbind(0))


@register("fp16")
def make_fp16() -> FP16Codec:
    return FP16Codec()
