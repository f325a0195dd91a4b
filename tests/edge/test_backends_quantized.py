"""Quantized (w8a16 QDQ) QNN HTP shards on the simulator: calibrated on real shard inputs
captured from edits of the template, compiled to context binaries, a whole edit close to
the exact one (~2 min: two quantize + HTP compiles of the tiny model's shard graphs)."""

from __future__ import annotations

import pytest
import torch
from sakura.dit.editing import Geometry, cached_edit
from sakura.edge.backends import create_backend
from sakura.edge.backends.base import BackendConfig
from sakura.edge.backends.bench import shard_inputs
from sakura.edge.backends.delegation import context_cpu_nodes
from sakura.edge.backends.executor import ShardExecutor, edit_geometry, step_groups
from sakura.edge.backends.qnn_quantized import (
    QnnQuantizedBackend,
    calibration_digest,
    capture_calibration,
    qdq_summary,
)
from sakura.edge.backends.shard import OUTPUT_NAMES, input_names
from sakura.edge.quality import psnr

GROUPS = step_groups(4, 2)
PROMPT, SEED = "a private prompt that must stay on the device", 4242
W8A16_PSNR_DB = 55.0  # whole 4-step edit vs exact; measured 69.6 dB (fp16 HTP: 86.4 dB)
HTP_VS_CPU_EP_DB = 40.0  # shard output SQNR, HTP vs the CPU EP; measured 47.3 / 51.4 dB


@pytest.fixture(scope="module")
def setup(world, tmp_path_factory):
    rt = world.runtime()
    req = rt.request(PROMPT, SEED)
    # calibration: edits with other prompts and seeds than the evaluated one
    cal_reqs = [rt.request(p, i) for i, p in enumerate(["calibration one", "another edit"])]
    geo = Geometry.of(world.model, world.template)
    cache = world.cache.to_fp16_exact()
    cal = capture_calibration(world.model, world.template, geo, cache, cal_reqs, GROUPS)
    backend = QnnQuantizedBackend(BackendConfig(cache_dir=tmp_path_factory.mktemp("qdq")),
                                  scheme="w8a16", calibration=cal)
    return req, geo, cache, cal, cal_reqs, backend


def test_calibration_is_the_real_shard_inputs_of_every_step(world, setup):
    req, geo, cache, cal, cal_reqs, _backend = setup
    per_edit = len(cal[GROUPS[0]]) // len(cal_reqs)
    assert per_edit >= 2  # every denoising step of each calibration edit
    for blocks in GROUPS:
        assert len(cal[blocks]) == per_edit * len(cal_reqs)
    # what the torch backend's shard graph saw at step 1 of the first calibration edit
    seen = shard_inputs(world.model, world.template, geo, cache, cal_reqs[0], GROUPS, step=1)
    for blocks, xs in seen:
        assert all(torch.equal(a, b) for a, b in zip(cal[blocks][1], xs))
    other = capture_calibration(world.model, world.template, geo, cache, cal_reqs[:1], GROUPS)
    assert calibration_digest(other) != calibration_digest(cal)


