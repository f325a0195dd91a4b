"""The render engine on Ray (``EngineConfig(pool="ray")``, ``cloud.render_ray``): the same
outputs as the process pool on a tiny seeded model, an actor killed mid-request recovers
with identical outputs, a hung actor is replaced after its task deadline, and an unknown
model or size is one clear error. One local Ray instance for the module (a start costs
seconds)."""

from __future__ import annotations

import os
import signal
import time
from collections import Counter

import pytest
import torch
from sakura.cloud.render import RenderEngine
from sakura.cloud.render_api import EngineConfig, RenderError, RenderRequest
from sakura.dit.weights import save_model

from sakura.errors import SakuraError
from tests.cloud.test_render import CFG, GUIDANCE, SIZE, STEPS, _model

ray = pytest.importorskip("ray")

DEADLINE_S = 6.0  # far above a tiny-model task (milliseconds), far below the test timeout


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    path = tmp_path_factory.mktemp("render-ray") / "tiny.safetensors"
    save_model(_model(), path)
    return str(path)


@pytest.fixture(scope="module")
def ray_engine(weights, text_encoder):
    # The spill test needs room on disk, not a disk under Ray's default 95% mark: the CI
    # machines share a disk whose fill is not ours (stop 51 failed there at 95% with
    # OutOfDiskError), so the mark is lifted to 100% (the spill itself is 160 MB).
    ray.init(address="local", num_cpus=6, include_dashboard=False, log_to_driver=False,
             object_store_memory=128 * 2**20, logging_level="warning",
             _system_config={"local_fs_capacity_threshold": 1.0})
    eng = RenderEngine(EngineConfig(workers=2, weights=weights, regional=CFG, pool="ray",
                                    capacity_rows=400, quality_eps=None,
                                    task_deadline_s=DEADLINE_S), encoder=text_encoder)
    eng.start()
    yield eng
    eng.stop()
    ray.shutdown()


@pytest.fixture(scope="module")
def process_images(weights, text_encoder):
    """The process pool's outputs for the requests of :func:`_requests` (the reference)."""
    with RenderEngine(EngineConfig(workers=2, weights=weights, regional=CFG,
                                   capacity_rows=400, quality_eps=None),
                      encoder=text_encoder) as eng:
        reqs = _requests(eng)
        return [f.result(timeout=120) for f in [eng.submit(r) for r in reqs]]


def _requests(engine, n: int = 8):
    prompts = ["smileys: grinning face", "animals & nature: dog face", "food: red apple"]
    modes = ("regional", "full", "separate", "regional")
    return [engine.prepare(RenderRequest(prompt=prompts[i % 3], seed=i, steps=STEPS, size=SIZE,
                                         guidance=GUIDANCE, mode=modes[i % 4]))
            for i in range(n)]


def _same(results, reference) -> None:
    """Bitwise equal in joint and full modes; ``separate`` packs whichever patches land on
    one worker into one call (placement varies run to run), so it is equal to float
    rounding there, as between two process-pool runs."""
    for a, b in zip(results, reference):
        if a.mode == "separate":
            assert float((a.image - b.image).abs().max()) < 1e-5
        else:
            assert torch.equal(a.image, b.image)
        assert a.stats["skipped_patch_steps"] == b.stats["skipped_patch_steps"]


def test_ray_outputs_equal_the_process_pool(ray_engine, process_images):
    reqs = _requests(ray_engine)
    res = [f.result(timeout=120) for f in [ray_engine.submit(r) for r in reqs]]
    _same(res, process_images)
    assert sum(r.stats["skipped_patch_steps"] for r in res) > 0
    m = ray_engine.metrics()
    assert m["completed"] == m["dispatched"] and m["duplicates"] == 0
    assert m["kv_syncs"]["delta"] + m["kv_syncs"]["none"] > 0  # replicas kept in sync


