"""Fixtures of the native tests: the built module (skip with the reason when it is not) and
a real pack of the tiny seeded model (template run, importance, RoPE frame)."""

from __future__ import annotations

import pytest
import torch
from sakura.codec.base import get_codec
from sakura.codec.pack import Manifest, PackReader, write_pack
from sakura.dit.editing import template_run
from sakura.dit.rope import rope_option

from tests.dit.common import tiny_model, tiny_template


@pytest.fixture(scope="session")
def native():
    return pytest.importorskip(
        "sakura_native", reason="sakura_native is not built (pip install ./native)")


@pytest.fixture(scope="session")
def tiny_pack(tmp_path_factory) -> tuple[Manifest, PackReader]:
    """A sakura pack (every uniform config kept) of the tiny model's real template run."""
    torch.manual_seed(0)
    model = tiny_model()
    tpl = tiny_template(model, steps=3)
    run = template_run(model, tpl)
    geo = run.geometry
    rope = rope_option(geo.pos[geo.unmasked], model.cfg.rope_axes, model.cfg.rope_theta,
                       model.cfg.num_heads)
    d = tmp_path_factory.mktemp("native-pack")
    m = write_pack(d, "tiny", run.cache, get_codec("sakura-all", rope=rope),
                   blocks_per_shard=3, model={"name": "tiny"})
    reader = PackReader(d / m.pack_file)
    yield m, reader
    reader.close()
