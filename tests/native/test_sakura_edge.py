"""``sakura-edge``: a whole edit in one executable, no Python (issue 31 item 2).

A small world made for it: a tiny seeded MMDiT whose text stream takes MiniLM's
``[16, 384]`` embeddings, its template run, ``sakura`` and ``fp16`` packs and the device
bundle with the text encoder program (``edge.bundle.export_bundle``), published into a
catalog with the template's assets and served by a real ``sakura serve`` child process on
loopback. The binary (CMake ``-DSAKURA_EDGE=ON``, built incrementally in
``native/build/sakura-edge`` by ``edge.sakura_edge_bench.build_x86``, as the benches build
it) and the Python runtime (``EdgeRuntime(runtime="native")``, what
``sakura edit --runtime native`` runs) edit the same template on the same fixed
configurations; the Python side encodes prompts with the same program through
``sakura_native.TextEncoder``, so the comparison covers everything after the encoder's
output: txt_in, the request tensors, the shard loop, composition.
"""

from __future__ import annotations

import base64
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.dit.common import text_width_model

TEMPLATE_ID = "edge-bin"
PROMPT = "a red hat with a small feather"
BPS = 1  # two shards per step (a double and a single block), each its own graph
FIXED = ["--policy", "sakura-fixed-config", "--no-local-fallback"]

native = pytest.importorskip("sakura_native")
pytestmark = pytest.mark.skipif(
    not (native.edit_runtime_available()[0] and native.text_encoder_available()[0]
         and shutil.which("cmake")),
    reason="needs the native edit runtime with the text encoder, and cmake")


def png_b64(arr: np.ndarray) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def exe() -> Path:
    from sakura.edge.sakura_edge_bench import build_x86  # lazy: as the world's imports

    return build_x86()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from sakura.cloud.bundle import publish_bundle
    from sakura.cloud.publish import CatalogTransaction, update_catalog
    from sakura.codec.base import get_codec
    from sakura.codec.pack import write_pack
    from sakura.dit.editing import EditRequest, Template, profile_importance, template_run
    from sakura.dit.weights import save_model
    from sakura.edge.backends.base import default_cache_dir
    from sakura.edge.backends.text_encoder import compiled_text_encoder
    from sakura.edge.bench import file_sha256
    from sakura.edge.bundle import export_bundle

    root = tmp_path_factory.mktemp("sakura-edge")
    model = text_width_model()
    g = torch.Generator().manual_seed(5)
    pixels = (torch.rand(32, 32, 3, generator=g) * 255).round().to(torch.uint8)
    mask = torch.zeros(32, 32, dtype=torch.bool)
    mask[8:20, 4:16] = True
    image = (pixels.float() / 127.5 - 1).permute(2, 0, 1).contiguous()
    template = Template(image=image, mask=mask, txt=torch.zeros(1, 16, 384), seed=1, steps=4,
                        guidance=2.0, strength=0.9)
    program = compiled_text_encoder(16)
    from sakura.edge.sakura_edge_bench import ProgramEncoder  # lazy: as the imports above

    enc = ProgramEncoder(program.pte, program.vocab)
    template.txt = enc.encode(["a template prompt"])
    reqs = [EditRequest(enc.encode([p]), enc.encode([""]), seed=i)
            for i, p in enumerate(["a profiling prompt", "another one"])]
    run = template_run(model, template)
    profile_importance(model, template, run, reqs)
    catalog = root / "catalog"
    # the device's key is the weights file's sha256 (what `sakura build`, `sakura edit` and
    # the replay use), so this world's graphs are the replay's and the CLI's (the same model)
    save_model(model, root / "model.safetensors")
    sha = file_sha256(root / "model.safetensors")
    with CatalogTransaction(catalog) as txn:
        # intq at 3 bits only: one configuration per shard (the comparison below needs the
        # same one on both sides), codes that straddle bytes, a partial channel group (48)
        for name, codec in (("sakura", get_codec("sakura")), ("fp16", get_codec("fp16")),
                            ("intq", get_codec("intq", bits=[3], group=32))):
            work = root / "work" / name
            m = write_pack(work, TEMPLATE_ID, run.cache, codec,
                           blocks_per_shard=BPS, model={"name": "tiny-384",
                                                        "weights_sha256": sha})
            txn.publish(TEMPLATE_ID, name, m.to_dict(), work / m.pack_file,
                        {"workload": "face-swap"})
    # the shared compiled cache (tests/edge/conftest.py compiled_dir): the replay and CLI
    # tests of the serial part run this model's full and template sets too
    compiled = default_cache_dir()
    made = export_bundle(model, sha, template, reqs[0], BPS, cache_dir_=compiled,
                         text_encoder=True, work=root / "bundle-work")
    entry = publish_bundle(catalog, made.files, made.doc)
    assets = {"prompt": "a template prompt", "seed": 1, "steps": 4, "guidance": 2.0,
              "strength": 0.9, "resolution": 32,
              "image_png_b64": png_b64(pixels.numpy()),
              "mask_png_b64": png_b64(mask.numpy().astype(np.uint8) * 255)}
    update_catalog(catalog, {TEMPLATE_ID: {"bundle": entry, "template": assets}})
    return {"model": model, "catalog": catalog, "root": root, "encoder": enc,
            "compiled": compiled, "bundle": entry, "sha": sha}


