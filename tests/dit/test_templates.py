"""The shipped template catalog and its validation."""

from __future__ import annotations

import json

import pytest
from sakura.dit.templates import DEFAULT_CATALOG, CatalogError, load_catalog


def test_shipped_catalog_strengths_by_workload():
    specs = load_catalog()
    by_workload = {s.workload: s.strength for s in specs.values()}
    # face swaps change the skin tone (most freedom), objects keep their layout
    assert by_workload == {"face-swap": 0.9, "try-on": 0.8, "instruction": 0.7}
    assert all(s.steps >= 20 for s in specs.values())


@pytest.mark.parametrize("bad", [0.0, 1.2, "strong"])
def test_bad_strength_is_a_catalog_error(tmp_path, bad):
    doc = json.loads(DEFAULT_CATALOG.read_text())
    tid = next(iter(doc["templates"]))
    entry = dict(doc["templates"][tid], strength=bad)
    for key in ("image", "mask"):
        entry[key] = str((DEFAULT_CATALOG.parent / entry[key]).resolve())
    path = tmp_path / "catalog.json"
    path.write_text(json.dumps({**doc, "templates": {tid: entry}}))
    with pytest.raises(CatalogError, match=tid):
        load_catalog(path)


def test_one_template_id_rule():
    """The catalog, the pack manifest (model and JSON Schema) and the server's layout check
    template ids with the one rule of ``sakura.ids``, not copies of it."""
    from sakura.codec import manifest
    from sakura.dit import templates

    from sakura import ids

    assert templates.TEMPLATE_ID is ids.TEMPLATE_ID is manifest.TEMPLATE_ID
    assert manifest.TEMPLATE_ID_PATTERN is ids.TEMPLATE_ID_PATTERN
    schema = json.loads(manifest.SCHEMA_PATH.read_text())
    assert schema["properties"]["template_id"]["pattern"] == ids.TEMPLATE_ID_PATTERN
    for path in (templates.__file__, manifest.__file__):
        assert ids.TEMPLATE_ID_PATTERN not in open(path).read()  # no second copy
