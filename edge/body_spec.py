"""What a configuration's body must be, from the manifest, and which bodies are prefixes of which.

A shard configuration is ONE byte range of the pack (pack format 2, ``codec/FORMAT.md``).
:class:`BodySpec` is what its body must be: where it lies in the pack, its exact length and
its units' (length, sha256) in order; every body is checked against it before the client
returns it (``edge/client.py``, unit by unit as it arrives: ``edge/transfer.py``).

Every configuration of a shard is a prefix of one byte stream, so a body's first units may
be a whole smaller configuration: :func:`prefix_fallbacks` lists those (same range start,
shorter, units a prefix; what a receive cut short may run on, the rule of the native
``StreamFeed::issue``), :func:`prefix_extensions` the configurations a received body may be
extended to (the rule of the native ``StreamFeed::try_refine``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sakura.edge.errors import EdgeError


@dataclass(frozen=True)
class BodySpec:
    """What a configuration's body must be: where it lies in the pack, its length and its
    units' (length, sha256) in order."""

    nbytes: int
    units: tuple[tuple[int, str], ...] = ()
    offset: int = 0
    pack_bytes: int | None = None

    @classmethod
    def from_manifest(cls, manifest: Mapping[str, Any], shard: int, config: int) -> BodySpec:
        entry = config_entry(manifest, shard, config)
        table = manifest.get("units") or []
        units = []
        try:
            for u in entry.get("units") or []:
                _off, length, sha = table[int(u)][:3]
                units.append((int(length), str(sha)))
            ranges = [(int(o), int(n)) for o, n in entry.get("ranges") or []]
            nbytes = int(entry["bytes"])
        except (IndexError, KeyError, TypeError, ValueError) as exc:
            raise EdgeError(f"manifest: shard {shard} config {config} is malformed: "
                            f"{exc!r}") from None
        if len(ranges) != 1:
            raise EdgeError(f"manifest: shard {shard} config {config} has {len(ranges)} byte "
                            "ranges; this client reads pack format 2 (one range each)")
        if not units or sum(n for n, _ in units) != nbytes or ranges[0][1] != nbytes:
            raise EdgeError(f"manifest: shard {shard} config {config}: units and range do not "
                            f"add up to its {nbytes} bytes")
        pack_bytes = manifest.get("pack_bytes")
        return cls(nbytes, tuple(units), ranges[0][0],
                   int(pack_bytes) if isinstance(pack_bytes, int) else None)

    def verify(self, data: bytes) -> str | None:
        """None when ``data`` is the body, else what is wrong."""
        if len(data) != self.nbytes:
            return f"{len(data)} bytes, expected {self.nbytes}"
        pos = 0
        for i, (length, sha) in enumerate(self.units):
            if hashlib.sha256(data[pos : pos + length]).hexdigest() != sha:
                return f"unit {i} (bytes {pos}..{pos + length}) fails its checksum"
            pos += length
        return None


def config_entry(manifest: Mapping[str, Any], shard: int, config: int) -> Mapping[str, Any]:
    for s in manifest.get("shards", []):
        if int(s["index"]) == shard:
            for c in s["configs"]:
                if int(c["id"]) == config:
                    return c
            raise EdgeError(f"manifest: shard {shard} has no configuration {config}")
    raise EdgeError(f"manifest: no shard {shard}")


def prefix_extensions(manifest: Mapping[str, Any], shard: int, config: int,
                      candidates: list[int] | tuple[int, ...]) -> list[tuple[int, int]]:
    """``(config id, bytes)`` of the ``candidates`` whose bodies begin with the whole body
    of ``config`` (the same range start, more bytes, ``config``'s units first), shortest
    first: what a received ``config`` may be extended to (prefix refinement; the rule of
    the native ``StreamFeed::try_refine``)."""
    have = BodySpec.from_manifest(manifest, shard, config)
    out: list[tuple[int, int]] = []
    for c in candidates:
        if int(c) == int(config):
            continue
        try:
            spec = BodySpec.from_manifest(manifest, shard, int(c))
        except EdgeError:
            continue
        if (spec.offset != have.offset or spec.nbytes <= have.nbytes or not have.units
                or spec.units[: len(have.units)] != have.units):
            continue
        out.append((int(c), spec.nbytes))
    out.sort(key=lambda f: f[1])
    return out


def prefix_fallbacks(manifest: Mapping[str, Any], shard: int, config: int,
                     candidates: list[int] | tuple[int, ...]) -> list[tuple[int, int]]:
    """``(config id, bytes)`` of the ``candidates`` (e.g. the allocator's ``fallbacks``)
    whose bodies are a prefix of ``config``'s: the same range start, fewer bytes, and its
    units the first units of ``config``'s; longest first (the rule of the native
    ``StreamFeed::issue``)."""
    want = BodySpec.from_manifest(manifest, shard, config)
    out: list[tuple[int, int]] = []
    for c in candidates:
        if int(c) == int(config):
            continue
        try:
            spec = BodySpec.from_manifest(manifest, shard, int(c))
        except EdgeError:
            continue
        if (spec.offset != want.offset or spec.nbytes >= want.nbytes or not spec.units
                or want.units[: len(spec.units)] != spec.units):
            continue
        out.append((int(c), spec.nbytes))
    out.sort(key=lambda f: -f[1])
    return out