@pytest.fixture(scope="module")
def server(world):
    from sakura.edge.server_process import ServerProcess

    with ServerProcess(world["catalog"]) as srv:
        yield srv


def command(exe: Path | list[str]) -> list[str]:
    """The binary, or a prefix that runs it (qemu-aarch64 and the arm64 binary: the bad-input
    tests below run under emulation too, ``test_sakura_edge_arm64.py``)."""
    return [str(x) for x in exe] if isinstance(exe, (list, tuple)) else [str(exe)]


def run_binary(exe: Path | list[str], args: list[str], tmp: Path, env: dict | None = None
               ) -> subprocess.CompletedProcess:
    full = {**os.environ, "SAKURA_CACHE": str(tmp / "cache"), **(env or {})}
    return subprocess.run([*command(exe), *args], capture_output=True, text=True, env=full,
                          timeout=900)


def edit_args(url: str, out: Path, seed: int = 3, prompt: str = PROMPT) -> list[str]:
    return ["edit", "--origin", url, "--template", TEMPLATE_ID, "--prompt", prompt,
            "--seed", str(seed), "--out", str(out)]


def python_edit(world, url: str, policy: str, seed: int, rate: float, tmp: Path):
    from sakura.edge.backends.base import BackendConfig
    from sakura.edge.options import EditOptions
    from sakura.edge.runtime import EdgeRuntime

    rt = EdgeRuntime(world["model"], encoder=world["encoder"], runtime="native",
                     weights_sha256=world["sha"],
                     backend_config=BackendConfig(cache_dir=tmp / "py-compiled"))
    template = rt.fetch_template(url, TEMPLATE_ID)
    req = rt.request(PROMPT, seed)
    opts = EditOptions(local_fallback=False, budget_rate_bps=rate)
    res = rt.edit(url, TEMPLATE_ID, template, req, policy, options=opts)
    return res


@pytest.mark.parametrize("policy,rate", [("sakura-fixed-config", 1e12),
                                         ("sakura-fixed-config", 1.0), ("fp16", 1e12),
                                         ("intq", 1e12)])
def test_the_binary_edits_as_the_python_runtime(exe, world, server, tmp_path, policy, rate):
    out, floats, timeline = tmp_path / "edit.png", tmp_path / "edit.npy", tmp_path / "tl.json"
    args = edit_args(server.url, out) + ["--policy", policy, "--no-local-fallback",
                                         "--budget-rate-bps", str(rate), "--timeline",
                                         str(timeline), "--float-out", str(floats)]
    done = run_binary(exe, args, tmp_path)
    assert done.returncode == 0, done.stderr
    mine = np.load(floats)
    res = python_edit(world, server.url, policy, 3, rate, tmp_path)
    theirs = res.image.numpy()
    assert mine.shape == theirs.shape == (3, 32, 32)
    err = float(np.abs(mine - theirs).max())
    print(f"{policy} rate {rate}: max abs err {err:.3g}")
    assert err <= 1e-4
    tl = json.loads(timeline.read_text())
    assert tl["configs"] == res.configs  # the same configuration of every shard
    assert len(tl["timeline"]) == len(res.timeline)
    assert all(r["config"] == c for r, c in zip(tl["timeline"], res.configs))
    # the PNG is the float output rounded as `sakura edit` rounds it
    from PIL import Image

    png = np.asarray(Image.open(out)).astype(np.int64)
    want = np.round((np.clip(mine, -1, 1) + 1) * 127.5).astype(np.int64).transpose(1, 2, 0)
    assert np.array_equal(png, want)


