"""`sakura bench model`'s masked self-edit check on the shipped model and catalog."""

from __future__ import annotations

import math

import torch
from sakura.dit.bench_model import masked_self_edit
from sakura.dit.editing import region_psnr
from sakura.dit.text import TextEncoder
from sakura.dit.weights import load_model


def test_region_psnr_counts_only_the_region():
    ref = torch.zeros(3, 8, 8)
    img = ref.clone()
    img[:, :, 4:] = 0.5            # error outside the mask only
    mask = torch.zeros(8, 8, dtype=torch.bool)
    mask[:, :4] = True
    assert region_psnr(img, ref, mask) == 100.0  # identical inside the mask
    img[:, :, :4] = 0.2            # MSE 0.04 inside: 10 log10(4 / 0.04) = 20 dB
    assert math.isclose(region_psnr(img, ref, mask), 20.0, abs_tol=1e-4)


def test_shipped_model_inpaints_people_better_than_biharmonic():
    res = masked_self_edit(load_model(), TextEncoder(), seeds=(0,))
    per = res["templates"]
    assert len(per) >= 6 and {v["workload"] for v in per.values()} == {
        "face-swap", "try-on", "instruction"}
    people = [v for v in per.values() if v["workload"] in ("face-swap", "try-on")]
    model = sum(v["from_noise_psnr_db"] for v in people) / len(people)
    floor = sum(v["biharmonic_psnr_db"] for v in people) / len(people)
    # from pure noise (strength 1), measured 12.5 vs 9.7 dB at step 6000 and 13.4 vs 9.7 at
    # step 11000; a model that ignores its context falls below
    assert model > floor + 1.0
    for tid, v in per.items():
        # at the catalog's strength every template beats the floor (skinless try-on masks:
        # the worst, tryon-farmer, 13.6 vs 11.3 dB) and never loses to the edit from noise
        # (tryon-farmer 13.6 vs 13.7 dB: its clothing-only region is easy from noise too)
        assert v["strength"] < 1.0, tid
        assert v["psnr_db"] > v["biharmonic_psnr_db"] + 2.0, tid
        assert v["psnr_db"] > v["from_noise_psnr_db"] - 0.5, tid
    gain = [v["psnr_db"] - v["from_noise_psnr_db"] for v in per.values()]
    assert sum(gain) / len(gain) > 2.0  # measured 3.6 dB
