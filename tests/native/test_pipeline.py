"""The native receive -> reconstruct -> execute pipeline: order, back-pressure, cancellation,
error propagation, native reconstruction, and the GIL released while it runs."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch


def test_runs_every_shard_in_order(native):
    seen = []
    stats = native.Pipeline(2, 3).run(
        50, lambda i: i * 10, lambda i, x: seen.append((i, x)), reconstruct=lambda i, x: x + 1)
    assert seen == [(i, i * 10 + 1) for i in range(50)]
    assert stats.received == stats.reconstructed == stats.executed == 50
    assert not stats.cancelled


def test_receive_returning_none_ends_the_stream(native):
    got = []
    stats = native.Pipeline().run(100, lambda i: None if i == 7 else i, lambda i, x: got.append(x),
                                  reconstruct=lambda i, x: x)
    assert got == list(range(7)) and stats.executed == 7


@pytest.mark.parametrize("cap_received,cap_ready", [(1, 1), (2, 2), (3, 1)])
def test_back_pressure_bounds_the_queues_and_receive(native, cap_received, cap_ready):
    lock = threading.Lock()
    state = {"received": 0, "executed": 0, "ahead": 0}

    def receive(i):
        with lock:
            state["received"] += 1
            state["ahead"] = max(state["ahead"], state["received"] - state["executed"])
        return i

    def execute(i, x):
        time.sleep(0.003)  # the slow stage: everything before it must wait, not pile up
        with lock:
            state["executed"] += 1

    stats = native.Pipeline(cap_received, cap_ready).run(40, receive, execute,
                                                         reconstruct=lambda i, x: x)
    assert stats.executed == 40
    assert stats.max_received_depth <= cap_received
    assert stats.max_ready_depth == cap_ready  # filled (execute is the bottleneck), never more
    # in flight: both queues, one shard in reconstruct, one in receive's hands, one executing
    assert state["ahead"] <= cap_received + cap_ready + 3


def test_cancel_from_another_thread_stops_every_stage(native):
    pipe = native.Pipeline(2, 2)
    executed = []

    def execute(i, x):
        executed.append(i)
        time.sleep(0.002)

    timer = threading.Timer(0.05, pipe.cancel)
    timer.start()
    t0 = time.perf_counter()
    stats = pipe.run(1_000_000, lambda i: i, execute, reconstruct=lambda i, x: x)
    assert time.perf_counter() - t0 < 5
    assert stats.cancelled and 0 < stats.executed < 1_000_000
    assert executed == list(range(len(executed)))
    assert not pipe.running
    # the object runs again afterwards, uncancelled
    assert not pipe.run(3, lambda i: i, lambda i, x: None, reconstruct=lambda i, x: x).cancelled


def test_cancel_from_inside_a_stage(native):
    pipe = native.Pipeline(2, 2)

    def execute(i, x):
        if i == 4:
            pipe.cancel()

    stats = pipe.run(1000, lambda i: i, execute, reconstruct=lambda i, x: x)
    assert stats.cancelled and stats.executed == 5


@pytest.mark.parametrize("stage", ["receive", "reconstruct", "execute"])
def test_an_exception_in_any_stage_stops_the_others_and_is_reraised(native, stage):
    class Boom(RuntimeError):
        pass

    calls = {"receive": 0, "reconstruct": 0, "execute": 0}

    def step(name, i):
        calls[name] += 1
        if name == stage and i == 5:
            raise Boom(f"{name} failed on shard {i}")

    def receive(i):
        step("receive", i)
        return i

    def reconstruct(i, x):
        step("reconstruct", i)
        return x

    def execute(i, x):
        step("execute", i)

    t0 = time.perf_counter()
    with pytest.raises(Boom, match=f"{stage} failed on shard 5"):
        native.Pipeline(2, 2).run(1_000_000, receive, execute, reconstruct=reconstruct)
    assert time.perf_counter() - t0 < 5
    # the others stopped: receive got at most a queue-full of shards past the failure
    assert calls["receive"] <= 5 + 1 + 2 + 2 + 2
    assert calls["execute"] <= 6  # shards 0..5 at most: nothing runs past the failure


def test_native_reconstruction_in_the_pipeline(native, tiny_pack):
    m, reader = tiny_pack
    codec = m.make_codec()
    spec = m.spec(0)
    table = np.ascontiguousarray(torch.view_as_real(codec._phasors(spec, torch.float32)))
    shards = [s for s in range(len(m.shards)) if m.spec(s).num_matrices == spec.num_matrices]
    items = [(reader.read_config(s, m.shards[s].configs[-1].id), m.shards[s].configs[-1].params)
             for s in shards]
    got = {}
    stats = native.Pipeline(1, 1).run(
        len(items), lambda i: (items[i][0], items[i][1]["ranks"]),
        lambda i, arr: got.__setitem__(i, arr), rope=table, decode_threads=2)
    assert stats.executed == len(items)
    for i, (data, params) in enumerate(items):
        assert got[i].dtype == np.float32 and got[i].shape == (spec.num_matrices, spec.tokens,
                                                             spec.channels)
        assert np.array_equal(got[i], native.decode(data, params["ranks"], table, 1))


def test_native_reconstruction_error_is_reraised(native, tiny_pack):
    m, reader = tiny_pack
    cfg = m.shards[0].configs[-1]
    data = reader.read_config(0, cfg.id)
    items = [data, data, data[:-3], data]
    with pytest.raises(native.FormatError, match="needs"):
        native.Pipeline().run(4, lambda i: (items[i], cfg.params["ranks"]), lambda i, a: None)
    with pytest.raises(native.FormatError, match="bytes, ranks"):
        native.Pipeline().run(2, lambda i: items[i], lambda i, a: None)


def test_gil_is_released_while_the_pipeline_runs(native):
    # a Python thread makes progress while run() waits on native no-op stages
    ticks = []
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            ticks.append(1)
            time.sleep(0.001)

    t = threading.Thread(target=spin)
    t.start()
    native.pipeline_overhead(200_000)
    stop.set()
    t.join()
    assert len(ticks) > 5


def test_bad_options(native):
    with pytest.raises((ValueError, TypeError)):
        native.Pipeline(0, 2)
    with pytest.raises(TypeError):
        native.Pipeline(-1, 2)