def test_the_manifest_is_revalidated_and_the_rate_remembered(exe, server, tmp_path):
    state = tmp_path / "state"
    for _ in range(2):
        done = run_binary(exe, edit_args(server.url, tmp_path / "e.png") + FIXED +
                          ["--state-dir", str(state), "--timeline", str(tmp_path / "t.json")],
                          tmp_path)
        assert done.returncode == 0, done.stderr
        tl = json.loads((tmp_path / "t.json").read_text())
        doc = json.loads((state / "state.json").read_text())
        rate = doc["rates"][server.url]
        assert rate["rate_bps"] > 0 and rate["at"] > 0
        assert doc["manifests"] == [f"{TEMPLATE_ID}.sakura.json"]
    # the second edit had a remembered rate: its manifest came back 304, no body
    assert tl["manifest_cached"] is True and tl["manifest_bytes"] == 0


def test_the_float_output_does_not_depend_on_the_seed_path(exe, server, tmp_path):
    outs = []
    for seed in (3, 4):
        f = tmp_path / f"{seed}.npy"
        done = run_binary(exe, edit_args(server.url, tmp_path / "e.png", seed=seed) + FIXED +
                          ["--float-out", str(f), "--no-state"], tmp_path)
        assert done.returncode == 0, done.stderr
        outs.append(np.load(f))
    assert np.abs(outs[0] - outs[1]).max() > 1e-3  # another seed, another edit


@pytest.mark.parametrize("policy", ["sakura", "sakura-greedy"])
def test_the_adaptive_policies_choose_from_the_manifest_and_edit_near_exact(
        exe, world, server, tmp_path, policy):
    """The adaptive allocation (the plan over the next shards, or the greedy rule) in the
    C++ allocator with the tables made from the manifest as edge/allocator.py makes them: every
    shard runs on one of its Pareto configurations, and the image is near the fp16 edit
    (``exact``) of the same request."""
    import math

    outs = {}
    for pol in (policy, "fp16"):
        f, tl = tmp_path / f"{pol}.npy", tmp_path / f"{pol}.json"
        done = run_binary(exe, edit_args(server.url, tmp_path / "o.png") +
                          ["--policy", pol, "--no-local-fallback", "--float-out", str(f),
                           "--timeline", str(tl), "--no-state"], tmp_path)
        assert done.returncode == 0, done.stderr
        outs[pol] = (np.load(f), json.loads(tl.read_text()))
    manifest = json.loads((world["catalog"] / "templates" / TEMPLATE_ID / "sakura" /
                           "manifest.json").read_text())
    offered = {int(s["index"]): {int(c["id"]) for c in s["configs"] if c.get("pareto", True)}
               for s in manifest["shards"]}
    records = outs[policy][1]["timeline"]
    assert len(records) == len(offered)
    assert all(r["config"] in offered[r["shard"]] for r in records)
    mse = float(((outs[policy][0] - outs["fp16"][0]) ** 2).mean())
    psnr = 100.0 if mse == 0 else 10 * math.log10(4.0 / mse)
    print(f"{policy} vs fp16: {psnr:.1f} dB")
    assert psnr > 25.0


