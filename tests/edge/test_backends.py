"""Execution backends: shard graphs equal the torch model, ExecuTorch and QNN HTP outputs
within their bounds, compiled artifacts reused, streamed edits on every backend, errors."""

from __future__ import annotations

import os

import pytest
import torch
from sakura.cloud.server import create_app
from sakura.cloud.storage import LocalStorage
from sakura.dit.editing import EditRequest, Geometry, cached_edit
from sakura.edge.backends import BackendError, BackendUnavailable, GeometryMismatch, create_backend
from sakura.edge.backends.base import BackendConfig
from sakura.edge.backends.bench import BackendBenchSpec, bench_backends, shard_inputs
from sakura.edge.backends.errors import AIHubError
from sakura.edge.backends.executor import ShardExecutor, edit_geometry, step_groups
from sakura.edge.errors import EdgeError
from sakura.edge.quality import psnr
from sakura.edge.runtime import EdgeRuntime

from tests.edge.aihub_stub import StubHub
from tests.edge.helpers import TEMPLATE_ID, FakeEncoder, Server

PROMPT = "a private prompt that must stay on the device"
SEED = 4242
GROUPS = step_groups(4, 2)  # the world's packs: 2 blocks per shard
# ExecuTorch/XNNPACK runs fp32: the brief's bound (measured 1.2e-7). QNN HTP runs fp16:
# measured max abs error 1.7e-3 on outputs of magnitude ~1.7 (tiny model); ~6x margin.
BOUNDS = {"executorch": 1e-3, "qnn": 1e-2}
# whole 4-step edit vs the torch backend (measured: executorch 155 dB, qnn 86 dB)
EDIT_PSNR_DB = {"executorch": 100.0, "qnn": 60.0}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    return tmp_path_factory.mktemp("compiled")


@pytest.fixture(scope="module")
def setup(world):
    req = world.runtime().request(PROMPT, SEED)
    geo = Geometry.of(world.model, world.template)
    cache = world.cache.to_fp16_exact()
    inputs = shard_inputs(world.model, world.template, geo, cache, req, GROUPS, step=1)
    return req, geo, cache, inputs


def test_torch_shard_graphs_equal_cached_edit(world, setup):
    req, geo, cache, _ = setup
    exact = cached_edit(world.model, world.template, geo, cache, req)
    ex = ShardExecutor(world.model, create_backend("torch"))
    out = ex.edit(world.template, geo, cache, req, GROUPS)
    assert float((out - exact).abs().max()) <= 1e-6
    # one step-independent graph per block group, for every geometry
    one = ShardExecutor(world.model, create_backend("torch"))
    one.edit(world.template, geo, cache, req, step_groups(4, 4))
    assert len(one.compiled) == 1


@pytest.mark.parametrize("name", ["executorch", "qnn"])
def test_compiled_backend_matches_torch_and_reuses_its_artifacts(world, setup, compiled, name):
    _req, _geo, _cache, inputs = setup
    geometry = edit_geometry(world.model, world.template, _geo, _req)
    ref = create_backend("torch")
    first = create_backend(name, BackendConfig(cache_dir=compiled))
    outs = {}
    for blocks, xs in inputs:
        got = first.prepare(world.model, blocks, geometry).run(*xs)
        want = ref.prepare(world.model, blocks, geometry).run(*xs)
        err = max(float((g - w).abs().max()) for g, w in zip(got, want))
        assert err < BOUNDS[name], (name, blocks, err)
        assert all(g.shape == w.shape for g, w in zip(got, want))
        outs[blocks] = got
    folders = sorted(p for p in (compiled / name).iterdir() if not p.name.startswith("."))
    assert len(folders) == len(GROUPS)
    mtimes = {f: [(p.name, p.stat().st_mtime_ns) for p in sorted(f.rglob("*"))]
              for f in folders}
    # a fresh backend (as a new process would) loads the artifacts and compiles nothing
    again = create_backend(name, BackendConfig(cache_dir=compiled))
    for blocks, xs in inputs:
        got = again.prepare(world.model, blocks, geometry).run(*xs)
        assert all(torch.equal(g, o) for g, o in zip(got, outs[blocks]))
    assert again.stats.compiles == 0 and again.stats.cache_hits == len(GROUPS)
    assert {f: [(p.name, p.stat().st_mtime_ns) for p in sorted(f.rglob("*"))]
            for f in folders} == mtimes
    # other weights are another key: nothing stale is loaded
    other = type(world.model)(world.model.cfg)
    key_a = first.key(world.model, "a" * 64, GROUPS[0], geometry)
    key_b = first.key(other, "b" * 64, GROUPS[0], geometry)
    assert key_a.digest() != key_b.digest()


