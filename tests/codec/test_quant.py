import numpy as np
import pytest
import torch
from sakura.codec.quant import (
    ProgressiveQuantizer,
    SegmentPlan,
    hadamard,
    pack_codes,
    packed_row_bytes,
    unpack_codes,
)


@pytest.mark.parametrize("bits", range(1, 9))
def test_pack_roundtrip(bits):
    rng = np.random.default_rng(bits)
    codes = rng.integers(0, 1 << bits, size=(5, 37), dtype=np.uint8)
    packed = pack_codes(codes, bits)
    assert packed.shape == (5, packed_row_bytes(37, bits))
    assert np.array_equal(unpack_codes(torch.from_numpy(packed), bits, 37).numpy(), codes)


def test_pack_little_endian_layout():
    packed = pack_codes(np.array([[1, 2, 3, 0, 3]], np.uint8), 2)
    assert packed.tolist() == [[1 | 2 << 2 | 3 << 4, 3]]


def test_hadamard_orthonormal():
    for n in (1, 2, 16, 64):
        h = hadamard(n)
        assert torch.allclose(h @ h.T, torch.eye(n, dtype=h.dtype), atol=1e-12)


def test_rotation_inverse_and_plan():
    plan = SegmentPlan(parts=(45, 20), group=16)
    assert plan.groups == 3 + 2
    assert [s for s, _, _ in plan.pieces()][:2] == [0, 32]
    v = torch.randn(3, plan.length, dtype=torch.float64)
    r = plan.rotate(v)
    assert torch.allclose(r.norm(dim=1), v.norm(dim=1))
    assert torch.allclose(plan.rotate(r, inverse=True), v, atol=1e-12)


def test_progressive_levels_gaussian_and_heavy_tailed():
    gen = torch.Generator().manual_seed(0)
    plan = SegmentPlan(parts=(256, 128), group=64)
    q = ProgressiveQuantizer(plan, (2, 2, 4))
    gauss = torch.randn(64, plan.length, generator=gen, dtype=torch.float64)
    heavy = gauss * torch.where(torch.rand(64, plan.length, generator=gen) < 0.03, 20.0, 1.0)
    for v in (gauss, heavy):
        steps, codes, recons = q.encode(v)
        rel = [float((v - r).pow(2).sum() / v.pow(2).sum()) for r in recons]
        assert rel[0] < 0.16 and rel[1] < 0.012 and rel[2] < 1e-4, rel
        # the decoder reproduces the encoder's reconstruction at every level
        for lv in range(3):
            dec = q.decode(steps, codes[: lv + 1])
            assert torch.allclose(dec.double(), recons[lv], atol=1e-4 * float(v.abs().max()))


def test_progressive_zero_rows():
    q = ProgressiveQuantizer(SegmentPlan(parts=(10, 6), group=8), (2, 2, 4))
    steps, codes, recons = q.encode(torch.zeros(2, 16, dtype=torch.float64))
    assert float(recons[-1].abs().max()) == 0.0
    assert float(q.decode(steps, codes).abs().max()) == 0.0
