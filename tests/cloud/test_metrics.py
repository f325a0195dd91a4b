"""cloud/metrics.py: each Metrics owns its registry; the series names stay as documented."""

from __future__ import annotations

from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families
from sakura.cloud.metrics import Metrics


def test_two_metrics_in_one_process_count_apart_and_skip_the_global_registry():
    a, b = Metrics(), Metrics()
    a.started()
    a.observe("/healthz", "GET", 200, 15, 0.002, disconnected=True)
    assert (a.in_flight, a.disconnects, b.in_flight, b.disconnects) == (0, 1, 0, 0)
    assert REGISTRY.get_sample_value("sakura_http_requests_in_flight") is None
    names = {s.name for f in text_string_to_metric_families(a.render().decode()) for s in f.samples}
    assert {"sakura_http_requests_total", "sakura_http_response_bytes_total",
            "sakura_http_request_duration_seconds_bucket", "sakura_http_request_duration_seconds_sum",
            "sakura_http_request_duration_seconds_count", "sakura_http_requests_in_flight",
            "sakura_http_client_disconnects_total"} <= names
    assert a.registry.get_sample_value(
        "sakura_http_requests_total", {"route": "/healthz", "method": "GET", "status": "200"}) == 1
    assert b.registry.get_sample_value(
        "sakura_http_requests_total", {"route": "/healthz", "method": "GET", "status": "200"}) is None
