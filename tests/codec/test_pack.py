import json
import struct

import pytest
import torch
from sakura.codec import PackError, get_codec
from sakura.codec.pack import (
    MAGIC,
    PREAMBLE,
    Manifest,
    PackCorruptError,
    PackMagicError,
    PackReader,
    PackTruncatedError,
    PackVersionError,
    decode_config,
    manifest_path,
    open_pack,
    write_pack,
)
from sakura.codec.shards import shard_data

SKELETON = {"format", "version", "template_id", "codec", "codec_options", "pack_file",
            "pack_bytes", "pack_sha256", "geometry", "model", "fp16_bytes", "stored_bytes",
            "units", "shards"}


def test_manifest_skeleton(packs, small_cache):
    d, m = packs["sakura"]
    doc = json.loads(manifest_path(d, "tpl-small").read_text())
    assert SKELETON <= set(doc)
    assert doc["format"] == "sakura-pack" and doc["version"] == 2
    assert doc["geometry"] == {"steps": 2, "blocks": 3, "tokens": small_cache.tokens,
                               "channels": 48, "heads": 4, "blocks_per_shard": 2,
                               "dtype": "fp16"}
    assert doc["model"] == {"name": "synthetic"}
    assert doc["pack_file"].startswith("sakura-") and doc["pack_file"].endswith(".pack")
    shard = doc["shards"][1]
    assert shard["step"] == 0 and shard["blocks"] == [2] and shard["compute_cost"] == 1.0
    cfg = shard["configs"][0]
    assert set(cfg) == {"id", "params", "units", "ranges", "bytes", "quality", "pareto",
                        "decode_ms"}
    assert all((c["decode_ms"] is not None) == c["pareto"] for c in shard["configs"])
    assert set(cfg["params"]) >= {"rank", "bits"}
    assert {"weighted_err", "psnr_db"} <= set(cfg["quality"])
    assert any(c["pareto"] for c in shard["configs"])
    assert Manifest.from_json(manifest_path(d, "tpl-small").read_text()).to_dict() == doc


def test_storage_accounting(packs, small_cache):
    for name, (d, m) in packs.items():
        path = d / m.pack_file
        data = path.read_bytes()
        assert m.pack_bytes == len(data)
        assert m.stored_bytes == sum(n for _, n, _ in m.units)
        assert m.fp16_bytes == small_cache.fp16_bytes()
        assert m.units[-1][0] + m.units[-1][1] == m.pack_bytes  # units fill the data section
        import hashlib

        assert hashlib.sha256(data).hexdigest() == m.pack_sha256
        assert m.pack_file == f"{name}-{m.pack_sha256[:16]}.pack"
        for s in m.shards:
            for c in s.configs:
                assert c.bytes == sum(m.units[u][1] for u in c.units)
    assert packs["fp16"][1].stored_bytes == small_cache.fp16_bytes()
    intq = packs["intq"][1]
    assert intq.stored_bytes == sum(
        max(c.bytes for c in s.configs if c.params == {"bits": b})
        for s in intq.shards for b in (2, 3, 4, 8))
    assert packs["sakura"][1].stored_bytes < packs["intq"][1].stored_bytes


def test_no_temp_files_left(packs):
    for d, m in packs.values():
        names = sorted(p.name for p in d.iterdir())
        assert names == sorted([m.pack_file, "tpl-small.manifest.json"])


def test_progressive_prefix_property(packs, small_cache):
    """Decoding (r, b) from only that config's ranges equals decoding it from the full pack."""
    d, m = packs["sakura"]
    raw = (d / m.pack_file).read_bytes()
    codec = m.make_codec()
    layout = m.layout()
    for s in m.shards:
        sd = shard_data(small_cache, layout, s.index)
        direct = codec.encode_shard(sd)
        assert len(s.configs) == len(direct.configs)
        for c, dc in zip(s.configs, direct.configs):
            served = b"".join(raw[o : o + n] for o, n in c.ranges)
            assert len(c.ranges) == 1  # every configuration is one byte range
            assert served == direct.config_data(s.configs.index(c))
            with PackReader(d / m.pack_file) as r:
                assert r.read_config(s.index, c.id) == served
            out = decode_config(m, s.index, c.id, served)
            ref = codec.decode(dc.params, direct.config_data(s.configs.index(c)), sd.spec)
            assert all(torch.equal(x, y) for x, y in zip(out, ref))
            assert len(out) == 2 * len(s.blocks) and out[0].shape == (m.geometry["tokens"], 48)


def test_every_codec_roundtrips_through_the_pack(packs, small_cache):
    for name, (d, _) in packs.items():
        m, reader = open_pack(d, "tpl-small")
        with reader:
            reader.verify(m.pack_sha256)
            s = m.shards[-1]
            best = max(s.configs, key=lambda c: c.bytes)
            out = decode_config(m, s.index, best.id, reader.read_config(s.index, best.id))
            k = small_cache.keys[s.step, s.blocks[0]]
            rel = float((out[0] - k).pow(2).sum() / k.pow(2).sum())
            assert rel < 2e-2, (name, rel)


def _copy(packs, tmp_path, name="sakura"):
    d, m = packs[name]
    p = tmp_path / m.pack_file
    p.write_bytes((d / m.pack_file).read_bytes())
    return p, m


