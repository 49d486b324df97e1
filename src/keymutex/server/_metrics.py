"""The server's Prometheus metrics, in a registry of its own (one per app).

Names follow Prometheus conventions (``_total`` for counters, ``_seconds`` for
durations). Labels are bounded: ``namespace`` (the first ``NAMESPACE_SERIES``
namespaces used through this server each have their own series; any later one is
counted under ``"*"``, so a client that makes up namespaces cannot grow the server's
memory and its scrapes without end), ``route`` (the route's path template, never the
raw path) and ``status``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["CONTENT_TYPE_LATEST", "NAMESPACE_SERIES", "Metrics", "MetricsMiddleware"]

NAMESPACE_SERIES = 256  # namespaces with series of their own; the rest share "*"
OTHER_NAMESPACES = "*"  # as in token files, where "*" means every namespace

# Waits last from milliseconds up to the server's max_wait (30 s by default).
WAIT_BUCKETS = (0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    """Every metric the server exports, registered in ``registry``."""

    def __init__(self) -> None:
        self._namespaces: set[str] = set()
        registry = self.registry = CollectorRegistry(auto_describe=True)
        self.acquires = Counter(
            "keymutex_acquires",
            "Leases granted (steals included).",
            ["namespace"],
            registry=registry,
        )
        self.refusals = Counter(
            "keymutex_refusals",
            "Acquires answered 409 locked (not acquired within their timeout).",
            ["namespace"],
            registry=registry,
        )
        self.waits = Counter(
            "keymutex_waits",
            "Requests that waited at this server: acquires with a timeout, and waits.",
            ["namespace", "kind"],
            registry=registry,
        )
        self.wait_seconds = Histogram(
            "keymutex_wait_seconds",
            "How long requests waited at this server.",
            ["namespace", "kind"],
            buckets=WAIT_BUCKETS,
            registry=registry,
        )
        self.renewals = Counter(
            "keymutex_renewals", "Leases renewed.", ["namespace"], registry=registry
        )
        self.lost = Counter(
            "keymutex_lost_leases",
            "Renewals and releases answered lock_lost: the token no longer held its key.",
            ["namespace"],
            registry=registry,
        )
        self.releases = Counter(
            "keymutex_releases",
            "Leases released by their holder.",
            ["namespace"],
            registry=registry,
        )
        self.force_releases = Counter(
            "keymutex_force_releases",
            "Keys force-released by an admin.",
            ["namespace"],
            registry=registry,
        )
        self.held = Gauge(
            "keymutex_held_locks",
            "Leases currently held, per namespace open at this server (as of the scrape).",
            ["namespace"],
            registry=registry,
        )
        self.namespaces_open = Gauge(
            "keymutex_namespaces_open",
            "Namespaces whose store client is open at this server (at most max_namespaces"
            " between requests).",
            registry=registry,
        )
        self.namespace_opens = Counter(
            "keymutex_namespace_opens",
            "Namespace store clients opened (a store connection each): a count that grows"
            " in step with requests says more namespaces are in use than max_namespaces.",
            registry=registry,
        )
        self.namespace_closes = Counter(
            "keymutex_namespace_closes",
            "Namespace store clients closed to keep at most max_namespaces open.",
            registry=registry,
        )
        self.waiting = Gauge(
            "keymutex_waiting_requests",
            "Requests waiting at this server right now.",
            registry=registry,
        )
        self.request_seconds = Histogram(
            "keymutex_http_request_duration_seconds",
            "Time to the first byte of each HTTP answer, by route template and status.",
            ["method", "route", "status"],
            registry=registry,
        )

    def namespace(self, namespace: str) -> str:
        """The ``namespace`` label of ``namespace``: itself, or ``"*"`` once
        ``NAMESPACE_SERIES`` others have series of their own."""
        known = self._namespaces
        if namespace in known:
            return namespace
        if len(known) < NAMESPACE_SERIES:
            known.add(namespace)
            return namespace
        return OTHER_NAMESPACES

    def set_held(self, counts: Mapping[str, int]) -> None:
        by_label: dict[str, int] = {}
        for namespace, count in counts.items():
            label = self.namespace(namespace)
            by_label[label] = by_label.get(label, 0) + count
        self.held.clear()
        for label, count in by_label.items():
            self.held.labels(label).set(count)

    def render(self) -> bytes:
        return generate_latest(self.registry)


# The methods the API and pages answer; any other is counted as "other", so that a
# client making up methods cannot add series without end (h11 passes any token on).
METHODS = frozenset({"GET", "HEAD", "POST", "OPTIONS"})


class MetricsMiddleware:
    """Times every HTTP request to its response's start (streams count until headers)."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()

        async def timed_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                route = scope.get("route")
                template = getattr(route, "path", None) or "unmatched"
                method = scope["method"] if scope["method"] in METHODS else "other"
                self.metrics.request_seconds.labels(
                    method, template, str(message["status"])
                ).observe(time.perf_counter() - started)
            await send(message)

        await self.app(scope, receive, timed_send)
