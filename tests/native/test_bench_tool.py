"""``sakura bench native`` and the standalone ``sakura-native`` executable (host build)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from sakura.dit.text import minilm_dir

from sakura.cli import main

NATIVE_DIR = Path(__file__).resolve().parents[2] / "native"


def test_bench_native_writes_its_json(native, tmp_path, capsys):
    out = tmp_path / "native.json"
    assert main(["bench", "native", "--json", str(out), "--shards", "1", "--configs", "2",
                 "--repeats", "1"]) == 0
    res = json.loads(out.read_text())
    for key in ("native_speedup", "native_2t_speedup", "python_gbps", "native_gbps",
                "bit_equal_tensors", "tensors", "max_abs_diff", "kernel", "per_config"):
        assert key in res
    assert res["configs"] == 2 and res["tensors"] == 16
    assert res["pipeline"]["max_received_depth"] <= 2 and res["pipeline"]["max_ready_depth"] <= 2
    assert res["pipeline"]["noop_native_us_per_shard"] > 0
    assert "speedup" in capsys.readouterr().out


def test_bench_native_bad_arguments(native, tmp_path, capsys):
    with pytest.raises(SystemExit) as info:  # usage errors exit 2
        main(["bench", "native", "--json", str(tmp_path / "x.json"), "--shards", "0"])
    assert info.value.code == 2 and "must be >= 1" in capsys.readouterr().err
    assert main(["bench", "native", "--pack", str(tmp_path)]) == 2  # neither --json nor --export
    assert main(["bench", "native", "--json", str(tmp_path / "x.json"),
                 "--pack", str(tmp_path)]) == 1
    assert "no manifest" in capsys.readouterr().err


def test_standalone_executable_builds_and_matches_python(native, tmp_path):
    # in the default suite: 52 s here at load 9.8 on 2 cores (CMake configure + a -j 2
    # build of the tool, then a 6-shard run), about 11 s of CPU
    if not (shutil.which("cmake") and shutil.which("c++")):
        pytest.skip("cmake / a C++ compiler are not installed")
    build = tmp_path / "build"
    subprocess.run(["cmake", "-S", str(NATIVE_DIR), "-B", str(build), "-DSAKURA_PYTHON=OFF",
                    "-DSAKURA_TOOL=ON", "-DCMAKE_BUILD_TYPE=Release"], check=True,
                   capture_output=True)
    subprocess.run(["cmake", "--build", str(build), "-j", "2"], check=True, capture_output=True)
    exe = build / "sakura-native"
    st = subprocess.run([str(exe), "selftest"], capture_output=True, text=True)
    assert st.returncode == 0, st.stdout + st.stderr
    shards = tmp_path / "shards"
    assert main(["bench", "native", "--export", str(shards), "--shards", "2", "--configs", "3"]) == 0
    run = subprocess.run([str(exe), "run", str(shards), "--threads", "2", "--capacity", "1"],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    res = json.loads(run.stdout)
    assert res["shards"] == 6 and res["mismatches"] == 0 and res["max_rel_err"] <= 1e-5
    assert res["max_received_depth"] <= 1 and res["max_ready_depth"] <= 1
    over = json.loads(subprocess.run([str(exe), "overhead", "2000"], capture_output=True,
                                     text=True, check=True).stdout)
    assert over["shards"] == 2000 and over["us_per_shard"] > 0
    if native.tokenizer_available()[0]:  # the text encoder's tokenizer (utf8proc found)
        vocab = str(minilm_dir() / "vocab.txt")
        prompts = ["Café, ΣΑΣ 野口!", "people & body: man technologist: light skin tone",
                   "a very long prompt " * 9]
        tok = subprocess.run([str(exe), "tokenize", vocab], input="\n".join(prompts),
                             capture_output=True, text=True, check=True)
        for p, line in zip(prompts, tok.stdout.splitlines(), strict=True):
            ids, mask = native.tokenize(p, vocab, 16)
            got = json.loads(line)
            assert (got["ids"], got["attention_mask"]) == (ids.tolist(), mask.tolist())
