"""``sakura build --ray ADDRESS``: the templates built as Ray tasks on a cluster started here
as an operator starts one (``cloud.render_ray.LocalCluster``: ``ray start --head``, one
node, two CPUs), published by the driver: the same files and bytes as a local build; an
error inside a task and an unreachable cluster are one ``sakura: error:`` line each."""

from __future__ import annotations

import json
import os
import shutil
import socket
from pathlib import Path

import pytest
import torch
from sakura.cloud.build import BuildConfig, build
from sakura.cloud.publish import published_files
from sakura.dit.model import MMDiT, MMDiTConfig
from sakura.dit.templates import DEFAULT_CATALOG
from sakura.dit.weights import save_model

from sakura.cli import main

ray = pytest.importorskip("ray")

TEMPLATES = ("edit-car-top", "edit-apple-leaf", "edit-house-roof")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny seeded model and a catalog of three 2-step templates (built at 32 px)."""
    root = tmp_path_factory.mktemp("build-ray")
    torch.manual_seed(0)
    model = MMDiT(MMDiTConfig(hidden_size=48, num_heads=3, double_blocks=1, single_blocks=2,
                              mlp_ratio=2.0, rope_axes=(4, 6, 6)))
    weights = root / "w.safetensors"
    save_model(model, weights)
    cat = json.loads(DEFAULT_CATALOG.read_text())
    templates = {}
    for tid in TEMPLATES:
        entry = dict(cat["templates"][tid], steps=2)
        for key in ("image", "mask"):
            shutil.copy(DEFAULT_CATALOG.parent / entry[key], root / entry[key])
        templates[tid] = entry
    (root / "catalog.json").write_text(json.dumps({"version": 1, "templates": templates}))
    return root, weights


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A one-node Ray cluster (2 CPUs) whose workers see their own, empty PSNR cache (so
    their fitted profiles are measured, not read back from the local build's), with this
    process's Ray authentication mode (``conftest.ray_auth_mode_of_this_process``)."""
    from sakura.cloud.render_ray import LocalCluster

    from tests.cloud.conftest import ray_auth_mode_of_this_process

    saved = {k: os.environ.get(k) for k in ("SAKURA_CACHE", "RAY_AUTH_MODE")}
    os.environ["SAKURA_CACHE"] = str(tmp_path_factory.mktemp("ray-cache"))
    os.environ["RAY_AUTH_MODE"] = ray_auth_mode_of_this_process()
    try:
        with LocalCluster(nodes=1, cpus_per_node=2, object_store_bytes=100_000_000,
                          port=_free_port()) as c:
            ray.shutdown()  # the build joins it by its address, as `sakura build --ray` does
            yield c.address
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _cli(tiny, out: Path, *extra: str) -> int:
    root, weights = tiny
    return main(["build", str(root / "catalog.json"), "--out", str(out), "--weights",
                 str(weights), "--resolution", "32", "--codecs", "fp16,sakura", "--no-bundle",
                 *extra])


def test_ray_build_is_byte_identical_to_a_local_build(tiny, cluster, tmp_path, capsys):
    root, weights = tiny
    local = tmp_path / "local"
    report = build(BuildConfig(catalog=str(root / "catalog.json"), out_dir=str(local),
                               codecs=("fp16", "sakura"), weights=str(weights), resolution=32,
                               psnr_cache=str(tmp_path / "psnr-local")), log=lambda *_: None)
    assert report.built == [f"{t}-32" for t in TEMPLATES]
    assert _cli(tiny, tmp_path / "ray", "--ray", cluster) == 0
    assert "built edit-car-top-32, edit-apple-leaf-32, edit-house-roof-32" in capsys.readouterr().out
    want, got = published_files(local), published_files(tmp_path / "ray")
    assert sorted(got) == sorted(want)
    assert len([k for k in want if k.endswith(".pack")]) == 2 * len(TEMPLATES)
    # byte for byte, but for the manifests' measured decode_ms (cloud.publish.published_files)
    assert [k for k in want if want[k] != got[k]] == []
    assert not ray.is_initialized()  # the build left the cluster it joined
    # up to date: nothing is sent to the cluster, nothing changes
    assert _cli(tiny, tmp_path / "ray", "--ray", cluster) == 0
    assert "up to date edit-car-top-32, edit-apple-leaf-32" in capsys.readouterr().out
    assert published_files(tmp_path / "ray") == got


def test_an_error_inside_a_task_is_one_line_naming_the_template(tiny, cluster, tmp_path,
                                                                 capsys, monkeypatch):
    # the CLI refuses an unknown codec before any compute; let it through to the tasks
    monkeypatch.setattr("sakura.cloud.cli.check_codecs", lambda *a, **k: None)
    root, weights = tiny
    out = tmp_path / "out"
    code = main(["build", str(root / "catalog.json"), "--out", str(out), "--weights",
                 str(weights), "--resolution", "32", "--codecs", "fp16,no-such-codec",
                 "--templates", "edit-car-top", "--no-bundle", "--ray", cluster])
    err = capsys.readouterr().err
    assert code == 1
    lines = [x for x in err.splitlines() if x.startswith("sakura")]  # (and tqdm's bar)
    assert len(lines) == 1, err
    assert lines[0].startswith("sakura: error: template edit-car-top-32: ")
    assert "no-such-codec" in lines[0] and "Traceback" not in err
    assert not (out / "catalog.json").exists()
    assert not ray.is_initialized()


def test_an_unreachable_cluster_is_one_clear_error(tiny, tmp_path, capsys):
    for address, says in ((f"127.0.0.1:{_free_port()}", "cannot reach the Ray cluster at"),
                          ("no-port", "give the head node's HOST:PORT")):
        assert _cli(tiny, tmp_path / "out", "--ray", address) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"sakura: error: --ray {address!r}"
                                                       if "HOST" in says else "sakura: error: ")
        assert says in err
    assert not (tmp_path / "out" / "catalog.json").exists()
    assert not ray.is_initialized()
