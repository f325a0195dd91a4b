"""Pack format v2: one immutable file per template plus its JSON manifest (``FORMAT.md``).

``write_pack`` encodes a :class:`~dit.cache.TemplateCache` shard by shard with a codec,
profiles every configuration, and publishes ``<codec>-<sha16>.pack`` and
``<template>.manifest.json`` atomically (temp file, fsync, rename). ``PackReader`` checks
magic, version, length and header checksum on open and unit checksums on every read;
``decode_config`` turns the bytes of one configuration (as served by the shard endpoint)
back into K/V tensors after verifying them.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import torch
import zstandard
from sakura.codec.base import Codec, EncodedShard, get_codec
from sakura.codec.errors import (
    PackCorruptError,
    PackError,
    PackMagicError,
    PackTruncatedError,
    PackVersionError,
)
from sakura.codec.manifest import (  # noqa: F401 - MAGIC, PREAMBLE re-exported
    FORMAT,
    MAGIC,
    PREAMBLE,
    TEMPLATE_ID,
    VERSION,
    PackManifest,
    merge_ranges,
    parse_manifest,
)
from sakura.codec.profile import decode_ms, mark_pareto, profile_config
from sakura.codec.shards import (
    ShardData,
    ShardLayout,
    ShardSpec,
    check_layout,
    shard_data,
    shard_spec,
)

from sakura.atomic import fsync_dir, write_atomic

# MAGIC and PREAMBLE (the pack file's first bytes), VERSION (pack and manifest format) and
# FORMAT come from the schema, sakura.codec.manifest, which the torch-free server reads too
ALIGN = 64
FLAG_ZSTD_HEADER = 1  # the header JSON is zstd-compressed
KNOWN_FLAGS = FLAG_ZSTD_HEADER

QualityFn = Callable[[int, dict[str, Any], list[torch.Tensor]], "float | None"]
"""``quality_fn(shard, params, decoded) -> output PSNR (dB) on the profiling requests``."""


# ---------------------------------------------------------------------------- manifest
@dataclass
class ConfigEntry:
    id: int
    params: dict[str, Any]
    units: list[int]
    ranges: list[list[int]]
    bytes: int
    quality: dict[str, float | None]
    pareto: bool = False
    decode_ms: float | None = None
    """Decode time measured when the pack was built (Pareto configs; null for the others).
    A measurement, so it is in the published manifest only, never in the pack's embedded
    header: the same inputs build byte-identical packs."""


@dataclass
class ShardEntry:
    index: int
    step: int
    blocks: list[int]
    compute_cost: float
    configs: list[ConfigEntry]
    q: float | None = None  # the importance exponent chosen for this shard (low-rank codecs)

    def config(self, config_id: int) -> ConfigEntry:
        for cfg in self.configs:
            if cfg.id == config_id:
                return cfg
        raise PackError(f"shard {self.index} has no configuration {config_id}")


@dataclass
class Manifest:
    """Dataclass view of a pack manifest (see ``FORMAT.md``), validated by the schema
    (:mod:`sakura.codec.manifest`) plus the shard-layout rule; the field names are the
    schema's (a test keeps the two equal)."""

    template_id: str
    codec: str
    codec_options: dict[str, Any]
    geometry: dict[str, Any]
    model: dict[str, Any]
    fp16_bytes: int
    stored_bytes: int
    units: list[list[Any]]
    shards: list[ShardEntry]
    pack_file: str = ""
    pack_bytes: int = 0
    pack_sha256: str = ""
    format: str = FORMAT
    version: int = VERSION
    local_psnr_db: float | None = None  # a local edit's PSNR vs exact (quality floor)
    extra: dict[str, Any] = field(default_factory=dict)

    # -- conversions
    def to_dict(self, embedded: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {
            "format": self.format, "version": self.version, "template_id": self.template_id,
            "codec": self.codec, "codec_options": self.codec_options,
        }
        if not embedded:
            out.update(pack_file=self.pack_file, pack_bytes=self.pack_bytes,
                       pack_sha256=self.pack_sha256)
        out.update(
            geometry=self.geometry, model=self.model, fp16_bytes=self.fp16_bytes,
            stored_bytes=self.stored_bytes, units=[list(u) for u in self.units],
            shards=[{"index": s.index, "step": s.step, "blocks": list(s.blocks),
                     "compute_cost": s.compute_cost,
                     "configs": [{"id": c.id, "params": c.params, "units": list(c.units),
                                  "ranges": [list(r) for r in c.ranges], "bytes": c.bytes,
                                  "quality": c.quality, "pareto": c.pareto,
                                  **({} if embedded else {"decode_ms": c.decode_ms})}
                                 for c in s.configs],
                     # (absent when not chosen: older packs stay byte-identical)
                     **({} if s.q is None else {"q": s.q})}
                    for s in self.shards],
        )
        if self.local_psnr_db is not None:  # (absent: older packs stay byte-identical)
            out["local_psnr_db"] = self.local_psnr_db
        out.update(self.extra)
        return json.loads(json.dumps(out))  # a deep, JSON-clean copy

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent, separators=None if indent else (",", ":"))

    @classmethod
    def from_dict(cls, d: dict[str, Any], embedded: bool = False) -> Manifest:
        """Validate ``d`` (the published manifest; with ``embedded`` the pack's header)
        against the schema and the shard layout; raises :class:`PackCorruptError` or
        :class:`PackVersionError` naming the field."""
        parse_manifest(d, embedded=embedded)
        known = set(PackManifest.model_fields)
        # the schema is strict (no coercion), so the document's values are the typed ones
        m = cls(
            template_id=d["template_id"],
            codec=d["codec"],
            codec_options=dict(d["codec_options"]),
            geometry=dict(d["geometry"]),
            model=dict(d["model"]),
            fp16_bytes=d["fp16_bytes"],
            stored_bytes=d["stored_bytes"],
            units=[[o, n, h] for o, n, h in d["units"]],
            shards=[
                ShardEntry(
                    index=s["index"], step=s["step"], blocks=list(s["blocks"]),
                    compute_cost=float(s.get("compute_cost", 1.0)),
                    configs=[
                        ConfigEntry(
                            id=c["id"], params=dict(c["params"]), units=list(c["units"]),
                            ranges=[[o, n] for o, n in c["ranges"]], bytes=c["bytes"],
                            quality=dict(c.get("quality", {})),
                            pareto=c.get("pareto", False),
                            decode_ms=None if c.get("decode_ms") is None
                            else float(c["decode_ms"]),
                        )
                        for c in s["configs"]
                    ],
                    q=None if s.get("q") is None else float(s["q"]),
                )
                for s in d["shards"]
            ],
            pack_file=d.get("pack_file", "") if not embedded else "",
            pack_bytes=d.get("pack_bytes", 0) if not embedded else 0,
            pack_sha256=d.get("pack_sha256", "") if not embedded else "",
            local_psnr_db=(None if d.get("local_psnr_db") is None
                           else float(d["local_psnr_db"])),
            extra={k: v for k, v in d.items() if k not in known},
        )
        m.check_layout()
        return m

    @classmethod
    def from_json(cls, text: str | bytes) -> Manifest:
        try:
            d = json.loads(text)
        except (ValueError, RecursionError) as exc:  # (JSONDecodeError, UnicodeDecodeError)
            raise PackCorruptError(f"manifest is not valid JSON: {exc}") from None
        return cls.from_dict(d)

    @classmethod
    def load(cls, path: str | Path) -> Manifest:
        try:
            return cls.from_json(Path(path).read_bytes())
        except OSError as exc:
            raise PackError(f"cannot read manifest {path}: {exc.strerror}") from None

    # -- checks and helpers
    def validate(self, embedded: bool = False) -> None:
        """Raise :class:`PackCorruptError` (with the reason) if the manifest is inconsistent:
        the schema's checks of :meth:`to_dict`, then :meth:`check_layout`."""
        parse_manifest(self.to_dict(embedded=embedded), embedded=embedded)
        self.check_layout()

    def check_layout(self) -> None:
        """The rule the schema leaves to the codec: the shards are the ones the geometry
        implies (their number, and each one's step and blocks)."""

        def bad(msg: str) -> PackCorruptError:
            return PackCorruptError(f"invalid manifest for {self.template_id!r}: {msg}")

        try:
            layout = self.layout()
        except Exception as exc:  # noqa: BLE001 - report any layout problem the same way
            raise bad(f"geometry: {exc}") from None
        if len(self.shards) != layout.num_shards:
            raise bad(f"{len(self.shards)} shards, geometry implies {layout.num_shards}")
        for i, s in enumerate(self.shards):
            step, blocks = layout.block_range(i)
            if (s.index != i or s.step != step or len(s.blocks) != len(blocks)
                    or s.blocks != list(blocks)):
                raise bad(f"shard {i} is (index {s.index}, step {s.step}, blocks {s.blocks}), "
                          f"expected step {step} blocks {blocks}")

    def layout(self) -> ShardLayout:
        g = self.geometry
        return ShardLayout(int(g["steps"]), int(g["blocks"]), int(g["blocks_per_shard"]))

    def spec(self, shard: int) -> ShardSpec:
        g = self.geometry
        return shard_spec(self.layout(), shard, int(g["tokens"]), int(g["channels"]))

    def shard(self, index: int) -> ShardEntry:
        if not 0 <= index < len(self.shards):
            raise PackError(f"no shard {index} (pack has {len(self.shards)})")
        return self.shards[index]

    def shard_fp16_bytes(self, index: int) -> int:
        g = self.geometry
        return 2 * len(self.shard(index).blocks) * int(g["tokens"]) * int(g["channels"]) * 2

    def make_codec(self) -> Codec:
        return get_codec(self.codec, **self.codec_options)


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def manifest_path(path_dir: str | Path, template_id: str) -> Path:
    return Path(path_dir) / f"{template_id}.manifest.json"