@pytest.mark.parametrize("name", ["executorch", "qnn"])
def test_a_streamed_edit_runs_on_the_backend(world, setup, compiled, name):
    req = setup[0]
    torch_rt = EdgeRuntime(world.model, encoder=FakeEncoder())
    rt = EdgeRuntime(world.model, encoder=FakeEncoder(), backend=name,
                     backend_config=BackendConfig(cache_dir=compiled))
    with Server(create_app(LocalStorage(world.catalog_dir))) as server:
        want = torch_rt.edit(server.url, TEMPLATE_ID, world.template, req, "fp16")
        got = rt.edit(server.url, TEMPLATE_ID, world.template, req, "fp16")
        with pytest.raises(EdgeError, match="local policy"):
            rt.edit(server.url, TEMPLATE_ID, world.template, req, "local")
    assert got.image.shape == want.image.shape
    assert psnr(got.image, want.image) >= EDIT_PSNR_DB[name]
    assert float((got.image - want.image).abs().max()) < BOUNDS[name]
    assert len(got.timeline) == len(want.timeline) and got.bytes == want.bytes
    keep = ~world.template.mask  # outside the mask: the template, bit for bit
    assert torch.equal(got.image[:, keep], want.image[:, keep])


def test_delegable_shard_graph_is_the_same_function(world, setup):
    """The XNNPACK-lowerable form of the graph (bmm attention, 4-D means, RoPE as exact
    matrix products, constants as tensors) computes what the plain graph computes."""
    from sakura.edge.backends.shard import ShardModule

    req, geo, _cache, inputs = setup
    geometry = edit_geometry(world.model, world.template, geo, req)
    for blocks, xs in inputs:
        plain = ShardModule(world.model, blocks, geometry).eval()
        delegable = ShardModule(world.model, blocks, geometry, sigmoid_gelu=True,
                                delegable=True).eval()
        with torch.no_grad():
            want, got = plain(*xs), delegable(*xs)
        err = max(float((g - w).abs().max()) for g, w in zip(got, want))
        assert err < 1e-5, (blocks, err)  # measured 4.8e-7 (float32 summation order)


@pytest.mark.parametrize("name", ["executorch", "qnn"])
def test_every_compute_op_of_a_shard_runs_in_the_delegate(world, setup, compiled, name):
    """Structural, not numeric: a partly delegated shard computes the same outputs."""
    import onnx
    from sakura.edge.backends.delegation import pte_kernel_calls

    req, geo, _cache, inputs = setup
    geometry = edit_geometry(world.model, world.template, geo, req)
    backend = create_backend(name, BackendConfig(cache_dir=compiled))
    weights = ShardExecutor(world.model, backend).weights
    for blocks, _xs in inputs:
        backend.prepare(world.model, blocks, geometry, weights)
        folder = backend.cache.lookup(backend.key(world.model, weights, blocks, geometry))
        assert folder is not None
        if name == "executorch":
            info = backend.delegation(folder)  # ExecuTorch's get_delegation_info, at compile
            assert info.outside == {} and info.fraction == 1.0, info.outside
            assert info.subgraphs == 1 and info.delegated_ops > 100  # measured 464 / 266
            calls = pte_kernel_calls((folder / "shard.pte").read_bytes())
            assert calls.delegates == ("XnnpackBackend",) and calls.kernels == {}
        else:
            got = backend.assignment(backend.onnx_path(folder))
            assert got.cpu_fallback_nodes == 0 and got.cpu_ops == {}
            assert got.nodes["QNNExecutionProvider"] > 100  # measured 338 / 190
            ctx = onnx.load(str(folder / "shard_ctx.onnx"), load_external_data=False)
            assert [n.op_type for n in ctx.graph.node] == ["EPContext"]


