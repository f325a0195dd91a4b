"""The native runtime against the manifest schema (issue 30 item 2).

The C++ side parses no manifest JSON: ``sakura.edge.native_runtime.stream_shards`` converts
a manifest already validated by ``sakura.codec.manifest`` into the shard table that
``sakura_native.StreamTable`` casts to C++ types (``int`` for ids, steps, blocks and ranks,
``int64_t`` for offsets, lengths and ``pack_bytes``, 64 hex digits for a sha256). So:

- every key that conversion (and ``stream_spec``) reads is a field of the JSON Schema;
- every manifest the builders write converts, and the C++ side accepts each field at the
  schema's bound and refuses, as the schema does, the first value past it (the bounds are
  the C++ types'). The C++ casts are looser than the schema below the bounds (a negative
  offset casts); the schema is the gate.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError
from sakura.cloud.synthetic import SyntheticSpec, make_pack
from sakura.codec import get_codec
from sakura.codec.manifest import (
    FORMAT,
    INT32_MAX,
    INT64_MAX,
    VERSION,
    PackManifest,
    json_schema,
    parse_manifest,
)
from sakura.codec.pack import write_pack
from sakura.dit.synthetic import synthetic_cache
from sakura.edge.native_runtime import stream_shards, stream_spec

URL = "http://127.0.0.1:9/templates/t/sakura/sakura-0123456789abcdef.pack"
SHA = "ab" * 32


class Recorder(dict):
    """A dict that records the path of every key read from it (``*``: a list element)."""

    def __init__(self, data: dict, path: tuple, seen: set[tuple]) -> None:
        super().__init__(data)
        self.path, self.seen = path, seen

    def _wrap(self, key: str, value: Any) -> Any:
        return _recorded(value, (*self.path, key), self.seen)

    def __getitem__(self, key: str) -> Any:
        self.seen.add((*self.path, key))
        return self._wrap(key, super().__getitem__(key))

    def get(self, key: str, default: Any = None) -> Any:
        self.seen.add((*self.path, key))
        return self._wrap(key, super().get(key, default))


def _recorded(value: Any, path: tuple, seen: set[tuple]) -> Any:
    if isinstance(value, dict):
        return Recorder(value, path, seen)
    if isinstance(value, list):
        return [_recorded(v, (*path, "*"), seen) for v in value]
    return value


def _field(schema: dict[str, Any], path: tuple) -> dict[str, Any]:
    """The JSON Schema of the field at ``path`` (KeyError if the schema has no such field)."""
    node = schema
    for key in path:
        while "$ref" in node or "anyOf" in node:
            if "$ref" in node:
                node = schema["$defs"][node["$ref"].rsplit("/", 1)[1]]
            else:
                node = next(n for n in node["anyOf"] if n.get("type") != "null")
        node = node["items"] if key == "*" else node["properties"][key]
    return node


@pytest.fixture(scope="module")
def builder_manifests(tmp_path_factory) -> dict[str, dict[str, Any]]:
    """Manifests as ``write_pack`` (four codecs) and the serve bench's synthetic packs
    write them."""
    cache = synthetic_cache(steps=2, blocks=3, grid=4, channels=16, heads=2, rank=4, seed=1)
    out = {}
    for name in ("sakura", "fp16", "intq", "cachegen"):
        m = write_pack(tmp_path_factory.mktemp(name), "tpl", cache, get_codec(name),
                       blocks_per_shard=2, model={"name": "synthetic"})
        out[name] = json.loads(m.to_json())
    out["synthetic"], _ = make_pack(tmp_path_factory.mktemp("synthetic"), "face-a", "sakura",
                                    SyntheticSpec(4, 3, 512, seed=3))
    return out


def test_the_native_inputs_are_read_from_schema_fields(native, builder_manifests):
    schema = json_schema()
    for name, doc in builder_manifests.items():
        seen: set[tuple] = set()
        shards = stream_shards(Recorder(doc, (), seen), URL)
        assert len(shards) == len(doc["shards"])
        stream_spec(native.StreamTable(shards), Recorder(doc["geometry"], ("geometry",), seen),
                    http=native.HttpOptions(),
                    origin=0.0, max_ahead=1, max_ready=1, max_inflight=1, lookahead_rtts=1.0,
                    max_ahead_cap=1, reconstruct="pipelined", kind="fp16", decode=print,
                    rope=None)
        assert {("units",), ("pack_bytes",), ("shards", "*", "configs", "*", "ranges"),
                ("geometry", "tokens")} <= seen, name
        for path in sorted(seen):
            try:
                _field(schema, path)
            except KeyError:
                pytest.fail(f"{name}: the native table reads {'.'.join(path)}, "
                            "which is not a field of codec/manifest.schema.json")


def test_every_builder_manifest_converts_to_the_native_table(native, builder_manifests):
    for name, doc in builder_manifests.items():
        parse_manifest(doc)
        table = native.StreamTable(stream_shards(doc, URL))
        assert len(table) == len(doc["shards"]), name


def _manifest(*, config: int = 0, step: int = 0, block: int = 0, ranks: list[int] | None = None,
              offset: int = 0, length: int = 64, pack_bytes: int | None = None,
              sha: str = SHA) -> dict[str, Any]:
    """A one-shard, one-configuration, one-unit manifest with the given native fields."""
    return {
        "format": FORMAT, "version": VERSION, "template_id": "t", "codec": "sakura",
        "codec_options": {}, "pack_file": "sakura-0123456789abcdef.pack",
        "pack_bytes": offset + length if pack_bytes is None else pack_bytes,
        "pack_sha256": SHA,
        "geometry": {"steps": 1, "blocks": 1, "tokens": 4, "channels": 8, "heads": 1,
                     "blocks_per_shard": 1, "dtype": "fp16"},
        "model": {}, "fp16_bytes": 128, "stored_bytes": length,
        "units": [[offset, length, sha]],
        "shards": [{"index": 0, "step": step, "blocks": [block], "compute_cost": 1.0,
                    "configs": [{"id": config, "params": {} if ranks is None else {"ranks": ranks},
                                 "units": [0], "ranges": [[offset, length]], "bytes": length,
                                 "quality": {}, "pareto": True}]}],
    }


AT_THE_BOUND = {  # field: (the schema's largest value, the first value past it)
    "config id (int)": ({"config": INT32_MAX}, {"config": INT32_MAX + 1}),
    "step (int)": ({"step": INT32_MAX}, {"step": INT32_MAX + 1}),
    "block (int)": ({"block": INT32_MAX}, {"block": INT32_MAX + 1}),
    "ranks (int)": ({"ranks": [INT32_MAX, 1]}, {"ranks": [INT32_MAX + 1, 1]}),
    "offset (int64)": ({"offset": INT64_MAX - 64, "pack_bytes": INT64_MAX},
                       {"offset": INT64_MAX + 1, "pack_bytes": INT64_MAX}),
    "length (int64)": ({"length": INT64_MAX}, {"length": INT64_MAX + 1, "pack_bytes": INT64_MAX}),
    "pack_bytes (int64)": ({"pack_bytes": INT64_MAX}, {"pack_bytes": INT64_MAX + 1}),
    "sha256 (64 hex)": ({"sha": "0" * 64}, {"sha": "0" * 63}),
}


@pytest.mark.parametrize("field", list(AT_THE_BOUND))
def test_the_native_table_accepts_what_the_schema_accepts(native, field):
    accepted, refused = (_manifest(**kw) for kw in AT_THE_BOUND[field])
    PackManifest.model_validate(accepted)  # (not the codec's layout rule: step may be any)
    assert len(native.StreamTable(stream_shards(accepted, URL))) == 1
    with pytest.raises(ValidationError):
        PackManifest.model_validate(refused)
    with pytest.raises((RuntimeError, TypeError, ValueError, OverflowError)):
        native.StreamTable(stream_shards(refused, URL))
