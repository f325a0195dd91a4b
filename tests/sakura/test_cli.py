"""The `sakura` front door: usage errors exit 2, user errors print one clear line."""

from __future__ import annotations

import subprocess
import sys


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sakura.cli", *args], capture_output=True,
                          text=True, timeout=120)


def test_no_command_prints_usage_and_exits_2():
    r = run()
    assert r.returncode == 2
    assert "usage: sakura" in r.stderr


def test_unknown_command_and_bad_option_exit_2():
    assert run("frobnicate").returncode == 2
    r = run("build", "--no-such-option")
    assert r.returncode == 2 and "usage:" in r.stderr


def test_user_error_is_one_line_without_traceback(tmp_path):
    r = run("build", str(tmp_path / "missing.json"), "--out", str(tmp_path / "out"))
    assert r.returncode == 1
    assert "Traceback" not in r.stderr
    assert r.stderr.startswith("sakura: error:")