def test_the_delegation_checks_see_ops_left_on_the_cpu(tmp_path):
    """The checks above can fail: ops XNNPACK / the QNN HTP do not take are counted."""
    import warnings

    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower
    from sakura.edge.backends.delegation import pte_kernel_calls, xnnpack_delegation

    class StridedSlice(torch.nn.Module):  # x[..., ::2] is not lowered (stride 2)
        def forward(self, x):
            return torch.sigmoid(x)[..., ::2] * 2.0

    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        lowered = to_edge_transform_and_lower(
            torch.export.export(StridedSlice(), (torch.randn(2, 8),), strict=False),
            partitioner=[XnnpackPartitioner()])
    info = xnnpack_delegation(lowered.exported_program().graph_module)
    assert info.outside_ops >= 1 and info.fraction < 1.0
    assert any("slice" in op for op in info.outside), info.outside
    assert pte_kernel_calls(lowered.to_executorch().buffer).kernels

    class Det(torch.nn.Module):  # the HTP has no determinant
        def forward(self, x):
            return torch.linalg.det(x) + 1.0

    path = tmp_path / "det.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Det(), (torch.randn(3, 4, 4),), str(path), dynamo=True,
                          opset_version=18)
    got = create_backend("qnn", BackendConfig(cache_dir=tmp_path)).assignment(path)
    assert got.cpu_fallback_nodes == 1 and got.cpu_ops == {"Det": 1}


def test_bad_input_gives_clear_errors(world, setup, monkeypatch):
    req, geo, cache, inputs = setup
    with pytest.raises(BackendError, match="unknown backend 'tpu'"):
        create_backend("tpu")
    with pytest.raises(BackendError, match="unknown backend"):
        EdgeRuntime(world.model, encoder=FakeEncoder(), backend="tpu")
    geometry = edit_geometry(world.model, world.template, geo, req)
    shard = create_backend("torch").prepare(world.model, GROUPS[0], geometry)
    blocks, xs = inputs[0]
    bad = list(xs)
    bad[-1] = torch.zeros(geometry.cached + 1, world.model.cfg.hidden_size)
    with pytest.raises(GeometryMismatch, match="compiled for"):
        shard.run(*bad)
    refs = EditRequest(req.txt, req.txt_uncond, req.seed, ref_images=torch.zeros(1, 3, 16, 16))
    with pytest.raises(BackendError, match="reference"):
        ShardExecutor(world.model, create_backend("torch")).edit(
            world.template, geo, cache, refs, GROUPS)
    with pytest.raises(BackendError, match="cover"):
        ShardExecutor(world.model, create_backend("torch")).edit(
            world.template, geo, cache, req, [(0, 1)])
    import onnxruntime_qnn

    monkeypatch.setattr(onnxruntime_qnn, "get_qnn_htp_path", lambda: "/nonexistent/libQnnHtp.so")
    with pytest.raises(BackendUnavailable, match="libQnnHtp.so"):
        EdgeRuntime(world.model, encoder=FakeEncoder(), backend="qnn")


def test_sakura_edit_backend_qnn_without_htp_library_is_one_error_line(monkeypatch, tmp_path,
                                                                      capsys):
    import onnxruntime_qnn

    from sakura.cli import main

    monkeypatch.setattr(onnxruntime_qnn, "get_qnn_htp_path", lambda: "/nonexistent/libQnnHtp.so")
    code = main(["edit", "--server", "http://127.0.0.1:9", "--template", "face-cook",
                 "--prompt", "p", "--out", str(tmp_path / "o.png"), "--no-state",
                 "--backend", "qnn"])
    err = capsys.readouterr().err
    assert code == 1
    errors = [line for line in err.splitlines() if line.startswith("sakura: error:")]
    assert len(errors) == 1
    assert errors[0].startswith("sakura: error: --backend qnn needs the QNN HTP library")
    assert "Traceback" not in err and "torchao" not in err


def test_ai_hub_without_a_token_is_a_clear_error(monkeypatch, tmp_path):
    from sakura.edge.backends.aihub import submit_shard_jobs

    monkeypatch.delenv("QAI_HUB_API_TOKEN", raising=False)
    monkeypatch.setenv("QAIHUB_CLIENT_INI", str(tmp_path / "none.ini"))
    onnx = tmp_path / "shard.onnx"
    onnx.write_bytes(b"x")
    hub = StubHub().install(monkeypatch)
    with pytest.raises(AIHubError, match="QAI_HUB_API_TOKEN"):
        submit_shard_jobs(onnx)
    assert hub.calls == []


