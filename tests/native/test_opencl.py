"""OpenCL reconstruction (native/src/sakura/opencl_*) against the CPU kernels, on pocl here:
the same K/V (bit-equal, or within the float32 summation bound the CPU-vs-Python tests
use), fp16 output = the float32 result rounded to nearest even, the same errors."""

from __future__ import annotations

import numpy as np
import pytest
from sakura.codec.base import get_codec
from sakura.codec.shards import ShardLayout, shard_data
from sakura.dit.synthetic import synthetic_cache


@pytest.fixture(scope="module")
def decoder(native):
    ok, why = native.opencl_available()
    if not ok:
        pytest.skip(f"no OpenCL: {why}")
    return native.OpenCLDecoder()


def _rope_table(codec, spec):
    from sakura.edge.native_bench import rope_table

    return rope_table(codec, spec)


def _assert_agree(native, cpu: np.ndarray, gpu: np.ndarray, data: bytes, ranks, rope: bool
                  ) -> bool:
    """Bit-equal, or within (2k + 6) u |A|^T |B| per element (x2 for the RoPE pairs), the
    bound tests/native/test_decode.py holds the CPU to against Python. True: bit-equal."""
    assert cpu.shape == gpu.shape and gpu.dtype == np.float32
    if np.array_equal(cpu, gpu):
        return True
    owner, values = native.dequantize(data, ranks)
    n = cpu.shape[1]
    for m in range(cpu.shape[0]):
        if np.array_equal(cpu[m], gpu[m]):
            continue
        rows = np.abs(values[owner == m].astype(np.float64))
        env = rows[:, :n].T @ rows[:, n:]
        if rope and m % 2 == 0:
            pair = env.reshape(n, -1, 2).max(-1, keepdims=True)
            env = 2 * np.broadcast_to(pair, (n, pair.shape[1], 2)).reshape(n, -1)
        tol = (2 * rows.shape[0] + 6) * 2.0**-24 * env
        diff = np.abs(cpu[m].astype(np.float64) - gpu[m].astype(np.float64))
        assert (diff <= tol).all(), float((diff - tol).max())
    return False


def _check(native, decoder, codec, params, data, spec) -> bool:
    table = _rope_table(codec, spec)
    ranks = params["ranks"]
    cpu = native.decode(data, ranks, table)
    gpu = decoder.decode(data, ranks, table)
    equal = _assert_agree(native, cpu, gpu, data, ranks, table is not None)
    half = decoder.decode(data, ranks, table, half=True)
    assert half.dtype == np.float16 and half.shape == cpu.shape
    # fp16 storage: the float32 result rounded to nearest even (numpy's cast)
    np.testing.assert_array_equal(half, gpu.astype(np.float16))
    return equal


def test_every_config_of_a_real_pack_matches_the_cpu(native, decoder, tiny_pack):
    m, reader = tiny_pack
    codec = m.make_codec()
    assert codec.opts.rope is not None
    checked = equal = 0
    for s in (0, len(m.shards) // 2, len(m.shards) - 1):
        for cfg in m.shards[s].configs:
            data = reader.read_config(s, cfg.id)
            equal += _check(native, decoder, codec, cfg.params, data, m.spec(s))
            checked += 1
    assert checked >= 20
    print(f"bit-equal configurations: {equal}/{checked}")  # measured: all, here


@pytest.mark.parametrize("seed,bits,group,q", [(1, (2, 4, 6, 8), 64, 0.5), (2, (3, 5), 16, 0.0),
                                               (3, (1, 2, 4, 8), 8, 0.5)])
def test_odd_geometry_and_bit_widths(native, decoder, seed, bits, group, q):
    # 121 tokens (tail pieces of every power of two), 3- and 5-bit codes that straddle
    # bytes, 1-bit levels, tokens not a multiple of the 16-token tile
    cache = synthetic_cache(steps=1, blocks=2, grid=11, channels=40, heads=4, rank=6, seed=seed)
    codec = get_codec("sakura", bits=bits, group=group, q=q,
                      level_fraction=(1.0,) + (0.5,) * (len(bits) - 1), keep="all")
    layout = ShardLayout(cache.steps, cache.blocks, 2)
    sd = shard_data(cache, layout, 0)
    enc = codec.encode_shard(sd)
    for i, cfg in enumerate(enc.configs):
        _check(native, decoder, codec, cfg.params, enc.config_data(i), sd.spec)


def test_bad_input_is_the_cpu_decoders_error_and_the_decoder_stays_usable(
        native, decoder, tiny_pack):
    m, reader = tiny_pack
    codec = m.make_codec()
    cfg = m.shards[0].configs[-1]
    data = reader.read_config(0, cfg.id)
    ranks = cfg.params["ranks"]
    table = _rope_table(codec, m.spec(0))
    for bad_data, bad_ranks in ((b"junk", ranks), (data[:-1], ranks), (data + b"\0", ranks),
                                (data, [r + 1 for r in ranks]), (data, ranks[:-1])):
        with pytest.raises(native.FormatError) as gpu_err:
            decoder.decode(bad_data, bad_ranks, table)
        with pytest.raises(native.FormatError) as cpu_err:
            native.decode(bad_data, bad_ranks, table)
        assert str(gpu_err.value) == str(cpu_err.value)
    with pytest.raises(native.FormatError, match="rope must be"):
        decoder.decode(data, ranks, table[:-1])
    with pytest.raises(native.FormatError, match="rope must be"):
        decoder.decode(data, ranks, table.astype(np.float64))
    # still decodes after the errors
    _check(native, decoder, codec, cfg.params, data, m.spec(0))


def test_device_and_work_groups_are_reported(native, decoder):
    dev = native.opencl_device()
    assert dev is not None and dev["name"] == decoder.device["name"]
    assert {"platform", "version", "type", "fp16_arithmetic", "max_work_group_size"} <= set(dev)
    wg = decoder.work_groups
    assert wg["dequantize"] == min(64, dev["max_work_group_size"])
    assert wg["product"] in ((16, 16), (8, 8))
    t = decoder.last_timings
    assert set(t) == {"upload_ms", "dequantize_ms", "product_ms", "download_ms"}
    with pytest.raises(RuntimeError, match="no device whose name contains"):
        native.OpenCLDecoder("no-such-device-name")