def test_fixed_bits_keeps_its_bit_width_and_floor_says_when_it_cannot_plan(
        exe, world, server, tmp_path):
    """``sakura-fixed-bits`` (edge/allocator.py ``_fixed_bits``): every shard runs on a
    uniform configuration of the bit width asked, on the Pareto front or off it; a width no
    shard offers is one error line. ``sakura-floor`` on a pack without ``local_psnr_db`` (the
    test world's) prints Policy.missing's warning and plans as ``sakura``."""
    manifest = json.loads((world["catalog"] / "templates" / TEMPLATE_ID / "sakura" /
                           "manifest.json").read_text())
    params = {int(s["index"]): {int(c["id"]): c.get("params", {}) for c in s["configs"]}
              for s in manifest["shards"]}
    def uniform(p):  # edge/allocator.py ConfigOption.uniform
        return len({r for r in p.get("ranks", []) if r > 0}) <= 1

    widths = [{p["bits"] for p in shard.values() if "bits" in p and uniform(p)}
              for shard in params.values()]
    bits = max(set.intersection(*widths))
    tl = tmp_path / "fb.json"
    done = run_binary(exe, edit_args(server.url, tmp_path / "o.png") +
                      ["--policy", "sakura-fixed-bits", "--bits", str(bits),
                       "--no-local-fallback", "--timeline", str(tl), "--no-state"], tmp_path)
    assert done.returncode == 0, done.stderr
    records = json.loads(tl.read_text())["timeline"]
    assert len(records) == len(params)
    for r in records:
        p = params[r["shard"]][r["config"]]
        assert p["bits"] == bits and uniform(p), p
    absent = next(b for b in range(1, 17) if all(b not in w for w in widths))
    one_error_line(run_binary(exe, edit_args(server.url, tmp_path / "o.png") +
                              ["--policy", "sakura-fixed-bits", "--bits", str(absent),
                               "--no-state"], tmp_path), 1, "no configuration matches")
    assert manifest.get("local_psnr_db") is None
    done = run_binary(exe, edit_args(server.url, tmp_path / "o.png") +
                      ["--policy", "sakura-floor", "--no-local-fallback", "--no-state"],
                      tmp_path)
    assert done.returncode == 0, done.stderr
    warnings = [ln for ln in done.stderr.splitlines() if ln.startswith("sakura-edge: warning:")]
    assert len(warnings) == 1 and "plans as sakura" in warnings[0], done.stderr


class Outage:
    """ASGI wrapper: pack GETs get their headers, then nothing for ``stall_s`` (no prefix can
    arrive); everything else passes (tests/edge/test_native_runtime.py's outage)."""

    def __init__(self, app, stall_s=30.0):
        self.app, self.stall_s = app, stall_s

    async def __call__(self, scope, receive, send):
        if (scope["type"] == "http" and scope["method"] == "GET"
                and scope["path"].endswith(".pack")):
            import asyncio

            asked = dict(scope["headers"]).get(b"range", b"bytes=0-0").split(b"=", 1)[1]
            await send({"type": "http.response.start", "status": 206,
                        "headers": [(b"content-type", b"application/octet-stream"),
                                    (b"content-range", b"bytes " + asked + b"/*")]})
            await asyncio.sleep(self.stall_s)
            return
        await self.app(scope, receive, send)


def test_an_outage_from_the_start_recomputes_as_the_python_runtime_does(exe, world, server,
                                                                        tmp_path):
    """The local fallback through the bundle's chains: no byte of the pack arrives, so the
    first step is a recompute step (the bundle's ``template`` graphs, the template prompt
    encoded by the binary's own text encoder) and the next ones reuse its K/V (stale reuse);
    the image is the Python-driven native runtime's edit over the same outage, and not
    ``local``'s (the whole model on its own trajectory)."""
    from sakura.cloud.server import create_app
    from sakura.cloud.storage import LocalStorage
    from sakura.edge.backends.base import BackendConfig
    from sakura.edge.runtime import EdgeRuntime, EditOptions

    from tests.edge.helpers import Server

    floats, timeline = tmp_path / "o.npy", tmp_path / "t.json"
    with Server(Outage(create_app(LocalStorage(world["catalog"])))) as srv:
        done = run_binary(exe, edit_args(srv.url, tmp_path / "o.png") +
                          ["--policy", "sakura-fixed-config", "--budget-rate-bps", "1e12",
                           "--float-out", str(floats), "--timeline", str(timeline),
                           "--no-state"], tmp_path)
    assert done.returncode == 0, done.stderr
    tl = json.loads(timeline.read_text())["timeline"]
    assert all(r["bytes"] == 0 for r in tl)
    assert tl[0]["local"] and all(r["local"] or r["stale_from"] is not None for r in tl)
    rt = EdgeRuntime(world["model"], encoder=world["encoder"], runtime="native",
                     weights_sha256=world["sha"],
                     backend_config=BackendConfig(cache_dir=world["compiled"]))
    template = rt.fetch_template(server.url, TEMPLATE_ID)
    req = rt.request(PROMPT, 3)
    with Server(Outage(create_app(LocalStorage(world["catalog"])))) as srv:
        same = rt.edit(srv.url, TEMPLATE_ID, template, req, "sakura-fixed-config",
                       options=EditOptions(initial_rate_bps=1e12))
    assert [(r["local"], r.get("stale_from")) for r in same.timeline] == \
        [(r["local"], r["stale_from"]) for r in tl]
    err = float(np.abs(np.load(floats) - same.image.numpy()).max())
    local = rt.edit(server.url, TEMPLATE_ID, template, req, "local")
    off = float(np.abs(np.load(floats) - local.image.numpy()).max())
    print(f"all-recomputed edit vs the Python runtime's: max abs err {err:.3g}; "
          f"vs local {off:.3g}")
    assert err <= 1e-4 < off


