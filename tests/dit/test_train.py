"""`dit.train`: a killed run resumes exactly where it stopped; bad settings are refused."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from sakura.dit.data import EmojiDataset, EmojiItem, load_image
from sakura.dit.model import MMDiTConfig
from sakura.dit.train import TrainConfig, TrainConfigError, train
from sakura.dit.weights import metadata

CATALOG = Path(__file__).resolve().parents[2] / "dit" / "catalog"


class Killed(Exception):
    pass


def _dataset() -> EmojiDataset:
    """Eight catalog images; the two cooks and the two students are skin-tone 'siblings'."""
    files = ["face-cook", "face-student", "tryon-tuxedo", "tryon-farmer", "edit-apple-leaf",
             "edit-car-top", "face-technologist", "edit-house-roof"]
    bases = ["cook", "person", "person", "cook", "apple", "car", "tech", "house"]
    items = [EmojiItem(f"people & body: {f}", f, "People & Body", b, f + ".png")
             for f, b in zip(files, bases)]
    imgs = torch.stack([load_image(CATALOG / (f + ".png")) for f in files])
    return EmojiDataset(items, imgs.half())


def _cfg(tmp: Path, **kw) -> TrainConfig:
    base = dict(out_dir=str(tmp), weights_out=str(tmp / "ema.safetensors"), steps=5,
                batch_size=4, resolutions=(32,), resolution_probs=(1.0,), ref_prob=0.3,
                checkpoint_every=1, export_every=5, threads=1, warmup=2)
    base.update(kw)
    return TrainConfig(**base)


MODEL = MMDiTConfig(hidden_size=48, num_heads=3, double_blocks=1, single_blocks=1,
                    mlp_ratio=2.0, rope_axes=(4, 6, 6))


def test_killed_run_resumes_bit_exactly(tmp_path):
    ds = _dataset()
    straight = train(_cfg(tmp_path / "a"), MODEL, log=lambda m: None, dataset=ds)

    def die_at_export(msg: str) -> None:
        if "step 3: exported" in msg:
            raise Killed

    with pytest.raises(Killed):
        train(_cfg(tmp_path / "b", export_every=3), MODEL, log=die_at_export, dataset=ds)
    logs: list[str] = []
    resumed = train(_cfg(tmp_path / "b"), MODEL, log=logs.append, dataset=ds)

    assert any("resumed" in m and "at step 3" in m for m in logs)
    a, b = load_file(straight), load_file(resumed)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert metadata(resumed)["train_step"] == "5"
    with (tmp_path / "b" / "loss.csv").open() as f:
        steps = [int(r[0]) for r in csv.reader(f)]
    assert steps == [1, 2, 3, 4, 5]


def test_loss_falls_on_a_tiny_set(tmp_path):
    train(_cfg(tmp_path, steps=150, lr=2e-3, ref_prob=0.0, checkpoint_every=150,
               export_every=150), MODEL, log=lambda m: None, dataset=_dataset())
    with (tmp_path / "loss.csv").open() as f:
        losses = [float(r[3]) for r in csv.reader(f)]
    assert sum(losses[-20:]) / 20 < 0.5 * sum(losses[:5]) / 5


@pytest.mark.parametrize("bad, word", [(dict(t_uniform=-0.1), "t_uniform"),
                                       (dict(t_uniform=1.5), "t_uniform"),
                                       (dict(variant_power=-1.0), "variant_power"),
                                       (dict(batch_size=0), "batch size"),
                                       (dict(lr=0.0), "lr"),
                                       (dict(resolution_probs=(1.0,)), "resolutions")])
def test_bad_settings_are_refused(bad, word):
    with pytest.raises(TrainConfigError, match=word):
        TrainConfig(**bad)


def test_cli_reports_bad_settings_without_traceback(capsys):
    from sakura.cli import main

    with pytest.raises(SystemExit) as info:  # a usage error (exit 2), before anything loads
        main(["train", "--t-uniform", "2"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--t-uniform: must be a number in [0, 1]" in err and "Traceback" not in err


def test_variant_weights_share_one_emoji_between_its_skin_tones():
    from sakura.dit.train import item_weights

    siblings = {0: [1, 2, 3], 1: [0, 2, 3], 2: [0, 1, 3], 3: [0, 1, 2]}  # 4 tones; 4 is alone
    assert item_weights([0, 1, 2, 3, 4], siblings, 0.0) == [1.0] * 5
    w = item_weights([0, 1, 2, 3, 4], siblings, 0.5)
    assert w == [0.5] * 4 + [1.0]  # the emoji with 4 tones: 2/3 of draws instead of 4/5
    assert item_weights([0, 4], siblings, 1.0) == [0.25, 1.0]


# ------------------------------------------------------------- the second model (flux2)


def test_flux2_arch_resumes_bit_exactly_and_exports_a_diffusers_folder(tmp_path):
    """``arch="flux2"``: the same recipe on diffusers' Flux2Transformer2DModel; a killed run
    resumes bit-exactly, and the export is a transformer folder with its train step."""
    from sakura.dit.flux2_pixel import FLUX2_CONFIG, WEIGHTS_FILE, flux2_metadata

    ds = _dataset()
    kw = dict(arch="flux2", ref_prob=None, steps=4)
    straight = train(_cfg(tmp_path / "a", weights_out=str(tmp_path / "a" / "w"), **kw),
                     log=lambda m: None, dataset=ds)

    def die_at_export(msg: str) -> None:
        if "step 2: exported" in msg:
            raise Killed

    with pytest.raises(Killed):
        train(_cfg(tmp_path / "b", weights_out=str(tmp_path / "b" / "w"), export_every=2,
                   **kw), log=die_at_export, dataset=ds)
    logs: list[str] = []
    resumed = train(_cfg(tmp_path / "b", weights_out=str(tmp_path / "b" / "w"), **kw),
                    log=logs.append, dataset=ds)
    assert any("resumed" in m and "at step 2" in m for m in logs)
    a, b = load_file(straight / WEIGHTS_FILE), load_file(resumed / WEIGHTS_FILE)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert flux2_metadata(resumed)["train_step"] == "4"
    import json

    config = json.loads((resumed / "config.json").read_text())
    assert config["_class_name"] == "Flux2Transformer2DModel"
    assert {k: config[k] for k in FLUX2_CONFIG} == {
        k: list(v) if isinstance(v, tuple) else v for k, v in FLUX2_CONFIG.items()}


def test_the_flux2_export_runs_through_the_adapter_as_trained(tmp_path):
    """The exported folder loads as ``--model flux2`` (dit.adapters), and the adapter's
    velocity of a 64 px grid equals the training forward's: one model, one token layout."""
    from sakura.dit.adapters import load_adapter
    from sakura.dit.adapters.inputs import Conditioning
    from sakura.dit.adapters.processors import Branch
    from sakura.dit.attention import AttentionHook
    from sakura.dit.flux2_pixel import PixelFlux2, load_flux2, save_flux2
    from sakura.dit.model import TokenBatch

    torch.manual_seed(0)
    save_flux2(PixelFlux2(), tmp_path / "w", {"train_step": "0"})
    net = load_flux2(tmp_path / "w")
    adapter = load_adapter("flux2", tmp_path / "w")
    x, txt = torch.randn(1, 256, 48), torch.randn(1, 16, 384)
    t = torch.tensor([0.7])
    with torch.no_grad():
        ref = net(TokenBatch(img=x, img_pos=torch.zeros(256, 3), txt=txt, t=t))
    got = adapter.velocity(x, torch.arange(256), (16, 16), t * 1000,
                           Branch(Conditioning(txt)), AttentionHook())
    assert torch.allclose(got, ref, atol=1e-5), (got - ref).abs().max()


def test_flux2_arch_refuses_reference_training():
    with pytest.raises(TrainConfigError, match="reference"):
        TrainConfig(arch="flux2", ref_prob=0.1)
    with pytest.raises(TrainConfigError, match="arch"):
        TrainConfig(arch="unet")
    assert TrainConfig(arch="flux2").out_dir != TrainConfig().out_dir