def test_reader_rejects_truncated(packs, tmp_path):
    p, m = _copy(packs, tmp_path)
    data = p.read_bytes()
    for cut in (len(data) - 1, len(data) // 2, PREAMBLE.size - 1, 5):
        p.write_bytes(data[:cut])
        with pytest.raises(PackTruncatedError, match="truncated"):
            PackReader(p)


def test_reader_rejects_wrong_magic(packs, tmp_path):
    p, m = _copy(packs, tmp_path)
    data = bytearray(p.read_bytes())
    data[:4] = b"ZIP!"
    p.write_bytes(bytes(data))
    with pytest.raises(PackMagicError, match="not a SAKURA pack"):
        PackReader(p)
    p.write_bytes(b"")
    with pytest.raises(PackTruncatedError):
        PackReader(p)


def test_reader_rejects_wrong_version(packs, tmp_path):
    p, m = _copy(packs, tmp_path)
    data = bytearray(p.read_bytes())
    for other in (1, 3):  # format 1 (several ranges per config) and a future one
        struct.pack_into("<H", data, 4, other)
        p.write_bytes(bytes(data))
        with pytest.raises(PackVersionError, match=f"version {other} is not supported.*rebuild"):
            PackReader(p)


def test_every_config_of_every_codec_is_one_range(packs):
    for name, (_d, m) in packs.items():
        for s in m.shards:
            for c in s.configs:
                assert len(c.ranges) == 1 and c.ranges[0][1] == c.bytes, (name, s.index, c.id)
                assert c.units == list(range(c.units[0], c.units[-1] + 1))
    # a manifest of the old layout (two ranges) or an old version is refused clearly
    d, m = packs["sakura"]
    doc = json.loads(manifest_path(d, "tpl-small").read_text())
    old = json.loads(json.dumps(doc))
    old["version"] = 1
    with pytest.raises(PackVersionError, match="version 1"):
        Manifest.from_dict(old)
    split = json.loads(json.dumps(doc))
    cfg = next(c for s in split["shards"] for c in s["configs"] if len(c["units"]) > 1)
    (off, n), = cfg["ranges"]
    first = split["units"][cfg["units"][0]][1]
    cfg["ranges"] = [[off, first], [off + first + 1, n - first]]
    with pytest.raises(PackCorruptError):
        Manifest.from_dict(split)


def test_reader_rejects_corrupted_header_and_data(packs, tmp_path):
    p, m = _copy(packs, tmp_path)
    data = bytearray(p.read_bytes())
    hdr = bytearray(data)
    hdr[PREAMBLE.size + 3] ^= 0xFF
    p.write_bytes(bytes(hdr))
    with pytest.raises(PackCorruptError, match="header checksum"):
        PackReader(p)
    # flip one byte inside the unit of shard 0's first data range
    body = bytearray(data)
    off, length, _ = m.units[1]
    body[off + length // 2] ^= 0x01
    p.write_bytes(bytes(body))
    r = PackReader(p)  # the header is fine: opening works
    with pytest.raises(PackCorruptError, match=r"unit 1 \(pack bytes \d+-\d+\) checksum"):
        r.read_unit(1)
    with pytest.raises(PackCorruptError):
        r.verify()
    r.read_unit(0)  # other units still verify
    r.close()
    p.write_bytes(bytes(data) + b"x")
    with pytest.raises(PackCorruptError, match="beyond"):
        PackReader(p)


def test_decode_config_verifies(packs):
    d, m = packs["sakura"]
    with PackReader(d / m.pack_file) as r:
        cfg = m.shards[0].configs[-1]
        data = r.read_config(0, cfg.id)
    bad = bytearray(data)
    bad[-1] ^= 0x80
    with pytest.raises(PackCorruptError, match="checksum"):
        decode_config(m, 0, cfg.id, bytes(bad))
    with pytest.raises(PackTruncatedError):
        decode_config(m, 0, cfg.id, data[:-3])
    with pytest.raises(PackError):
        decode_config(m, 0, 10_000, data)
    with pytest.raises(PackError):
        decode_config(m, 99, cfg.id, data)


def test_manifest_validation_errors(packs):
    d, m = packs["intq"]
    doc = json.loads(manifest_path(d, "tpl-small").read_text())
    for mutate, match in [
        (lambda x: x.update(format="other"), "format"),
        (lambda x: x.update(version=7), "version"),
        (lambda x: x.pop("units"), "lacks units"),
        (lambda x: x["shards"][0]["configs"][0].update(bytes=1), "bytes"),
        (lambda x: x["shards"][0]["configs"][0].update(ranges=[[0, 5]]), "ranges"),
        (lambda x: x["shards"].pop(), "shards"),
        (lambda x: x.update(template_id="../etc"), "template_id"),
        (lambda x: x["geometry"].pop("heads"), "geometry"),
    ]:
        bad = json.loads(json.dumps(doc))
        mutate(bad)
        with pytest.raises(PackError, match=match):
            Manifest.from_json(json.dumps(bad))
    with pytest.raises(PackCorruptError):
        Manifest.from_json("{not json")


def test_write_pack_rejects_bad_input(small_cache, tmp_path):
    with pytest.raises(PackError, match="template id"):
        write_pack(tmp_path, "../x", small_cache, get_codec("fp16"))
    with pytest.raises(PackError, match="compute_cost"):
        write_pack(tmp_path, "ok", small_cache, get_codec("fp16"), compute_cost=[1.0])
    assert list(tmp_path.iterdir()) == []


def test_compute_cost_and_header_embeds_manifest(packs, small_cache, tmp_path):
    m = write_pack(tmp_path, "costs", small_cache, get_codec("fp16"), blocks_per_shard=3,
                   compute_cost=[1.5, 2.5])
    assert [s.compute_cost for s in m.shards] == [1.5, 2.5]
    with PackReader(tmp_path / m.pack_file) as r:
        emb = r.manifest
        assert emb.shards[1].compute_cost == 2.5 and emb.units == m.units
        assert emb.to_dict(embedded=True) == m.to_dict(embedded=True)
    assert MAGIC == b"SAKP"