def _wait_busy(engine, deadline: float) -> int:
    victim = min(engine.worker_pids())
    while victim not in engine.busy_workers():
        assert time.monotonic() < deadline
        time.sleep(0.002)
    return victim


def test_killed_actor_mid_request_recovers_with_identical_outputs(ray_engine, process_images):
    before = ray_engine.metrics()
    applied_before = len(ray_engine.applied)
    reqs = _requests(ray_engine)
    futs = [ray_engine.submit(r) for r in reqs]
    victim = _wait_busy(ray_engine, time.monotonic() + 60)
    os.kill(ray_engine.worker_pids()[victim], signal.SIGKILL)
    res = [f.result(timeout=180) for f in futs]
    after = ray_engine.metrics()
    assert after["worker_deaths"] == before["worker_deaths"] + 1
    assert after["respawned"] == before["respawned"] + 1
    assert after["requeued"] > before["requeued"]
    _same(res, process_images)
    applied = list(ray_engine.applied)[applied_before:]
    assert not [k for k, c in Counter(applied).items() if c > 1]
    assert victim not in ray_engine.worker_pids()


def test_hung_actor_is_replaced_after_its_task_deadline(ray_engine, process_images):
    before = ray_engine.metrics()
    reqs = _requests(ray_engine, 4)
    futs = [ray_engine.submit(r) for r in reqs]
    victim = _wait_busy(ray_engine, time.monotonic() + 60)
    pid = ray_engine.worker_pids()[victim]
    os.kill(pid, signal.SIGSTOP)  # alive, but it never answers: hung
    try:
        res = [f.result(timeout=180) for f in futs]
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    after = ray_engine.metrics()
    assert after["worker_deaths"] == before["worker_deaths"] + 1
    assert after["respawned"] == before["respawned"] + 1
    _same(res, process_images[:4])
    assert victim not in ray_engine.worker_pids()


def test_a_full_object_store_spills_and_loses_nothing(ray_engine, process_images):
    """The object store (128 MB here) filled by other objects that stay referenced: the
    actors' K/V puts spill to disk and every request comes back unchanged."""
    import numpy as np

    filler = [ray.put(np.full(16 * 2**20, i, dtype=np.uint8)) for i in range(10)]  # 160 MB
    try:
        reqs = _requests(ray_engine)
        res = [f.result(timeout=180) for f in [ray_engine.submit(r) for r in reqs]]
        _same(res, process_images)
        assert all(int(ray.get(ref)[0]) == i for i, ref in enumerate(filler))
    finally:
        del filler


def test_unknown_model_or_size_is_one_clear_error(ray_engine, tmp_path):
    with pytest.raises(SakuraError, match="unknown model 'nope'"):
        RenderEngine(EngineConfig(pool="ray", model="nope", model_path=str(tmp_path)))
    with pytest.raises(SakuraError, match="not found"):
        RenderEngine(EngineConfig(pool="ray", weights=str(tmp_path / "none.safetensors")))
    with pytest.raises(RenderError, match="size"):
        ray_engine.submit(RenderRequest(prompt="x", size=30))
    with pytest.raises(RenderError, match="pool"):
        RenderEngine(EngineConfig(pool="threads"))


def test_cli_takes_a_ray_address_or_the_local_ray_pool():
    import argparse

    from sakura.cloud import render_cli

    parser = argparse.ArgumentParser()
    commands = parser.add_subparsers(dest="command")
    render_cli.register(commands, commands.add_parser("bench").add_subparsers(dest="bench"))
    a = parser.parse_args(["render", "serve", "--ray", "10.0.0.1:6379"])
    assert (a.ray, a.pool) == ("10.0.0.1:6379", "process")  # --ray implies the Ray pool
    b = parser.parse_args(["render", "replay", "--pool", "ray"])
    assert (b.ray, b.pool) == (None, "ray")
    assert parser.parse_args(["render", "serve"]).pool == "process"
