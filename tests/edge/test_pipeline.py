"""The pipeline's stages, buffers, stall accounting and error propagation, with scripted
transfer and decode times (no network, no model)."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from sakura.edge.client import Fetched
from sakura.edge.errors import EdgeError, ServerUnreachable
from sakura.edge.monitor import BandwidthMonitor, ExecutionProgress
from sakura.edge.pipeline import NetLoop, Pipeline

SHARDS = [(0, [0, 1]), (0, [2, 3]), (1, [0, 1]), (1, [2, 3])]


def make(fetch_s, decode_s=0.0, max_ahead=2, fail_at=None, exec_s=0.05, latency_s=0.0,
         max_inflight=2, max_ready=2, allowance_s=0.0, shards=SHARDS, lookahead_rtts=0.0,
         max_ahead_cap=None, initial_bps=8e6):
    origin = time.monotonic()
    decisions = []

    async def fetch(shard, config, transfer):
        """``latency_s`` to the first byte, then the body in five parts over fetch_s."""
        t0 = time.monotonic()
        if fail_at == shard:
            raise ServerUnreachable("scripted: the server went away")
        await asyncio.sleep(latency_s)
        first = time.monotonic()
        size = 1000 * (config + 1)
        for part in range(1, 6):
            await asyncio.sleep(fetch_s[shard] / 5)
            transfer.feed(bytes(size * part // 5 - transfer.received))
        return Fetched(bytes(size), t0, first, time.monotonic())

    def decode(shard, config, data):
        time.sleep(decode_s)
        return [torch.full((3, 4), float(shard)) for _ in range(4)]

    def allocate(shard, window, rate, stale):
        decisions.append((shard, window, rate))
        return shard % 2

    pipe = Pipeline(shards, fetch=fetch, decode=decode, allocate=allocate,
                    monitor=BandwidthMonitor(initial_bps=initial_bps),
                    progress=ExecutionProgress.with_allowance([exec_s] * len(shards), origin,
                                                              allowance_s, now=origin),
                    origin=origin,
                    max_ahead=max_ahead, max_ready=max_ready,
                    describe=lambda s, c: {"level": c},
                    config_bytes=lambda s, c: 1000 * (c + 1), max_inflight=max_inflight,
                    lookahead_rtts=lookahead_rtts, max_ahead_cap=max_ahead_cap)
    return pipe, decisions


def execute(pipe, exec_s=0.05):
    """What cached_edit does: get(step, block) in execution order, computing in between."""
    seen = []
    for step in range(2):
        for block in range(4):
            k, v = pipe.provider.get(step, block)
            seen.append(int(k[0, 0]))
            time.sleep(exec_s / 2)
    return seen


def test_shards_arrive_in_order_and_tensors_match_the_block():
    with NetLoop() as net:
        pipe, decisions = make([0.01] * 4)
        pipe.start(net)
        seen = execute(pipe)
        stats = pipe.finish()
    assert seen == [0, 0, 1, 1, 2, 2, 3, 3]
    assert stats.configs == [0, 1, 0, 1]
    assert stats.bytes == 1000 + 2000 + 1000 + 2000
    assert stats.stalls == 0
    assert [d[0] for d in decisions] == [0, 1, 2, 3]
    assert all(d[2] == pytest.approx(8e6) or d[2] > 0 for d in decisions)
    assert [r.params for r in pipe.records] == [{"level": c} for c in (0, 1, 0, 1)]


def test_a_late_shard_is_a_stall_of_the_right_length():
    with NetLoop() as net:
        pipe, _ = make([0.01, 0.01, 0.35, 0.01])
        pipe.start(net)
        execute(pipe)
        stats = pipe.finish()
    # shard 2 is asked for at ~0.11 s after shard 0 starts; it arrives at ~0.37 s
    assert stats.stalls == 1
    late = pipe.records[2]
    assert late.stall_s == pytest.approx(0.25, abs=0.12)
    assert stats.stall_s == pytest.approx(late.stall_s)
    assert late.exec_start >= late.recon_end - 1e-9


def test_back_pressure_bounds_the_shards_held_ahead():
    with NetLoop() as net:
        pipe, _ = make([0.0] * 4, max_ahead=1)
        pipe.start(net)
        execute(pipe, exec_s=0.08)
        pipe.finish()
    recs = pipe.records
    for j in range(1, 4):
        # with one slot, shard j is fetched only once shard j - 1 started executing
        assert recs[j].recv_start >= recs[j - 1].exec_start - 1e-9


def test_reconstructed_shards_ahead_are_bounded():
    with NetLoop() as net:
        pipe, _ = make([0.0] * 4, max_ahead=4, max_ready=1)
        pipe.start(net)
        execute(pipe, exec_s=0.08)
        pipe.finish()
    recs = pipe.records
    assert recs[3].recv_end < recs[1].exec_start      # all received early...
    for j in range(1, 4):                             # ...but decoded one ahead at most
        assert recs[j].recon_start >= recs[j - 1].exec_start - 1e-9


def test_slow_reconstruction_is_part_of_the_stall():
    with NetLoop() as net:
        pipe, _ = make([0.0] * 4, decode_s=0.12)
        pipe.start(net)
        execute(pipe, exec_s=0.02)
        stats = pipe.finish()
    assert stats.stalls >= 2
    for r in pipe.records:
        assert r.recon_end - r.recon_start >= 0.11


@pytest.mark.parametrize("max_inflight", [1, 2])
def test_requests_are_pipelined_behind_the_previous_body(max_inflight):
    # 60 ms to the first byte, 40 ms bodies: one request at a time idles the link for a
    # round trip per shard; pipelined, the next request goes out while a body arrives
    with NetLoop() as net:
        # (a prior that matches the scripted bodies, 0.2 Mbit/s: the prior counts until five
        # bodies are in, and an 8 Mbit/s one would send shards 1 and 2 together)
        pipe, _ = make([0.04] * 4, latency_s=0.06, exec_s=0.0, max_inflight=max_inflight,
                       initial_bps=0.2e6)
        pipe.start(net)
        execute(pipe, exec_s=0.0)
        pipe.finish()
    recs = pipe.records
    overlaps = [recs[j + 1].recv_start < recs[j].recv_end for j in range(3)]
    span = recs[-1].recv_end - recs[0].recv_start
    if max_inflight == 1:
        assert not any(overlaps)
        assert span >= 4 * 0.1 - 0.01
    else:
        # from shard 1 on (a latency sample exists) each request went out while the body
        # before it was still arriving: no idle round trip between them (how much time that
        # saves depends on the machine's scheduling, so it is not asserted)
        assert all(overlaps[1:])
        for j in range(2, 4):                # never more than two on the wire
            assert recs[j].recv_start >= recs[j - 2].recv_end - 1e-9


def test_a_receive_failure_reaches_the_executing_thread():
    with NetLoop() as net:
        pipe, _ = make([0.01] * 4, fail_at=2)
        pipe.start(net)
        with pytest.raises(ServerUnreachable, match="went away"):
            execute(pipe)
        pipe.close()
    assert pipe.records[2].exec_start is None


def test_a_decode_failure_reaches_the_executing_thread():
    with NetLoop() as net:
        pipe, _ = make([0.01] * 4)

        def bad_decode(shard, config, data):
            raise ValueError("scripted decode failure")

        pipe.decode = bad_decode
        pipe.start(net)
        with pytest.raises(EdgeError, match="could not be delivered.*scripted decode"):
            execute(pipe)
        pipe.close()


def test_reconstruction_resumes_as_soon_as_execution_moves_on():
    """A shard received while the reconstructed buffer is full is decoded right when
    execution frees a slot (not after a polling timeout)."""
    with NetLoop() as net:
        pipe, _ = make([0.0] * 4, max_ahead=4, max_ready=1)
        pipe.start(net)
        execute(pipe, exec_s=0.02)
        pipe.finish()
    for j in range(1, 4):
        r, prev = pipe.records[j], pipe.records[j - 1]
        assert r.recon_start - prev.exec_start < 0.05, (j, r.recon_start, prev.exec_start)
    assert pipe.stats().stall_s < 0.05


def test_a_startup_allowance_widens_the_first_windows_but_does_not_hold_execution():
    """The first shards are allotted windows that end after the allowance; execution
    still starts as soon as shard 0 is in (here long before the allowance is over)."""
    windows, records = {}, {}
    for allowance in (0.0, 0.3):
        with NetLoop() as net:
            pipe, decisions = make([0.01] * 4, max_ahead=4, allowance_s=allowance)
            pipe.start(net)
            execute(pipe)
            stats = pipe.finish()
        windows[allowance] = {d[0]: d[1] for d in decisions}
        records[allowance] = pipe.records
        assert stats.stalls == 0
        assert pipe.records[0].exec_start < 0.15   # not held until the allowance ends
    plain, wide = windows[0.0], windows[0.3]
    assert plain[0].window_s < 0.06 and wide[0].window_s > 0.25
    assert records[0.0][0].deadline == pytest.approx(0.05, abs=0.01)   # exec_s[0]
    assert records[0.3][0].deadline == pytest.approx(0.3, abs=0.01)     # the allowance
    # shard 1 was asked for before execution started: its window grew by the allowance too
    assert wide[1].window_s - plain[1].window_s == pytest.approx(0.3 - 0.05, abs=0.03)
    assert wide[1].slot_s == pytest.approx(0.05) and wide[1].carry_s > 0.2


@pytest.mark.parametrize("impl", ["python", "native"])
def test_lookahead_rule_beyond_max_ahead_follows_the_round_trip(impl):
    """Within max_ahead a shard may go now; beyond it, up to the cap, once its execution is
    within the horizon (lookahead_rtts request latencies); past the cap, only when execution
    advances. The native receive stage uses the C++ twin of the same rule."""
    if impl == "native":
        import sakura_native

        rule = sakura_native.lookahead_wait
    else:
        from sakura.edge.pipeline import lookahead_wait as rule
    assert rule(3, 4, 16, 5.0, 0.12) == 0.0            # within max_ahead
    assert rule(6, 4, 16, 0.10, 0.12) == 0.0           # beyond, but due within the horizon
    assert rule(6, 4, 16, 0.50, 0.12) == pytest.approx(0.38)  # due in 0.38 s
    assert rule(17, 4, 16, 0.0, 0.12) is None          # past the cap
    assert rule(6, 4, 16, 0.0, 0.0) is None            # no horizon: the count rule only


def test_requests_run_ahead_of_max_ahead_when_shards_are_shorter_than_a_round_trip():
    """6 ms shards behind a 60 ms request latency: with a 3-RTT horizon the receiver has
    more than max_ahead shards requested before execution gets to them."""
    shards = [(s, [0, 1]) for s in range(12)]
    with NetLoop() as net:
        pipe, _ = make([0.0] * 12, exec_s=0.006, latency_s=0.06, max_ahead=2,
                       max_inflight=8, shards=shards, lookahead_rtts=3.0, max_ahead_cap=10)
        pipe.start(net)
        for step, _blocks in shards:
            pipe.provider.get(step, 0)
            time.sleep(0.006)
        pipe.finish()
    tl = [r.to_dict() for r in pipe.records]
    most_ahead = max(sum(1 for o in tl if o["recv_start"] <= r["exec_start"]) - r["shard"] - 1
                     for r in tl)
    assert most_ahead > 2
    for j in range(10, len(tl)):                        # never beyond the cap
        assert tl[j]["recv_start"] >= tl[j - 10]["exec_start"] - 1e-9


def test_a_wait_loop_ends_on_a_cancel_that_arrives_as_its_event_is_set():
    # the watchdog's and the receive loop's wait (edge.netloop.wait_event): Python 3.11's
    # asyncio.wait_for dropped this cancellation (bpo-42130), the loop went on, and
    # NetLoop.close waited 10 s for it in a CI run
    from sakura.edge.netloop import wait_event

    async def loop_on(event):
        while True:
            event.clear()
            await wait_event(event, 5.0)

    async def main():
        event = asyncio.Event()
        task = asyncio.create_task(loop_on(event))
        await asyncio.sleep(0.01)
        event.set()
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=1.0)
        return task in done and task.cancelled()

    assert asyncio.run(main())
