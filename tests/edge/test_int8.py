"""int8 XNNPACK shard graphs (``edge.backends.int8``, issue 31 item 6) on the tiny model.

The bound: the int8 program computes the PT2E-converted graph (its quantize/dequantize pairs
around every Linear, run in eager torch as the reference of what the quantization alone
does), so the ``.pte`` must match that reference to fp32 kernel precision (up to the odd
activation value that rounds to the other int8 neighbour); against fp32 the error is the
quantization's own: weights per channel with step max|w|/127 and activations per call with
step max|x|/127, i.e. a relative error of order 1/127 per Linear, so the output's
relative RMS error stays under a few percent (SNR above 20 dB) through two blocks.
"""

from __future__ import annotations

import pytest
import torch
from sakura.edge.backends.int8 import check_precision, lower_int8, quantize_int8
from sakura.edge.backends.shard import ShardGeometry, ShardModule, example_inputs

from tests.edge.helpers import tiny_model

BLOCKS = (1, 2)


def run_pte(pte: bytes, xs):
    from executorch.runtime import Runtime  # lazy: executorch

    program = Runtime.get().load_program(pte)
    return program.load_method("forward").execute(list(xs))


def snr_db(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(10 * torch.log10(want.pow(2).mean() / (got - want).pow(2).mean()))


def test_int8_shard_graph_is_close_to_fp32():
    pytest.importorskip("executorch")
    model = tiny_model()
    geometry = ShardGeometry(1, model.cfg.text_tokens, 16, 48)
    module = ShardModule(model, BLOCKS, geometry, True, True, delegable=True).eval()
    xs = example_inputs(model, BLOCKS, geometry, seed=3)
    with torch.no_grad():
        want = module(*xs)
        fake = quantize_int8(module, xs).module()(*xs)
    got = run_pte(lower_int8(module, xs), xs)
    for g, f, w in zip(got, fake, want):
        # the program is the quantized function: fp32 kernels on the same int8 values
        rel = float((g - f).abs().max() / w.abs().max())
        assert rel < 2e-2, rel
        assert snr_db(g, w) > 20, snr_db(g, w)
        assert snr_db(g, w) < 100  # it is quantized: not the fp32 program by accident


def test_a_bad_precision_is_one_clear_error():
    assert check_precision("int8") == "int8"
    with pytest.raises(ValueError, match=r"precision must be one of fp32, int8, got 'int4'"):
        check_precision("int4")


def test_edit_options_take_a_precision_and_refuse_a_bad_one():
    from sakura.edge.errors import EdgeError
    from sakura.edge.options import EditOptions

    assert EditOptions(precision="int8").precision == "int8"
    with pytest.raises(EdgeError, match=r"^precision must be one of fp32, int8, got 'fp16'$"):
        EditOptions(precision="fp16")


def test_int8_engine_has_its_own_graph_key(tmp_path):
    pytest.importorskip("executorch")
    from sakura.edge.native_runtime import NativeEngine, step_groups

    model = tiny_model()
    fp32 = NativeEngine(model, "0" * 64, cache_dir=tmp_path)
    int8 = NativeEngine(model, "0" * 64, cache_dir=tmp_path, precision="int8")
    shape = ShardGeometry(1, model.cfg.text_tokens, 16, 48)
    groups = step_groups(model.cfg.num_blocks, 2)
    assert fp32._key(shape, groups).digest() != int8._key(shape, groups).digest()
    with pytest.raises(ValueError, match="precision must be one of"):
        NativeEngine(model, "0" * 64, cache_dir=tmp_path, precision="int4")


@pytest.mark.slow  # 6 min here (2 shared cores): the four chains' export, int8 PT2E included
def test_int8_option_runs_the_bundles_int8_graphs(world, compiled_dir, tmp_path):
    """An int8 bundle (fp32 and int8 graph sets, each recording its precision); an edit with
    ``precision="int8"`` runs the int8 sets from the bundle (nothing exported on the
    device) and its image is near the fp32 edit's, not equal to it. The int8 sets' step_in /
    step_out are the fp32 sets' bytes under other names: the device stores them once per
    checksum under both names (it kept only the last name and failed to open the first)."""
    pytest.importorskip("executorch")
    import shutil

    from sakura.cloud.bundle import publish_bundle
    from sakura.cloud.publish import update_catalog
    from sakura.edge.backends.base import weights_sha256
    from sakura.edge.bundle import export_bundle
    from sakura.edge.options import EditOptions

    from tests.edge.helpers import TEMPLATE_ID, serve_catalog
    from tests.edge.test_bundle import BPS, device
    from tests.edge.test_edit import PROMPT, SEED

    catalog = tmp_path / "catalog"
    shutil.copytree(world.catalog_dir, catalog)
    req = world.runtime().request(PROMPT, SEED)
    made = export_bundle(world.model, weights_sha256(world.model), world.template, req, BPS,
                         cache_dir_=compiled_dir, text_encoder=False, work=tmp_path / "w",
                         precision="int8")
    by_name = {s["name"]: s["precision"] for s in made.doc["graph_sets"]}
    assert by_name == {"cached": "fp32", "full": "fp32", "cached-int8": "int8",
                       "full-int8": "int8"}
    update_catalog(catalog, {TEMPLATE_ID: {"bundle": publish_bundle(catalog, made.files,
                                                                     made.doc)}})
    dev = device(world, tmp_path / "phone")
    images = {}
    with serve_catalog(catalog) as server:
        for p in ("fp32", "int8"):
            images[p] = dev.edit(server.url, TEMPLATE_ID, world.template, req, "fp16",
                                 options=EditOptions(local_fallback=False, precision=p)).image
    assert dev.native.compiles == 0 and dev.runner._engines["int8"].compiles == 0
    diff = (images["int8"] - images["fp32"]).abs()
    assert 0 < float(diff.max()) < 0.1, float(diff.max())
