"""Property tests (hypothesis): catalog and manifest JSON, whatever it holds, is parsed or
refused with the project's own error (a :class:`SakuraError`: one ``sakura: error:`` line),
never a traceback (issue 29, item 4).

Three sources of documents: any JSON value, any bytes, and a valid document with one part
replaced by any JSON value or removed (which reaches the checks behind the first ones).
"""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sakura.errors import SakuraError

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "dit" / "catalog"

# FUZZ_EXAMPLES=2000 for a deeper run (about a minute here)
SETTINGS = settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", "150")), deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow,
                                           HealthCheck.function_scoped_fixture])

scalars = (st.none() | st.booleans() | st.integers() | st.integers(-2**80, 2**80)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12))
json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=10), inner, max_size=4), max_leaves=16)


def _paths(doc: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path (keys and indices) to a part of ``doc``."""
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc[:6]):  # (long lists: their first items stand for them)
            out += _paths(v, (*prefix, i))
    return out


@st.composite
def mutated(draw: Any, doc: Any) -> Any:
    """``doc`` with one part replaced by any JSON value, or removed."""
    doc = json.loads(json.dumps(doc))
    path = draw(st.sampled_from(_paths(doc)))
    if not path:
        return draw(json_values)
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    if draw(st.booleans()) and isinstance(parent, dict):
        del parent[path[-1]]
    else:
        parent[path[-1]] = draw(json_values)
    return doc


def _only_our_errors(fn: Any, *args: Any) -> None:
    try:
        fn(*args)
    except SakuraError:
        pass  # a refusal with a message: what the CLI prints as one line


# --------------------------------------------------------------------------- catalog

def _shipped_doc() -> dict[str, Any]:
    doc = json.loads((SHIPPED / "catalog.json").read_text())
    tid = "face-cook"
    entry = dict(doc["templates"][tid])
    for key in ("image", "mask"):
        entry[key] = str(SHIPPED / entry[key])
    return {**doc, "templates": {tid: entry}}


CATALOG = _shipped_doc()


def _check_catalog(path: Path) -> None:
    from sakura.dit.cli import check_template_images, template_ids
    from sakura.dit.templates import load_catalog

    _only_our_errors(load_catalog, path)
    try:
        ids = template_ids(path)
    except SakuraError:
        return
    _only_our_errors(check_template_images, path, ids[:2])


@SETTINGS
@given(doc=st.one_of(json_values, mutated(CATALOG)))
def test_any_catalog_json_is_parsed_or_refused(doc, tmp_path):
    path = tmp_path / "catalog.json"
    path.write_text(json.dumps(doc))
    _check_catalog(path)


@SETTINGS
@given(raw=st.binary(max_size=200))
def test_any_catalog_bytes_are_parsed_or_refused(raw, tmp_path):
    path = tmp_path / "catalog.json"
    path.write_bytes(raw)
    _check_catalog(path)


DEEP = [b"[" * 100_000, b'{"templates":' * 50_000, b'{"templates": {"t": ' + b"[" * 100_000]


@pytest.mark.parametrize("raw", DEEP, ids=["list", "object", "entry"])
def test_deeply_nested_json_is_refused(raw, tmp_path):
    from sakura.codec.pack import Manifest

    path = tmp_path / "catalog.json"
    path.write_bytes(raw)
    _check_catalog(path)
    _only_our_errors(Manifest.from_json, raw)


def test_the_shipped_catalog_still_loads():
    from sakura.dit.templates import load_catalog

    spec = load_catalog(SHIPPED)["face-cook"]
    assert spec.load_image().shape == (3, 64, 64)


# -------------------------------------------------------------------------- manifest

@pytest.fixture(scope="module")
def manifest_doc(tmp_path_factory) -> dict[str, Any]:
    from sakura.codec import get_codec
    from sakura.codec.pack import write_pack
    from sakura.dit.synthetic import synthetic_cache

    cache = synthetic_cache(steps=2, blocks=3, grid=4, channels=16, heads=2, rank=4, seed=1)
    m = write_pack(tmp_path_factory.mktemp("pack"), "tpl", cache, get_codec("sakura"),
                   blocks_per_shard=2, model={"name": "synthetic"})
    return json.loads(m.to_json())


def test_the_manifest_parses(manifest_doc):
    from sakura.codec.pack import Manifest

    assert Manifest.from_dict(manifest_doc).to_dict() == manifest_doc


@st.composite
def manifests(draw: Any, base: dict[str, Any]) -> Any:
    return draw(st.one_of(json_values, mutated(base)))


@SETTINGS
@given(data=st.data())
def test_any_manifest_json_is_parsed_or_refused(manifest_doc, data):
    from sakura.codec.pack import Manifest

    doc = data.draw(manifests(manifest_doc))
    _only_our_errors(Manifest.from_json, json.dumps(doc))
    _only_our_errors(Manifest.from_dict, doc, True)  # (the pack's embedded header)


@SETTINGS
@given(raw=st.binary(max_size=200))
def test_any_manifest_bytes_are_parsed_or_refused(raw):
    from sakura.codec.pack import Manifest

    _only_our_errors(Manifest.from_json, raw)


# --------------------------------------------------- a server's published catalog entry

def _published_entry() -> dict[str, Any]:
    png = {k: base64.b64encode((SHIPPED / f"face-cook{s}.png").read_bytes()).decode()
           for k, s in (("image_png_b64", ""), ("mask_png_b64", "-mask"))}
    return {"template": {**png, "prompt": "a cook", "seed": 3, "steps": 4, "guidance": 3.0,
                         "strength": 0.7, "resolution": 64}}


@SETTINGS
@given(entry=st.one_of(json_values, mutated(_published_entry())))
def test_any_published_template_entry_is_used_or_refused(entry):
    from sakura.edge.templates import template_from_entry

    _only_our_errors(template_from_entry, "t", entry)