def test_w8a16_shards_compile_for_the_htp_and_edit_close_to_exact(world, setup):
    req, geo, cache, _cal, _reqs, backend = setup
    geometry = edit_geometry(world.model, world.template, geo, req)
    ex = ShardExecutor(world.model, backend)
    for blocks in GROUPS:
        ex.shard(geometry, blocks)
        folder = backend.cache.lookup(backend.key(world.model, ex.weights, blocks, geometry))
        assert folder is not None
        q = qdq_summary(backend.qdq_path(folder))
        # integer graph: 16-bit activations, 8-bit weights
        assert q["quantize_linear"] > 50 and q["dequantize_linear"] > 50
        assert set(q["zero_point_types"]) == {"UINT16", "UINT8"}
        assert q["zero_point_types"]["UINT16"] > q["zero_point_types"]["UINT8"] > 0
        # the product's session: one EPContext node, nothing on the CPU
        assert context_cpu_nodes(folder / "shard_ctx.onnx") == {}
        # with fallback allowed, ONNX Runtime leaves only the boundary Q (of the float
        # inputs) / DQ (of the outputs) to its CPU EP
        got = backend.assignment(backend.qdq_path(folder))
        assert got.boundary_only(backend.qdq_path(folder)), got.cpu_nodes
        assert got.cpu_ops["QuantizeLinear"] >= len(input_names(blocks))
        assert got.cpu_ops["DequantizeLinear"] == len(OUTPUT_NAMES)
    exact = cached_edit(world.model, world.template, geo, cache, req)
    image = ex.edit(world.template, geo, cache, req, GROUPS)
    db = psnr(image, exact)
    assert db >= W8A16_PSNR_DB, db
    keep = ~world.template.mask
    assert torch.equal(image[:, keep], exact[:, keep])  # outside the mask: the template
    # it is really quantized: its shard outputs are not the fp16 HTP graph's
    fp16 = create_backend("qnn", BackendConfig(cache_dir=backend.config.cache_dir))
    blocks, xs = shard_inputs(world.model, world.template, geo, cache, req, GROUPS, step=2)[0]
    a = ex.shard(geometry, blocks).run(*xs)
    b = fp16.prepare(world.model, blocks, geometry, ex.weights).run(*xs)
    assert max(float((x - y).abs().max()) for x, y in zip(a, b)) > 0
    # and the HTP runs the QDQ graph as ONNX Runtime's CPU EP defines it (the Concat
    # inputs requantized: without that the HTP's Concat mixed encodings)
    import onnxruntime as ort

    folder = backend.cache.lookup(backend.key(world.model, ex.weights, blocks, geometry))
    cpu = ort.InferenceSession(str(backend.qdq_path(folder)),
                               providers=["CPUExecutionProvider"]).run(
        None, {n: x.numpy() for n, x in zip(input_names(blocks), xs)})
    for htp, ref in zip(a, cpu):
        ref = torch.from_numpy(ref).double()
        sqnr = 10 * torch.log10((ref ** 2).sum() / ((htp.double() - ref) ** 2).sum())
        print(f"HTP vs CPU EP on the QDQ graph: {float(sqnr):.1f} dB")
        assert sqnr >= HTP_VS_CPU_EP_DB, float(sqnr)


def test_without_calibration_or_with_an_unknown_scheme_a_clear_error(world, setup, tmp_path):
    from sakura.edge.backends.errors import BackendError

    req, geo, _cache, _cal, _reqs, _backend = setup
    geometry = edit_geometry(world.model, world.template, geo, req)
    with pytest.raises(BackendError, match="unknown quantization scheme"):
        QnnQuantizedBackend(BackendConfig(cache_dir=tmp_path), scheme="w4a4")
    empty = QnnQuantizedBackend(BackendConfig(cache_dir=tmp_path))
    with pytest.raises(BackendError, match="no calibration inputs"):
        empty.prepare(world.model, GROUPS[0], geometry)


@pytest.mark.slow
def test_bench_backends_phone_side_keys(world, setup):
    """The arm64, opencl and qnn_quantized keys of `sakura bench backends` (~4 min)."""
    from sakura.edge.backends.bench import BackendBenchSpec, bench_backends

    req, _geo, _cache, _cal, cal_reqs, _backend = setup
    doc = bench_backends(world.model, world.template, req, BackendBenchSpec(
        backends=("torch",), blocks_per_shard=2, repeats=1, phone=True,
        quantized=("w8a16",), calibration_requests=cal_reqs), template_id="tiny-face")
    assert doc["arm64"]["built"] is True and doc["arm64"]["selftest"] == "ok"
    assert doc["arm64"]["kernel"] == "neon" and doc["arm64"]["max_rel_err"] <= 1e-5
    assert doc["opencl"]["max_abs_err_vs_cpu"] <= 1e-5 * doc["opencl"]["max_abs_value"]
    q = doc["qnn_quantized"]
    assert q["scheme"] == "w8a16" and q["edit_psnr_db"] >= W8A16_PSNR_DB
    assert all(g["context_cpu_nodes"] == {} and g["boundary_only"] for g in q["w8a16"]["graphs"])
