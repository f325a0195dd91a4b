"""The manifest schema (``sakura.codec.manifest``, issue 30 item 2): defined once, the
committed JSON Schema generated from it, every manifest the builder writes valid under both,
and bad input refused with one error naming the field."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from sakura.codec import manifest as schema
from sakura.codec import pack
from sakura.codec.errors import PackCorruptError, PackVersionError
from sakura.codec.manifest import (
    SCHEMA_PATH,
    ManifestHeader,
    PackManifest,
    json_schema,
    parse_manifest,
    schema_text,
)
from sakura.codec.pack import PREAMBLE, ConfigEntry, Manifest, ShardEntry, manifest_path

from tests.sakura.test_fuzz_inputs import mutated


def _validator(doc_schema: dict[str, Any]):
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.Draft202012Validator.check_schema(doc_schema)
    return jsonschema.Draft202012Validator(doc_schema)


def _published(packs) -> dict[str, dict[str, Any]]:
    return {name: json.loads(manifest_path(d, "tpl-small").read_text())
            for name, (d, _m) in packs.items()}


def _header(path) -> dict[str, Any]:
    """The manifest embedded in a pack file, as stored (FORMAT.md section 1)."""
    with open(path, "rb") as f:
        _magic, _version, flags, _n, header_len, _sha = PREAMBLE.unpack(f.read(PREAMBLE.size))
        raw = f.read(header_len)
    assert flags & pack.FLAG_ZSTD_HEADER
    return json.loads(zstandard.ZstdDecompressor().decompress(raw, max_output_size=1 << 30))


def test_the_committed_json_schema_is_the_generated_one():
    assert SCHEMA_PATH.read_text() == schema_text(), (
        "codec/manifest.schema.json differs from the models: run "
        "`python -m sakura.codec.manifest` and commit the file")
    assert json.loads(SCHEMA_PATH.read_text())["$schema"].endswith("2020-12/schema")


def test_every_manifest_the_builder_writes_is_valid_under_both(packs):
    published = _validator(json.loads(SCHEMA_PATH.read_text()))
    embedded = _validator(ManifestHeader.model_json_schema())
    for name, doc in _published(packs).items():
        model = PackManifest.model_validate(doc)
        assert model.codec == doc["codec"] and len(model.shards) == len(doc["shards"]), name
        published.validate(doc)
        d, m = packs[name]
        header = _header(d / m.pack_file)
        assert not set(schema.FILE_FIELDS) & set(header)
        ManifestHeader.model_validate(header)
        embedded.validate(header)
        with pytest.raises(ValidationError):  # the header is not a published manifest
            PackManifest.model_validate(header)


def test_the_dataclass_view_has_the_schemas_fields():
    def names(cls: type) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    assert names(ConfigEntry) == set(schema.Config.model_fields)
    assert names(ShardEntry) == set(schema.Shard.model_fields)
    assert names(Manifest) - {"extra"} == set(PackManifest.model_fields)
    defaults = {f.name: f.default for f in dataclasses.fields(Manifest)}
    assert (defaults["format"], defaults["version"]) == (schema.FORMAT, schema.VERSION)


def test_the_format_constants_are_the_schemas():
    assert pack.FORMAT is schema.FORMAT and pack.VERSION is schema.VERSION
    assert pack.TEMPLATE_ID is schema.TEMPLATE_ID and pack.merge_ranges is schema.merge_ranges
    props = json_schema()["properties"]
    assert props["format"]["const"] == schema.FORMAT
    assert props["version"]["const"] == schema.VERSION
    assert props["template_id"]["pattern"] == schema.TEMPLATE_ID_PATTERN


def _set(path: tuple, value: Any):
    def apply(doc: dict) -> None:
        parent = doc
        for key in path[:-1]:
            parent = parent[key]
        parent[path[-1]] = value
    return apply


def _drop(path: tuple):
    def apply(doc: dict) -> None:
        parent = doc
        for key in path[:-1]:
            parent = parent[key]
        del parent[path[-1]]
    return apply


BAD = [  # (mutation, error class, message pattern): each names the field or the rule
    (_set(("shards", 0, "configs", 1, "id"), "1"), PackCorruptError,
     r"shards\[0\]\.configs\[1\]\.id: Input should be a valid integer \(got '1'\)"),
    (_set(("shards", 0, "configs", 1, "id"), True), PackCorruptError,
     r"shards\[0\]\.configs\[1\]\.id: Input should be a valid integer"),
    (_set(("shards", 1, "step"), 1.0), PackCorruptError, r"shards\[1\]\.step: .*integer"),
    (_set(("shards", 0, "configs", 0, "ranges"), [[0, 1], [1, 1]]), PackCorruptError,
     r"shards\[0\]\.configs\[0\]\.ranges: .*at most 1 item.*exactly one range"),
    (_drop(("shards", 2, "configs", 0, "bytes")), PackCorruptError,
     r"manifest for 'tpl-small' lacks shards\[2\]\.configs\[0\]\.bytes"),
    (_drop(("units",)), PackCorruptError, r"lacks units$"),
    (_set(("units", 1, 2), "F" * 64), PackCorruptError, r"units\[1\]\[2\]: String should match"),
    (_set(("units", 1, 1), -1), PackCorruptError, r"units\[1\]\[1\]: .*greater than or equal"),
    (_set(("units", 1, 0), 0), PackCorruptError, r"unit 1 \[0, \+\d+\) overlaps the unit before"),
    (_set(("pack_file",), "../x.pack"), PackCorruptError, r"pack_file: String should match"),
    (_set(("pack_bytes",), 10), PackCorruptError, r"unit 0 .* lies outside the pack \(10 bytes\)"),
    (_set(("geometry", "heads"), 0), PackCorruptError, r"geometry\.heads: .*greater than"),
    (_set(("shards", 0, "configs", 0, "params", "ranks"), [2**31]), PackCorruptError,
     r"params\.ranks\[0\]: Input should be less than or equal to 2147483647"),
    (_set(("shards", 0, "configs", 0, "units"), [99999]), PackCorruptError,
     r"shard 0 config \d+ has bad units"),
    (_set(("shards", 1, "index"), 0), PackCorruptError, r"shard at position 1 has index 0"),
    (_set(("shards", 0, "configs", 0, "quality", "psnr_db"), "30"), PackCorruptError,
     r"quality\.psnr_db: Input should be a valid number"),
    (_set(("version",), 2.0), PackVersionError, r"unsupported manifest version 2\.0"),
    (_set(("format",), "other"), PackCorruptError, r"not a SAKURA manifest: format 'other'"),
]


@pytest.mark.parametrize("mutate,cls,match", BAD, ids=[m for *_, m in BAD])
def test_bad_input_is_one_error_naming_the_field(packs, mutate, cls, match):
    doc = _published(packs)["sakura"]
    mutate(doc)
    with pytest.raises(cls, match=match) as got:
        Manifest.from_dict(doc)
    assert type(got.value) is cls
    with pytest.raises(cls) as direct:
        parse_manifest(doc)
    assert str(direct.value) == str(got.value)


def test_the_layout_rule_stays_with_the_codec(packs):
    """The shards the geometry implies: a rule of the codec's reader, not of the schema."""
    doc = _published(packs)["intq"]
    doc["shards"][1]["step"] = 1
    PackManifest.model_validate(doc)
    with pytest.raises(PackCorruptError, match=r"shard 1 is \(index 1, step 1"):
        Manifest.from_dict(doc)


