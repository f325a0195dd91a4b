"""The pack manifest's schema, defined once (``FORMAT.md`` section 2; issue 30 item 2).

What it is: pydantic v2 models of the two JSON documents of a pack, the published manifest
(:class:`PackManifest`, ``<template>.manifest.json`` and the catalog's ``manifest.json``)
and the header embedded in the pack file (:class:`ManifestHeader`: the same without the
three file fields), with the format and version constants and the name patterns. Every
reader validates through :func:`parse_manifest`: ``sakura.codec.pack.Manifest`` (which adds
the one rule that needs the shard layout: shards as the geometry implies them),
``sakura.cloud.layout.validate_manifest`` (which adds the serving checks: the expected
template, codec and stored pack size) and, for the constants, the edge client.

Why pydantic: it is already a core dependency; one declaration gives the checks, their
error paths (``shards[3].configs[0].ranges``) and a JSON Schema for readers in other
languages. The models are strict (no coercion: ``"3"``, ``3.0`` and ``true`` are not
integers; an integer is a valid number) and bound every integer by the C++ type that holds
it at the native binding (``int``: :data:`INT32_MAX`; ``int64_t``: :data:`INT64_MAX`).
The rules between fields (units ascending and inside the pack, a configuration's one range
equal to its merged units, ``bytes`` its length, shard ``i`` at position ``i``) are a
model validator, so the models alone accept exactly what the readers accept, short of the
codec's layout rule. A JSON Schema cannot say those; its ``description`` names them.

The JSON Schema: ``codec/manifest.schema.json``, generated from :class:`PackManifest` by
:func:`json_schema` (``python -m sakura.codec.manifest`` rewrites it); a test fails when
the committed file and the models differ.

The native runtime parses no manifest JSON: ``sakura.edge.native_runtime.stream_shards``
converts a manifest that was validated here into the shard table of
``sakura_native.StreamTable`` (shard step and blocks, each configuration's id, its one
range, its units' lengths and sha256, ``params.ranks``, ``pack_bytes``), and
``stream_spec`` passes ``geometry.tokens * geometry.channels``. The conformance test
(``tests/native/test_manifest_conformance.py``) checks that every key that conversion reads
is a field of this schema and that the C++ side accepts every value the schema accepts for
those fields (and refuses, as the schema does, the first value past its C++ type).

Bad input raises ONE :class:`~sakura.codec.errors.PackCorruptError` (or
:class:`~sakura.codec.errors.PackVersionError` for another version) naming the field path;
this module imports no torch.
"""

from __future__ import annotations

import json
import reprlib
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    model_validator,
)
from pydantic_core import PydanticCustomError
from sakura.codec.errors import PackCorruptError, PackVersionError

from sakura.ids import TEMPLATE_ID, TEMPLATE_ID_PATTERN  # noqa: F401 - re-exported: one rule

FORMAT = "sakura-pack"
VERSION = 2  # 2: every configuration is one byte range (embedded streams)
# the pack file's first bytes (codec/FORMAT.md): magic, version, flags, pack bytes, header
# length, the header's sha256; here, with the schema, so the torch-free server checks them
MAGIC = b"SAKP"
PREAMBLE = struct.Struct("<4sHHQI32s")

CODEC_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,31}$"
PACK_FILE_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,95}(?:\.[a-z0-9_-]{1,32})?\.pack$"
SHA256_PATTERN = r"^[0-9a-f]{64}$"

INT32_MAX = 2**31 - 1  # C++ `int` at the native binding (ids, steps, blocks, ranks)
INT64_MAX = 2**63 - 1  # C++ `int64_t` (offsets, lengths, pack_bytes)

SCHEMA_PATH = Path(__file__).with_name("manifest.schema.json")
SCHEMA_ID = "urn:sakura:pack-manifest:2"  # (format and version; no URL is promised)

