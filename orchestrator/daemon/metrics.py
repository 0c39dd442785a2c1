"""Prometheus metrics of the daemon, served over HTTP with `serve --metrics-bind HOST:PORT`.

Rules: two kinds. Events (a sync closed, a bucket applied, an engine finalized) update
prometheus-client counters and histograms from the loop thread as they happen. State
(engines by state, versions, skew, heartbeat age, spool size, queue depths) is read at
scrape time from the last status snapshot the loop published (`publish`): the HTTP
thread only ever reads a dict the loop no longer touches, so scrapes never race the
loop and their values are the status object's. Names follow Prometheus conventions
(`weightsync_..._seconds`, `_bytes_total`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric

from messages.replies import JsonObject
from messages.schema import FRAMES

DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
ENGINE_STATES = ("STALE", "JOINING", "LOADING", "FINALIZING", "READY", "LOST")


class _Snapshot:
    """Gauges computed from the published status snapshot, at scrape time."""

    def __init__(self, metrics: Metrics) -> None:
        self.m = metrics

    def collect(self) -> Iterator[Metric]:
        st, mono = self.m.snapshot, self.m.snapshot_mono
        served = st.get("version")
        g = GaugeMetricFamily("weightsync_served_version", "Version the daemon serves (-1: none, dirty)")
        g.add_metric([], -1 if served is None else served)
        yield g
        g = GaugeMetricFamily("weightsync_state", "1 for the daemon's current state", labels=["state"])
        for s in ("IDLE", "LOADING_BUCKETS", "FINALIZING", "READY"):
            g.add_metric([s], 1 if st.get("state") == s else 0)
        yield g
        g = GaugeMetricFamily("weightsync_dirty", "1 when engines may hold mixed weights")
        g.add_metric([], 1 if st.get("dirty") else 0)
        yield g
        engines = st.get("engines", [])
        g = GaugeMetricFamily("weightsync_engines", "Registered engines by state", labels=["state"])
        for s in ENGINE_STATES:
            g.add_metric([s], sum(1 for e in engines if e["state"] == s))
        yield g
        ver = GaugeMetricFamily(
            "weightsync_engine_version", "Version an engine holds (-1: none)", labels=["engine_id"]
        )
        skew = GaugeMetricFamily(
            "weightsync_engine_version_skew",
            "Served version minus the engine's (versions behind)",
            labels=["engine_id"],
        )
        fin = GaugeMetricFamily(
            "weightsync_engine_finalize_count", "Post-load steps the engine process ran", labels=["engine_id"]
        )
        age = GaugeMetricFamily(
            "weightsync_engine_heartbeat_age_seconds",
            "Seconds since the engine was last heard from",
            labels=["engine_id"],
        )
        ranks = GaugeMetricFamily(
            "weightsync_engine_rank_bytes_received",
            "Bytes each rank of an engine that takes slices was handed in its last sync",
            labels=["engine_id", "rank"],
        )
        for e in engines:
            eid = e["engine_id"]
            for r, n in enumerate((e.get("slices") or {}).get("received") or ()):
                ranks.add_metric([eid, str(r)], n)
            ver.add_metric([eid], -1 if e["version"] is None else e["version"])
            if served is not None:
                skew.add_metric([eid], served - (e["version"] if e["version"] is not None else 0))
            fin.add_metric([eid], e["finalize_count"])
            if e.get("heartbeat_age_s") is not None:
                age.add_metric([eid], max(0.0, time.monotonic() - mono + e["heartbeat_age_s"]))
        yield from (ver, skew, fin, age, ranks)
        spool = st.get("spool") or {}
        g = GaugeMetricFamily("weightsync_spool_bytes", "Bytes of the version held in the spool")
        g.add_metric([], spool.get("bytes", 0))
        yield g
        sync = st.get("sync") or {}
        g = GaugeMetricFamily(
            "weightsync_sync_sources", "Sources (trainer processes) of the running sync (0: none running)"
        )
        g.add_metric([], sync.get("source_count", 1) if sync else 0)
        yield g
        sent = GaugeMetricFamily(
            "weightsync_source_bytes", "Bytes a source of the running sharded push sent", labels=["source"]
        )
        acked = GaugeMetricFamily(
            "weightsync_source_buckets_acked",
            "Buckets of a source of the running sharded push that every engine applied",
            labels=["source"],
        )
        phase = GaugeMetricFamily(
            "weightsync_source_state",
            "1 for where each source of the running sharded push stands",
            labels=["source", "state"],
        )
        for x in sync.get("sources", ()):
            k = str(x["source"])
            sent.add_metric([k], x["bytes"])
            acked.add_metric([k], x["acked"])
            now = (
                "lost"
                if not x["connected"]
                else "finished"
                if x["finished"]
                else "sending"
                if x["begun"]
                else "not_begun"
            )
            for name in ("not_begun", "sending", "finished", "lost"):
                phase.add_metric([k, name], 1 if name == now else 0)
        yield from (sent, acked, phase)
        g = GaugeMetricFamily("weightsync_queue_depth", "Items waiting, by queue", labels=["queue"])
        for k, v in sorted(st.get("queues", {}).items()):
            g.add_metric([k], v)
        yield g


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.sync_seconds = Histogram(
            "weightsync_sync_duration_seconds",
            "Begin to end of a sync",
            ["transport", "outcome", "kind"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.sync_bytes = Counter(
            "weightsync_sync_bytes_total", "Weight bytes of ended syncs", ["outcome"], registry=r
        )
        self.sync_buckets = Counter(
            "weightsync_sync_buckets_total", "Buckets of ended syncs", ["outcome"], registry=r
        )
        self.syncs = Counter("weightsync_syncs_total", "Ended syncs", ["outcome", "kind"], registry=r)
        self.failures = Counter(
            "weightsync_sync_failures_total", "Failed syncs by error code", ["code"], registry=r
        )
        self.rollbacks = Counter(
            "weightsync_rollbacks_total", "Rollbacks from the spool, by outcome", ["outcome"], registry=r
        )
        self.catchups = Counter(
            "weightsync_catchups_total", "Engines brought to the served version", ["outcome"], registry=r
        )
        # Engines report progress cumulatively (several buckets per report), so apply time
        # is a sum and a count: mean seconds per bucket = rate(seconds) / rate(buckets).
        self.apply_seconds = Counter(
            "weightsync_bucket_apply_seconds",
            "An engine's time verifying and applying buckets",
            ["engine_id"],
            registry=r,
        )
        self.buckets_applied = Counter(
            "weightsync_buckets_applied", "Buckets an engine applied", ["engine_id"], registry=r
        )
        self.finalize_seconds = Histogram(
            "weightsync_engine_finalize_seconds",
            "An engine's post-load step (and probes)",
            ["engine_id"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.received_bytes = Counter(
            "weightsync_received_bytes_total",
            "Bucket bytes that passed through the daemon (frames, spool copies)",
            registry=r,
        )
        self._applied: dict[str, tuple[Counter, Counter]] = {}  # engine id -> its two counters above
        self.snapshot: dict[str, Any] = {}
        self.snapshot_mono = time.monotonic()
        r.register(_Snapshot(self))
        self.server: WSGIServer | None = None

    def serve(self, bind: str) -> str:
        """Start the HTTP endpoint on `HOST:PORT` (port 0: any); returns the bound address."""
        host, _, port = bind.rpartition(":")
        self.server, _thread = start_http_server(int(port), addr=host or "127.0.0.1", registry=self.registry)
        return f"{host or '127.0.0.1'}:{self.server.server_port}"

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server = None

    def publish(self, status: JsonObject) -> None:
        """The loop hands over a fresh status dict (never mutated afterwards)."""
        self.snapshot, self.snapshot_mono = status, time.monotonic()

    def applied(self, engine_id: str) -> tuple[Counter, Counter]:
        """An engine's (apply seconds, buckets applied) counters, looked up once (a fleet's
        progress reports come thousands a second)."""
        c = self._applied.get(engine_id)
        if c is None:
            c = self._applied[engine_id] = (
                self.apply_seconds.labels(engine_id),
                self.buckets_applied.labels(engine_id),
            )
        return c

    def forget_engine(self, engine_id: str) -> None:
        """An expired engine's own series go with it."""
        if self._applied.pop(engine_id, None) is not None:
            self.apply_seconds.remove(engine_id)
            self.buckets_applied.remove(engine_id)

    def sync_ended(self, summary: dict[str, Any] | None) -> None:
        if not summary:
            return
        outcome = {"READY": "ready", "ROLLED_BACK": "ready", "ABORTED": "aborted"}.get(
            summary["status"], "failed"
        )
        kind = summary.get("kind", "sync")
        self.sync_seconds.labels(summary.get("transport", FRAMES), outcome, kind).observe(summary["seconds"])
        self.sync_bytes.labels(outcome).inc(summary.get("bytes", 0))
        self.sync_buckets.labels(outcome).inc(summary.get("buckets", 0))
        self.syncs.labels(outcome, kind).inc()
        if summary.get("code"):
            self.failures.labels(summary["code"]).inc()
        if kind == "rollback":
            self.rollbacks.labels(outcome).inc()
