"""The files of ``./scripts/test``'s serial part (``tests/conftest.py`` says why), in one place:
conftest marks their tests ``serial``, and ``python -m tests.parts`` prints them for the
serial run, which then imports only these files (collecting all 1335 tests took 23.5 s of
the serial part, these 395 12.7 s; 2026-12-07, this 2-core host)."""

#: Files that run alone: emulated links, replays, Ray clusters.
SERIAL = (
    "tests/traces/",
    "tests/cloud/test_build_ray.py", "tests/cloud/test_render_ray.py",
    "tests/cloud/test_render_ray_cluster.py", "tests/cloud/test_render_slo.py",
    "tests/cloud/test_faults.py",
    "tests/edge/test_allocator.py", "tests/edge/test_bench_cli.py", "tests/edge/test_client.py",
    "tests/edge/test_deadlines.py", "tests/edge/test_edit.py",
    "tests/edge/test_failure_parity.py", "tests/edge/test_http2.py",
    "tests/edge/test_lookahead.py", "tests/edge/test_native_runtime.py",
    "tests/edge/test_received_quality.py", "tests/edge/test_replay.py",
    "tests/edge/test_tail_bench.py", "tests/edge/test_timeline.py",
    "tests/sakura/test_serve_ride.py",
)

if __name__ == "__main__":
    print(" ".join(SERIAL))
