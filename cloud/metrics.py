"""``/metrics`` on prometheus_client, and the ASGI middleware that feeds it.

prometheus_client (the Prometheus project's own Python client, as LMCache uses) writes the
exposition, so the format, escaping and histogram arithmetic are not ours to maintain.

Exposed, in Prometheus text format 0.0.4 (``generate_latest``; the content type is
``CONTENT_TYPE``). Labels use the route *template*, e.g.
``/v1/templates/{template_id}/{codec}/pack``, never the raw path, and unknown routes and
methods collapse to ``other``, so label cardinality stays bounded whatever clients send:

* ``sakura_http_requests_total{route,method,status}`` counter
* ``sakura_http_response_bytes_total{route}`` counter: body bytes actually sent
* ``sakura_http_request_duration_seconds{route}`` histogram (``_bucket``/``_sum``/``_count``):
  request start to last byte
* ``sakura_http_requests_in_flight`` gauge
* ``sakura_http_client_disconnects_total`` counter: responses cut short by the client

Each counter and the histogram also carry prometheus_client's ``*_created`` series (when the
series was first seen, one per label set, so just as bounded). Values print as floats
(``1.0``) and labels in name order (``method``, ``route``, ``status``), as the library writes
them. Every ``Metrics`` has its own ``CollectorRegistry`` (the library's global ``REGISTRY``
is never used), so several apps in one process, as the tests create, do not share counts.

One worker only: ``sakura serve`` runs one uvicorn worker, so one in-process registry is
the whole truth. With several workers, prometheus_client's multiprocess mode would be the
way (``PROMETHEUS_MULTIPROC_DIR`` set before start, ``multiprocess.MultiProcessCollector``
over that directory for ``/metrics``, ``multiprocess_mode`` on the gauge); it is not enabled.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

DEFAULT_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)
# generate_latest writes the 0.0.4 text format for names like ours (the library's
# CONTENT_TYPE_LATEST says 1.0.0, which only differs for UTF-8 metric names)
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
# label values come from these sets or a route template only: a client cannot grow /metrics
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH"})
OTHER = "other"
ZEROCOPY = "http.response.zerocopy"  # ASGI zero-copy send (cloud/zerocopy.py)

IN_FLIGHT = "sakura_http_requests_in_flight"
DISCONNECTS = "sakura_http_client_disconnects_total"


class Metrics:
    """The server's series in a registry of its own; prometheus_client makes each update
    thread-safe."""

    def __init__(self, buckets: tuple[float, ...] = DEFAULT_BUCKETS) -> None:
        self.buckets = tuple(buckets)
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "sakura_http_requests_total",
            "HTTP requests by route template, method and status.",
            ("route", "method", "status"),
            registry=self.registry,
        )
        self.bytes_sent = Counter(
            "sakura_http_response_bytes_total",
            "Response body bytes sent, by route template.",
            ("route",),
            registry=self.registry,
        )
        self.latency = Histogram(
            "sakura_http_request_duration_seconds",
            "Time from request start to the last body byte.",
            ("route",),
            buckets=self.buckets,
            registry=self.registry,
        )
        self._in_flight = Gauge(IN_FLIGHT, "Requests being served now.", registry=self.registry)
        self._disconnects = Counter(
            DISCONNECTS,
            "Responses cut short by a client disconnect.",
            registry=self.registry,
        )

    @property
    def in_flight(self) -> int:
        return int(self.registry.get_sample_value(IN_FLIGHT) or 0)

    @property
    def disconnects(self) -> int:
        return int(self.registry.get_sample_value(DISCONNECTS) or 0)

    def started(self) -> None:
        self._in_flight.inc()

    def observe(
        self,
        route: str,
        method: str,
        status: int,
        nbytes: int,
        seconds: float,
        disconnected: bool = False,
    ) -> None:
        """One finished request; ``route`` and ``method`` must already be bounded values."""
        self._in_flight.dec()
        self.requests.labels(route, method, str(status)).inc()
        self.bytes_sent.labels(route).inc(nbytes)
        self.latency.labels(route).observe(seconds)
        if disconnected:
            self._disconnects.inc()

    def render(self) -> bytes:
        """The text exposition of every series (serve it as ``CONTENT_TYPE``)."""
        return generate_latest(self.registry)


class MetricsMiddleware:
    """ASGI middleware: counts each HTTP request, its status, body bytes and latency."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        state = {"status": 500, "bytes": 0, "done": False}

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                state["status"] = message["status"]
            elif message["type"] == "http.response.body":
                body = message.get("body", b"")
                await send(message)
                state["bytes"] += len(body)
                if not message.get("more_body", False):
                    state["done"] = True
                return
            elif message["type"] == ZEROCOPY:  # cloud.zerocopy: raises if the client left
                await send(message)
                state["bytes"] += int(message.get("count", 0))
                if not message.get("more_body", False):
                    state["done"] = True
                return
            await send(message)

        self.metrics.started()
        failed = False
        try:
            await self.app(scope, receive, counting_send)
        except BaseException:
            failed = True
            raise
        finally:
            route = scope.get("route")
            path = getattr(route, "path", None) or OTHER
            method = scope.get("method", "GET")
            self.metrics.observe(
                path,
                method if method in METHODS else OTHER,
                int(state["status"]),
                int(state["bytes"]),
                time.perf_counter() - start,
                disconnected=not state["done"] and not failed,
            )
