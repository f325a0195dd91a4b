"""The published catalog layout: names, storage keys and validation of catalog and manifests.

A published catalog directory (or bucket prefix) holds::

    catalog.json                                     index, written last, atomically
    templates/<template_id>/<codec>/manifest.json    the current manifest
    templates/<template_id>/<codec>/<pack_file>      immutable pack, named by content hash
    templates/<template_id>/<codec>/<stem>.manifest.json  the manifest of that pack version

Template ids match ``^[a-z0-9][a-z0-9_-]{0,63}$``, codec names ``^[a-z0-9][a-z0-9_-]{0,31}$``,
pack files ``<codec>-<sha256 prefix>.pack``. The manifest schema is owned by ``codec``; this
module only checks what serving relies on (pack identity, shard/config table, byte ranges
inside the pack) and treats every other field as opaque.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sakura.cloud.errors import ManifestError

TEMPLATE_ID_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")
CODEC_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,31}$")
PACK_FILE_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,95}(?:\.[a-z0-9_-]{1,32})?\.pack$")
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")

CATALOG_KEY = "catalog.json"
CATALOG_VERSION = 1
MANIFEST_FORMAT = "sakura-pack"
MANIFEST_VERSION = 2  # pack format 2: every configuration is one byte range
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

    def units_in(self, start: int, stop: int) -> range:
        """Indices of the units overlapping pack bytes ``[start, stop)``."""
        offsets = [u[0] for u in self.units]
        first = max(0, bisect.bisect_right(offsets, start) - 1)
        while first < len(self.units) and sum(self.units[first][:2]) <= start:
            first += 1
        last = bisect.bisect_left(offsets, stop)
        return range(first, max(first, last))


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ManifestError(f"{what} must be an integer, got {value!r:.40}")
    return value


def validate_manifest(
    manifest: Any,
    *,
    template_id: str | None = None,
    codec: str | None = None,
    pack_size: int | None = None,
) -> ManifestIndex:
    """Check the serving-relevant parts of a manifest and index its configurations.

    ``pack_size`` (the actual stored size), when given, must equal ``pack_bytes``.
    """
    if not isinstance(manifest, Mapping):
        raise ManifestError("manifest must be a JSON object")
    if manifest.get("format") != MANIFEST_FORMAT:
        raise ManifestError(
            f"manifest format must be {MANIFEST_FORMAT!r}, got {manifest.get('format')!r:.40}"
        )
    if manifest.get("version") != MANIFEST_VERSION:
        raise ManifestError(
            f"unsupported manifest version {manifest.get('version')!r:.20} (expected "
            f"{MANIFEST_VERSION}; rebuild the pack with this version of `sakura build`)"
        )
    tid, cname = manifest.get("template_id"), manifest.get("codec")
    check_ids(tid, cname)
    if template_id is not None and tid != template_id:
        raise ManifestError(f"manifest is for template {tid!r}, expected {template_id!r}")
    if codec is not None and cname != codec:
        raise ManifestError(f"manifest is for codec {cname!r}, expected {codec!r}")
    pack_file = manifest.get("pack_file")
    if not isinstance(pack_file, str) or not valid_pack_file(pack_file):
        raise ManifestError(f"manifest pack_file {pack_file!r:.80} is not a valid pack file name")
    pack_bytes = _int(manifest.get("pack_bytes"), "pack_bytes")
    if pack_bytes < 0:
        raise ManifestError("pack_bytes must be >= 0")
    sha = manifest.get("pack_sha256")
    if not isinstance(sha, str) or not SHA256_RE.fullmatch(sha):
        raise ManifestError("pack_sha256 must be 64 lowercase hex digits")
    if pack_size is not None and pack_size != pack_bytes:
        raise ManifestError(
            f"pack {pack_file} has {pack_size} bytes but the manifest says {pack_bytes}"
        )

    def check_span(offset: Any, length: Any, what: str) -> tuple[int, int]:
        offset, length = _int(offset, f"{what} offset"), _int(length, f"{what} length")
        if offset < 0 or length < 0 or offset + length > pack_bytes:
            raise ManifestError(
                f"{what} [{offset}, +{length}) lies outside the pack ({pack_bytes} bytes)"
            )
        return offset, length

    units = manifest.get("units", [])
    if not isinstance(units, list):
        raise ManifestError("units must be a list")
    table: list[tuple[int, int, str]] = []
    end = 0
    for i, unit in enumerate(units):
        if not isinstance(unit, (list, tuple)) or len(unit) < 3:
            raise ManifestError(f"unit {i} must be [offset, length, sha256]")
        offset, length = check_span(unit[0], unit[1], f"unit {i}")
        if offset < end or not isinstance(unit[2], str) or not SHA256_RE.fullmatch(unit[2]):
            raise ManifestError(f"unit {i} overlaps the one before or lacks a sha256")
        end = offset + length
        table.append((offset, length, unit[2]))
    shards = manifest.get("shards")
    if not isinstance(shards, list):
        raise ManifestError("shards must be a list")
    configs: dict[tuple[int, int], ConfigEntry] = {}
    seen_shards: set[int] = set()
    for shard in shards:
        if not isinstance(shard, Mapping):
            raise ManifestError("every shard must be a JSON object")
        index = _int(shard.get("index"), "shard index")
        if index in seen_shards:
            raise ManifestError(f"duplicate shard index {index}")
        seen_shards.add(index)
        shard_configs = shard.get("configs")
        if not isinstance(shard_configs, list):
            raise ManifestError(f"shard {index} configs must be a list")
        for cfg in shard_configs:
            if not isinstance(cfg, Mapping):
                raise ManifestError(f"shard {index}: every config must be a JSON object")
            cid = _int(cfg.get("id"), f"shard {index} config id")
            if (index, cid) in configs:
                raise ManifestError(f"shard {index}: duplicate config id {cid}")
            ranges = cfg.get("ranges")
            if not isinstance(ranges, list):
                raise ManifestError(f"shard {index} config {cid}: ranges must be a list")
            spans = []
            for rng in ranges:
                if not isinstance(rng, (list, tuple)) or len(rng) != 2:
                    raise ManifestError(
                        f"shard {index} config {cid}: a range must be [offset, length]"
                    )
                spans.append(check_span(rng[0], rng[1], f"shard {index} config {cid} range"))
            if len(spans) != 1:
                raise ManifestError(
                    f"shard {index} config {cid}: {len(spans)} ranges; pack format "
                    f"{MANIFEST_VERSION} serves every configuration as exactly one range"
                )
            total = sum(length for _, length in spans)
            declared = cfg.get("bytes", total)
            if _int(declared, f"shard {index} config {cid} bytes") != total:
                raise ManifestError(
                    f"shard {index} config {cid}: bytes={declared} but its ranges hold {total}"
                )
            used = cfg.get("units", [])
            if not isinstance(used, list) or not all(
                isinstance(u, int) and not isinstance(u, bool) and 0 <= u < len(table)
                for u in used
            ):
                raise ManifestError(f"shard {index} config {cid}: units must index the table")
            if used and sum(table[u][1] for u in used) != total:
                raise ManifestError(f"shard {index} config {cid}: units do not fill its range")
            configs[(index, cid)] = ConfigEntry(index, cid, tuple(spans), total, tuple(used))
    return ManifestIndex(tid, cname, pack_file, pack_bytes, sha, configs, tuple(table))


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
