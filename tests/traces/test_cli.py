"""`sakura traces stats` and `sakura bench link` through the real CLI entry point."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sakura.traces import load_trace
from sakura.traces.netns import kernel_shaping_unavailable_reason

from sakura.cli import main


def test_stats_table_and_json(trace_dir: Path, capsys) -> None:
    files = [trace_dir / "lumos5g/5g/5g_trace_100_walking.txt", trace_dir / "mahimahi"]
    assert main(["traces", "stats", *map(str, files)]) == 0
    out = capsys.readouterr().out
    assert "5g_trace_100_walking" in out and "Verizon-LTE-short.down" in out
    assert out.splitlines()[0].split()[:4] == ["trace", "format", "dur_s", "mean"]
    assert main(["traces", "stats", "--json", "-", str(files[0])]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    expected = load_trace(files[0]).stats()
    for key in ("mean_mbps", "median_mbps", "p10_mbps", "p90_mbps", "outage_fraction"):
        assert row[key] == pytest.approx(expected[key])
    assert row["median_mbps"] == pytest.approx(220.0)


def test_stats_label_filter(trace_dir: Path, capsys) -> None:
    path = trace_dir / "ucc5g/driving_B_2019.12.14_10.16.30.csv"
    assert main(["traces", "stats", "--json", "-", "--label", "LTE", str(path)]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["name"].endswith("[LTE]")
    assert row["duration_s"] < load_trace(path).duration_s


def test_stats_bad_file_is_a_clean_error(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "notes.trace"
    bad.write_text("hello world\n")
    assert main(["traces", "stats", str(bad)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("sakura: error:") and str(bad) in err and "Traceback" not in err
    assert main(["traces", "stats", str(tmp_path / "missing.txt")]) == 1
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["traces", "stats"])
    assert info.value.code == 2


def test_bench_link_paced_only(trace_dir: Path, capsys) -> None:
    path = trace_dir / "lumos5g/4g/4g_trace_driving_50015_dr.txt"
    args = ["bench", "link", "--json", "-", "--quick", "--no-kernel", "--window", "1.5", str(path)]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["paced_rel_error"] < 0.05
    assert report["kernel_rel_error"] is None and "disabled" in report["kernel_skipped"]
    (entry,) = report["traces"]
    assert entry["trace"] == "4g_trace_driving_50015_dr" and entry["paced"]["windows"]


@pytest.mark.root
@pytest.mark.skipif(kernel_shaping_unavailable_reason() is not None, reason="no kernel shaping")
def test_bench_link_both_emulators(trace_dir: Path, tmp_path: Path, capsys) -> None:
    path = trace_dir / "wifi/7_2_wifi.csv"
    out = tmp_path / "link.json"
    assert main(["bench", "link", "--quick", "--window", "1.5", "--json", str(out), str(path)]) == 0
    assert "kernel link: max window error" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["paced_rel_error"] < 0.05 and report["kernel_rel_error"] < 0.05


def test_mahimahi_export_command(trace_dir: Path, tmp_path: Path, capsys) -> None:
    src = trace_dir / "lumos5g/5g/5g_trace_100_walking.txt"
    out = tmp_path / "mm" / "walk.down"
    assert main(["traces", "mahimahi", str(src), "--scale", "0.05", "--start", "3",
                 "--duration", "20", "--out", str(out)]) == 0
    assert "mm-link" in capsys.readouterr().out
    back = load_trace(out)
    want = load_trace(src).scaled(0.05).bits_between(3, 23) / 8
    assert abs(back.bits_between(0, 20) / 8 - want) <= 1500
    assert main(["traces", "mahimahi", "--out", str(out)]) == 1  # neither PATH nor --mixed
    assert capsys.readouterr().err.startswith("sakura: error: ")