# ---------------------------------------------------------------------- bad input
def one_error_line(done: subprocess.CompletedProcess, code: int, *words: str) -> str:
    assert done.returncode == code, (done.returncode, done.stderr)
    lines = [ln for ln in done.stderr.splitlines() if ln.startswith("sakura-edge: error:")]
    assert len(lines) == 1, done.stderr
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


def test_bad_usage_exits_2(exe, tmp_path):
    one_error_line(run_binary(exe, [], tmp_path), 2, "no command")
    one_error_line(run_binary(exe, ["edit", "--origin", "ftp://x"], tmp_path), 2, "http")
    one_error_line(run_binary(exe, edit_args("http://127.0.0.1:1", tmp_path / "o.png")[:-2],
                              tmp_path), 2, "--out")
    one_error_line(run_binary(exe, edit_args("http://127.0.0.1:1", tmp_path / "o.png") +
                              ["--policy", "cachegen"], tmp_path), 2, "policy")
    one_error_line(run_binary(exe, edit_args("http://127.0.0.1:1", tmp_path / "o.png") +
                              ["--bits", "0"], tmp_path), 2, "--bits")
    one_error_line(run_binary(exe, edit_args("http://127.0.0.1:1", tmp_path / "o.png",
                                             prompt="   "), tmp_path), 2, "empty")
    one_error_line(run_binary(exe, edit_args("http://127.0.0.1:1", tmp_path / "o.png") +
                              ["--precision", "int4"], tmp_path), 2, "--precision", "int4")
    one_error_line(run_binary(exe, edit_args("http://127.0.0.1:1", tmp_path / "o.png") +
                              ["--http-version", "3"], tmp_path), 2, "--http-version", "'3'")
    one_error_line(run_binary(exe, edit_args("http://127.0.0.1:1", tmp_path / "o.png") +
                              ["--reconstruct", "gpu"], tmp_path), 2, "--reconstruct", "'gpu'")
    one_error_line(run_binary(exe, edit_args("http://127.0.0.1:1", tmp_path / "o.png") +
                              ["--pack-origin", "ftp://h"], tmp_path), 2, "--pack-origin")
    one_error_line(run_binary(exe, edit_args("http://127.0.0.1:1", tmp_path / "o.png") +
                              ["--pack-origin", "http://h:1/packs"], tmp_path), 2,
                   "scheme://host:port only")


@pytest.fixture(scope="module")
def nginx(world):
    from sakura.cloud.origins import NginxOrigin, nginx_binary

    if nginx_binary() is None:
        pytest.skip("nginx is not installed")
    origin = NginxOrigin(world["catalog"], http2=True, access_log=True)
    with origin:
        yield origin


