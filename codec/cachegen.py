"""``cachegen``: CacheGen (Liu et al., SIGCOMM 2024) adapted to DiT template caches.

Per matrix ``X [N, C]`` of block ``b`` (tokens in row-major image order):

- *delta to anchors*: tokens are grouped by ``anchor_every`` consecutive tokens; the first
  of each group is an anchor, quantized on its own with a finer bin
  (``anchor_factor`` x the delta bin); every other token is coded as its difference to the
  *reconstructed* anchor of its group (groups decode independently, as in CacheGen);
- *layer-wise quantization bins*: the bin is ``level bin x layer factor x rms(X)``, with
  the blocks split into ``len(layer_factors)`` consecutive groups and deeper groups using
  coarser bins;
- *arithmetic coding*: symbols (round to nearest, no clipping) are range-coded with
  ``constriction`` using one frequency table per channel, separately for anchors and
  deltas. A channel's table is the discretised Laplace distribution whose scale is the
  channel's mean absolute symbol, stored as a 4-bit code relative to the matrix's
  largest channel scale (``scale = top * 2**(-code / 2)``), so tables cost half a byte
  per channel and stream (channels sharing a code share the table; the stream holds the
  channels grouped by code, each channel's symbols in token order);
- *quality levels*: each entry of ``levels`` (bin in units of ``rms(X)``) is a separate
  encoding, one unit per shard and level; the stored size is the sum of all levels.
"""

from __future__ import annotations

import struct
from typing import Any

import constriction
import numpy as np
import torch
from sakura.codec.base import Codec, EncodedConfig, EncodedShard, register
from sakura.codec.errors import CodecError, PackError
from sakura.codec.shards import ShardData, ShardSpec

UNIT_HEAD = "<4sHIIH"  # magic, matrices, N, C, anchor_every
UNIT_MAGIC = b"SKCG"
MAT_HEAD = "<ffIIffII"  # delta bin, anchor bin, K anchor, K delta, top scales, word counts
SCALE_CODES = 16
MIN_SCALE = 1e-3


def _scale_codes(sym: np.ndarray) -> tuple[float, np.ndarray]:
    """Per-channel Laplace scales of ``sym [T, C]`` as 4-bit codes relative to the largest."""
    if sym.shape[0] == 0:
        return MIN_SCALE, np.zeros(sym.shape[1], np.uint8)
    scale = np.maximum(np.abs(sym).mean(axis=0), MIN_SCALE)
    top = float(np.float32(scale.max()))  # stored as float32: encoder and decoder agree
    code = np.clip(np.round(-2.0 * np.log2(scale / top)), 0, SCALE_CODES - 1).astype(np.uint8)
    return top, code


def _code_scales(top: float, code: np.ndarray) -> np.ndarray:
    return np.maximum(top * 2.0 ** (-code.astype(np.float64) / 2.0), MIN_SCALE)


def _pack_u4(code: np.ndarray) -> bytes:
    c = np.concatenate([code, np.zeros(len(code) % 2, np.uint8)])
    return (c[0::2] | (c[1::2] << 4)).astype(np.uint8).tobytes()


def _unpack_u4(data: bytes, count: int) -> np.ndarray:
    b = np.frombuffer(data, np.uint8)
    return np.stack([b & 15, b >> 4], axis=1).reshape(-1)[:count]


def _laplace_table(scale: float, k: int) -> np.ndarray:
    """Discretised Laplace probabilities of the symbols ``-k-1 .. k+1`` (unit bins)."""
    edges = np.arange(-k - 1, k + 3, dtype=np.float64) - 0.5
    tail = 0.5 * np.exp(-np.abs(edges) / scale)
    cdf = np.where(edges < 0, tail, 1 - tail)
    return np.maximum(np.diff(cdf), 1e-12).astype(np.float32)


