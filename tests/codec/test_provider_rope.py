import math

import pytest
import torch
from sakura.codec import CodecError, PackError, get_codec
from sakura.codec.lowrank import rope_angles, rope_rotate
from sakura.codec.metrics import weighted_rel_error
from sakura.codec.pack import PackReader, decode_config
from sakura.codec.profile import select_for_ratio
from sakura.codec.provider import DecodedProvider, PackProvider
from sakura.codec.shards import ShardData, ShardSpec
from sakura.dit.rope import rope_option


def test_pack_provider_serves_steps_and_blocks(packs, small_cache):
    d, m = packs["sakura"]
    choice = select_for_ratio(m, 4)
    with PackReader(d / m.pack_file) as r:
        prov = PackProvider(m, r, choice, keep=1)
        for step in range(small_cache.steps):
            for block in range(small_cache.blocks):
                k, v = prov.get(step, block)
                shard = m.layout().shard_of(step, block)
                ref = decode_config(m, shard, choice[shard], r.read_config(shard, choice[shard]))
                j = block % 2
                assert torch.equal(k, ref[2 * j]) and torch.equal(v, ref[2 * j + 1])
        assert set(prov.decode_seconds) == set(range(len(m.shards)))
        with pytest.raises(PackError):
            PackProvider(m, r, choice[:-1])
    fd, fp = packs["fp16"]
    with PackReader(fd / fp.pack_file) as r:
        shards = [decode_config(fp, s.index, 0, r.read_config(s.index, 0)) for s in fp.shards]
    dp = DecodedProvider(fp.layout(), shards)
    assert torch.equal(dp.get(1, 2)[1], small_cache.to_fp16_exact().values[1, 2])


def _rope_setup(n_side=8, heads=2, head_dim=8):
    ys, xs = torch.meshgrid(torch.arange(n_side), torch.arange(n_side), indexing="ij")
    pos = torch.stack([torch.zeros(n_side * n_side), ys.flatten() + 0.5, xs.flatten() + 0.5], 1)
    return rope_option(pos, (2, 2, 4), 100.0, heads), pos, heads * head_dim


def test_rope_rotation_roundtrip_and_norms():
    opt, pos, c = _rope_setup()
    ang = rope_angles(opt, len(pos), c)
    x = torch.randn(len(pos), c)
    y = rope_rotate(x, ang, 2, inverse=False)
    assert torch.allclose(y.norm(dim=1), x.norm(dim=1), atol=1e-5)
    assert torch.allclose(rope_rotate(y, ang, 2, inverse=True), x, atol=1e-5)
    # pair (0, 1) of head 0 turns by pos[:, 0] * theta^0 = 0; pair (2, 3) by pos[:, 1]
    assert torch.allclose(y[:, :2], x[:, :2])
    a = pos[:, 1]
    assert torch.allclose(y[:, 2], x[:, 2] * torch.cos(a) - x[:, 3] * torch.sin(a), atol=1e-5)
    with pytest.raises(CodecError):
        rope_angles(opt, len(pos) - 1, c)
    with pytest.raises(CodecError):
        get_codec("sakura", rope={"heads": 2, "axes": [3], "theta": 1.0, "positions": [[0.0]]})


def test_rope_frame_makes_rotated_keys_cheap():
    opt, pos, c = _rope_setup()
    n = len(pos)
    gen = torch.Generator().manual_seed(0)
    pre = torch.randn(n, 2, generator=gen) @ torch.randn(2, c, generator=gen)  # rank 2
    keys = rope_rotate(pre, rope_angles(opt, n, c), 2, inverse=False)
    vals = torch.randn(n, 2, generator=gen) @ torch.randn(2, c, generator=gen)
    spec = ShardSpec(index=0, step=0, blocks=(0,), tokens=n, channels=c, total_blocks=1,
                     total_steps=1)
    sd = ShardData(spec=spec, matrices=[keys, vals], importance=[torch.ones(n)] * 2)
    errs = {}
    for name, codec in (("plain", get_codec("sakura")), ("rope", get_codec("sakura", rope=opt))):
        enc = codec.encode_shard(sd)
        i = max(j for j, cf in enumerate(enc.configs) if cf.params["rank"] == 2)
        dec = codec.decode(enc.configs[i].params, enc.config_data(i), spec)
        errs[name] = weighted_rel_error(sd.matrices, dec, sd.importance)
        assert math.isclose(errs[name], enc.configs[i].weighted_err, rel_tol=1e-3, abs_tol=1e-6)
    assert errs["rope"] < 1e-3 < errs["plain"]