def test_pack_ranges_come_from_the_pack_origin_with_the_same_image(exe, server, nginx,
                                                                   tmp_path):
    """--pack-origin: catalog, bundle and manifest from --origin, every pack range from
    the other listener (nginx's access log holds them all), and the same float output."""
    outs = {}
    for name, extra in (("alone", []), ("split", ["--pack-origin", nginx.url])):
        before = len(nginx.access_log_lines())
        f = tmp_path / f"{name}.npy"
        done = run_binary(exe, edit_args(server.url, tmp_path / "e.png") + FIXED + extra +
                          ["--float-out", str(f), "--no-state", "--budget-rate-bps", "1e12",
                           "--timeline", str(tmp_path / "t.json")], tmp_path)
        assert done.returncode == 0, done.stderr
        outs[name] = (np.load(f), json.loads((tmp_path / "t.json").read_text())["configs"])
        lines = [x.split() for x in nginx.access_log_lines()[before:]]
        ranges = [x for x in lines if x[2] == "GET" and x[4] == "206"]
        if name == "alone":
            assert lines == []
        else:
            tl = json.loads((tmp_path / "t.json").read_text())
            assert len(ranges) == len(tl["timeline"]) > 1
            assert all(f"/templates/{TEMPLATE_ID}/sakura/" in x[3] for x in ranges)
            assert not any("manifest" in x[3] or "catalog" in x[3] for x in lines)
    assert outs["alone"][1] == outs["split"][1]
    assert np.array_equal(outs["alone"][0], outs["split"][0])


def test_opencl_reconstruction_edits_as_the_cpu_one(exe, server, tmp_path):
    """--reconstruct opencl (the GPU path; pocl on this CPU): the same configurations and the
    same float output as the SIMD kernels within 1e-4 (the binary against the module's
    bound); with the smallest configuration as well as the largest."""
    ok, why = native.opencl_available()
    if not ok:
        pytest.skip(f"no OpenCL device: {why}")
    for rate in ("1e12", "1"):
        outs = {}
        for stage in ("cpu", "opencl"):
            f, t = tmp_path / f"{stage}-{rate}.npy", tmp_path / f"{stage}-{rate}.json"
            done = run_binary(exe, edit_args(server.url, tmp_path / "e.png") + FIXED +
                              ["--no-state", "--budget-rate-bps", rate, "--reconstruct", stage,
                               "--float-out", str(f), "--timeline", str(t)], tmp_path)
            assert done.returncode == 0, done.stderr
            outs[stage] = (np.load(f), json.loads(t.read_text())["configs"])
        assert outs["cpu"][1] == outs["opencl"][1]
        assert float(np.abs(outs["cpu"][0] - outs["opencl"][0]).max()) <= 1e-4
    # the flag reaches the OpenCL stage: a device that is not there is named, one line
    done = run_binary(exe, edit_args(server.url, tmp_path / "x.png") + FIXED +
                      ["--no-state", "--reconstruct", "opencl:no-such-gpu"], tmp_path)
    one_error_line(done, 1, "no-such-gpu")
    assert not (tmp_path / "x.png").exists()


def test_http2_pack_ranges(exe, server, nginx, tmp_path):
    """--http-version 2 --pack-origin (nginx's h2c listener): the ranges as HTTP/2 streams
    of one connection, the HTTP/1.1 image; on a libcurl that cannot reuse an h2c connection
    (Debian 12's 7.88.1, curl#10634) one clear line and no image."""
    from tests.edge.test_http2 import H2C_REUSE_BROKEN

    f = tmp_path / "h2.npy"
    done = run_binary(exe, edit_args(server.url, tmp_path / "e.png") + FIXED +
                      ["--http-version", "2", "--pack-origin", nginx.h2_url, "--no-state",
                       "--budget-rate-bps", "1e12", "--float-out", str(f)], tmp_path)
    if H2C_REUSE_BROKEN:
        one_error_line(done, 1, "curl#10634", "use HTTP/1.1")
        assert not (tmp_path / "e.png").exists()
        return
    assert done.returncode == 0, done.stderr
    h2 = [x.split() for x in nginx.access_log_lines() if x.startswith("HTTP/2.0")]
    assert h2 and len({x[1] for x in h2 if x[2] == "GET"}) == 1
    ref = tmp_path / "h1.npy"
    done = run_binary(exe, edit_args(server.url, tmp_path / "e1.png") + FIXED +
                      ["--no-state", "--budget-rate-bps", "1e12", "--float-out", str(ref)],
                      tmp_path)
    assert done.returncode == 0, done.stderr
    assert np.array_equal(np.load(f), np.load(ref))


def test_int8_from_a_bundle_without_int8_graphs_is_one_line(exe, server, tmp_path):
    done = run_binary(exe, edit_args(server.url, tmp_path / "o.png") + FIXED
                      + ["--precision", "int8"], tmp_path)
    one_error_line(done, 1, "no int8 graphs", "sakura build --int8")
    assert not (tmp_path / "o.png").exists()


