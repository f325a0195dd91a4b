"""One cache-directory rule (``sakura.cachedir``): every cache folder follows it, and no
other module reads the variables it is made of (a second copy would drift)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sakura.cachedir import cache_dir

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("sakura_cache,xdg,want", [
    ("/s", "/x", "/s"), (None, "/x", "/x/sakura"), (None, None, "HOME/.cache/sakura")])
def test_the_rule(monkeypatch, tmp_path, sakura_cache, xdg, want):
    monkeypatch.setenv("HOME", str(tmp_path))
    for name, value in (("SAKURA_CACHE", sakura_cache), ("XDG_CACHE_HOME", xdg)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert cache_dir() == Path(want.replace("HOME", str(tmp_path)))
    assert cache_dir("edge") == cache_dir() / "edge"


def test_every_cache_follows_it(monkeypatch, tmp_path):
    from sakura.dit.data import cache_dir as data_dir
    from sakura.edge.backends.base import default_cache_dir
    from sakura.edge.cli import default_state_dir

    monkeypatch.setenv("SAKURA_CACHE", str(tmp_path))
    assert data_dir() == tmp_path
    assert default_state_dir() == tmp_path / "edge"
    assert default_cache_dir() == tmp_path / "compiled"


def test_no_second_copy_of_the_rule():
    readers = sorted(
        str(p.relative_to(ROOT)) for folder in ("sakura", "codec", "dit", "traces", "cloud",
                                                "edge")
        for p in (ROOT / folder).rglob("*.py")
        if any(v in p.read_text() for v in ('"SAKURA_CACHE"', '"XDG_CACHE_HOME"')))
    assert readers == ["sakura/cachedir.py"]
