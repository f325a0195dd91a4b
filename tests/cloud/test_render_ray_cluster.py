"""The render engine on a two-node Ray cluster started as an operator starts one
(``cloud.render_ray.LocalCluster``): a node removed mid-request (its raylet, object store
and actors SIGKILLed, as a machine that fails) costs no request and changes no output
(about 20 s here, most of it the cluster's start)."""

from __future__ import annotations

import time

import pytest
import torch
from sakura.cloud.render import RenderEngine
from sakura.cloud.render_api import EngineConfig, RenderRequest
from sakura.dit.weights import save_model

from tests.cloud.conftest import ray_auth_mode_of_this_process
from tests.cloud.test_build_ray import _free_port
from tests.cloud.test_render import CFG, GUIDANCE, SIZE, STEPS, _model

ray = pytest.importorskip("ray")


@pytest.fixture
def cluster_auth(monkeypatch):
    """The cluster runs with this process's Ray authentication mode (conftest)."""
    monkeypatch.setenv("RAY_AUTH_MODE", ray_auth_mode_of_this_process())


def test_a_node_removed_mid_request_costs_no_request_and_no_output(tmp_path, text_encoder,
                                                                   cluster_auth):
    from sakura.cloud.render_ray import LocalCluster, nodes_of

    path = tmp_path / "tiny.safetensors"
    save_model(_model(), path)
    prompts = ["smileys: grinning face", "animals & nature: dog face", "food: red apple"]
    with LocalCluster(nodes=2, object_store_bytes=100_000_000, port=_free_port()) as cluster:
        cfg = EngineConfig(workers=2, weights=str(path), regional=CFG, pool="ray",
                           ray_address=cluster.address, capacity_rows=400,
                           quality_eps=None, task_deadline_s=20.0)
        with RenderEngine(cfg, encoder=text_encoder) as eng:
            reqs = [eng.prepare(RenderRequest(prompt=prompts[i % 3], seed=i, steps=STEPS,
                                              size=SIZE, guidance=GUIDANCE))
                    for i in range(6)]
            calm = [f.result(timeout=120) for f in [eng.submit(r) for r in reqs]]
            placed = nodes_of(eng.pool)
            assert len(set(placed.values())) == 2  # one actor per node (SPREAD)
            head = ray.get_runtime_context().get_node_id()
            far = [w for w, node in placed.items() if node != head]
            futs = [eng.submit(r) for r in reqs]
            deadline = time.monotonic() + 60
            while not set(far) & eng.busy_workers():
                assert time.monotonic() < deadline
                time.sleep(0.002)
            cluster.remove_node(1)
            hit = [f.result(timeout=180) for f in futs]
            m = eng.metrics()
    # (Ray's own node table marks the node dead only after its health checks time out,
    # ~15 s later; the engine learns it from the lost actor calls)
    assert m["worker_deaths"] >= 1 and m["requeued"] >= 1
    for a, b in zip(hit, calm):
        assert torch.equal(a.image, b.image)
