"""Issue 24's promises, one test per case of `sakura bench faults` (sakura/faults_bench.py):
a damaged pack is never vouched for and a repair is served without a restart, bounded
metric labels, an edit's fetch rides out a `sakura serve` restart, clear errors for a
truncated pack, killed builds leave nothing behind, /healthz sees a broken catalog, HEAD
everywhere, slow headers time out, byte-identical builds."""

from __future__ import annotations

import logging

import pytest

from sakura.faults_bench import CASES, CaseFailed, Tally, run


@pytest.mark.parametrize("name", list(CASES))
def test_fault_case(name, tmp_path, caplog):
    caplog.set_level(logging.CRITICAL, logger="sakura.cloud.server")  # injected faults
    tally = Tally()
    try:
        detail = CASES[name](tmp_path, tally)
    except CaseFailed as exc:
        pytest.fail(f"{name}: {exc}")
    assert detail
    assert tally.wrong_bytes_accepted == 0 and tally.crashes == 0


def test_the_bench_reports_every_case(monkeypatch):
    calls = []

    def fake(name):
        def case(work, tally):
            calls.append(name)
            if name == "head_routes":
                raise CaseFailed("HEAD /x: 405")
            return "fine"
        return case

    for name in list(CASES):
        monkeypatch.setitem(CASES, name, fake(name))
    result = run()
    assert calls == list(CASES) and set(result["cases"]) == set(CASES)
    assert result["cases"]["head_routes"] == {"ok": False, "detail": "HEAD /x: 405",
                                              "seconds": result["cases"]["head_routes"]["seconds"]}
    assert not result["ok"] and result["wrong_bytes_accepted"] == 0 and result["crashes"] == 0
