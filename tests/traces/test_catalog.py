"""Trace folder discovery (env override, ../shared/traces), file expansion, named sets."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import sakura.traces.catalog as catalog
from sakura.traces import (
    Trace,
    TraceError,
    default_trace_dir,
    find_trace_files,
    load_set,
    mixed_trace,
    trace_set,
)


def test_default_dir_is_shared_traces_next_to_repo(trace_dir: Path, monkeypatch) -> None:
    monkeypatch.delenv("SAKURA_TRACES", raising=False)
    repo_root = Path(catalog.__file__).resolve().parents[1]
    assert default_trace_dir() == (repo_root.parent / "shared" / "traces").resolve()
    # Never copied into the repository.
    assert not (repo_root / "traces" / "lumos5g").exists()


def test_env_override(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("SAKURA_TRACES", str(tmp_path))
    assert default_trace_dir() == tmp_path.resolve()
    monkeypatch.setenv("SAKURA_TRACES", str(tmp_path / "missing"))
    with pytest.raises(TraceError, match="SAKURA_TRACES"):
        default_trace_dir()


def test_find_files_skips_docs(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "README.md").write_text("# doc")
    (tmp_path / "README").write_text("doc")
    (tmp_path / ".hidden").write_text("1\n")
    (tmp_path / "sub" / "a.down").write_text("0\n5\n")
    (tmp_path / "b.txt").write_text("1\t2\n")
    files = find_trace_files([tmp_path])
    assert [f.name for f in files] == ["b.txt", "a.down"]
    with pytest.raises(TraceError, match="does not exist"):
        find_trace_files([tmp_path / "nope"])


def test_named_sets(trace_dir: Path) -> None:
    assert len(trace_set("5g", trace_dir)) == 91
    assert all("walking" in p.name for p in trace_set("5g-walking", trace_dir))
    assert all(p.suffix == ".down" for p in trace_set("mahimahi", trace_dir))
    assert all(t.fmt == "gnettrack" for t in load_set("ucc5g", trace_dir))
    with pytest.raises(TraceError, match="unknown trace set"):
        trace_set("6g", trace_dir)


def test_mixed_4g_5g_reproducible(trace_dir: Path) -> None:
    lte, nr = load_set("lte", trace_dir)[:10], load_set("5g", trace_dir)[:10]
    a = mixed_trace(lte, nr, segments=4, segment_s=15, seed=3)
    b = mixed_trace(lte, nr, segments=4, segment_s=15, seed=3)
    assert a.duration_s == pytest.approx(60)
    np.testing.assert_array_equal(a.rates_bps, b.rates_bps)
    assert a.label_at(5) == "LTE" and a.label_at(20) == "5G" and a.label_at(35) == "LTE"
    with pytest.raises(TraceError):
        mixed_trace([], [Trace.constant(1.0)])
