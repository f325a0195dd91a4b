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
