"""Templates from the server's catalog entry, and the pack/model identity check."""

from __future__ import annotations

import pytest
import torch
from sakura.dit.templates import template_assets
from sakura.edge.errors import EdgeError
from sakura.edge.runtime import EdgeRuntime
from sakura.edge.templates import has_assets, template_from_entry

from tests.edge.helpers import FakeEncoder, tiny_model, tiny_template


class _Spec:
    prompt = "a template prompt"


def test_catalog_entry_round_trip():
    model = tiny_model()
    tpl = tiny_template(model)
    entry = {"codecs": {}, "template": template_assets(_Spec(), tpl)}
    assert has_assets(entry) and entry["template"]["seed"] == tpl.seed
    got = template_from_entry("t", entry, FakeEncoder())
    assert torch.equal(got.mask, tpl.mask)
    assert (got.image - tpl.image).abs().max() <= 1 / 127.5 + 1e-6  # 8-bit PNG
    assert (got.steps, got.guidance, got.seed) == (tpl.steps, tpl.guidance, tpl.seed)
    assert got.strength == 1.0
    tpl.strength = 0.7
    entry = {"codecs": {}, "template": template_assets(_Spec(), tpl)}
    assert template_from_entry("t", entry, FakeEncoder()).strength == 0.7
    del entry["template"]["strength"]  # a catalog published before strength existed
    assert template_from_entry("t", entry, FakeEncoder()).strength == 1.0
    entry["template"]["strength"] = 1.5
    with pytest.raises(EdgeError, match="strength must be in"):
        template_from_entry("t", entry, FakeEncoder())


def test_entry_without_assets_or_seed():
    with pytest.raises(EdgeError, match="no template assets"):
        template_from_entry("t", {"codecs": {}}, FakeEncoder())
    tpl = tiny_template(tiny_model())
    assets = template_assets(_Spec(), tpl)
    del assets["seed"]  # a catalog published before the seed was part of the assets
    entry = {"template": assets}
    assert template_from_entry("t", entry, FakeEncoder()).seed == -1  # unknown
    assert template_from_entry("t", entry, FakeEncoder(), seed=5).seed == 5
    broken = {"template": {**entry["template"], "image_png_b64": "bm90IGEgcG5n"}}
    with pytest.raises(EdgeError, match="not valid"):
        template_from_entry("t", broken, FakeEncoder())


def test_local_policy_refuses_an_unknown_template_seed():
    model = tiny_model()
    tpl = tiny_template(model)
    tpl.seed = -1
    rt = EdgeRuntime(model, FakeEncoder())
    with pytest.raises(EdgeError, match="needs the template's seed"):
        rt.edit("http://127.0.0.1:1", "t", tpl, rt.request("x", 1), "local")


def test_model_mismatch_is_a_warning():
    rt = EdgeRuntime(tiny_model(), FakeEncoder(), weights_sha256="a" * 64)
    assert rt.model_warning({"codec": "sakura", "model": {"weights_sha256": "a" * 64}}) is None
    assert rt.model_warning({"codec": "sakura", "model": {}}) is None
    warning = rt.model_warning({"codec": "sakura", "model": {"weights_sha256": "b" * 64}})
    assert "bbbbbbbbbbbb" in warning and "sakura build" in warning
