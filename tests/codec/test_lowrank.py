import torch
from sakura.codec import get_codec
from sakura.codec.metrics import weighted_rel_error
from sakura.codec.shards import ShardLayout, shard_data


def _shard(cache, index=0, bps=2):
    return shard_data(cache, ShardLayout(cache.steps, cache.blocks, bps), index)


def test_q0_factorization_is_plain_svd(small_cache):
    sd = _shard(small_cache)
    codec = get_codec("svd")
    x = sd.matrices[0]
    a, b, rel = codec.factorize(x, sd.importance[0])
    u, s, vh = torch.linalg.svd(x.double(), full_matrices=False)
    for r in (1, 4, 10):
        plain = (u[:, :r] * s[:r]) @ vh[:r]
        assert torch.allclose(a[:r].T @ b[:r], plain, atol=1e-8)
    assert torch.allclose(rel, s**2 / (s**2).sum())


def test_svd_codec_equals_sakura_q0(small_cache):
    sd = _shard(small_cache)
    e1 = get_codec("svd").encode_shard(sd)
    e2 = get_codec("sakura", q=0.0).encode_shard(sd)
    assert e1.units == e2.units
    assert [c.params for c in e1.configs] == [c.params for c in e2.configs]


def test_importance_weighting_changes_the_basis(small_cache):
    sd = _shard(small_cache)
    a0, _, _ = get_codec("svd").factorize(sd.matrices[0], sd.importance[0])
    a5, _, _ = get_codec("sakura").factorize(sd.matrices[0], sd.importance[0])
    assert not torch.allclose(a0[:4].abs(), a5[:4].abs(), atol=1e-3)


def test_closed_form_error_matches_decode(small_cache):
    sd = _shard(small_cache, 1)  # the partial shard (one block, two matrices)
    codec = get_codec("sakura")
    enc = codec.encode_shard(sd)
    for i, cfg in enumerate(enc.configs):
        dec = codec.decode(cfg.params, enc.config_data(i), sd.spec)
        err = weighted_rel_error(sd.matrices, dec, sd.importance)
        assert abs(err - cfg.weighted_err) <= 1e-5 * max(err, 1e-3), (cfg.params, err)


def test_layout_is_progressive(small_cache):
    from sakura.codec.embedded import StreamHeader

    sd = _shard(small_cache)
    codec = get_codec("sakura", keep="all")
    enc = codec.encode_shard(sd)
    g = codec.geometry(sd.spec.num_matrices, sd.spec.tokens, sd.spec.channels)
    uniform = {(c.params["rank"], c.params["bits"]) for c in enc.configs
               if len({r for r in c.params["ranks"] if r}) == 1}
    for r in g.reference:  # the uniform configurations of format 1's ladder
        assert (r, 2) in uniform
        if r <= g.level_max[-1]:
            assert (r, 8) in uniform
    # every configuration is ONE contiguous run of units that starts with a stream header,
    # and is exactly the prefix of that stream its ranks name
    headers = [i for i, u in enumerate(enc.units) if u[:4] == b"SKLR"]
    assert headers[0] == 0 and enc.meta["streams"] == len(headers) >= 2
    for i, cfg in enumerate(enc.configs):
        assert cfg.units == list(range(cfg.units[0], cfg.units[-1] + 1))
        assert cfg.units[0] in headers
        head = StreamHeader.parse(enc.units[cfg.units[0]])
        assert head.prefix_units(cfg.params["ranks"]) == len(cfg.units) - 1
        assert len(enc.config_data(i)) == head.prefix_bytes(len(cfg.units) - 1)
    # a higher rank at the same bits costs more and is no worse
    by = sorted(enc.configs, key=lambda c: enc.config_bytes(enc.configs.index(c)))
    assert by[0].weighted_err > by[-1].weighted_err


