import pytest
import torch
from sakura.codec import CODECS, CodecError, get_codec
from sakura.codec.metrics import weighted_rel_error
from sakura.codec.shards import ShardLayout, shard_data


def _shard(cache, index=0):
    return shard_data(cache, ShardLayout(cache.steps, cache.blocks, 2), index)


def test_registry_and_errors():
    get_codec("fp16")
    assert {"sakura", "svd", "fp16", "intq", "cachegen"} <= set(CODECS)
    with pytest.raises(CodecError, match="unknown codec"):
        get_codec("zip")
    with pytest.raises(CodecError):
        get_codec("intq", bits=[9])
    with pytest.raises(CodecError):
        get_codec("sakura", nonsense=1)
    with pytest.raises(CodecError):
        get_codec("sakura", bits=[4, 2])
    with pytest.raises(CodecError):
        get_codec("svd", q=0.5)


def test_fp16_is_exact(small_cache):
    sd = _shard(small_cache)
    codec = get_codec("fp16")
    enc = codec.encode_shard(sd)
    assert enc.stored_bytes == sum(m.numel() * 2 for m in sd.matrices)
    dec = codec.decode({}, enc.config_data(0), sd.spec)
    exact = small_cache.to_fp16_exact()
    for i, b in enumerate(sd.spec.blocks):
        assert torch.equal(dec[2 * i], exact.keys[sd.spec.step, b])
        assert torch.equal(dec[2 * i + 1], exact.values[sd.spec.step, b])


def test_intq_bytes_and_error(small_cache):
    sd = _shard(small_cache)
    codec = get_codec("intq")
    enc = codec.encode_shard(sd)
    rows = sum(m.shape[0] for m in sd.matrices)
    groups = -(-sd.spec.channels // 32)
    errs = {}
    for i, cfg in enumerate(enc.configs):
        bits = cfg.params["bits"]
        assert enc.config_bytes(i) == rows * (4 * groups + (sd.spec.channels * bits + 7) // 8)
        dec = codec.decode(cfg.params, enc.config_data(i), sd.spec)
        errs[bits] = weighted_rel_error(sd.matrices, dec, sd.importance)
        # per element, min-max rounding is within half a step (+ fp16 rounding of the scale)
        for x, y in zip(sd.matrices, dec):
            span = (x.view(x.shape[0], -1, 16).amax(-1) - x.view(x.shape[0], -1, 16).amin(-1))
            assert float((x - y).abs().max()) <= float(span.max()) / ((1 << bits) - 1) * 0.51 + 1e-2
    assert enc.stored_bytes == sum(len(u) for u in enc.units)
    assert errs[2] > errs[3] > errs[4] > errs[8] and errs[8] < 1e-3


def test_cachegen_levels(small_cache):
    sd = _shard(small_cache, 2)
    codec = get_codec("cachegen")
    enc = codec.encode_shard(sd)
    assert len(enc.units) == len(codec.levels)  # each level stored separately
    sizes, errs = [], []
    for i, cfg in enumerate(enc.configs):
        dec = codec.decode(cfg.params, enc.config_data(i), sd.spec)
        sizes.append(enc.config_bytes(i))
        errs.append(weighted_rel_error(sd.matrices, dec, sd.importance))
    assert sizes == sorted(sizes, reverse=True)
    assert errs[0] < 1e-2 and errs[0] < errs[2] < errs[-1]
    # lossless entropy coding: a finer bin reconstructs within half a bin
    fine = get_codec("cachegen", levels=[0.01], anchor_every=5)
    e = fine.encode_shard(sd)
    dec = fine.decode({"level": 0}, e.config_data(0), sd.spec)
    for x, y in zip(sd.matrices, dec):
        rms = float(x.pow(2).mean().sqrt())
        assert float((x - y).abs().max()) <= 0.01 * 2.0 * rms * 0.5 + 1e-5


def test_cachegen_layer_bins():
    codec = get_codec("cachegen", layer_factors=[1.0, 2.0, 3.0])
    assert [codec.layer_factor(b, 6) for b in range(6)] == [1.0, 1.0, 2.0, 2.0, 3.0, 3.0]


def test_decoders_reject_garbage(small_cache):
    from sakura.codec import PackError

    sd = _shard(small_cache)
    gen = torch.Generator().manual_seed(5)
    for name in ("cachegen", "intq", "fp16", "sakura"):
        codec = get_codec(name)
        enc = codec.encode_shard(sd)
        cfg = enc.configs[0]
        data = bytearray(enc.config_data(0))
        noise = torch.randint(0, 256, (len(data) - 8,), generator=gen, dtype=torch.uint8)
        data[8:] = bytes(noise.tolist())
        for bad in (bytes(data[: len(data) // 2]), b"", b"\x00" * 3):
            with pytest.raises(PackError):
                codec.decode(cfg.params, bad, sd.spec)
        try:  # same length, random payload: either a clean error or finite tensors
            out = codec.decode(cfg.params, bytes(data), sd.spec)
            assert len(out) == sd.spec.num_matrices
        except PackError:
            pass
