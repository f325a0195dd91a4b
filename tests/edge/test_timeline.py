"""The timeline an edit records and the plot a person reads (issue 29, item 6): set-up
phases from 0, each shard's configuration, the rate estimate, the total latency."""

from __future__ import annotations

import json

import pytest
from sakura.cloud.server import create_app
from sakura.cloud.storage import LocalStorage
from sakura.edge.netem import shaped
from sakura.edge.runtime import EditOptions
from sakura.edge.timeline import config_label, plot_timeline, timeline_figure
from sakura.traces import Trace

from tests.edge.helpers import TEMPLATE_ID, Server


@pytest.fixture(scope="module")
def paced(world):
    """A sakura edit of the tiny world over a paced 40 Mbit/s link (planned recompute off:
    the tiny model's steps are so short that the plan would recompute step 0 rather than
    fetch its smallest configuration, and this is the plot of a streamed edit)."""
    rt = world.runtime()
    req = rt.request("a pirate hat", 5)
    with Server(create_app(LocalStorage(world.catalog_dir))) as server, \
            shaped(server.url, Trace.constant(40e6, 1.0), 0.0) as (url, _link):
        return rt.edit(url, TEMPLATE_ID, world.template, req, "sakura",
                       options=EditOptions(remember_rate=False, cache_manifests=False,
                                           stale_plan_local=False))


def test_the_result_records_the_set_up_phases(paced):
    names = [p["phase"] for p in paced.phases]
    assert names in (["open", "manifest", "plan", "startup allowance"],
                     ["manifest", "plan", "startup allowance"], ["open", "manifest", "plan"],
                     ["manifest", "plan"]), names
    phases = {p["phase"]: p for p in paced.phases}
    assert phases["manifest"]["cached"] is False
    for p in paced.phases:
        assert 0.0 <= p["start"] <= p["end"] <= paced.latency_s, p
    first_request = min(r["recv_start"] for r in paced.timeline if r["recv_start"] is not None)
    assert phases["plan"]["end"] <= first_request + 1e-6  # set-up ends before shard 0 asks
    assert phases["manifest"]["end"] <= phases["plan"]["start"] + 1e-6
    if paced.startup_allowance_s > 0 and "startup allowance" in phases:
        # the allowance's window, cut at the edit's end (a CI run under load placed it after
        # an edit whose shard 0 came sooner than the manifest's request latency)
        allowance = phases["startup allowance"]
        length = allowance["end"] - allowance["start"]
        assert length == pytest.approx(paced.startup_allowance_s, abs=1e-5) or (
            allowance["end"] == pytest.approx(paced.latency_s, abs=1e-5)
            and length < paced.startup_allowance_s)
    assert json.loads(json.dumps(paced.summary()))["phases"] == paced.phases


def test_the_plot_starts_at_zero_and_says_what_each_shard_got(paced, tmp_path):
    fig = timeline_figure(paced.timeline, "sakura on tiny-face", phases=paced.phases,
                          latency_s=paced.latency_s)
    rate_ax, ax = fig.axes[:2]
    assert ax.get_xlim()[0] == 0.0 and rate_ax.get_xlim()[0] == 0.0
    assert ax.get_xlim()[1] >= paced.latency_s
    title = rate_ax.get_title()
    assert "sakura on tiny-face" in title and f"total latency {paced.latency_s:.3f} s" in title
    assert [t.get_text() for t in ax.get_yticklabels()][0] == "set-up"
    texts = {t.get_text() for t in ax.texts}
    for row in paced.timeline:
        p = row["params"]
        if row["planned_stale"]:  # not fetched (edge/stale_plan.py): the K/V it ran on
            assert config_label(row) == f"stale (step {row['stale_from']})"
        elif row["planned_local"]:  # not fetched: its step recomputed on the device
            assert config_label(row) == "local"
        else:
            assert config_label(row).startswith(f"r{p['rank']} {p['bits']}b")
        assert config_label(row) in texts
    assert "rate estimate" in rate_ax.get_ylabel()
    # (drawn at each request: a shard the stale plan left unfetched has none)
    estimates = [r["rate_bps"] / 1e6 for r in paced.timeline
                 if r.get("rate_bps") and r["recv_start"] is not None]
    assert estimates and max(rate_ax.get_ylim()) >= max(estimates)
    legend = {t.get_text() for t in ax.get_legend().get_texts()}
    assert {"receive", "reconstruct", "execute", "stall", "manifest", "plan"} <= legend
    path = plot_timeline(paced.timeline, tmp_path / "t.png", "x", phases=paced.phases,
                         latency_s=paced.latency_s)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_timeline_without_phases_or_rates_still_plots(tmp_path):
    """The replay report's expanded timelines carry the stages only."""
    rows = [{"shard": i, "recv_start": 0.1 * i, "recv_end": 0.1 * i + 0.05,
             "exec_start": 0.1 * i + 0.06, "exec_end": 0.1 * i + 0.09} for i in range(3)]
    fig = timeline_figure(rows, "replay")
    ax = fig.axes[0]
    assert len(fig.axes) == 1 and ax.get_xlim()[0] == 0.0
    assert "total latency 0.290 s" in ax.get_title()
    assert plot_timeline(rows, tmp_path / "r.png").exists()


@pytest.mark.parametrize("row,label", [
    ({"params": {"rank": 16, "bits": 8, "ranks": [16, 8]}, "config": 3}, "r16 8b"),
    ({"params": {"bits": 4}, "config": 1}, "4b"),
    ({"params": {}, "config": 0}, "config 0"),
    ({"params": {"rank": 4, "bits": 2}, "config": 0, "truncated": True}, "r4 2b (truncated)"),
    ({"params": {"rank": 4, "bits": 2}, "config": 0, "requested": 5}, "r4 2b (fallback)"),
    ({}, ""),
])
def test_config_labels(row, label):
    assert config_label(row) == label


def test_the_allowance_window_is_cut_at_the_edits_end():
    from types import SimpleNamespace

    from sakura.edge.timeline import setup_phases

    got = SimpleNamespace(start=10.01, end=10.05, cached=False)
    # the loop starts at 0.06 s, the manifest's request latency was 0.3 s: the allowance
    # window [0.36, 0.46] is a permission; the edit ended at 0.40
    phases = setup_phases(10.0, got, [10.06], 0.3, 0.1, latency_s=0.40)
    assert phases[-1] == {"phase": "startup allowance", "start": 0.36, "end": 0.4}
    assert setup_phases(10.0, got, [10.06], 0.3, 0.1)[-1]["end"] == pytest.approx(0.46)
    late = setup_phases(10.0, got, [10.06], 0.5, 0.1, latency_s=0.40)
    assert [p["phase"] for p in late] == ["open", "manifest", "plan"]
