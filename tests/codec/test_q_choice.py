"""Issue 33 item 3: the per-shard choice of the importance exponent q from the measured
rate-quality front (``codec.lowrank.choose_q``, option ``q_candidates``), its manifest
field (``shards[i].q``) and ``sakura pack inspect``."""

from __future__ import annotations

import json
import random

from sakura.codec import get_codec
from sakura.codec.lowrank import choose_q, front_db
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
