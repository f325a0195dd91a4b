"""The stale plan's source rule (edge/stale_plan.py) and its C++ twin (``stale_source`` in
native/src/sakura/edit.cpp), on the same tables."""

from __future__ import annotations

import itertools

import pytest
from sakura.edge.stale_plan import stale_source

# 5 steps x 2 block groups, shards in execution order
LAYOUT = [(s, [0, 1] if g == 0 else [2, 3]) for s in range(5) for g in range(2)]


@pytest.fixture(params=["python", "native"])
def source(request):
    if request.param == "python":
        return stale_source
    import sakura_native as native

    return lambda blocks, planned, shard, max_age, unfetched_from=None: native.stale_source(
        [(s, list(b)) for s, b in blocks], list(planned), shard, max_age, unfetched_from)


def test_the_source_is_the_last_fetched_shard_of_the_same_blocks(source):
    planned = [False] * len(LAYOUT)
    assert source(LAYOUT, planned, 0, 3) is None and source(LAYOUT, planned, 1, 3) is None
    assert source(LAYOUT, planned, 2, 3) == 0  # step 1 group 0: step 0's group 0
    assert source(LAYOUT, planned, 3, 3) == 0
    planned[2] = planned[4] = planned[6] = True  # group 0 of steps 1-3 not fetched
    assert source(LAYOUT, planned, 6, 3) == 0  # age 3: the cap
    assert source(LAYOUT, planned, 8, 3) is None  # age 4: fetched
    assert source(LAYOUT, planned, 7, 3) == 2  # the other group is its own
    assert source(LAYOUT, planned, 2, 0) is None  # max_age 0: off


def test_the_lookahead_counts_the_shards_it_has_not_decided_as_unfetched(source):
    """From shard 4 on nothing is decided: shard 8 (step 4, group 0) may not lean on shards
    4 or 6 (steps 2, 3), which the plan itself may skip, only on shard 2 (step 1, age 3)."""
    planned = [False] * len(LAYOUT)
    assert source(LAYOUT, planned, 8, 3) == 3  # decided: step 3's shard 6
    assert source(LAYOUT, planned, 8, 3, 4) == 1  # shard 2, step 1
    assert source(LAYOUT, planned, 8, 3, 2) is None  # step 0 is 4 steps back
    planned[2] = True
    assert source(LAYOUT, planned, 8, 3, 4) is None
    assert source(LAYOUT, planned, 4, 3, 4) == 0  # the shard at hand: as decided


def test_python_and_native_agree_on_every_plan_of_a_small_layout():
    import sakura_native as native

    for bits in itertools.product([False, True], repeat=6):
        planned = list(bits) + [False] * (len(LAYOUT) - 6)
        for shard in range(len(LAYOUT)):
            for age in (0, 1, 3):
                for frm in (None, 0, 3, shard):
                    assert stale_source(LAYOUT, planned, shard, age, frm) == (
                        native.stale_source([(s, b) for s, b in LAYOUT], planned, shard, age,
                                            frm)), (planned, shard, age, frm)
