"""The demo's side-by-side picture labels each panel (issue 29, item 6)."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from sakura.demo import _psnr, side_by_side


def test_side_by_side_labels_each_panel(tmp_path):
    g = torch.Generator().manual_seed(0)
    images = [torch.rand(3, 16, 16, generator=g) * 2 - 1 for _ in range(4)]
    labels = ["template", "exact", "edit (streamed)", "local"]
    path = side_by_side([(im, lab, f"caption {i}") for i, (im, lab) in
                         enumerate(zip(images, labels))], tmp_path / "side-by-side.png",
                        scale=4)
    sheet = np.asarray(Image.open(path).convert("RGB"))
    gap, top, bottom, w = 8, 30, 24, 64
    assert sheet.shape == (top + w + bottom, 4 * (w + gap) + gap, 3)
    for i, im in enumerate(images):
        x = gap + i * (w + gap)
        want = ((im.permute(1, 2, 0).clamp(-1, 1) + 1) * 127.5).round().byte().numpy()
        want = want.repeat(4, axis=0).repeat(4, axis=1)
        assert np.array_equal(sheet[top:top + w, x:x + w], want)  # the pixels, unchanged
        label, caption = sheet[:top, x:x + w], sheet[top + w:, x:x + w]
        assert (label < 100).any() and (caption < 160).any()  # text drawn over each panel
    # and not the same text twice: the label strips differ
    strips = [sheet[:top, gap + i * (w + gap):gap + i * (w + gap) + w] for i in range(4)]
    assert all(not np.array_equal(a, b) for a, b in zip(strips, strips[1:]))


def test_psnr_captions():
    assert _psnr(float("inf")) == "identical"
    assert _psnr(31.456) == "31.5 dB"
    assert _psnr(None) == "PSNR n/a"
