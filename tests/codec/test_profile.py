from types import SimpleNamespace

from sakura.codec import get_codec
from sakura.codec.pack import write_pack
from sakura.codec.profile import (
    mark_pareto,
    quality_score,
    rate_quality_curve,
    select_for_ratio,
    shard_curve,
)


def _cfg(nbytes, db):
    return SimpleNamespace(bytes=nbytes, quality={"weighted_err": 10 ** (-db / 10), "kv_db": db,
                                                  "psnr_db": None}, pareto=None)


def test_mark_pareto():
    cfgs = [_cfg(100, 10), _cfg(200, 9), _cfg(300, 20), _cfg(300, 15), _cfg(50, 5)]
    mark_pareto(cfgs)
    assert [c.pareto for c in cfgs] == [True, False, True, False, True]


def test_pareto_uses_psnr_when_profiled(small_cache, tmp_path):
    calls = []

    def quality_fn(shard, params, decoded):
        calls.append((shard, dict(params)))
        assert len(decoded) == 4 or len(decoded) == 2
        return 30.0 + params.get("bits", 0)  # pretend: only precision matters

    m = write_pack(tmp_path, "q", small_cache, get_codec("intq"), quality_fn=quality_fn)
    assert len(calls) == sum(len(s.configs) for s in m.shards)
    s = m.shards[0]
    assert [c.quality["psnr_db"] for c in s.configs] == [32.0, 33.0, 34.0, 38.0]
    assert all(c.pareto for c in s.configs)
    assert quality_score(s.configs[0].quality) == 32.0


def test_selection_and_curves(packs):
    _, m = packs["sakura"]
    plain = select_for_ratio(m, 10, carry_over=False)
    assert plain is not None
    for s, c in zip(m.shards, plain):
        assert s.config(c).bytes <= m.shard_fp16_bytes(s.index) / 10
    carry = select_for_ratio(m, 10)
    spent = budget = 0.0
    for s, c in zip(m.shards, carry):  # never more than the budget so far
        spent += s.config(c).bytes
        budget += m.shard_fp16_bytes(s.index) / 10
        assert spent <= budget
    assert spent >= sum(s.config(c).bytes for s, c in zip(m.shards, plain))
    assert select_for_ratio(packs["intq"][1], 15) is None  # 2-bit INTQ is ~5.3x at best
    assert select_for_ratio(packs["fp16"][1], 2) is None
    pts = rate_quality_curve(m)
    assert pts and all(p.bytes <= m.fp16_bytes / p.ratio for p in pts)
    q = [p.quality for p in pts]
    assert q == sorted(q, reverse=True)
    curve = shard_curve(m, 0)
    assert [b for b, _ in curve] == sorted(b for b, _ in curve)
    assert [v for _, v in curve] == sorted(v for _, v in curve)