# ---------------------------------------------------------------------------- writing
def write_pack(
    path_dir: str | Path,
    template_id: str,
    cache: Any,
    codec: Codec,
    *,
    blocks_per_shard: int = 2,
    model: dict[str, Any] | None = None,
    compute_cost: list[float] | None = None,
    quality_fn: QualityFn | None = None,
    profile_floor: float | None = None,
    shard_meta: list[dict[str, Any]] | None = None,
    local_psnr_db: float | None = None,
) -> Manifest:
    """Encode ``cache`` with ``codec`` and publish the pack and its manifest in ``path_dir``.

    ``quality_fn(shard, params, decoded)`` (optional, from the builder that owns the model)
    returns the output PSNR of the profiling requests with that shard decoded; without it
    ``psnr_db`` is null and the Pareto front uses the weighted error. Returns the manifest;
    the files are ``<codec>-<sha256[:16]>.pack`` and ``<template_id>.manifest.json``.
    ``shard_meta`` (a list), when given, receives every shard's encoder notes
    (``EncodedShard.meta``, e.g. the low-rank codecs' ``bytes_vs_pareto``).
    ``local_psnr_db`` (optional, with ``quality_fn``): a local edit's output PSNR against
    exact on the same profiling requests, the device's quality floor.
    """
    if not TEMPLATE_ID.match(template_id):
        raise PackError(
            f"bad template id {template_id!r}: use 1-64 characters of [a-z0-9_-], "
            "starting with a letter or digit"
        )
    layout = ShardLayout(cache.steps, cache.blocks, blocks_per_shard)
    check_layout(cache, layout)
    if compute_cost is not None and len(compute_cost) != layout.num_shards:
        raise PackError(f"compute_cost has {len(compute_cost)} entries, need {layout.num_shards}")
    out_dir = Path(path_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    spool = tempfile.TemporaryFile(dir=out_dir)
    try:
        units, shards, data_pos = _encode_shards(cache, layout, codec, spool, compute_cost,
                                                 quality_fn, profile_floor, shard_meta)
        manifest = Manifest(
            template_id=template_id,
            codec=codec.name,
            codec_options=codec.options,
            geometry={"steps": cache.steps, "blocks": cache.blocks, "tokens": cache.tokens,
                      "channels": cache.channels, "heads": int(cache.num_heads),
                      "blocks_per_shard": blocks_per_shard, "dtype": "fp16"},
            model=dict(model or {}),
            fp16_bytes=int(cache.fp16_bytes()),
            stored_bytes=data_pos,
            units=units,
            shards=shards,
            local_psnr_db=None if local_psnr_db is None else float(local_psnr_db),
        )
        pack_name, pack_bytes, sha = _publish_pack_file(out_dir, template_id, codec.name,
                                                        manifest, spool, data_pos)
    finally:
        spool.close()
    manifest.pack_file = pack_name
    manifest.pack_bytes = pack_bytes
    manifest.pack_sha256 = sha
    manifest.validate()
    write_atomic(manifest_path(out_dir, template_id), manifest.to_json().encode())
    fsync_dir(out_dir)
    return manifest


def _encode_shards(cache: Any, layout: ShardLayout, codec: Codec, spool: IO[bytes],
                   compute_cost: list[float] | None, quality_fn: QualityFn | None,
                   profile_floor: float | None, shard_meta: list[dict[str, Any]] | None
                   ) -> tuple[list[list[Any]], list[ShardEntry], int]:
    """Encode every shard, its units appended to ``spool``; returns the unit table
    (``[offset, length, sha256]``, offsets relative to the data section for now), the shard
    entries and the data section's length."""
    units: list[list[Any]] = []
    decode_times: dict[str, float] = {}
    shards: list[ShardEntry] = []
    data_pos = 0
    for i in range(layout.num_shards):
        sd = shard_data(cache, layout, i)
        enc = codec.encode_shard(sd)
        if shard_meta is not None:
            shard_meta.append(enc.meta)
        base = len(units)
        for blob in enc.units:
            spool.write(blob)
            units.append([data_pos, len(blob), sha256_hex(blob)])
            data_pos += len(blob)
        configs = _shard_configs(codec, sd, enc, base, quality_fn, profile_floor, decode_times)
        shards.append(ShardEntry(
            index=i, step=sd.spec.step, blocks=list(sd.spec.blocks),
            compute_cost=float(compute_cost[i]) if compute_cost else 1.0, configs=configs,
            q=None if enc.meta.get("q") is None else float(enc.meta["q"])))
    return units, shards, data_pos


def _shard_configs(codec: Codec, sd: ShardData, enc: EncodedShard, base: int,
                   quality_fn: QualityFn | None, profile_floor: float | None,
                   decode_times: dict[str, float]) -> list[ConfigEntry]:
    """One shard's configuration table: its units (from ``base`` in the pack's unit table),
    bytes and profiled quality, the Pareto marks, and the decode time of the Pareto ones."""
    configs = []
    for j, cfg in enumerate(enc.configs):
        quality = profile_config(codec, sd, enc, j, quality_fn, floor=profile_floor)
        configs.append(ConfigEntry(
            id=j, params=cfg.params, units=[base + u for u in cfg.units], ranges=[],
            bytes=enc.config_bytes(j), quality=quality))
    mark_pareto(configs)
    for j, c in enumerate(configs):
        if c.pareto:
            # decode cost depends on the parameters and the (shared) geometry, not on
            # the values: time each distinct configuration once per pack
            key = json.dumps(c.params, sort_keys=True)
            if key not in decode_times:
                decode_times[key] = decode_ms(codec, sd, enc, j)
            c.decode_ms = decode_times[key]
    return configs


def _publish_pack_file(out_dir: Path, template_id: str, codec_name: str, manifest: Manifest,
                       spool: IO[bytes], data_pos: int) -> tuple[str, int, str]:
    """Write preamble, header and the spooled data to a temporary file, fsync it and rename
    it to its content-addressed name; returns (file name, bytes, sha256)."""
    header, data_offset = _layout_header(manifest)
    pack_bytes = data_offset + data_pos
    preamble = PREAMBLE.pack(MAGIC, VERSION, FLAG_ZSTD_HEADER, pack_bytes, len(header),
                             hashlib.sha256(header).digest())
    digest = hashlib.sha256()
    fd, tmp_name = tempfile.mkstemp(dir=out_dir, prefix=f".{template_id}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            for chunk in (preamble, header, b"\0" * (data_offset - PREAMBLE.size - len(header))):
                f.write(chunk)
                digest.update(chunk)
            spool.seek(0)
            while chunk := spool.read(1 << 20):
                f.write(chunk)
                digest.update(chunk)
            f.flush()
            os.fsync(f.fileno())
        sha = digest.hexdigest()
        pack_name = f"{codec_name}-{sha[:16]}.pack"
        os.replace(tmp_name, out_dir / pack_name)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    return pack_name, pack_bytes, sha


def _layout_header(manifest: Manifest) -> tuple[bytes, int]:
    """Fix unit offsets to absolute file offsets; returns (header bytes, data offset).

    The header (zstd-compressed JSON) precedes the data, whose offsets it lists: start from
    a size estimate and grow the reserved space until the header fits.
    """
    rel = [list(u) for u in manifest.units]
    compressor = zstandard.ZstdCompressor(level=9)
    data_offset = 0
    while True:
        manifest.units = [[o + data_offset, n, h] for o, n, h in rel]
        for s in manifest.shards:
            for c in s.configs:
                c.ranges = merge_ranges([manifest.units[u][:2] for u in c.units])
                c.bytes = sum(n for _, n in c.ranges)
        text = json.dumps(manifest.to_dict(embedded=True), separators=(",", ":")).encode()
        header = compressor.compress(text)
        need = _align(PREAMBLE.size + len(header))
        if data_offset and need <= data_offset:
            return header, data_offset
        data_offset = _align(need + need // 16 + ALIGN)  # slack for longer offsets


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


# ---------------------------------------------------------------------------- reading
class PackReader:
    """Random access to a pack file with validation.

    Opening checks the magic, version, declared length and header checksum; every read of
    a unit checks that unit's sha256; :meth:`verify` checks everything, including the
    whole-file hash against an expected value.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self._f = open(self.path, "rb")  # noqa: SIM115 - closed in close()
        except OSError as exc:
            raise PackError(f"cannot open pack {self.path}: {exc.strerror}") from None
        try:
            self.manifest = self._open()
        except BaseException:
            self._f.close()
            raise

    def _open(self) -> Manifest:
        size = os.fstat(self._f.fileno()).st_size
        pre = self._f.read(PREAMBLE.size)
        if len(pre) >= 4 and pre[:4] != MAGIC:
            raise PackMagicError(f"{self.path} is not a SAKURA pack (magic {pre[:4]!r}, "
                                 f"expected {MAGIC!r})")
        if len(pre) < PREAMBLE.size:
            raise PackTruncatedError(f"{self.path}: truncated ({size} bytes, shorter than "
                                     f"the {PREAMBLE.size}-byte preamble)")
        magic, version, flags, pack_bytes, header_len, header_sha = PREAMBLE.unpack(pre)
        if version != VERSION:
            raise PackVersionError(f"{self.path}: pack version {version} is not supported "
                                   f"(this reader supports version {VERSION}; rebuild the "
                                   "pack with this version of `sakura build`)")
        if flags & ~KNOWN_FLAGS:
            raise PackVersionError(f"{self.path}: unknown pack flags {flags:#x}")
        if size < pack_bytes:
            raise PackTruncatedError(f"{self.path}: truncated ({size} of {pack_bytes} bytes)")
        if size > pack_bytes:
            raise PackCorruptError(f"{self.path}: {size - pack_bytes} bytes beyond the pack end")
        if PREAMBLE.size + header_len > pack_bytes:
            raise PackCorruptError(f"{self.path}: header length {header_len} exceeds the file")
        header = self._f.read(header_len)
        if hashlib.sha256(header).digest() != header_sha:
            raise PackCorruptError(f"{self.path}: header checksum mismatch (corrupted pack)")
        try:
            if flags & FLAG_ZSTD_HEADER:
                header = zstandard.ZstdDecompressor().decompress(header, max_output_size=1 << 30)
            d = json.loads(header)
        except (ValueError, RecursionError, zstandard.ZstdError) as exc:
            raise PackCorruptError(f"{self.path}: header is not JSON: {exc}") from None
        m = Manifest.from_dict(d, embedded=True)
        m.pack_file = self.path.name
        m.pack_bytes = pack_bytes
        if m.units and m.units[-1][0] + m.units[-1][1] > pack_bytes:
            raise PackCorruptError(f"{self.path}: units extend beyond the file")
        return m

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> PackReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def read_range(self, offset: int, length: int) -> bytes:
        self._f.seek(offset)
        data = self._f.read(length)
        if len(data) != length:
            raise PackTruncatedError(f"{self.path}: short read at {offset} (+{length})")
        return data

    def read_unit(self, index: int) -> bytes:
        if not 0 <= index < len(self.manifest.units):
            raise PackError(f"no unit {index} in {self.path}")
        off, length, digest = self.manifest.units[index]
        data = self.read_range(off, length)
        if sha256_hex(data) != digest:
            raise PackCorruptError(f"{self.path}: unit {index} (pack bytes {off}-"
                                   f"{off + length - 1}) checksum mismatch (corrupted pack)")
        return data

    def read_config(self, shard: int, config_id: int) -> bytes:
        """The bytes the shard endpoint serves: the config's ranges, concatenated, verified."""
        cfg = self.manifest.shard(shard).config(config_id)
        return b"".join(self.read_unit(u) for u in cfg.units)

    def file_sha256(self) -> str:
        h = hashlib.sha256()
        self._f.seek(0)
        while chunk := self._f.read(1 << 20):
            h.update(chunk)
        return h.hexdigest()

    def verify(self, expected_sha256: str | None = None) -> None:
        """Check every unit; with ``expected_sha256`` also the whole file."""
        for i in range(len(self.manifest.units)):
            self.read_unit(i)
        if expected_sha256 is not None and self.file_sha256() != expected_sha256:
            raise PackCorruptError(f"{self.path}: file sha256 does not match the manifest")


def open_pack(path_dir: str | Path, template_id: str) -> tuple[Manifest, PackReader]:
    """Load ``<template_id>.manifest.json`` and open the pack it names (checked together)."""
    manifest = Manifest.load(manifest_path(path_dir, template_id))
    reader = PackReader(Path(path_dir) / manifest.pack_file)
    if reader.manifest.pack_bytes != manifest.pack_bytes or reader.manifest.units != manifest.units:
        reader.close()
        raise PackCorruptError(f"{manifest.pack_file} does not match its manifest")
    return manifest, reader


def verify_config_bytes(manifest: Manifest, shard: int, config_id: int, data: bytes) -> None:
    """Raise :class:`PackError` unless ``data`` is exactly the config's verified bytes."""
    cfg = manifest.shard(shard).config(config_id)
    if len(data) != cfg.bytes:
        kind = PackTruncatedError if len(data) < cfg.bytes else PackCorruptError
        raise kind(f"shard {shard} config {config_id}: got {len(data)} bytes, "
                   f"expected {cfg.bytes}")
    pos = 0
    for u in cfg.units:
        _, length, digest = manifest.units[u]
        if sha256_hex(data[pos : pos + length]) != digest:
            raise PackCorruptError(f"shard {shard} config {config_id}: unit {u} checksum "
                                   "mismatch (corrupted response)")
        pos += length


def decode_config(
    manifest: Manifest,
    shard: int,
    config_id: int,
    data: bytes,
    codec: Codec | None = None,
) -> list[torch.Tensor]:
    """Verify and decode one configuration's bytes into the shard's ``[N, C]`` tensors
    (block0 K, block0 V, block1 K, ...)."""
    verify_config_bytes(manifest, shard, config_id, data)
    codec = codec or manifest.make_codec()
    cfg = manifest.shard(shard).config(config_id)
    return codec.decode(cfg.params, data, manifest.spec(shard))