def test_a_deeply_nested_manifest_is_an_error_not_a_recursion(packs):
    deep: Any = 0
    for _ in range(100_000):
        deep = [deep]
    doc = _published(packs)["fp16"]
    doc["shards"][0]["configs"][0]["units"] = deep
    with pytest.raises(PackCorruptError, match=r"units\[0\]: Input should be a valid integer"):
        Manifest.from_dict(doc)
    with pytest.raises(PackCorruptError, match="not valid JSON"):
        Manifest.from_json(b'{"format": "sakura-pack", "units": ' + b"[" * 100_000)


# ------------------------------------------- the committed JSON Schema and the models agree
def _walk(doc: Any):
    yield doc
    if isinstance(doc, dict):
        for v in doc.values():
            yield from _walk(v)
    elif isinstance(doc, list):
        for v in doc:
            yield from _walk(v)


def _json_schema_may_accept(error: dict[str, Any]) -> bool:
    """Errors of the models that JSON Schema cannot state, or states another way: the rules
    between fields, an integral float for an integer (JSON Schema: 3.0 is an integer; the
    models are strict), NaN against a bound (NaN is not JSON), and a trailing newline
    (Python's `re`, which the `jsonschema` package uses, lets `$` match before one)."""
    value = error.get("input")
    return (error["type"] == "manifest_table"
            or (error["type"] == "int_type" and isinstance(value, float)
                and value.is_integer())
            or (isinstance(value, float) and math.isnan(value))
            or (error["type"] == "string_pattern_mismatch" and isinstance(value, str)
                and value.endswith("\n")))


@pytest.fixture(scope="module")
def published_schema():
    return _validator(json.loads(SCHEMA_PATH.read_text()))


@pytest.fixture(scope="module")
def sakura_doc(packs):
    return _published(packs)["sakura"]


@settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", "150")), deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_the_json_schema_accepts_what_the_models_accept(sakura_doc, published_schema, data):
    doc = data.draw(mutated(sakura_doc))
    schema_ok = published_schema.is_valid(doc)
    try:
        PackManifest.model_validate(doc)
    except ValidationError as exc:
        if schema_ok:  # the models refused a document the JSON Schema accepts: only for
            assert all(_json_schema_may_accept(e) for e in exc.errors()), exc.errors()
    else:
        assert schema_ok, list(published_schema.iter_errors(doc))[:1]