def _channel_order(codes: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """Channels grouped by table code (ascending), in channel order within a group."""
    return [(int(c), np.flatnonzero(codes == c)) for c in np.unique(codes)]


def _encode_stream(sym: np.ndarray, top: float, codes: np.ndarray) -> tuple[int, np.ndarray]:
    """Range-code ``sym [T, C]``: channel by table, token order within a channel."""
    if sym.size == 0:
        return 0, np.zeros(0, np.uint32)
    k = int(np.abs(sym).max())
    enc = constriction.stream.queue.RangeEncoder()
    scales = _code_scales(top, codes)
    for _code, chans in _channel_order(codes):
        model = constriction.stream.model.Categorical(_laplace_table(scales[chans[0]], k),
                                                      perfect=False)
        flat = np.ascontiguousarray(sym[:, chans].T, dtype=np.int32).reshape(-1) + (k + 1)
        enc.encode(flat, model)
    return k, enc.get_compressed()


def _decode_stream(words: np.ndarray, k: int, rows: int, top: float, codes: np.ndarray) -> np.ndarray:
    out = np.zeros((rows, len(codes)), np.int32)
    if rows == 0 or len(words) == 0:
        return out
    dec = constriction.stream.queue.RangeDecoder(words)
    scales = _code_scales(top, codes)
    for _code, chans in _channel_order(codes):
        model = constriction.stream.model.Categorical(_laplace_table(scales[chans[0]], k),
                                                      perfect=False)
        vals = np.asarray(dec.decode(model, rows * len(chans)), dtype=np.int32) - (k + 1)
        out[:, chans] = vals.reshape(len(chans), rows).T
    return out


class CacheGenCodec(Codec):
    name = "cachegen"

    def __init__(
        self,
        levels: tuple[float, ...] | list[float] = (0.12, 0.3, 0.7, 1.5, 3.0, 6.0, 12.0),
        anchor_every: int = 10,
        anchor_factor: float = 0.5,
        layer_factors: tuple[float, ...] | list[float] = (1.0, 1.5, 2.0),
    ) -> None:
        self.levels = tuple(float(x) for x in levels)
        if not self.levels or any(x <= 0 for x in self.levels):
            raise CodecError(f"cachegen levels must be positive bins, got {levels}")
        if not 1 <= anchor_every <= 4096:
            raise CodecError(f"anchor_every must be in 1..4096, got {anchor_every}")
        if not 0 < anchor_factor <= 1:
            raise CodecError(f"anchor_factor must be in (0, 1], got {anchor_factor}")
        self.layer_factors = tuple(float(x) for x in layer_factors)
        if not self.layer_factors or any(x <= 0 for x in self.layer_factors):
            raise CodecError(f"layer_factors must be positive, got {layer_factors}")
        self.anchor_every = int(anchor_every)
        self.anchor_factor = float(anchor_factor)

    @property
    def options(self) -> dict[str, Any]:
        return {
            "levels": list(self.levels),
            "anchor_every": self.anchor_every,
            "anchor_factor": self.anchor_factor,
            "layer_factors": list(self.layer_factors),
        }

    def layer_factor(self, block: int, total_blocks: int) -> float:
        group = min(len(self.layer_factors) - 1, block * len(self.layer_factors) // total_blocks)
        return self.layer_factors[group]

    def _anchors(self, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        idx = np.arange(n)
        is_anchor = idx % self.anchor_every == 0
        return idx[is_anchor], idx[~is_anchor], (idx // self.anchor_every)[~is_anchor]

    def _encode_matrix(self, x: np.ndarray, bin_rel: float) -> bytes:
        n, c = x.shape
        rms = float(np.sqrt(np.mean(x**2))) or 1.0
        d_bin = np.float32(bin_rel * rms)
        a_bin = np.float32(d_bin * self.anchor_factor)
        anchors, others, group = self._anchors(n)
        a_sym = np.round(x[anchors] / a_bin).astype(np.int64)
        a_hat = a_sym * np.float64(a_bin)
        d_sym = np.round((x[others] - a_hat[group]) / d_bin).astype(np.int64)
        a_top, a_code = _scale_codes(a_sym)
        d_top, d_code = _scale_codes(d_sym)
        ka, wa = _encode_stream(a_sym, a_top, a_code)
        kd, wd = _encode_stream(d_sym, d_top, d_code)
        head = struct.pack(MAT_HEAD, d_bin, a_bin, ka, kd, a_top, d_top, len(wa), len(wd))
        return head + _pack_u4(a_code) + _pack_u4(d_code) + wa.tobytes() + wd.tobytes()

    def encode_shard(self, shard: ShardData) -> EncodedShard:
        spec = shard.spec
        units, configs = [], []
        for level, bin_rel in enumerate(self.levels):
            parts = [struct.pack(UNIT_HEAD, UNIT_MAGIC, spec.num_matrices, spec.tokens,
                                 spec.channels, self.anchor_every)]
            for i, x in enumerate(shard.matrices):
                block = spec.blocks[i // 2]
                rel = bin_rel * self.layer_factor(block, spec.total_blocks)
                parts.append(self._encode_matrix(x.double().numpy(), rel))
            units.append(b"".join(parts))
            configs.append(EncodedConfig(params={"level": level}, units=[level]))
        return EncodedShard(units=units, configs=configs)

    def decode(self, params: dict[str, Any], data: bytes, spec: ShardSpec) -> list[torch.Tensor]:
        try:
            return self._decode(data, spec)
        except (struct.error, ValueError, RuntimeError, AssertionError, IndexError) as exc:
            raise PackError(f"shard {spec.index}: bad cachegen data: {exc}") from None

    def _decode(self, data: bytes, spec: ShardSpec) -> list[torch.Tensor]:
        magic, m_count, n, c, every = struct.unpack_from(UNIT_HEAD, data, 0)
        if magic != UNIT_MAGIC or (m_count, n, c) != (spec.num_matrices, spec.tokens, spec.channels):
            raise PackError(f"shard {spec.index}: cachegen header does not match the shard")
        off = struct.calcsize(UNIT_HEAD)
        idx = np.arange(n)
        anchors = idx[idx % every == 0]
        others = idx[idx % every != 0]
        group = others // every
        half = (c + 1) // 2
        out = []
        for _ in range(m_count):
            d_bin, a_bin, ka, kd, a_top, d_top, na, nd = struct.unpack_from(MAT_HEAD, data, off)
            off += struct.calcsize(MAT_HEAD)
            a_code = _unpack_u4(data[off : off + half], c)
            d_code = _unpack_u4(data[off + half : off + 2 * half], c)
            off += 2 * half
            wa = np.frombuffer(data, np.uint32, na, off)
            off += 4 * na
            wd = np.frombuffer(data, np.uint32, nd, off)
            off += 4 * nd
            a_hat = _decode_stream(wa, ka, len(anchors), a_top, a_code) * np.float64(a_bin)
            d_hat = _decode_stream(wd, kd, len(others), d_top, d_code) * np.float64(d_bin)
            x = np.empty((n, c), np.float64)
            x[anchors] = a_hat
            x[others] = a_hat[group] + d_hat
            out.append(torch.from_numpy(x.astype(np.float32)))
        if off != len(data):
            raise PackError(f"shard {spec.index}: {len(data) - off} trailing bytes in cachegen data")
        return out

    def rank_key(self, params: dict[str, Any]) -> float:
        return -float(params.get("level", 0))


@register("cachegen")
def make_cachegen(
    levels: tuple[float, ...] | list[float] = (0.12, 0.3, 0.7, 1.5, 3.0, 6.0, 12.0),
    anchor_every: int = 10,
    anchor_factor: float = 0.5,
    layer_factors: tuple[float, ...] | list[float] = (1.0, 1.5, 2.0),
) -> CacheGenCodec:
    return CacheGenCodec(levels, anchor_every, anchor_factor, layer_factors)