Index = Annotated[StrictInt, Field(ge=0, le=INT32_MAX)]
Count = Annotated[StrictInt, Field(ge=1, le=INT32_MAX)]
Size = Annotated[StrictInt, Field(ge=0, le=INT64_MAX)]
Number = Annotated[float, Strict()]  # an integer is a number too; a bool or string is not
Sha256 = Annotated[StrictStr, Field(pattern=SHA256_PATTERN)]
Unit = tuple[Size, Size, Sha256]  # [offset, length, sha256]
Span = tuple[Size, Size]  # [offset, length]


class _Table(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ConfigParams(BaseModel):
    """The codec's parameters of a configuration (section 3 of ``FORMAT.md``); the keys a
    reader outside the codec uses are ``ranks`` (the low-rank codecs' per-level ranks, which
    the native reconstruct stage reads) and ``bits`` (intq: the configuration's one bit width,
    which the native IntQ stage reads; the low-rank codecs: the bits of the configuration's
    top level, which ``sakura-fixed-bits`` filters on)."""

    model_config = ConfigDict(extra="allow")
    ranks: list[Index] | None = None
    bits: Index | None = None


class Config(_Table):
    """One configuration of a shard: a run of consecutive units, served as one range."""

    id: Index = Field(description="unique within its shard")
    params: ConfigParams
    units: list[Index] = Field(min_length=1, description="indices into `units`, ascending")
    ranges: list[Span] = Field(
        min_length=1, max_length=1,
        description="exactly one [offset, length]: its units merged (pack format 2)")
    bytes: Size = Field(description="the range's length")
    quality: dict[str, Number | None] = Field(default_factory=dict)
    pareto: StrictBool = False
    decode_ms: Annotated[Number, Field(ge=0)] | None = None


class Shard(_Table):
    """One shard: some consecutive blocks of one step, and its configurations."""

    index: Index = Field(description="its position in `shards`")
    step: Index
    blocks: list[Index] = Field(min_length=1)
    compute_cost: Annotated[Number, Field(ge=0)] = 1.0
    configs: list[Config] = Field(min_length=1)
    q: Annotated[Number, Field(ge=0, le=4)] | None = Field(
        None, description="the low-rank codecs' importance exponent the builder chose for "
        "this shard from its measured rate-quality front (codec option q_candidates); "
        "absent: the codec_options' q. Informational: decoding does not depend on it")


class Geometry(BaseModel):
    """The cached tensors' shape; other keys are kept."""

    model_config = ConfigDict(extra="allow")
    steps: Count
    blocks: Count
    tokens: Count
    channels: Count
    heads: Count
    blocks_per_shard: Count
    dtype: StrictStr


class ManifestHeader(BaseModel):
    """The manifest embedded in the pack file's header (no file fields)."""

    model_config = ConfigDict(extra="allow", title="SAKURA pack manifest header")
    format: Literal[FORMAT]  # type: ignore[valid-type]  (the constant: one definition)
    version: Literal[VERSION]  # type: ignore[valid-type]
    template_id: Annotated[StrictStr, Field(pattern=TEMPLATE_ID_PATTERN)]
    codec: Annotated[StrictStr, Field(pattern=CODEC_PATTERN)]
    codec_options: dict[str, Any]
    geometry: Geometry
    model: dict[str, Any]
    fp16_bytes: Size
    stored_bytes: Size
    units: list[Unit] = Field(description="[offset, length, sha256], ascending, disjoint")
    shards: list[Shard] = Field(min_length=1)
    local_psnr_db: float | None = Field(
        None, allow_inf_nan=False, description="output PSNR against the exact edit of a local edit (every token "
        "computed, no cache) on the profiling requests of the configurations' psnr_db; "
        "the device never streams a configuration below its share of that error "
        "(edge/allocator.py, quality floor)")

    @model_validator(mode="after")
    def _table(self) -> ManifestHeader:
        check_table(self, self.pack_limit())
        return self

    def pack_limit(self) -> int | None:
        """The pack length the units must fit in (unknown in the header)."""
        return None


class PackManifest(ManifestHeader):
    """The published manifest: the header plus the pack file's name, length and sha256."""

    model_config = ConfigDict(title="SAKURA pack manifest")
    pack_file: Annotated[StrictStr, Field(pattern=PACK_FILE_PATTERN)]
    pack_bytes: Size
    pack_sha256: Sha256

    def pack_limit(self) -> int | None:
        return self.pack_bytes


GEOMETRY_KEYS = tuple(Geometry.model_fields)
FILE_FIELDS = tuple(k for k in PackManifest.model_fields if k not in ManifestHeader.model_fields)

RULES = (
    "Rules between fields (checked by the readers, not expressible here): shards[i].index "
    "== i; units ascending and disjoint and, in the published manifest, inside pack_bytes; "
    "in every shard, config ids unique; a config's range inside pack_bytes, its units "
    "ascending indices of `units` whose spans, merged, equal `ranges`, and `bytes` the "
    "range's length. The codec's reader also checks that the shards are the ones "
    "`geometry` implies (step and blocks of each)."
)


def merge_ranges(spans: Any) -> list[list[int]]:
    """Merge ``(offset, length)`` spans that touch, in order."""
    out: list[list[int]] = []
    for off, length in spans:
        if out and out[-1][0] + out[-1][1] == off:
            out[-1][1] += length
        else:
            out.append([int(off), int(length)])
    return out


def _bad(message: str) -> PydanticCustomError:
    return PydanticCustomError("manifest_table", message)


def check_table(m: ManifestHeader, pack_bytes: int | None) -> None:
    """The rules between fields (see :data:`RULES`); ``pack_bytes`` None: not known."""

    def outside(offset: int, length: int) -> bool:
        return pack_bytes is not None and offset + length > pack_bytes

    end = 0
    for i, (offset, length, _sha) in enumerate(m.units):
        if outside(offset, length):
            raise _bad(f"unit {i} [{offset}, +{length}) lies outside the pack "
                       f"({pack_bytes} bytes)")
        if offset < end:
            raise _bad(f"unit {i} [{offset}, +{length}) overlaps the unit before")
        end = offset + length
    for i, s in enumerate(m.shards):
        if s.index != i:
            raise _bad(f"shard at position {i} has index {s.index} (shards are listed in "
                       "order, shard i at position i)")
        ids: set[int] = set()
        for c in s.configs:
            where = f"shard {i} config {c.id}"
            if c.id in ids:
                raise _bad(f"shard {i} repeats configuration id {c.id}")
            ids.add(c.id)
            (offset, length), = c.ranges
            if outside(offset, length):
                raise _bad(f"{where} range [{offset}, +{length}) lies outside the pack "
                           f"({pack_bytes} bytes)")
            if c.units != sorted(set(c.units)) or c.units[-1] >= len(m.units):
                raise _bad(f"{where} has bad units {c.units!r:.80} (ascending indices into "
                           f"the {len(m.units)} units)")
            if [list(r) for r in c.ranges] != merge_ranges(m.units[u][:2] for u in c.units):
                raise _bad(f"{where}: ranges do not match its units (one range, the units "
                           "merged)")
            if c.bytes != length:
                raise _bad(f"{where}: bytes={c.bytes} but its range holds {length}")


# ------------------------------------------------------------------------ validation
_repr = reprlib.Repr()  # bounded: an input nested deeply or long prints short
_repr.maxlevel, _repr.maxstring, _repr.maxother, _repr.maxlong = 2, 40, 40, 40
_repr.maxlist = _repr.maxtuple = _repr.maxdict = 4


def _path(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _error(exc: ValidationError, doc: Mapping[str, Any]) -> PackCorruptError:
    """One :class:`PackCorruptError` from a pydantic error: the field path and the reason."""
    tid = doc.get("template_id")
    about = f" for {tid!r:.80}" if isinstance(tid, str) else ""
    errors = exc.errors(include_url=False)
    missing = [_path(e["loc"]) for e in errors if e["type"] == "missing"]
    if missing:
        return PackCorruptError(f"manifest{about} lacks {', '.join(missing)}")
    e = errors[0]
    where = _path(e["loc"])
    if e["type"] == "manifest_table":
        text = e["msg"]
    else:
        text = f"{where + ': ' if where else ''}{e['msg']} (got {_repr.repr(e['input'])})"
        if e["loc"] and e["loc"][-1] == "ranges" and e["type"] in ("too_long", "too_short"):
            text += f"; pack format {VERSION} serves every configuration as exactly one range"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return PackCorruptError(f"invalid manifest{about}: {text}{more}")


def parse_manifest(doc: Any, *, embedded: bool = False) -> ManifestHeader:
    """Validate a manifest document (parsed JSON) against the schema and return the model
    (:class:`PackManifest`; with ``embedded``, the pack header's :class:`ManifestHeader`).

    Raises :class:`PackVersionError` for another format version and
    :class:`PackCorruptError` for anything else that is wrong, with the field path.
    """
    if not isinstance(doc, Mapping):
        raise PackCorruptError("manifest must be a JSON object")
    fmt, version = doc.get("format"), doc.get("version")
    if fmt != FORMAT or not isinstance(fmt, str):
        raise PackCorruptError(f"not a SAKURA manifest: format {fmt!r:.40} "
                               f"(expected {FORMAT!r})")
    if version != VERSION or type(version) is not int:
        raise PackVersionError(
            f"unsupported manifest version {_repr.repr(version)} (this reader supports "
            f"{VERSION}; rebuild the pack with this version of `sakura build`)")
    model = ManifestHeader if embedded else PackManifest
    if not isinstance(doc, dict):
        doc = dict(doc)  # (any Mapping; pydantic validates dicts)
    try:
        return model.model_validate(doc)
    except ValidationError as exc:
        raise _error(exc, doc) from None
    except RecursionError:  # (not reached by parsed JSON: opaque fields are not walked)
        raise PackCorruptError("manifest is nested too deeply") from None


# ------------------------------------------------------------------------ device bundle
# What the device executes, exported in the cloud per template geometry (issue 31 items 1
# and 5): the catalog entry's ``bundle`` key, validated here like a manifest (one schema,
# torch-free, strict). Every file is published under a content-addressed key
# ``bundles/<first 16 hex of its sha256>/<name>``, so a file is immutable and a file that
# several templates share (the graphs of one geometry) is stored and downloaded once.
BUNDLE_FORMAT = "sakura-bundle"
BUNDLE_VERSION = 1
BUNDLE_NAME_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,63}\.(?:pte|txt|bin)$"
BUNDLE_KEY_PATTERN = r"^bundles/[0-9a-f]{16}/[a-z0-9][a-z0-9_-]{0,63}\.(?:pte|txt|bin)$"
BUNDLE_ROLES = ("graph", "text_encoder", "vocab", "tables")
BundleName = Annotated[StrictStr, Field(pattern=BUNDLE_NAME_PATTERN)]


def bundle_key(name: str, sha256: str) -> str:
    """The content-addressed storage key of a bundle file."""
    return f"bundles/{sha256[:16]}/{name}"


class BundleFile(_Table):
    """One file of a bundle: where it is, its length and its sha256 (checked by the server
    before it is served and by the device before it is used)."""

    name: BundleName
    role: Literal["graph", "text_encoder", "vocab", "tables"]
    key: Annotated[StrictStr, Field(pattern=BUNDLE_KEY_PATTERN)]
    bytes: Size
    sha256: Sha256


class GraphSetSpec(_Table):
    """One chain of compiled graphs (``StepIn``, the block groups' shards, ``StepOut``) and
    what they were exported for: ``digest`` is the device's cache key of that chain
    (``sakura.edge.native_runtime.NativeEngine`` computes the same one for what it needs)."""

    name: Annotated[StrictStr, Field(pattern=r"^[a-z0-9_-]{1,32}$")]
    digest: Sha256
    shape: dict[str, Any]
    groups: list[list[Index]] = Field(min_length=1)
    dynamic: StrictBool
    takes_cache: StrictBool
    # the groups also output every block's K/V: the template pass of the local fallback's
    # recompute step (sakura.dit.editing.RecomputedKV)
    emits_kv: StrictBool = False
    step_in: BundleName
    group_files: list[BundleName] = Field(min_length=1)
    step_out: BundleName


class DeviceBundle(BaseModel):
    """A device bundle: graphs of one template geometry, the text encoder program, its
    vocabulary and the RoPE / schedule tables, with what they were made for."""

    model_config = ConfigDict(extra="allow", title="SAKURA device bundle")
    format: Literal[BUNDLE_FORMAT]  # type: ignore[valid-type]
    version: Literal[BUNDLE_VERSION]  # type: ignore[valid-type]
    id: Annotated[StrictStr, Field(pattern=r"^[0-9a-f]{16}$")]
    weights_sha256: StrictStr
    architecture: Sha256
    graphs_format: Index
    executorch: StrictStr
    graph_sets: list[GraphSetSpec] = Field(min_length=1)
    tables: dict[str, Any] = Field(default_factory=dict)
    text_encoder: dict[str, Any] | None = None
    files: list[BundleFile] = Field(min_length=1)

    @model_validator(mode="after")
    def _names(self) -> DeviceBundle:
        names = [f.name for f in self.files]
        if len(set(names)) != len(names):
            raise _bad("bundle file names repeat")
        for f in self.files:
            if f.key != bundle_key(f.name, f.sha256):
                raise _bad(f"bundle file {f.name}: key {f.key} is not its content address")
        for gs in self.graph_sets:
            for n in (gs.step_in, *gs.group_files, gs.step_out):
                if n not in names:
                    raise _bad(f"graph set {gs.name} names {n}, which is not a bundle file")
            if len(gs.group_files) != len(gs.groups):
                raise _bad(f"graph set {gs.name}: {len(gs.group_files)} group files for "
                           f"{len(gs.groups)} groups")
        return self

    def file(self, name: str) -> BundleFile:
        for f in self.files:
            if f.name == name:
                return f
        raise KeyError(name)

    @property
    def total_bytes(self) -> int:
        return sum(f.bytes for f in self.files)


def parse_bundle(doc: Any) -> DeviceBundle:
    """Validate a catalog entry's ``bundle`` (parsed JSON); raises
    :class:`PackVersionError` for another bundle format version and
    :class:`PackCorruptError` naming the field for anything else."""
    if not isinstance(doc, Mapping):
        raise PackCorruptError("bundle must be a JSON object")
    if doc.get("format") != BUNDLE_FORMAT:
        raise PackCorruptError(f"not a SAKURA device bundle: format {doc.get('format')!r:.40}"
                               f" (expected {BUNDLE_FORMAT!r})")
    version = doc.get("version")
    if version != BUNDLE_VERSION or type(version) is not int:
        raise PackVersionError(
            f"unsupported device bundle version {_repr.repr(version)} (this reader supports "
            f"{BUNDLE_VERSION}; rebuild with this version of `sakura build`)")
    try:
        return DeviceBundle.model_validate(dict(doc))
    except ValidationError as exc:
        e = exc.errors(include_url=False)[0]
        where = _path(e["loc"])
        text = e["msg"] if e["type"] == "manifest_table" else (
            f"{where + ': ' if where else ''}{e['msg']} (got {_repr.repr(e['input'])})")
        raise PackCorruptError(f"invalid device bundle: {text}") from None


# ------------------------------------------------------------------------ JSON Schema
def json_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of the published manifest, as committed in
    ``codec/manifest.schema.json``."""
    schema = PackManifest.model_json_schema()
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": SCHEMA_ID,
            **schema, "description": f"{(PackManifest.__doc__ or '').strip()} {RULES}"}


def schema_text() -> str:
    return json.dumps(json_schema(), indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    SCHEMA_PATH.write_text(schema_text())
    print(f"wrote {SCHEMA_PATH}")
