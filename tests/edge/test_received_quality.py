"""What quality an edit got (issue 29 item 5): its share of the pack's full-quality bytes and
the PSNR vs exact that the pack's per-configuration profile predicts, from real edits
against a real local server."""

from __future__ import annotations

import json
import math

import pytest
from sakura.cloud.psnr_profile import OutputPSNR
from sakura.cloud.publish import CatalogTransaction
from sakura.cloud.server import create_app
from sakura.cloud.storage import LocalStorage
from sakura.codec.base import get_codec
from sakura.codec.pack import write_pack
from sakura.codec.shards import ShardLayout
from sakura.dit.editing import profile_importance, template_run
from sakura.edge.netem import shaped
from sakura.edge.quality import received_quality
from sakura.edge.runtime import EdgeRuntime, EditOptions
from sakura.traces import Trace

from tests.edge.helpers import TEMPLATE_ID, FakeEncoder, Server, tiny_model, tiny_template

PROMPT = "turn my secret portrait into a pirate captain"
# a fast link, a 60 s deadline and every shard requested at once: every shard's window is
# the whole deadline, so each gets its largest configuration (with the default lookahead
# the last shards' windows are one execution slot at the rate measured on 127.0.0.1, and
# they took smaller ones)
# (no local fallback: on a loaded host a late shard's step would run on the device and
# receive nothing, as the clean-clone CI at ebf554a saw: fraction 0.49)
EVERYTHING = EditOptions(initial_rate_bps=1e10, deadline_s=60.0, max_ahead=16,
                         max_inflight=16, local_fallback=False)


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """The tiny world's sakura pack, built with the output-PSNR profile (every
    configuration of every shard, two profiling requests)."""
    root = tmp_path_factory.mktemp("profiled")
    model = tiny_model()
    template = tiny_template(model, steps=4)
    run = template_run(model, template)
    rt = EdgeRuntime(model, encoder=FakeEncoder())
    reqs = [rt.request(p, seed=i) for i, p in enumerate(["a profiling prompt", "another one"])]
    profile_importance(model, template, run, reqs)
    layout = ShardLayout(run.cache.steps, run.cache.blocks, 2)
    fn = OutputPSNR(rt.engine, rt.prepared(TEMPLATE_ID, template), run, reqs, layout)
    work = root / "work"
    with CatalogTransaction(root / "catalog") as txn:
        m = write_pack(work, TEMPLATE_ID, run.cache, get_codec("sakura"), blocks_per_shard=2,
                       model={"name": "tiny"}, quality_fn=fn)
        txn.publish(TEMPLATE_ID, "sakura", m.to_dict(), work / m.pack_file,
                    {"workload": "face-swap"})
    return model, template, root / "catalog", m.to_dict()


def _largest_bytes(manifest):
    """The bytes of every shard's largest Pareto configuration (the best the pack offers)."""
    return sum(max(c["bytes"] for c in s["configs"] if c["pareto"]) for s in manifest["shards"])


def test_everything_received_is_fraction_one_and_a_forced_small_one_is_lower(profiled):
    model, template, catalog, manifest = profiled
    rt = EdgeRuntime(model, encoder=FakeEncoder())
    req = rt.request(PROMPT, 5)
    with Server(create_app(LocalStorage(catalog))) as server:
        full = rt.edit(server.url, TEMPLATE_ID, template, req, "sakura", options=EVERYTHING)
        # sakura-fixed-config at a budget below every shard's smallest: the smallest ones
        small = rt.edit(server.url, TEMPLATE_ID, template, req, "sakura-fixed-config",
                        options=EditOptions(budget_rate_bps=1.0, pack="sakura"))
    assert full.shards_below_largest == 0 and full.truncations == 0
    assert full.full_quality_byte_fraction == 1.0
    assert full.bytes == _largest_bytes(manifest)
    assert small.shards_below_largest == len(small.configs) > 0
    assert 0 < small.full_quality_byte_fraction < 1
    assert small.full_quality_byte_fraction == pytest.approx(small.bytes / _largest_bytes(
        manifest))
    assert full.psnr_estimate_db is not None and small.psnr_estimate_db is not None
    assert small.psnr_estimate_db < full.psnr_estimate_db
    # the estimate is the sum of the profile's per-shard MSEs of the configurations run on
    by_id = {(s["index"], c["id"]): c["quality"]["psnr_db"] for s in manifest["shards"]
             for c in s["configs"]}
    mse = sum(10 ** (-by_id[(r["shard"], r["config"])] / 10) for r in small.timeline)
    assert small.psnr_estimate_db == pytest.approx(-10 * math.log10(mse))
    # the console line says what was received and what limited it; the JSON keeps the keys
    assert "1.000 of full-quality bytes" in full.quality_line()
    assert "limited" not in full.quality_line()
    assert f"limited: {len(small.configs)} of {len(small.configs)} shards" in \
        small.quality_line()
    # a policy that fixes the configuration is named as the limit, not the link
    assert small.limited_by_policy == len(small.configs)
    assert "by the policy sakura-fixed-config" in small.quality_line()
    assert "by the link" not in small.quality_line()
    doc = json.loads(json.dumps(small.to_json()))
    assert doc["full_quality_byte_fraction"] == small.full_quality_byte_fraction
    assert doc["psnr_estimate_db"] == small.psnr_estimate_db