@pytest.mark.slow  # ~3 min here: the int8 export of the tiny model's two chains
def test_int8_runs_the_bundles_int8_graphs_as_the_python_runtime(exe, world, tmp_path):
    """An int8 bundle (``sakura build --int8``'s): ``--precision int8`` runs its int8
    sets, and the image is the Python runtime's int8 edit (same graphs, same runtime),
    near the fp32 edit and not equal to it."""
    from sakura.cloud.bundle import publish_bundle
    from sakura.cloud.publish import update_catalog
    from sakura.edge.backends.base import BackendConfig
    from sakura.edge.bundle import export_bundle
    from sakura.edge.options import EditOptions
    from sakura.edge.runtime import EdgeRuntime
    from sakura.edge.server_process import ServerProcess

    catalog = tmp_path / "catalog"
    shutil.copytree(world["catalog"], catalog)
    model, enc = world["model"], world["encoder"]
    rt = EdgeRuntime(model, encoder=enc, runtime="native", weights_sha256=world["sha"],
                     backend_config=BackendConfig(cache_dir=tmp_path / "py-compiled"))
    with ServerProcess(world["catalog"]) as srv:
        template = rt.fetch_template(srv.url, TEMPLATE_ID)
    req = rt.request(PROMPT, 3)
    made = export_bundle(model, world["sha"], template, req, BPS,
                         cache_dir_=world["compiled"], text_encoder=True,
                         work=tmp_path / "w", precision="int8")
    update_catalog(catalog, {TEMPLATE_ID: {"bundle": publish_bundle(catalog, made.files,
                                                                     made.doc)}})
    floats, tl = {}, {}
    with ServerProcess(catalog) as srv:
        for p in ("fp32", "int8"):
            out = tmp_path / p
            out.mkdir()
            done = run_binary(exe, edit_args(srv.url, out / "o.png") + FIXED
                              + ["--precision", p, "--float-out", str(out / "o.npy"),
                                 "--timeline", str(out / "tl.json")], tmp_path)
            assert done.returncode == 0, done.stderr
            floats[p] = np.load(out / "o.npy")
            tl[p] = json.loads((out / "tl.json").read_text())
        res = rt.edit(srv.url, TEMPLATE_ID, template, req, "sakura-fixed-config",
                      options=EditOptions(local_fallback=False, precision="int8"))
    assert tl["int8"]["precision"] == "int8" and tl["fp32"]["precision"] == "fp32"
    assert float(np.abs(floats["int8"] - res.image.numpy()).max()) <= 1e-4
    diff = float(np.abs(floats["int8"] - floats["fp32"]).max())
    assert 0 < diff < 0.1, diff


def test_an_unknown_template_is_one_line(exe, server, tmp_path):
    args = edit_args(server.url, tmp_path / "o.png")
    args[args.index(TEMPLATE_ID)] = "no-such-template"
    one_error_line(run_binary(exe, args, tmp_path), 1, "unknown template", "no-such-template")


def test_an_unreachable_origin_is_one_line(exe, tmp_path):
    done = run_binary(exe, edit_args("http://127.0.0.1:9", tmp_path / "o.png") +
                      ["--retry-window", "0.5"], tmp_path)
    one_error_line(done, 1, "cannot reach", "127.0.0.1:9")


