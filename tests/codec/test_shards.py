import pytest
from sakura.codec import CodecError, ShardLayout


def test_layout_even():
    lay = ShardLayout(steps=3, blocks=4, blocks_per_shard=2)
    assert lay.num_shards == 6
    assert lay.shard_of(0, 0) == 0 and lay.shard_of(0, 3) == 1 and lay.shard_of(2, 2) == 5
    assert lay.blocks_of(3) == (1, [2, 3])


def test_layout_uneven_and_inverse():
    lay = ShardLayout(steps=2, blocks=5, blocks_per_shard=2)
    assert lay.shards_per_step == 3 and lay.num_shards == 6
    assert lay.blocks_of(2) == (0, [4])
    seen = []
    for shard in range(lay.num_shards):
        step, blocks = lay.blocks_of(shard)
        for b in blocks:
            assert lay.shard_of(step, b) == shard
            seen.append((step, b))
    assert seen == [(s, b) for s in range(2) for b in range(5)]  # execution order


@pytest.mark.parametrize("args", [(0, 4, 1), (2, 4, 0), (2, 4, 5)])
def test_layout_rejects_bad(args):
    with pytest.raises(CodecError):
        ShardLayout(*args)


def test_layout_out_of_range():
    lay = ShardLayout(2, 2, 1)
    with pytest.raises(CodecError):
        lay.shard_of(2, 0)
    with pytest.raises(CodecError):
        lay.blocks_of(4)
