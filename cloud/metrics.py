"""A tiny Prometheus text exposition (format 0.0.4) and the ASGI middleware that feeds it.

Series (labels use the route *template*, e.g. ``/v1/templates/{template_id}/{codec}/pack``,
never the raw path, and unknown routes and methods collapse to ``other``, so label
cardinality stays bounded whatever clients send):

* ``sakura_http_requests_total{route,method,status}`` counter
* ``sakura_http_response_bytes_total{route}`` counter: body bytes actually sent
* ``sakura_http_request_duration_seconds{route}`` histogram: request start to last byte
* ``sakura_http_requests_in_flight`` gauge
* ``sakura_http_client_disconnects_total`` counter: responses cut short by the client
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

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
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# label values come from these sets or a route template only: a client cannot grow /metrics
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH"})
OTHER = "other"
ZEROCOPY = "http.response.zerocopy"  # ASGI zero-copy send (cloud/zerocopy.py)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(**labels: str) -> str:
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items()) + "}"


def _fmt(value: float) -> str:
    if value == float("inf"):
        return "+Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


@dataclass
class Metrics:
    """Counters and a latency histogram, safe to update from any thread."""

    buckets: tuple[float, ...] = DEFAULT_BUCKETS
    requests: dict[tuple[str, str, str], int] = field(default_factory=lambda: defaultdict(int))
    bytes_sent: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    latency_counts: dict[str, list[int]] = field(default_factory=dict)
    latency_sum: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    in_flight: int = 0
    disconnects: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def started(self) -> None:
        with self._lock:
            self.in_flight += 1

    def observe(
        self,
        route: str,
        method: str,
        status: int,
        nbytes: int,
        seconds: float,
        disconnected: bool = False,
    ) -> None:
        with self._lock:
            self.in_flight -= 1
            self.requests[(route, method, str(status))] += 1
            self.bytes_sent[route] += nbytes
            counts = self.latency_counts.setdefault(route, [0] * (len(self.buckets) + 1))
            for i, bound in enumerate(self.buckets):
                if seconds <= bound:
                    counts[i] += 1
                    break
            else:
                counts[-1] += 1
            self.latency_sum[route] += seconds
            if disconnected:
                self.disconnects += 1

    def render(self) -> str:
        """The Prometheus text exposition of every series."""
        with self._lock:
            lines = [
                "# HELP sakura_http_requests_total HTTP requests by route template, method and status.",
                "# TYPE sakura_http_requests_total counter",
            ]
            for (route, method, status), n in sorted(self.requests.items()):
                lines.append(
                    f"sakura_http_requests_total{_labels(route=route, method=method, status=status)} {n}"
                )
            lines += [
                "# HELP sakura_http_response_bytes_total Response body bytes sent, by route template.",
                "# TYPE sakura_http_response_bytes_total counter",
            ]
            for route, n in sorted(self.bytes_sent.items()):
                lines.append(f"sakura_http_response_bytes_total{_labels(route=route)} {n}")
            lines += [
                "# HELP sakura_http_request_duration_seconds Time from request start to the last body byte.",
                "# TYPE sakura_http_request_duration_seconds histogram",
            ]
            for route, counts in sorted(self.latency_counts.items()):
                cumulative = 0
                for bound, n in zip((*self.buckets, float("inf")), counts):
                    cumulative += n
                    le = _labels(route=route, le=_fmt(bound))
                    lines.append(f"sakura_http_request_duration_seconds_bucket{le} {cumulative}")
                lines.append(
                    f"sakura_http_request_duration_seconds_sum{_labels(route=route)} {self.latency_sum[route]!r}"
                )
                lines.append(
                    f"sakura_http_request_duration_seconds_count{_labels(route=route)} {cumulative}"
                )
            lines += [
                "# HELP sakura_http_requests_in_flight Requests being served now.",
                "# TYPE sakura_http_requests_in_flight gauge",
                f"sakura_http_requests_in_flight {self.in_flight}",
                "# HELP sakura_http_client_disconnects_total Responses cut short by a client disconnect.",
                "# TYPE sakura_http_client_disconnects_total counter",
                f"sakura_http_client_disconnects_total {self.disconnects}",
            ]
        return "\n".join(lines) + "\n"


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
