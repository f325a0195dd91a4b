"""``intq``: uniform integer quantization with group-wise scales (the INTQ baseline).

Every token row of every matrix is split into groups of ``group`` channels; each group
stores an fp16 scale and an fp16 minimum (asymmetric min-max quantization, round to
nearest). Each bit width of ``bits`` is its own encoding: one unit per bit width per
shard, and the stored size is the sum of all of them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from sakura.codec.base import Codec, EncodedConfig, EncodedShard, register
from sakura.codec.errors import CodecError, PackError
from sakura.codec.quant import pack_codes, packed_row_bytes, unpack_codes
from sakura.codec.shards import ShardData, ShardSpec


class IntQCodec(Codec):
    name = "intq"

    def __init__(self, bits: tuple[int, ...] | list[int] = (2, 3, 4, 8), group: int = 32) -> None:
        self.bits = tuple(sorted({int(b) for b in bits}))
        if not self.bits or not all(1 <= b <= 8 for b in self.bits):
            raise CodecError(f"intq bits must be in 1..8, got {bits}")
        if not 1 <= group <= 4096:
            raise CodecError(f"intq group must be in 1..4096, got {group}")
        self.group = int(group)

    @property
    def options(self) -> dict[str, Any]:
        return {"bits": list(self.bits), "group": self.group}

    def _groups(self, channels: int) -> int:
        return -(-channels // self.group)

    def unit_bytes(self, spec: ShardSpec, bits: int) -> int:
        rows = spec.num_matrices * spec.tokens
        return rows * (4 * self._groups(spec.channels) + packed_row_bytes(spec.channels, bits))

    def encode_shard(self, shard: ShardData) -> EncodedShard:
        spec = shard.spec
        x = torch.stack([m.float() for m in shard.matrices]).reshape(-1, spec.channels)
        rows, c = x.shape
        ng = self._groups(c)
        pad = ng * self.group - c
        xp = torch.nn.functional.pad(x, (0, pad)).view(rows, ng, self.group)
        valid = torch.nn.functional.pad(torch.ones(c), (0, pad)).view(ng, self.group).bool()
        big = torch.finfo(torch.float32).max
        lo = torch.where(valid, xp, torch.full_like(xp, big)).amin(-1).half().float()
        hi = torch.where(valid, xp, torch.full_like(xp, -big)).amax(-1)
        units, configs = [], []
        for bits in self.bits:
            levels = (1 << bits) - 1
            scale = ((hi - lo) / levels).half().float()
            safe = torch.where(scale > 0, scale, torch.ones_like(scale))
            codes = torch.round((xp - lo[..., None]) / safe[..., None]).clamp(0, levels)
            codes = codes.reshape(rows, -1)[:, :c].to(torch.uint8).numpy()
            head = np.concatenate(
                [scale.half().numpy().view(np.uint8), lo.half().numpy().view(np.uint8)], axis=1
            )
            units.append(np.concatenate([head, pack_codes(codes, bits)], axis=1).tobytes())
            configs.append(EncodedConfig(params={"bits": bits}, units=[len(units) - 1]))
        return EncodedShard(units=units, configs=configs)

    def decode(self, params: dict[str, Any], data: bytes, spec: ShardSpec) -> list[torch.Tensor]:
        bits = int(params.get("bits", 0))
        if bits not in self.bits:
            raise PackError(f"shard {spec.index}: intq has no {bits}-bit encoding")
        if len(data) != self.unit_bytes(spec, bits):
            raise PackError(
                f"shard {spec.index}: intq {bits}-bit needs {self.unit_bytes(spec, bits)} "
                f"bytes, got {len(data)}"
            )
        c = spec.channels
        ng = self._groups(c)
        rows = spec.num_matrices * spec.tokens
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(rows, -1)
        scale = buf[:, : 2 * ng].contiguous().view(torch.float16).float()
        lo = buf[:, 2 * ng : 4 * ng].contiguous().view(torch.float16).float()
        codes = unpack_codes(buf[:, 4 * ng :], bits, c).float()
        gidx = torch.arange(c) // self.group
        x = codes * scale[:, gidx] + lo[:, gidx]
        return list(x.view(spec.num_matrices, spec.tokens, c).unbind(0))

    def rank_key(self, params: dict[str, Any]) -> float:
        return float(params.get("bits", 0))


@register("intq")
def make_intq(bits: tuple[int, ...] | list[int] = (2, 3, 4, 8), group: int = 32) -> IntQCodec:
    return IntQCodec(bits=bits, group=group)
