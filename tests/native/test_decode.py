"""The native sakura decoder agrees with the Python one (bit-equal factors; K/V bit-equal
here, within the float32 summation bound anywhere) and rejects bad input clearly."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sakura.codec import native as codec_native
from sakura.codec.base import get_codec
from sakura.codec.embedded import StreamHeader
from sakura.codec.errors import PackError
from sakura.codec.lowrank import LowRankCodec
from sakura.codec.quant import ProgressiveQuantizer, SegmentPlan, unpack_codes
from sakura.codec.shards import ShardData, ShardLayout, ShardSpec, shard_data
from sakura.dit.synthetic import synthetic_cache


def _both(codec: LowRankCodec, params, data, spec, native, threads: int = 1):
    """Python and native K/V, after checking they agree (see :func:`_assert_agree`)."""
    codec.use_native = False
    try:
        ref = codec.decode(params, data, spec)
    finally:
        codec.use_native = True
    codec.native_threads = threads
    try:
        out = codec.decode(params, data, spec)
    finally:
        codec.native_threads = 1
    _assert_agree(ref, out, native, data, params["ranks"], codec.opts.rope is not None)
    return ref, out


def _assert_agree(ref, out, native, data, ranks, rope: bool) -> None:
    """Bit-equal dequantized factors are guaranteed (and tested below); the K/V product sums
    over components, so with another BLAS/SIMD order each element may differ within the
    float32 summation bound (2k + 6) u (|A|^T |B|), u = 2^-24 (x2 for the RoPE pairs).
    On this machine (MKL, AVX-512 kernel) they are bit-equal; both are counted."""
    assert len(ref) == len(out)
    owner, values = native.dequantize(data, ranks)
    n = ref[0].shape[0]
    for m, (a, b) in enumerate(zip(ref, out)):
        assert a.dtype == b.dtype == torch.float32 and a.shape == b.shape
        if torch.equal(a, b):
            continue
        rows = torch.from_numpy(values[owner == m]).double().abs()
        env = rows[:, :n].T @ rows[:, n:]
        if rope and m % 2 == 0:
            env = 2 * env.view(n, -1, 2).amax(-1, keepdim=True).expand(-1, -1, 2).reshape(n, -1)
        tol = (2 * rows.shape[0] + 6) * 2.0**-24 * env
        diff = (a.double() - b.double()).abs()
        assert bool((diff <= tol).all()), float((diff - tol).max())


def test_real_pack_every_config_of_several_shards_bit_equal(native, tiny_pack):
    m, reader = tiny_pack
    codec = m.make_codec()
    assert codec.opts.rope is not None  # the keys go through the RoPE frame
    checked = equal = 0
    for s in (0, len(m.shards) // 2, len(m.shards) - 1):
        for cfg in m.shards[s].configs:
            data = reader.read_config(s, cfg.id)
            ref, out = _both(codec, cfg.params, data, m.spec(s), native)
            equal += sum(bool(torch.equal(a, b)) for a, b in zip(ref, out))
            checked += len(ref)
    assert checked >= 100
    print(f"bit-equal K/V tensors: {equal}/{checked}")


@pytest.mark.parametrize("seed,bits,group,q", [(1, (2, 4, 6, 8), 64, 0.5), (2, (3, 5), 16, 0.0),
                                               (3, (1, 2, 4, 8), 8, 0.5), (4, (4, 8), 32, 1.0)])
def test_synthetic_configs_bit_equal(native, seed, bits, group, q):
    # odd token counts (tail pieces of every power of two), 3- and 5-bit levels (codes that
    # straddle bytes), 1-bit levels, partial shards
    cache = synthetic_cache(steps=1, blocks=3, grid=11, channels=40, heads=4, rank=6, seed=seed)
    codec = get_codec("sakura", bits=bits, group=group, q=q,
                      level_fraction=(1.0,) + (0.5,) * (len(bits) - 1), keep="all")
    layout = ShardLayout(cache.steps, cache.blocks, 2)
    for s in range(layout.num_shards):
        sd = shard_data(cache, layout, s)
        enc = codec.encode_shard(sd)
        for i, cfg in enumerate(enc.configs):
            _both(codec, cfg.params, enc.config_data(i), sd.spec, native, threads=1 + i % 3)


def test_dequantized_factors_bit_equal_to_progressive_quantizer(native, tiny_pack):
    m, reader = tiny_pack
    cfg = m.shards[1].configs[-1]
    data = reader.read_config(1, cfg.id)
    h = native.header(data)
    owner, values = native.dequantize(data, cfg.params["ranks"])
    # the Python decoder's own steps and codes, straight from the bytes
    quant = ProgressiveQuantizer(SegmentPlan((h.tokens, h.channels), h.group),
                                 tuple(h.level_bits))
    n_len = h.tokens + h.channels
    groups = quant.plan.groups
    counts = [r * h.matrices for r in cfg.params["ranks"]]
    # the level streams of the prefix (units re-assembled in stream order, FORMAT.md)
    streams = StreamHeader.parse(data).split(data, cfg.params["ranks"])
    codes = []
    for lv, k in enumerate(counts):
        if k == 0:
            break
        size = (n_len * h.level_bits[lv] + 7) // 8 + (1 + 2 * groups if lv == 0 else 0)
        block = torch.frombuffer(bytearray(streams[lv]), dtype=torch.uint8).view(k, size)
        if lv == 0:
            own = block[:, 0].numpy()
            steps = block[:, 1: 1 + 2 * groups].contiguous().view(torch.float16)
            block = block[:, 1 + 2 * groups:]
        codes.append(unpack_codes(block, h.level_bits[lv], n_len))
    ref = quant.decode(steps, codes)
    assert np.array_equal(owner, own)
    assert torch.equal(torch.from_numpy(values), ref)


def test_thread_count_does_not_change_the_result(native, tiny_pack):
    m, reader = tiny_pack
    codec = m.make_codec()
    cfg = m.shards[0].configs[-1]
    data = reader.read_config(0, cfg.id)
    table = np.ascontiguousarray(torch.view_as_real(codec._phasors(m.spec(0), torch.float32)))
    one = native.decode(data, cfg.params["ranks"], table, 1)
    for t in (2, 3, 8):
        assert np.array_equal(native.decode(data, cfg.params["ranks"], table, t), one)


def test_switch_env_forces_python(native, tiny_pack, monkeypatch):
    assert codec_native.available() and codec_native.status().enabled
    monkeypatch.setenv("SAKURA_NATIVE", "0")
    st = codec_native.status()
    assert not codec_native.available() and not st.enabled and "SAKURA_NATIVE" in st.reason
    with pytest.raises(PackError, match="not available"):
        codec_native.decode_lowrank(b"", [1], None)


def _small_config():
    spec = ShardSpec(index=0, step=0, blocks=(0,), tokens=20, channels=12, total_blocks=1,
                     total_steps=1)
    g = torch.Generator().manual_seed(0)
    mats = [torch.randn(20, 3, generator=g) @ torch.randn(3, 12, generator=g) for _ in range(2)]
    sd = ShardData(spec=spec, matrices=mats, importance=[torch.ones(20)] * 2)
    codec = get_codec("sakura")
    enc = codec.encode_shard(sd)
    i = len(enc.configs) - 1
    return codec, spec, enc.configs[i].params, enc.config_data(i)


def test_bad_input_is_a_clear_error_never_a_crash(native):
    codec, spec, params, data = _small_config()
    ranks = params["ranks"]
    # through the codec (validated in Python first): PackError
    for bad in (data[:-1], data + b"\0", b"XXXX" + data[4:], data[:10]):
        with pytest.raises(PackError):
            codec.decode(params, bad, spec)
    # straight into the native module: its own FormatError (a ValueError), never a crash
    cases = [
        (b"", ranks), (data[:18], ranks), (data[:-1], ranks), (data + b"\0", ranks),
        (b"SKLR\x01" + data[5:], ranks),  # format-1 stream version
        (b"SKLR\x03" + data[5:], ranks),  # a future version
        (data[:5] + b"\0" + data[6:], ranks),  # zero levels
        (data[:16] + b"\x03\x00" + data[18:], ranks),  # group not a power of two
        (data[:18] + b"\x09" + data[19:], ranks),  # a 9-bit level
        (data, ranks[:-1]), (data, [-1] + ranks[1:]), (data, [10**6] + ranks[1:]),
        (data, [0] * len(ranks)), (data, [ranks[0], ranks[0] + 1] + ranks[2:]),
    ]
    for bad, rk in cases:
        with pytest.raises(native.FormatError):
            native.decode(bad, rk, None, 1)
    # a prefix the stream does not have (ranks of a later level without the earlier one)
    head = StreamHeader.parse(data)
    prefixes, counts = set(), [0] * head.levels
    for lv, _first, end in head.walk():
        counts[lv] = end
        prefixes.add(tuple(c // head.matrices for c in counts))
    other = next(s for s in ((r,) + (0,) * (head.levels - 1) for r in head.ladder)
                 if s not in prefixes and s[0] <= ranks[0])
    with pytest.raises(native.FormatError, match="not a prefix"):
        native.decode(data, list(other), None, 1)
    # a unit list that refines before it quantizes: refused when the header is parsed
    bad_order = StreamHeader(head.levels, head.matrices, head.tokens, head.channels,
                             head.group, head.level_bits, head.ladder,
                             (1,) + head.unit_levels[1:]).pack()
    with pytest.raises(native.FormatError, match="refines"):
        native.decode(bad_order + data[head.size:], ranks, None, 1)
    # a component owned by a matrix that does not exist
    hdr = head.size
    evil = data[:hdr] + bytes([200]) + data[hdr + 1:]
    with pytest.raises(native.FormatError, match="matrix 200"):
        native.decode(evil, ranks, None, 1)
    with pytest.raises(PackError):
        codec_native.decode_lowrank(evil, ranks, None)
    # a RoPE table of the wrong shape or dtype
    for table in (np.zeros((20, 6, 2), np.float64), np.zeros((19, 6, 2), np.float32),
                  np.zeros((20, 6, 2), np.float32)[:, ::2]):
        with pytest.raises(native.FormatError, match="rope"):
            native.decode(data, ranks, table, 1)
    with pytest.raises(PackError):
        codec_native.decode_lowrank(data, ranks, torch.zeros(20, 6))
    with pytest.raises(PackError):
        codec_native.decode_lowrank(data, ranks, None, threads=0)
    with pytest.raises(TypeError):
        native.decode("not bytes", ranks, None, 1)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("group,channels", [(32, 48), (16, 16), (7, 20)])
def test_intq_native_decode_is_the_codecs_bit_for_bit(native, bits, group, channels):
    """``sakura_native.decode_intq`` (the streamed edit's IntQ stage, also sakura-edge's)
    against ``IntQCodec.decode``: every bit width (codes straddling bytes at 3, 5, 6, 7),
    partial channel groups, outliers; equal to the bit, since both round the product and the
    sum apart."""
    if not hasattr(native, "decode_intq"):
        pytest.skip("the native module was built without the edit runtime")
    from sakura.codec.intq import IntQCodec

    torch.manual_seed(bits * 100 + group)
    mats = [torch.randn(9, channels) * (1 + 20 * (torch.rand(9, 1) < 0.2)) for _ in range(4)]
    spec = ShardSpec(index=0, step=0, blocks=(0, 1), tokens=9, channels=channels,
                     total_blocks=2, total_steps=1)
    codec = IntQCodec(bits=[bits], group=group)
    enc = codec.encode_shard(ShardData(spec=spec, matrices=mats,
                                       importance=[torch.ones(9)] * 4))
    data = enc.units[0]
    ref = torch.stack(codec.decode({"bits": bits}, data, spec)).reshape(-1, channels)
    out = native.decode_intq(data, bits, group, 4 * 9, channels)
    assert out.dtype == np.float32 and out.shape == (36, channels)
    assert np.array_equal(out, ref.numpy())
    for bad in (data[:-1], data + b"\0"):
        with pytest.raises(native.FormatError, match="intq"):
            native.decode_intq(bad, bits, group, 36, channels)
    with pytest.raises(native.FormatError, match="bits 1-8"):
        native.decode_intq(data, 9, group, 36, channels)