def test_ai_hub_jobs_upload_only_the_shard_graph(world, setup, compiled, monkeypatch):
    from sakura.edge.backends.aihub import submit_shard_jobs

    req, geo = setup[0], setup[1]
    geometry = edit_geometry(world.model, world.template, geo, req)
    qnn = create_backend("qnn", BackendConfig(cache_dir=compiled))
    qnn.prepare(world.model, GROUPS[0], geometry)
    folder = qnn.cache.lookup(qnn.key(world.model, ShardExecutor(world.model, qnn).weights,
                                      GROUPS[0], geometry))
    assert folder is not None
    monkeypatch.setenv("QAI_HUB_API_TOKEN", "test-token")
    hub = StubHub().install(monkeypatch)  # bound to the real qai_hub.Client's signatures
    jobs = submit_shard_jobs(qnn.onnx_path(folder))
    assert hub.kinds() == ["Client", "submit_compile_job", "get_target_model", "Client",
                           "submit_inference_job"]
    assert hub.calls[0][1]["config"].api_token == "test-token"
    compile_kw, infer_kw = hub.calls[1][1], hub.calls[4][1]
    assert compile_kw["device"].name == "Snapdragon 8 Elite QRD"
    assert "qnn_context_binary" in compile_kw["options"]
    assert os.path.commonpath([compile_kw["model"], str(folder / "onnx")]) == str(folder / "onnx")
    assert infer_kw["inputs"] is None and infer_kw["profile"] is True
    summary = jobs.summary()
    assert summary["compile_job"]["id"] == "jc1" and summary["profile_job"]["id"] == "jp2"
    assert all(name.startswith("shard.onnx") for name in jobs.uploaded)
    # nothing of the request is in any call
    blob = repr(hub.calls)
    assert PROMPT not in blob and str(SEED) not in blob


def test_bench_backends_reports_errors_and_cache_reuse(world, setup):
    req = setup[0]
    doc = bench_backends(world.model, world.template, req,
                         BackendBenchSpec(backends=("torch", "qnn"), blocks_per_shard=2,
                                          repeats=1))
    t, q = doc["backends"]["torch"], doc["backends"]["qnn"]
    assert t["max_abs_err"] == 0.0 and t["edit_max_abs_err"] <= 1e-6
    assert q["max_abs_err"] < BOUNDS["qnn"] and q["edit_psnr_db"] >= EDIT_PSNR_DB["qnn"]
    assert q["compiles"] == 2 and q["recompiles"] == 0 and q["cache_hits"] == 2
    assert len(q["compile_s"]) == 2 and len(q["cached_load_s"]) == 2
    assert doc["geometry"]["batch"] == 2 and doc["groups"] == [[0, 1], [2, 3]]
    assert doc["qnn_cpu_fallback_nodes"] == 0
    assert [x["cpu_fallback_nodes"] for x in q["assignment"]] == [0, 0]


def test_bench_backends_is_a_sakura_bench_command():
    from sakura.cli import build_parser

    args = build_parser().parse_args(["bench", "backends", "--json", "x.json",
                                      "--backends", "torch", "qnn"])
    assert args.backends == ["torch", "qnn"] and callable(args.func)


@pytest.mark.slow
def test_shipped_model_on_executorch_matches_torch(tmp_path):
    """The shipped weights on a catalog template (~1 min: two XNNPACK compiles)."""
    from sakura.dit.templates import load_catalog
    from sakura.dit.text import TextEncoder
    from sakura.dit.weights import DEFAULT_WEIGHTS, load_model

    model = load_model(DEFAULT_WEIGHTS)
    spec = load_catalog()["face-technologist"]
    encoder = TextEncoder(model.cfg.text_tokens)
    template, req = spec.to_template(encoder), spec.requests(encoder)[0]
    doc = bench_backends(model, template, req,
                         BackendBenchSpec(backends=("executorch",), repeats=1))
    r = doc["backends"]["executorch"]
    assert r["max_abs_err"] < 1e-3          # measured 1.9e-5 on outputs up to 29
    assert r["edit_psnr_db"] >= 100.0       # measured 141.6 dB
    assert r["recompiles"] == 0 and r["cache_hits"] == 2
    assert doc["xnnpack_delegated_ops_fraction"] == 1.0
