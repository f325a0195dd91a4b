"""Issue 33 item 3: the per-shard choice of the importance exponent q from the measured
rate-quality front (``codec.lowrank.choose_q``, option ``q_candidates``), its manifest
field (``shards[i].q``) and ``sakura pack inspect``."""

from __future__ import annotations

import json
import math
import random

import pytest
from sakura.codec import get_codec
from sakura.codec.errors import CodecError
from sakura.codec.lowrank import choose_q, choose_q_db, front_db
from sakura.codec.pack import Manifest, write_pack
from sakura.codec.shards import ShardLayout, shard_data

from sakura.cli import main


def _random_front(rng: random.Random) -> list[tuple[int, float]]:
    return [(rng.randint(10, 1000), rng.uniform(1e-4, 1.0)) for _ in range(rng.randint(1, 8))]


def test_choose_q_never_worse_than_q0_on_the_measured_front():
    rng = random.Random(33)
    picked_other = 0
    for _ in range(500):
        fronts = [_random_front(rng) for _ in range(rng.randint(1, 4))]
        budgets = sorted(rng.uniform(5, 1200) for _ in range(3))
        i = choose_q(fronts, budgets)
        base, got = front_db(fronts[0], budgets), front_db(fronts[i], budgets)
        for b0, g in zip(base, got):
            assert b0 is None or (g is not None and g >= b0)
        if i:
            picked_other += 1
            assert sum(g - b0 for g, b0 in zip(got, base) if b0 is not None) > 0
    assert picked_other > 0  # the choice does pick q != 0 where it dominates


def test_choose_q_prefers_the_better_dominating_front():
    budgets = [100.0, 300.0]
    q0 = [(90, 0.10), (290, 0.01)]
    worse_somewhere = [(90, 0.05), (290, 0.02)]  # better at 100 B, worse at 300 B
    better = [(90, 0.08), (290, 0.008)]
    assert choose_q([q0, worse_somewhere], budgets) == 0
    assert choose_q([q0, worse_somewhere, better], budgets) == 2
    assert front_db(better, [50.0]) == [None]


def test_encoded_choice_is_no_worse_than_plain_svd(small_cache):
    layout = ShardLayout(small_cache.steps, small_cache.blocks, 2)
    codec = get_codec("sakura", q_candidates=[0.5, 1.0])
    svd = get_codec("svd")
    for i in range(layout.num_shards):
        sd = shard_data(small_cache, layout, i)
        enc = codec.encode_shard(sd)
        assert enc.meta["q"] in (0.0, 0.5, 1.0)
        fp16 = 2 * sd.spec.num_matrices * sd.spec.tokens * sd.spec.channels
        budgets = [fp16 / r for r in (5, 15, 50)]
        ref = svd.encode_shard(sd)
        mine = front_db([(enc.config_bytes(j), c.weighted_err) for j, c in enumerate(enc.configs)],
                        budgets)
        base = front_db([(ref.config_bytes(j), c.weighted_err) for j, c in enumerate(ref.configs)],
                        budgets)
        assert mine == enc.meta["q_front_db"][f"{enc.meta['q']:g}"]
        for m, b in zip(mine, base):
            assert b is None or (m is not None and m >= b - 1e-9)


