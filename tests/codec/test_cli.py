import json

from safetensors.torch import save_file

from sakura.cli import main


def test_pack_inspect(packs, capsys):
    d, m = packs["sakura"]
    assert main(["pack", "inspect", str(d), "--verify"]) == 0
    out = capsys.readouterr().out
    assert "codec sakura" in out and "verify:" in out and "rate-quality" in out
    assert main(["pack", "inspect", str(d / m.pack_file), "--json", "-"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["codec"] == "sakura" and doc["units"] == m.units


def test_pack_inspect_errors(tmp_path, capsys):
    bad = tmp_path / "x.pack"
    bad.write_bytes(b"NOPE" + b"\0" * 100)
    assert main(["pack", "inspect", str(bad)]) == 1
    assert "not a SAKURA pack" in capsys.readouterr().err
    assert main(["pack", "inspect", str(tmp_path)]) == 1
    assert "holds no pack manifest" in capsys.readouterr().err


def test_bench_codec_on_saved_cache(small_cache, tmp_path, capsys):
    f = tmp_path / "tiny.safetensors"
    save_file({k: v.contiguous() for k, v in small_cache.state_dict().items()}, str(f))
    out = tmp_path / "bench.json"
    rc = main(["bench", "codec", "--cache", str(f), "--json", str(out), "--silent"])
    assert rc == 0
    res = json.loads(out.read_text())
    for key in ("psnr_db", "storage_ratio_vs_fp16", "reconstruct_gbps", "kv_db", "targets"):
        assert key in res
    assert set(res["psnr_db"]) == {"fp16", "intq", "cachegen", "svd", "sakura"}
    assert set(res["psnr_db"]["sakura"]) == {"5", "15", "50"}
    assert res["psnr_source"] == "kv_weighted"
    assert res["psnr_db"]["fp16"] == {"5": None, "15": None, "50": None}
    assert res["psnr_db"]["intq"]["15"] is None and res["psnr_db"]["intq"]["50"] is None
    assert all(v is not None for v in res["psnr_db"]["sakura"].values())
    assert res["storage_ratio_vs_fp16"]["fp16"] == 1.0
    assert res["reconstruct_gbps"] > 0


def test_bench_codec_bad_cache(tmp_path, capsys):
    rc = main(["bench", "codec", "--cache", str(tmp_path / "missing.safetensors"),
               "--json", str(tmp_path / "o.json")])
    assert rc == 1
    assert "cannot read cache" in capsys.readouterr().err


def test_pack_inspect_verifies_by_default(packs, tmp_path, capsys):
    """A corrupt pack is one error naming the unit and its pack bytes, exit 1, unless
    --no-verify (issue 29); an intact one says what was checked."""
    import shutil

    src, m = packs["fp16"]
    d = tmp_path / "pack"
    shutil.copytree(src, d)
    assert main(["pack", "inspect", str(d)]) == 0
    assert f"verify: the {len(m.units)} unit checksums and the file hash match" in \
        capsys.readouterr().out
    off, length, _ = m.units[3]
    pack = d / m.pack_file
    data = bytearray(pack.read_bytes())
    data[off + length // 2] ^= 0x01
    pack.write_bytes(bytes(data))
    for target in (d, pack):
        assert main(["pack", "inspect", str(target)]) == 1
        err = capsys.readouterr().err
        lines = [ln for ln in err.splitlines() if ln.startswith("sakura: error:")]
        assert len(lines) == 1 and "Traceback" not in err, err
        assert f"unit 3 (pack bytes {off}-{off + length - 1}) checksum mismatch" in lines[0]
    assert main(["pack", "inspect", str(d), "--no-verify"]) == 0
    assert "verify: skipped (--no-verify)" in capsys.readouterr().out