def test_a_slow_link_lowers_the_fraction_and_a_pack_without_profile_has_no_estimate(world):
    """The tiny world's packs carry no PSNR profile: the estimate is None, the fraction is
    still told, and a slow link (allocation at its rate) gets less of the pack."""
    rt = world.runtime()
    req = rt.request(PROMPT, 5)
    with Server(create_app(LocalStorage(world.catalog_dir))) as server:
        fast = rt.edit(server.url, TEMPLATE_ID, world.template, req, "sakura",
                       options=EVERYTHING)
        with shaped(server.url, Trace.constant(2e5)) as (url, _):
            slow = rt.edit(url, TEMPLATE_ID, world.template, req, "sakura",
                           # (no local fallback: at 0.2 Mbit/s its steps would be computed
                           # on the device, which streams nothing)
                           options=EditOptions(initial_rate_bps=2e5, rate_origin=server.url,
                                               local_fallback=False))
    assert fast.full_quality_byte_fraction == 1.0 and fast.psnr_estimate_db is None
    assert slow.full_quality_byte_fraction < 1.0 and slow.shards_below_largest > 0
    # sakura's own policy may choose every configuration: the link limited them
    assert slow.limited_by_policy == 0 and "by the link" in slow.quality_line()
    assert slow.psnr_estimate_db is None
    assert "no PSNR profile in the pack" in slow.quality_line()
    assert fast.to_json()["psnr_estimate_db"] is None


def test_a_shard_missing_from_the_manifest_is_an_error(world):
    with pytest.raises(ValueError, match="shard 99"):
        received_quality(world.manifests["sakura"], [{"shard": 99, "config": 0}])


def test_steps_computed_on_the_device_are_not_in_the_estimate(profiled):
    """A local step has no profile: an edit whose every step ran on the device has no
    estimate (not an infinite one), and one that streamed some shards is estimated from
    those alone."""
    _model, _template, _root, manifest = profiled
    shards = [int(s["index"]) for s in manifest["shards"]]
    streamed = [{"shard": j, "config": 0, "local": False} for j in shards]
    everything = received_quality(manifest, streamed)
    assert everything["psnr_estimate_db"] is not None and everything["local_shards"] == 0
    all_local = received_quality(manifest, [{"shard": j, "config": None, "local": True}
                                            for j in shards])
    assert all_local["psnr_estimate_db"] is None
    assert all_local["local_shards"] == len(shards)
    assert all_local["full_quality_byte_fraction"] == 0.0
    half = [dict(r, local=True, config=None) if r["shard"] % 2 else r for r in streamed]
    some = received_quality(manifest, half)
    alone = received_quality(manifest, [r for r in streamed if r["shard"] % 2 == 0])
    assert some["psnr_estimate_db"] == pytest.approx(alone["psnr_estimate_db"])
    assert some["psnr_estimate_db"] > everything["psnr_estimate_db"]  # fewer errors summed


def test_the_quality_line_says_which_shards_the_estimate_leaves_out():
    """A step computed on the device and a shard run on earlier K/V (stale reuse, the stale
    plan: no configuration of its own) have no profile: the line names both counts."""
    import torch
    from sakura.edge.result import EditResult

    rows = [{"shard": 0, "step": 0, "config": 3, "local": False},
            {"shard": 1, "step": 1, "config": None, "local": False, "stale_from": 0},
            {"shard": 2, "step": 2, "config": None, "local": True}]
    res = EditResult(image=torch.zeros(3, 2, 2), policy="sakura", codec="sakura",
                     latency_s=0.1, local_fallbacks=1, timeline=rows,
                     full_quality_byte_fraction=0.5, psnr_estimate_db=40.0)
    line = res.quality_line()
    assert ("~40.0 dB (estimated from the pack's profile, over the streamed shards: 1 steps "
            "computed on the device and 1 shards run on earlier K/V are not in it)") in line
    only_stale = EditResult(image=torch.zeros(3, 2, 2), policy="sakura", codec="sakura",
                            latency_s=0.1, timeline=rows[:2], full_quality_byte_fraction=0.5,
                            psnr_estimate_db=40.0)
    assert "over the streamed shards: 1 shards run on earlier K/V are not in it" in \
        only_stale.quality_line()
    full = EditResult(image=torch.zeros(3, 2, 2), policy="sakura", codec="sakura",
                      latency_s=0.1, timeline=rows[:1], full_quality_byte_fraction=1.0,
                      psnr_estimate_db=40.0)
    assert full.quality_line().endswith("(estimated from the pack's profile)")
