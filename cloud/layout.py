"""The published catalog layout: names, storage keys and validation of catalog and manifests.

A published catalog directory (or bucket prefix) holds::

    catalog.json                                     index, written last, atomically
    templates/<template_id>/<codec>/manifest.json    the current manifest
    templates/<template_id>/<codec>/<pack_file>      immutable pack, named by content hash
    templates/<template_id>/<codec>/<stem>.manifest.json  the manifest of that pack version
    bundles/<sha16>/<name>                           immutable device bundle file (cloud.bundle)

Template ids match ``^[a-z0-9][a-z0-9_-]{0,63}$``, codec names ``^[a-z0-9][a-z0-9_-]{0,31}$``,
pack files ``<codec>-<sha256 prefix>.pack``. The manifest schema, its format and version
constants and these name patterns are defined once, in ``sakura.codec.manifest`` (pydantic
models, JSON Schema ``codec/manifest.schema.json``); :func:`validate_manifest` validates
through it and adds what serving needs beyond it (the expected template and codec, the
stored pack's size) and the index of the configurations' byte ranges.
"""

from __future__ import annotations

import bisect
import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sakura.cloud.errors import ManifestError
from sakura.codec.errors import PackError
from sakura.codec.manifest import (
    CODEC_PATTERN,
    PACK_FILE_PATTERN,
    SHA256_PATTERN,
    TEMPLATE_ID_PATTERN,
    parse_bundle,
    parse_manifest,
)
from sakura.codec.manifest import FORMAT as MANIFEST_FORMAT  # noqa: F401 - re-exported
from sakura.codec.manifest import VERSION as MANIFEST_VERSION  # noqa: F401 - re-exported

TEMPLATE_ID_RE = re.compile(TEMPLATE_ID_PATTERN)
CODEC_RE = re.compile(CODEC_PATTERN)
PACK_FILE_RE = re.compile(PACK_FILE_PATTERN)
SHA256_RE = re.compile(SHA256_PATTERN)

CATALOG_KEY = "catalog.json"
CATALOG_VERSION = 1
MANIFEST_NAME = "manifest.json"


def valid_template_id(value: str) -> bool:
    return bool(TEMPLATE_ID_RE.fullmatch(value))


def valid_codec(value: str) -> bool:
    return bool(CODEC_RE.fullmatch(value))


def valid_pack_file(value: str) -> bool:
    return bool(PACK_FILE_RE.fullmatch(value)) and ".." not in value


def check_ids(template_id: str, codec: str | None = None) -> None:
    """Raise :class:`ManifestError` for an invalid template id or codec name."""
    if not isinstance(template_id, str) or not valid_template_id(template_id):
        raise ManifestError(
            f"invalid template id {str(template_id)[:80]!r}: must match {TEMPLATE_ID_RE.pattern}"
        )
    if codec is not None and (not isinstance(codec, str) or not valid_codec(codec)):
        raise ManifestError(f"invalid codec {str(codec)[:80]!r}: must match {CODEC_RE.pattern}")


def template_dir(template_id: str, codec: str) -> str:
    return f"templates/{template_id}/{codec}"


def manifest_key(template_id: str, codec: str) -> str:
    return f"{template_dir(template_id, codec)}/{MANIFEST_NAME}"


def pack_key(template_id: str, codec: str, pack_file: str) -> str:
    if not valid_pack_file(pack_file):
        raise ManifestError(f"invalid pack file name {pack_file[:80]!r}")
    return f"{template_dir(template_id, codec)}/{pack_file}"


def versioned_manifest_name(pack_file: str) -> str:
    """``sakura-3fa2c1d0.pack`` -> ``sakura-3fa2c1d0.manifest.json``."""
    return pack_file.removesuffix(".pack") + ".manifest.json"


def versioned_manifest_key(template_id: str, codec: str, pack_file: str) -> str:
    pack_key(template_id, codec, pack_file)  # validates the name
    return f"{template_dir(template_id, codec)}/{versioned_manifest_name(pack_file)}"


def pack_file_name(codec: str, sha256_hex: str) -> str:
    """The content-addressed name of a pack: ``<codec>-<first 16 hex of sha256>.pack``."""
    return f"{codec}-{sha256_hex[:16]}.pack"


# ---------------------------------------------------------------------------- manifests


