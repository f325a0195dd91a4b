"""Issue 24's promises, one test per case of `sakura bench faults` (sakura/faults_bench.py):
a damaged pack is never vouched for and a repair is served without a restart, bounded
metric labels, an edit's fetch rides out a `sakura serve` restart, clear errors for a
truncated pack, killed builds leave nothing behind, /healthz sees a broken catalog, HEAD
everywhere, slow headers time out, byte-identical builds; and issue 29's (the two native
cases on the shipped model are marked slow)."""

from __future__ import annotations

import logging

import pytest

from sakura.faults_bench import CASES, run
from sakura.faults_harness import CaseFailed, Tally
from sakura.faults_native import REAL_MODEL_CASES, shared_work


@pytest.fixture(scope="module")
def real_world_folder(tmp_path_factory):
    """One real build of the shipped template for the native cases (as one bench run)."""
    with shared_work(tmp_path_factory.mktemp("faults-shared")) as folder:
        yield folder


# the native cases build the shipped template with the shipped model (~0.5-2 min on 2
# cores) and run the native runtime: slow, outside the default suite (run with -m slow)
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow)
                                  if n in REAL_MODEL_CASES else n for n in CASES])
def test_fault_case(name, tmp_path, caplog, request):
    caplog.set_level(logging.CRITICAL, logger="sakura.cloud.server")  # injected faults
    if name in REAL_MODEL_CASES:
        request.getfixturevalue("real_world_folder")
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