def test_an_over_long_prompt_is_refused_or_truncated_and_said(exe, server, tmp_path):
    long = " ".join(["word"] * 30)
    one_error_line(run_binary(exe, edit_args(server.url, tmp_path / "o.png", prompt=long)
                              + FIXED, tmp_path), 1, "30 word pieces", "reads 14", "--truncate")
    done = run_binary(exe, edit_args(server.url, tmp_path / "o.png", prompt=long) + FIXED +
                      ["--truncate"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert "truncated" in done.stderr


def test_a_non_utf8_prompt_is_one_line(exe, server, tmp_path):
    args = [a.encode() for a in edit_args(server.url, tmp_path / "o.png")]
    args[args.index(PROMPT.encode())] = b"caf\xe9 au lait"
    done = subprocess.run([*command(exe), *args], capture_output=True,
                          env={**os.environ, "SAKURA_CACHE": str(tmp_path / "cache")})
    done = subprocess.CompletedProcess(done.args, done.returncode, done.stdout.decode(),
                                       done.stderr.decode(errors="replace"))
    one_error_line(done, 1, "prompt", "UTF-8")


def corrupted_catalog(world, tmp_path: Path, name: str, how: str) -> Path:
    catalog = tmp_path / "catalog"
    shutil.copytree(world["catalog"], catalog)
    f = next(x for x in world["bundle"]["files"] if x["name"] == name)
    path = catalog / f["key"]
    if how == "missing":
        path.unlink()
    else:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    return catalog


@pytest.mark.parametrize("how,code", [("missing", "publish_broken"),
                                      ("corrupt", "pack_damaged")])
def test_a_missing_or_corrupt_bundle_file_is_one_line(exe, world, tmp_path, how, code):
    # sakura serve verifies a bundle file before it serves it: a 500 naming it
    from sakura.edge.server_process import ServerProcess

    catalog = corrupted_catalog(world, tmp_path, "tables.bin", how)
    with ServerProcess(catalog) as srv:
        done = run_binary(exe, edit_args(srv.url, tmp_path / "o.png") + FIXED, tmp_path)
    one_error_line(done, 1, code, "tables.bin", "retrying will not help")
    assert not (tmp_path / "o.png").exists()


def test_a_corrupt_bundle_file_from_a_plain_file_origin_fails_its_checksum(exe, world,
                                                                          tmp_path):
    # an origin that does not verify (a static file server, a CDN): the device's own check
    import socket
    import time

    catalog = corrupted_catalog(world, tmp_path, "tables.bin", "corrupt")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind",
                             "127.0.0.1", "--directory", str(catalog)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                break
            except OSError:
                time.sleep(0.1)
        done = run_binary(exe, edit_args(f"http://127.0.0.1:{port}", tmp_path / "o.png")
                          + FIXED, tmp_path)
    finally:
        proc.terminate()
        proc.wait(10)
    one_error_line(done, 1, "tables.bin", "fails its checksum", "not used")
    assert not (tmp_path / "o.png").exists()
    assert not list((tmp_path / "cache").rglob("tables.bin"))  # nothing kept


def test_a_bundle_for_other_weights_is_one_line(exe, world, tmp_path):
    from sakura.cloud.publish import update_catalog
    from sakura.edge.server_process import ServerProcess

    catalog = tmp_path / "catalog"
    shutil.copytree(world["catalog"], catalog)
    entry = dict(world["bundle"], weights_sha256="f" * 64)
    update_catalog(catalog, {TEMPLATE_ID: {"bundle": entry}})
    with ServerProcess(catalog) as srv:
        done = run_binary(exe, edit_args(srv.url, tmp_path / "o.png") + FIXED, tmp_path)
    one_error_line(done, 1, "refused", "ffffffffffff")


# ---------------------------------------------------------------------- no interpreter
def test_no_interpreter_starts(exe, server, tmp_path):
    env = {"PYTHONHOME": "/nonexistent", "PYTHONPATH": "", "PATH": "/usr/bin:/bin"}
    args = edit_args(server.url, tmp_path / "o.png") + FIXED + ["--no-state"]
    strace = shutil.which("strace")
    if strace is None:
        done = run_binary(exe, args, tmp_path, env)
        assert done.returncode == 0, done.stderr
        pytest.skip("strace is not installed: ran without Python on PATH only")
    trace = tmp_path / "trace.txt"
    done = run_binary(Path(strace), ["-f", "-e", "trace=openat,execve", "-o", str(trace),
                                     str(exe), *args], tmp_path, env)
    assert done.returncode == 0, done.stderr
    calls = trace.read_text().splitlines()
    opened = [ln for ln in calls if "openat(" in ln]
    assert opened, "strace saw no openat"
    assert not [ln for ln in opened if ".py\"" in ln or ".pyc\"" in ln]
    assert not [ln for ln in calls if "execve(" in ln and "sakura-edge" not in ln]
    assert not [ln for ln in opened if "encodings" in ln or "site-packages/torch/" in ln
                and ".py" in ln]