@dataclass(frozen=True)
class ConfigEntry:
    """One configuration of a shard: the byte ranges of the pack that make it up."""

    shard: int
    config: int
    ranges: tuple[tuple[int, int], ...]  # (offset, length) in the pack
    nbytes: int
    units: tuple[int, ...] = ()  # indices into ManifestIndex.units, in body order


@dataclass(frozen=True)
class ManifestIndex:
    """What the server needs from a manifest, validated once when it is loaded."""

    template_id: str
    codec: str
    pack_file: str
    pack_bytes: int
    pack_sha256: str
    configs: Mapping[tuple[int, int], ConfigEntry]
    units: tuple[tuple[int, int, str], ...] = ()  # (offset, length, sha256), ascending

    def config(self, shard: int, config: int) -> ConfigEntry | None:
        return self.configs.get((shard, config))

    @functools.cached_property
    def unit_offsets(self) -> list[int]:
        """The units' pack offsets, ascending (built once per manifest: rebuilding the list
        on every range was ~0.1 ms of a ~1 ms request under ``sakura bench serve``)."""
        return [u[0] for u in self.units]

    def units_in(self, start: int, stop: int) -> range:
        """Indices of the units overlapping pack bytes ``[start, stop)``."""
        offsets = self.unit_offsets
        first = max(0, bisect.bisect_right(offsets, start) - 1)
        while first < len(self.units) and sum(self.units[first][:2]) <= start:
            first += 1
        last = bisect.bisect_left(offsets, stop)
        return range(first, max(first, last))


def validate_manifest(
    manifest: Any,
    *,
    template_id: str | None = None,
    codec: str | None = None,
    pack_size: int | None = None,
) -> ManifestIndex:
    """Validate a published manifest against the schema (``sakura.codec.manifest``) and
    index its configurations; raises one :class:`ManifestError` naming the field.

    ``template_id`` / ``codec``, when given, must be the manifest's; ``pack_size`` (the
    actual stored size), when given, must equal ``pack_bytes``.
    """
    try:
        m = parse_manifest(manifest)
    except PackError as exc:
        raise ManifestError(str(exc)) from None
    if template_id is not None and m.template_id != template_id:
        raise ManifestError(f"manifest is for template {m.template_id!r}, expected {template_id!r}")
    if codec is not None and m.codec != codec:
        raise ManifestError(f"manifest is for codec {m.codec!r}, expected {codec!r}")
    if pack_size is not None and pack_size != m.pack_bytes:
        raise ManifestError(
            f"pack {m.pack_file} has {pack_size} bytes but the manifest says {m.pack_bytes}"
        )
    configs = {
        (s.index, c.id): ConfigEntry(s.index, c.id, tuple(tuple(r) for r in c.ranges),
                                     c.bytes, tuple(c.units))
        for s in m.shards
        for c in s.configs
    }
    return ManifestIndex(m.template_id, m.codec, m.pack_file, m.pack_bytes, m.pack_sha256,
                         configs, tuple(tuple(u) for u in m.units))


def validate_catalog(catalog: Any) -> dict[str, Any]:
    """Check the shape of ``catalog.json`` (version, template ids, codec entries)."""
    if not isinstance(catalog, dict):
        raise ManifestError("catalog.json must be a JSON object")
    if catalog.get("version") != CATALOG_VERSION:
        raise ManifestError(
            f"unsupported catalog version {catalog.get('version')!r:.20} (expected {CATALOG_VERSION})"
        )
    templates = catalog.get("templates")
    if not isinstance(templates, dict):
        raise ManifestError("catalog.json 'templates' must be an object")
    for tid, entry in templates.items():
        check_ids(tid)
        if not isinstance(entry, dict):
            raise ManifestError(f"catalog entry of {tid!r} must be an object")
        if entry.get("bundle") is not None:
            try:
                parse_bundle(entry["bundle"])
            except PackError as exc:
                raise ManifestError(f"catalog entry of {tid!r}: {exc}") from None
        codecs = entry.get("codecs", {})
        if not isinstance(codecs, dict):
            raise ManifestError(f"catalog entry of {tid!r}: 'codecs' must be an object")
        for codec, centry in codecs.items():
            check_ids(tid, codec)
            if not isinstance(centry, dict):
                raise ManifestError(f"catalog entry {tid}/{codec} must be an object")
            pack_file = centry.get("pack_file")
            if pack_file is not None and (
                not isinstance(pack_file, str) or not valid_pack_file(pack_file)
            ):
                raise ManifestError(
                    f"catalog entry {tid}/{codec}: invalid pack_file {pack_file!r:.80}"
                )
    return catalog
