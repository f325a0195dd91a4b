"""The fitted output-PSNR profile (``codec.profile.FittedPSNR``): what it measures, how
well its per-step model predicts the rest, and its cache of measured values."""

from __future__ import annotations

import pytest
from sakura.codec import ShardLayout, get_codec
from sakura.codec.metrics import err_to_db, weighted_rel_error
from sakura.codec.pack import write_pack
from sakura.codec.profile import FittedPSNR
from sakura.codec.shards import shard_data
from sakura.dit.synthetic import synthetic_cache


@pytest.fixture(scope="module")
def cache():
    return synthetic_cache(steps=6, blocks=4, grid=12, channels=48, heads=4, rank=12, seed=3)


class Truth:
    """A stand-in for the output-PSNR measurement with a known law: per step an offset,
    a slope on the KV error (dB) and a bit-width term (what a fit must capture)."""

    def __init__(self, cache, layout, slope=0.8, per_bit=1.5):
        self.cache, self.layout, self.slope, self.per_bit = cache, layout, slope, per_bit
        self.calls = 0

    def value(self, shard, params, decoded):
        step, _ = self.layout.blocks_of(shard)
        sd = shard_data(self.cache, self.layout, shard)
        kv = err_to_db(weighted_rel_error(sd.matrices, [t.float() for t in decoded],
                                          sd.importance))
        return 10.0 + 0.5 * (step // 2) + self.slope * kv + self.per_bit * float(params["bits"])

    def __call__(self, shard, params, decoded):
        self.calls += 1
        return self.value(shard, params, decoded)


def test_fitted_profile_measures_a_few_shards_and_predicts_the_rest(cache, tmp_path):
    layout = ShardLayout(cache.steps, cache.blocks, 2)
    truth = Truth(cache, layout)
    codec = get_codec("intq")
    fitted = FittedPSNR(truth, layout, cache, codec, sample_steps=3, spacing_db=3.0,
                        max_per_shard=12, cache_dir=str(tmp_path / "psnr"), key="k1")
    assert fitted.sampled_steps == [0, 2, 5]  # spread over the 6 steps
    m = write_pack(tmp_path / "a", "tpl", cache, codec, blocks_per_shard=2,
                   quality_fn=fitted)
    n_cfg = len(m.shards[0].configs)
    assert n_cfg >= 3
    # only the first shard of each sampled step is measured (at least two configurations:
    # a fit needs two points); every configuration, measured or not, gets the model's value
    assert 3 * 2 <= truth.calls == fitted.stats["measured"] <= 3 * n_cfg
    assert fitted.stats["fitted"] == len(m.shards) * n_cfg
    errors = []
    for s in m.shards:
        for c in s.configs:
            assert c.quality["psnr_db"] is not None
    # the law is linear in (kv dB, bits); intq has one configuration per bit width, too few
    # points for the bit term (the kv-only fit absorbs it, bits and KV error move together);
    # steps 1, 3, 4 use the model of the sampled step before them (0-0.5 dB offset)
    from sakura.codec.pack import PackReader, decode_config

    with PackReader(tmp_path / "a" / m.pack_file) as reader:
        for s in m.shards:
            for c in s.configs:
                dec = decode_config(m, s.index, c.id, reader.read_config(s.index, c.id), codec)
                errors.append(abs(c.quality["psnr_db"] - truth.value(s.index, c.params, dec)))
    assert max(errors) < 1.2


def test_measured_values_are_cached_per_key_and_reused(cache, tmp_path):
    layout = ShardLayout(cache.steps, cache.blocks, 2)
    codec = get_codec("intq")
    first = Truth(cache, layout)
    a = write_pack(tmp_path / "a", "tpl", cache, codec, blocks_per_shard=2,
                   quality_fn=FittedPSNR(first, layout, cache, codec,
                                         cache_dir=str(tmp_path / "c"), key="same"))
    again = Truth(cache, layout)
    fitted = FittedPSNR(again, layout, cache, codec, cache_dir=str(tmp_path / "c"), key="same")
    b = write_pack(tmp_path / "b", "tpl", cache, codec, blocks_per_shard=2, quality_fn=fitted)
    assert again.calls == 0 and fitted.stats["reused"] == first.calls > 0
    assert [[c.quality["psnr_db"] for c in s.configs] for s in a.shards] == \
           [[c.quality["psnr_db"] for c in s.configs] for s in b.shards]
    other = Truth(cache, layout)
    write_pack(tmp_path / "c2", "tpl", cache, codec, blocks_per_shard=2,
               quality_fn=FittedPSNR(other, layout, cache, codec,
                                     cache_dir=str(tmp_path / "c"), key="another"))
    assert other.calls == first.calls  # another key (weights, template, codec) measures


def test_measurements_per_sampled_shard_are_bounded_by_spacing_and_count(cache, tmp_path):
    layout = ShardLayout(cache.steps, cache.blocks, 2)
    truth = Truth(cache, layout)
    codec = get_codec("sakura")
    fitted = FittedPSNR(truth, layout, cache, codec, sample_steps=2, spacing_db=1000.0,
                        max_per_shard=5)
    write_pack(tmp_path / "s", "tpl", cache, codec, blocks_per_shard=2, quality_fn=fitted)
    # nothing is 1000 dB apart: the extremes of each bit width only, never more than 5
    assert 2 * 2 <= truth.calls <= 2 * 5


def test_a_noisy_measurement_never_reaches_the_manifest(cache, tmp_path):
    """Every value is the model's: a measured shard whose largest configuration measures
    low (noise) keeps it on its Pareto front."""
    layout = ShardLayout(cache.steps, cache.blocks, 2)
    codec = get_codec("intq")
    truth = Truth(cache, layout)
    biggest = max(codec.encode_shard(shard_data(cache, layout, 0)).configs,
                  key=lambda c: c.params["bits"]).params["bits"]

    def noisy(shard, params, decoded):
        value = truth(shard, params, decoded)
        return value - 30.0 if shard == 0 and params["bits"] == biggest else value

    m = write_pack(tmp_path / "n", "tpl", cache, codec, blocks_per_shard=2,
                   quality_fn=FittedPSNR(noisy, layout, cache, codec))
    top = max(m.shards[0].configs, key=lambda c: c.bytes)
    assert top.pareto and top.quality["psnr_db"] == max(
        c.quality["psnr_db"] for c in m.shards[0].configs)


def test_the_bit_term_can_reorder_what_the_kv_error_ranks(cache, tmp_path):
    """With a strong bit-width effect, the fitted PSNR ranks configurations differently from
    the KV error: that reordering is what a quality profile can give the allocator."""
    layout = ShardLayout(cache.steps, cache.blocks, 2)
    truth = Truth(cache, layout, slope=0.2, per_bit=-6.0)
    codec = get_codec("intq")
    fitted = FittedPSNR(truth, layout, cache, codec)
    m = write_pack(tmp_path / "r", "tpl", cache, codec, blocks_per_shard=2, quality_fn=fitted)
    s = m.shards[1]  # predicted, not measured
    by_kv = [c.id for c in sorted(s.configs, key=lambda c: -c.quality["kv_db"])]
    by_psnr = [c.id for c in sorted(s.configs, key=lambda c: -c.quality["psnr_db"])]
    assert by_kv != by_psnr
