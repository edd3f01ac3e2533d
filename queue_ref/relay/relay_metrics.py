"""Prometheus metrics of the relay, served on a loopback port (``metrics_listen``).

Each relay has a registry of its own (several relays in one test process never share
counters).  Group-commit figures come from the backend when it keeps them: the
filesystem queue counts its sync rounds and the callers they served.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from queue_ref.storage import Storage

__all__ = ["RelayMetrics", "group_commit_counts"]

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 3600, 86400)
_ROUND_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_COMMIT = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


def group_commit_counts(store: Storage) -> tuple[int, int, dict[int, int]] | None:
    """(sync rounds run, callers served, rounds by the callers each served) of a backend
    that counts them, read in one snapshot, else None."""
    counts = getattr(getattr(store, "_group", None), "counts", None)
    if not callable(counts):
        return None
    got = counts()
    if (isinstance(got, tuple) and len(got) == 3 and isinstance(got[0], int)
            and isinstance(got[1], int) and isinstance(got[2], Mapping)):
        return got[0], got[1], dict(got[2])
    return None


class _GroupCommitCollector(Collector):
    def __init__(self, store: Storage) -> None:
        self.store = store

    def collect(self) -> Iterator[Metric]:
        counts = group_commit_counts(self.store)
        if counts is None:
            return
        n_rounds, n_served, sizes = counts
        rounds = CounterMetricFamily(
            "queue_ref_group_commit_rounds", "Sync rounds the backend ran (group commit)")
        rounds.add_metric([], n_rounds)
        served = CounterMetricFamily(
            "queue_ref_group_commit_requests",
            "Callers the sync rounds served (a commit whose link follows its data round "
            "is served by two rounds and counted once)")
        served.add_metric([], n_served)
        yield rounds
        yield served
        snapshot = sorted(sizes.items())
        buckets = []
        for bound in _ROUND_SIZES:
            buckets.append((str(bound), sum(n for k, n in snapshot if k <= bound)))
        buckets.append(("+Inf", sum(n for _, n in snapshot)))
        hist = HistogramMetricFamily(
            "queue_ref_group_commit_round_size", "Callers each sync round served")
        hist.add_metric([], buckets, sum_value=sum(k * n for k, n in snapshot))
        yield hist


class _QueueSizeCollector(Collector):
    def __init__(self, sizes: Callable[[], dict[str, int]]) -> None:
        self._sizes = sizes

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily("queue_ref_relay_queue_entries",
                                   "Entries the relay holds, by state", labels=["state"])
        for state, n in self._sizes().items():
            family.add_metric([state], n)
        yield family


class RelayMetrics:
    def __init__(self, store: Storage, queue_sizes: Callable[[], dict[str, int]],
                 body_bytes: Callable[[], int] = lambda: 0) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.deliveries = Counter("queue_ref_relay_deliveries", "Delivery attempts per recipient",
                                  ["outcome"], registry=r)
        self.delivery_seconds = Histogram(
            "queue_ref_relay_delivery_seconds",
            "From arrival to the end of a successful delivery", buckets=_LATENCY, registry=r)
        self.commit_seconds = Histogram(
            "queue_ref_relay_commit_seconds", "Time a received message's commit took",
            buckets=_COMMIT, registry=r)
        self.received = Counter("queue_ref_relay_received_messages", "Messages queued (250 sent)",
                                registry=r)
        self.etrn = Counter("queue_ref_relay_etrn_requests",
                            "ETRN commands that reached the queue, by outcome (started: mail "
                            "was waiting; empty: none was; failed: the queue failed)",
                            ["outcome"], registry=r)
        self.job_errors = Counter(
            "queue_ref_relay_job_errors",
            "Unexpected errors in a delivery job, by step (claim, route, deliver, bounce, "
            "finish, return); the entries concerned went back to the queue with a retry",
            ["step"], registry=r)
        self.in_flow_waits = Counter(
            "queue_ref_relay_in_flow_waits",
            "DATA commands that waited before their 354 because delivery to the destination "
            "of a recipient of theirs was behind (in_flow_delay)", registry=r)
        self.body_bytes = Gauge(
            "queue_ref_relay_body_bytes",
            "Bytes of message bodies the delivery jobs hold in memory (a job waiting for a "
            "delivery slot holds none over 256 KiB unless another of its domains is on the "
            "wire)", registry=r)
        self.body_bytes.set_function(body_bytes)
        r.register(_QueueSizeCollector(queue_sizes))
        self._group_commit = _GroupCommitCollector(store)
        r.register(self._group_commit)
        self._server: Any = None
        self._thread: threading.Thread | None = None

    def follow(self, store: Storage) -> None:
        """Report the group commit of ``store`` from now on (the queue was reopened)."""
        self._group_commit.store = store

    def serve(self, host: str, port: int) -> int:
        """Serve on ``host:port`` (0: any free port); the port bound."""
        server, thread = start_http_server(port, addr=host, registry=self.registry)
        self._server, self._thread = server, thread
        bound: int = server.server_address[1]
        return bound

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