def test_manifest_records_the_choice_and_round_trips(small_cache, tmp_path, packs, capsys):
    m = write_pack(tmp_path, "tpl-q", small_cache, get_codec("sakura", q_candidates=[0.5, 1.0]),
                   blocks_per_shard=2)
    qs = [s.q for s in m.shards]
    assert all(q in (0.0, 0.5, 1.0) for q in qs)
    assert m.codec_options["q_candidates"] == [0.5, 1.0]
    doc = json.loads(m.to_json())
    assert [s["q"] for s in doc["shards"]] == qs
    back = Manifest.from_json(m.to_json())
    assert [s.q for s in back.shards] == qs and back.to_json() == m.to_json()
    # without the option: no q key, no new codec option (older packs byte-identical)
    _, plain = packs["sakura"]
    assert all("q" not in s for s in json.loads(plain.to_json())["shards"])
    assert "q_candidates" not in plain.codec_options
    assert Manifest.from_json(plain.to_json()).to_json() == plain.to_json()
    assert main(["pack", "inspect", str(tmp_path), "--no-verify"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("q per shard"))
    assert line.split(":", 1)[1].split("(")[0].split() == [f"{q:g}" for q in qs]
    d, _ = packs["sakura"]
    assert main(["pack", "inspect", str(d), "--no-verify"]) == 0
    assert "q per shard" not in capsys.readouterr().out


# ---------------------------------------------------------------- the output front
def test_choose_q_db_never_worse_than_candidate_0():
    rng = random.Random(34)
    for _ in range(500):
        k = rng.randint(1, 4)
        dbs = [[None if rng.random() < 0.15 else rng.uniform(20, 80) for _ in range(3)]
               for _ in range(k)]
        i = choose_q_db(dbs)
        for d, b0 in zip(dbs[i], dbs[0]):
            assert b0 is None or (d is not None and d >= b0)
    assert choose_q_db([[50.0, 30.0], [51.0, 29.9], [50.5, 30.5]]) == 2
    assert choose_q_db([[50.0, 30.0], [50.0, 30.0]]) == 0  # ties keep q = 0


def test_choose_q_db_mean_rule_never_loses_to_candidate_0_on_the_mean():
    rng = random.Random(35)
    for _ in range(500):
        dbs = [[rng.uniform(20, 80) for _ in range(3)] for _ in range(rng.randint(1, 4))]
        if len(dbs) > 1 and rng.random() < 0.3:
            dbs[-1][rng.randrange(3)] = None  # a candidate (not q = 0) that misses a budget
        i = choose_q_db(dbs, dominate=False)
        assert all(d is not None for d in dbs[i])
        assert sum(dbs[i]) >= sum(dbs[0])
        # and it is the best mean among the candidates that reach every budget
        assert sum(dbs[i]) == pytest.approx(max(sum(d) for d in dbs if None not in d))
    # a candidate worse at one budget but better on the mean wins here, not with dominate
    assert choose_q_db([[50.0, 30.0], [53.0, 29.0]], dominate=False) == 1
    assert choose_q_db([[50.0, 30.0], [53.0, 29.0]]) == 0


class _FakeMeasure:
    """A seeded stand-in for the builder's output PSNR: minus the dB of an unweighted error
    (plain SVD's objective) of the decoded shard, so q = 0 should win where it matters."""

    def __init__(self, cache, layout):
        self.cache, self.layout, self.calls = cache, layout, []

    def __call__(self, shard, params, decoded):
        sd = shard_data(self.cache, self.layout, shard)
        num = sum(float(((x.float() - y.float()) ** 2).sum()) for x, y in zip(sd.matrices, decoded))
        den = sum(float((x.float() ** 2).sum()) for x in sd.matrices)
        self.calls.append((shard, json.dumps(params, sort_keys=True)))
        return -10 * math.log10(max(num / den, 1e-20))


def test_output_front_choice_uses_the_measure_and_never_loses_to_q0_on_it(small_cache):
    layout = ShardLayout(small_cache.steps, small_cache.blocks, 2)
    codec = get_codec("sakura", q_candidates=[0.5, 1.0], q_front="output")
    codec.q_measure = measure = _FakeMeasure(small_cache, layout)
    assert codec.options["q_front"] == "output"
    for i in range(layout.num_shards):
        enc = codec.encode_shard(shard_data(small_cache, layout, i))
        assert enc.meta["q_front"] == "output"
        fronts = enc.meta["q_output_db"]
        assert set(fronts) == {"0", "0.5", "1"}
        mine, base = fronts[f"{enc.meta['q']:g}"], fronts["0"]
        for m, b in zip(mine, base):
            assert b is None or (m is not None and m >= b)
    # only the shard's own configurations are measured, each at most once per candidate
    assert measure.calls and all(0 <= s < layout.num_shards for s, _ in measure.calls)
    assert len(measure.calls) <= layout.num_shards * 3 * 3


def test_output_front_without_a_measure_falls_back_to_the_kv_front(small_cache):
    layout = ShardLayout(small_cache.steps, small_cache.blocks, 2)
    out = get_codec("sakura", q_candidates=[0.5], q_front="output")
    kv = get_codec("sakura", q_candidates=[0.5])
    assert "q_front" not in kv.options  # the kv front: manifests as before the option
    sd = shard_data(small_cache, layout, 0)
    a, b = out.encode_shard(sd), kv.encode_shard(sd)
    assert a.meta["q_front"] == "kv" and a.meta["q"] == b.meta["q"] and a.units == b.units


def test_q_front_bad_value_is_one_clear_error():
    with pytest.raises(CodecError, match="q_front must be 'kv' or 'output'"):
        get_codec("sakura", q_candidates=[0.5], q_front="psnr")
    with pytest.raises(CodecError, match="q_dominate must be true or false"):
        get_codec("sakura", q_candidates=[0.5], q_dominate="no")


def test_bench_gives_sakura_the_builders_output_q_choice_only_with_a_measure(small_cache):
    from sakura.codec_bench import BenchTemplate, run_codec_bench

    made = []

    def factory(layout):
        made.append(_FakeMeasure(small_cache, layout))
        return made[-1]

    with_measure = BenchTemplate("tpl-m", small_cache, measure=factory)
    res = run_codec_bench([with_measure], {"svd": {}, "sakura": {}}, ratios=(5, 15))
    opts = res["codec_options"]
    assert opts["sakura"]["q_front"] == "output" and opts["sakura"]["q_candidates"] == [0.25, 0.5, 1.0]
    assert opts["sakura"]["q_dominate"] is False
    assert "q_candidates" not in opts["svd"]
    rec = res["per_template"]["tpl-m"]["codecs"]
    assert rec["sakura"]["q_front"] == ["output"] and made and made[0].calls
    assert all(q in (0.0, 0.25, 0.5, 1.0) for q in rec["sakura"]["q_chosen"])
    assert "q_chosen" not in rec["svd"]
    # an explicit option wins over the builder's (q_candidates=None: q = 0.5 everywhere)
    plain = run_codec_bench([BenchTemplate("tpl-p", small_cache, measure=factory)],
                            {"sakura": {"q_candidates": None}}, ratios=(5,))
    assert "q_candidates" not in plain["codec_options"]["sakura"]
    assert "q_chosen" not in plain["per_template"]["tpl-p"]["codecs"]["sakura"]