def test_every_prefix_of_the_stream_is_a_staircase_in_rate_distortion_order(small_cache):
    from sakura.codec.embedded import StreamHeader

    sd = _shard(small_cache)
    codec = get_codec("sakura")
    enc = codec.encode_shard(sd)
    assert enc.meta["streams"] == 1
    head = StreamHeader.parse(enc.units[0])
    counts = [0] * head.levels
    for lv, first, end in head.walk():
        assert first == counts[lv] and end > first
        counts[lv] = end
        assert all(a >= b for a, b in zip(counts, counts[1:]))  # a staircase
    # the table's configurations are prefixes of the one stream, nested in byte order,
    # and each further byte buys a lower error
    prev_units, prev_err = [], float("inf")
    for cfg in sorted(enc.configs, key=lambda c: len(c.units)):
        assert cfg.units[: len(prev_units)] == prev_units
        assert cfg.weighted_err < prev_err
        prev_units, prev_err = cfg.units, cfg.weighted_err
    # the prefix layout reaches the multi-range Pareto front's errors with few more bytes
    ratios = [r for r in enc.meta["bytes_vs_pareto"] if r is not None]
    assert ratios and min(ratios) > 0.5  # (the finer unit ladder can need fewer bytes)
    assert sorted(ratios)[len(ratios) // 2] <= 1.10


def test_stream_header_rejects_bad_unit_orders():
    import pytest
    from sakura.codec import PackError
    from sakura.codec.embedded import StreamHeader

    ok = StreamHeader(2, 2, 8, 8, 4, (2, 2), (1, 2, 4), (0, 1, 0))
    assert StreamHeader.parse(ok.pack()) == ok
    for units in ((1,), (0, 1, 1), (0, 0, 0, 0)):  # refine before, then past the ladder
        with pytest.raises(PackError):
            StreamHeader.parse(StreamHeader(2, 2, 8, 8, 4, (2, 2), (1, 2, 4), units).pack())
    with pytest.raises(PackError, match="version 1 is not supported"):
        StreamHeader.parse(ok.pack()[:4] + b"\x01" + ok.pack()[5:])
    with pytest.raises(PackError, match="truncated"):
        StreamHeader.parse(ok.pack()[:-1])


def test_exact_low_rank_is_recovered():
    from sakura.codec.shards import ShardData, ShardSpec

    gen = torch.Generator().manual_seed(3)
    n, c = 40, 24
    mats = [torch.randn(n, 3, generator=gen) @ torch.randn(3, c, generator=gen) for _ in range(2)]
    imp = [torch.rand(n, generator=gen)] * 2
    spec = ShardSpec(index=0, step=0, blocks=(0,), tokens=n, channels=c, total_blocks=1,
                     total_steps=1)
    sd = ShardData(spec=spec, matrices=mats, importance=imp)
    codec = get_codec("sakura", r_max=4, ranks=[1, 2, 3, 4], level_fraction=[1, 1, 1, 1])
    enc = codec.encode_shard(sd)
    best = min(enc.configs, key=lambda cf: cf.weighted_err)
    assert best.params["bits"] == 8 and best.weighted_err < 1e-4
    dec = codec.decode(best.params, enc.config_data(enc.configs.index(best)), spec)
    assert weighted_rel_error(mats, dec, imp) < 1e-4


def test_zero_importance_and_zero_matrix():
    from sakura.codec.shards import ShardData, ShardSpec

    n, c = 20, 16
    mats = [torch.zeros(n, c), torch.randn(n, c)]
    imp = [torch.zeros(n)] * 2
    spec = ShardSpec(index=0, step=0, blocks=(0,), tokens=n, channels=c, total_blocks=1,
                     total_steps=1)
    codec = get_codec("sakura")
    enc = codec.encode_shard(ShardData(spec=spec, matrices=mats, importance=imp))
    cfg = enc.configs[-1]
    dec = codec.decode(cfg.params, enc.config_data(len(enc.configs) - 1), spec)
    assert torch.isfinite(dec[0]).all() and float(dec[0].abs().max()) == 0.0
    assert torch.isfinite(dec[1]).all()


def test_decode_rejects_bad_params_and_bytes(small_cache):
    import pytest
    from sakura.codec import PackError

    sd = _shard(small_cache)
    codec = get_codec("sakura")
    enc = codec.encode_shard(sd)
    cfg = enc.configs[3]
    data = enc.config_data(3)
    for params in ({}, {"ranks": "12"}, {"ranks": [1, 2]}, {"ranks": [-1, 0, 0, 0]},
                   {"ranks": [0, 0, 0, 0]}, {"ranks": [1.5, 0, 0, 0]}, {"ranks": [999, 0, 0, 0]}):
        with pytest.raises(PackError):
            codec.decode(params, data, sd.spec)
    with pytest.raises(PackError):
        codec.decode(cfg.params, data[:-1], sd.spec)
    with pytest.raises(PackError):
        codec.decode(cfg.params, b"XXXX" + data[4:], sd.spec)


def test_default_table_is_the_thinned_pareto_front(small_cache):
    sd = _shard(small_cache)
    enc = get_codec("sakura").encode_shard(sd)
    sizes = [enc.config_bytes(i) for i in range(len(enc.configs))]
    errs = [c.weighted_err for c in enc.configs]
    assert sizes == sorted(sizes) and errs == sorted(errs, reverse=True)
    assert all(b >= a * 1.15 for a, b in zip(sizes[:-2], sizes[1:-1]))
    full = get_codec("sakura", keep="all").encode_shard(sd)
    assert len(full.configs) > len(enc.configs)
    assert min(c.weighted_err for c in full.configs) == errs[-1]
    uniform_only = get_codec("sakura", mixed=False).encode_shard(sd)
    assert all(len({r for r in c.params["ranks"] if r}) == 1 for c in uniform_only.configs)
