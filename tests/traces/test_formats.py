"""Loaders on the real trace files (known lines), auto-detection and clear errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from sakura.traces import (
    Trace,
    TraceFormatError,
    detect_format,
    find_trace_files,
    load_set,
    load_trace,
)
from sakura.traces.formats import load_gnettrack, load_mahimahi

MB = 1e6


def _columns(path: Path, sep: str | None, skip: int = 0) -> list[list[str]]:
    """The raw rows of a trace file, split plainly: what each loader must agree with (the
    expected values are read from ../shared, never copied into this repository)."""
    rows = path.read_text().splitlines()[skip:]
    return [r.split(sep) for r in rows if r.strip()]


def test_lumos_known_lines(trace_dir: Path) -> None:
    path = trace_dir / "lumos5g/5g/5g_trace_100_walking.txt"
    raw = _columns(path, None)
    tr = load_trace(path)
    assert tr.fmt == "lumos" and tr.name == "5g_trace_100_walking"
    np.testing.assert_allclose(tr.rates_bps, [float(r[1]) * MB for r in raw])
    assert tr.interval_s == 1.0 and tr.duration_s == float(len(raw))
    assert set(tr.labels) == {"5G"}
    path = trace_dir / "lumos5g/4g/4g_trace_driving_50015_dr.txt"
    lte = load_trace(path)
    np.testing.assert_allclose(lte.rates_bps, [float(r[1]) * MB for r in _columns(path, None)])
    assert set(lte.labels) == {"LTE"}


def test_bytes_csv_known_lines(trace_dir: Path) -> None:
    path = trace_dir / "wifi/7_2_wifi.csv"
    tr = load_trace(path)
    assert tr.fmt == "bytes_csv"
    np.testing.assert_allclose(tr.rates_bps, [float(r[1]) * 8.0 for r in _columns(path, ",")])
    assert tr.times_s[0] == 0.0 and tr.interval_s == 1.0
    assert set(tr.labels) == {"WiFi"}
    assert set(load_trace(trace_dir / "wifi/7_2_cellular.csv").labels) == {"cellular"}


def test_gnettrack_known_rows_and_timestamps(trace_dir: Path) -> None:
    from datetime import datetime

    path = trace_dir / "ucc5g/driving_B_2019.12.14_10.16.30.csv"
    head, *rows = _columns(path, ",")
    col = {name: i for i, name in enumerate(head)}
    tr = load_trace(path)
    assert tr.fmt == "gnettrack"
    assert len(tr) == len(rows)  # every data row is kept
    np.testing.assert_allclose(tr.rates_bps[:50],
                               [float(r[col["DL_bitrate"]]) * 1e3 for r in rows[:50]])
    assert tr.labels[:50] == tuple(r[col["NetworkMode"]] for r in rows[:50])
    assert {"5G", "LTE", "HSPA+"} <= set(tr.labels)
    # Rows sharing a second are spread out (times strictly increase); time is the ground
    # truth: the trace spans the first to the last timestamp plus one spacing.
    stamps = [datetime.strptime(r[col["Timestamp"]], "%Y.%m.%d_%H.%M.%S") for r in rows]
    seconds = [(t - stamps[0]).total_seconds() for t in stamps]
    assert tr.times_s[0] == 0.0 and np.all(np.diff(tr.times_s) > 0)
    assert tr.duration_s == pytest.approx(seconds[-1] + 1.0)
    up = load_gnettrack(path, column="UL_bitrate")
    assert up.rates_bps[0] == pytest.approx(float(rows[0][col["UL_bitrate"]]) * 1e3)


def test_mahimahi_conserves_every_packet(trace_dir: Path) -> None:
    path = trace_dir / "mahimahi/Verizon-LTE-short.down"
    lines = path.read_text().split()
    tr = load_trace(path)
    assert tr.fmt == "mahimahi"
    period_ms = int(lines[-1])  # the last opportunity ends the period
    assert tr.duration_s == pytest.approx(period_ms / 1e3)
    assert tr.interval_s == pytest.approx(0.1)
    assert tr.total_bits / 8 == pytest.approx(len(lines) * 1500)
    # First 100 ms bin: count the opportunities with timestamp < 100 ms.
    first_bin = sum(1 for x in lines if int(x) < 100 or int(x) == period_ms)
    assert tr.rates_bps[0] == pytest.approx(first_bin * 1500 * 8 / 0.1)
    coarse = load_trace(path, mahimahi_bin_s=1.0)
    assert len(coarse) == round(period_ms / 1e3) and coarse.total_bits == pytest.approx(tr.total_bits)


def test_every_real_file_loads_and_readme_medians(trace_dir: Path) -> None:
    files = find_trace_files([trace_dir])
    assert len(files) > 250 and not any(f.name.upper().startswith("README") for f in files)
    for f in files:
        tr = load_trace(f)
        assert tr.duration_s > 0 and np.all(tr.rates_bps >= 0)

    def pooled_median(name: str) -> float:
        return float(
            np.median(np.concatenate([t.resampled(1.0).rates_bps for t in load_set(name)]))
        )

    # README: 5G walking ~500 Mbit/s, 5G driving ~124, Lumos 4G ~30 (1-s windows).
    assert pooled_median("5g-walking") / MB == pytest.approx(500, rel=0.1)
    assert pooled_median("5g-driving") / MB == pytest.approx(124, rel=0.1)
    assert pooled_median("lte") / MB == pytest.approx(30, rel=0.1)
    # UCC 5G-mode ~20 Mbit/s with p90 ~190.
    five = np.concatenate(
        [t.select("5G").resampled(1.0).rates_bps for t in load_set("ucc5g") if "5G" in t.labels]
    )
    assert np.median(five) / MB == pytest.approx(20, rel=0.15)
    assert np.percentile(five, 90) / MB == pytest.approx(190, rel=0.1)
    # Wi-Fi has outages (zero seconds) that are kept as data.
    assert any(t.stats()["outage_fraction"] > 0 for t in load_set("wifi"))


def test_detection(tmp_path: Path, trace_dir: Path) -> None:
    # the head of one real file per format, read from ../shared (never copied here)
    sources = {"a.down": "mahimahi/ATT-LTE-driving.down",
               "b.txt": "lumos5g/5g/5g_trace_100_walking.txt",
               "c.csv": "wifi/7_2_wifi.csv",
               "d.csv": "ucc5g/driving_B_2019.12.14_10.16.30.csv"}
    expected = {"a.down": "mahimahi", "b.txt": "lumos", "c.csv": "bytes_csv", "d.csv": "gnettrack"}
    for name, src in sources.items():
        head = (trace_dir / src).read_bytes().splitlines(keepends=True)[:40]
        (tmp_path / name).write_bytes(b"".join(head))
        assert detect_format(tmp_path / name) == expected[name]
        load_trace(tmp_path / name)


@pytest.mark.parametrize(
    "content, match",
    [
        (b"", "empty"),
        (b"\n\n  \n", "empty"),
        (b"\x89PNG\r\n\x1a\n\x00\x00", "binary"),
        (b"\xff\xfe\xfa bad", "not UTF-8"),
        (b"# Real network throughput traces\n", "unrecognised first line"),
        (b"time,rate\n1,2\n", "no DL_bitrate"),
        (b"1.0\t10.0\n2.0\tabc\n", r":2: expected 'seconds<TAB>Mbps'"),
        (b"1.0\t10.0\n2.0\t-5\n", "negative"),
        (b"1,100\n2,200\n3\n", r":3: expected 'seconds,bytes_per_second'"),
        (b"0\n5\n3\n", "must not decrease"),
        (b"0\n0\n", "period"),
        (b"5\nx\n", r":2: expected one integer ms timestamp"),
        (b"3.0\t1.0\n2.0\t1.0\n", "backwards"),
        (b"Timestamp,DL_bitrate\n2020-01-01,5\n", "not YYYY.MM.DD_HH.MM.SS"),
        (b"Timestamp,DL_bitrate\n2020.01.01_00.00.00,fast\n", "not a number"),
        (b"Timestamp,DL_bitrate\n", "no data rows"),
    ],
)
def test_bad_files_give_clear_errors(tmp_path: Path, content: bytes, match: str) -> None:
    path = tmp_path / "bad.trace"
    path.write_bytes(content)
    with pytest.raises(TraceFormatError, match=match) as info:
        load_trace(path)
    assert str(path) in str(info.value)  # the message names the file


def test_missing_and_directory(tmp_path: Path) -> None:
    with pytest.raises(TraceFormatError, match="does not exist"):
        load_trace(tmp_path / "nope.txt")
    with pytest.raises(TraceFormatError, match="is a directory"):
        load_trace(tmp_path)


def test_outages_are_data_not_errors(tmp_path: Path) -> None:
    path = tmp_path / "outage.csv"
    path.write_text("1,1000\n2,0\n3,0\n4,1000\n")
    tr = load_trace(path)
    np.testing.assert_allclose(tr.rates_bps, [8000, 0, 0, 8000])
    assert tr.stats()["outage_fraction"] == 0.5
    all_zero = tmp_path / "dead.txt"
    all_zero.write_text("1\t0\n2\t0\n")
    assert load_trace(all_zero).total_bits == 0.0
    mm = tmp_path / "gap.up"
    mm.write_text("0\n1000\n")  # one packet at 0 ms, a 1-s period: 0.1-s bins 1..9 empty
    tr = load_mahimahi(mm)
    assert tr.rates_bps[0] == pytest.approx(2 * 1500 * 8 / 0.1) and tr.rates_bps[1:].sum() == 0


def test_mahimahi_export_round_trip_of_a_scaled_and_a_mixed_trace(trace_dir: Path,
                                                                  tmp_path: Path) -> None:
    from sakura.traces import load_set, mixed_trace
    from sakura.traces.formats import to_mahimahi, write_mahimahi

    nr = load_trace(trace_dir / "lumos5g/5g/5g_trace_100_walking.txt").scaled(0.05)
    mixed = mixed_trace(load_set("lte"), load_set("5g"), seed=3).scaled(0.1)
    for trace, start, dur in ((nr, 12.5, 40.0), (mixed, 0.0, None)):
        path = write_mahimahi(tmp_path / "t.down", trace, start, dur)
        back = load_trace(path)
        assert back.fmt == "mahimahi"
        period = trace.duration_s if dur is None else dur
        assert back.duration_s == pytest.approx(period)  # mm-link loops at the period
        want = trace.bits_between(start, start + period) / 8
        # floor of the integral (and at most one packet added at the period's end)
        assert abs(back.bits_between(0, period) / 8 - want) <= 1500
        # dynamics kept in 1-s windows: opportunities sit on whole ms (up to 1 ms late; the
        # last ms's wrap to time 0, as mm-link loops), so a window may differ by 2 ms of rate
        slack = float(np.max(trace.rates_bps)) * 0.002 / 8 + 2 * 1500
        for a in range(0, int(period) - 5, 5):
            got = back.bits_between(a, a + 1.0) / 8
            assert abs(got - trace.bits_between(start + a, start + a + 1) / 8) <= slack
    # an outage: no opportunity inside it; the period's last ms always has one
    gap = Trace.from_edges([0.0, 1.0, 2.0], [12e6, 0.0])
    stamps = [int(x) for x in to_mahimahi(gap).split()]
    assert stamps[-1] == 2000 and not any(1000 < t < 2000 for t in stamps)
    assert len(stamps) == 1000 + 1  # 12 Mbit/s x 1 s = 1000 packets, + the period marker
