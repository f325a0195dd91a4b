"""``dit.weights.model_card``: what a report says of a model (class, parameters, train step
from the weights file; prompt accuracy from the card beside it, only for the file it names)."""

from __future__ import annotations

import json

import pytest
from sakura.dit.errors import WeightsError
from sakura.dit.model import MMDiT, MMDiTConfig
from sakura.dit.weights import DEFAULT_WEIGHTS, card_path, load_model, model_card, save_model


def test_the_shipped_card_belongs_to_the_shipped_weights():
    card = model_card()
    model = load_model()
    assert card["name"] == "sakura-mmdit" and card["class"] == "sakura.dit.model.MMDiT"
    assert card["params"] == sum(p.numel() for p in model.parameters())
    assert str(card["train_step"]) == model.weights_meta["train_step"]
    # its figures were read (the card names this file), and they are the bar
    assert card["prompt_accuracy"] >= 3 * card["chance_level"] > 0
    assert json.loads(card_path(DEFAULT_WEIGHTS).read_text())["weights_file_sha256"] == \
        card["weights_file_sha256"]


def test_a_card_is_used_only_for_the_weights_it_names(tmp_path):
    w = tmp_path / "tiny.safetensors"
    save_model(MMDiT(MMDiTConfig(hidden_size=24, num_heads=2, double_blocks=1,
                                 single_blocks=1, rope_axes=(4, 4, 4))), w,
               {"train_step": "7"})
    bare = model_card(w)
    assert bare["train_step"] == 7 and bare["prompt_accuracy"] is None
    assert "no card" in bare["source"]
    card_path(w).write_text(json.dumps({"weights_file_sha256": "0" * 64,
                                        "prompt_accuracy": 0.9, "chance_level": 0.1}))
    other = model_card(w)
    assert other["prompt_accuracy"] is None and "other weights" in other["source"]
    card_path(w).write_text(json.dumps({"weights_file_sha256": bare["weights_file_sha256"],
                                        "prompt_accuracy": 0.5, "chance_level": 0.1,
                                        "source": "here"}))
    mine = model_card(w)
    assert (mine["prompt_accuracy"], mine["chance_level"], mine["source"]) == (0.5, 0.1, "here")
    card_path(w).write_text("{not json")
    with pytest.raises(WeightsError, match="not JSON"):
        model_card(w)
    with pytest.raises(WeightsError, match="not found"):
        model_card(tmp_path / "none.safetensors")


def test_the_second_models_folder_has_a_card_too(tmp_path):
    """The FLUX.2 model's weights are a diffusers transformer folder: class from its
    config.json, parameters from the safetensors header, its card beside the folder."""
    import torch
    from sakura.dit.flux2_pixel import PixelFlux2, save_flux2

    torch.manual_seed(0)
    net = PixelFlux2()
    w = tmp_path / "sakura-flux2"
    save_flux2(net, w, {"train_step": "12"})
    card = model_card(w)
    assert card["name"] == "sakura-flux2"
    assert card["class"] == "diffusers.Flux2Transformer2DModel"
    assert card["params"] == sum(p.numel() for p in net.parameters()) == 5_597_824
    assert card["train_step"] == 12 and "no card" in card["source"]
    assert card_path(w) == tmp_path / "sakura-flux2.card.json"
    card_path(w).write_text(json.dumps({"weights_file_sha256": card["weights_file_sha256"],
                                        "prompt_accuracy": 0.4, "chance_level": 0.1111}))
    assert model_card(w)["prompt_accuracy"] == 0.4


def test_the_second_models_card_belongs_to_its_committed_weights():
    from sakura.dit.flux2_pixel import DEFAULT_DIR, load_flux2

    card = model_card(DEFAULT_DIR)
    model = load_flux2()
    assert card["class"] == "diffusers.Flux2Transformer2DModel" != model_card()["class"]
    assert card["params"] == sum(p.numel() for p in model.parameters())
    assert str(card["train_step"]) == model.weights_meta["train_step"]
    assert card["prompt_accuracy"] >= 3 * card["chance_level"] > 0
