"""Prometheus metrics over real HTTP, during and after a real push: parsed with
prometheus-client's own parser, their values are the status object's."""

from __future__ import annotations

import threading
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from examples.tiny import perturbed
from messages.buckets import digest

from .helpers import FAST_DAEMON, running_daemon

pytestmark = pytest.mark.slow


def scrape(addr: str) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(m, name, **labels):
    return m.get((name, tuple(sorted(labels.items()))))


def until(pred, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.05)
    return pred()


def test_metrics_during_and_after_a_push_match_status(tmp_path, tiny_model_dir, tiny_state):
    args = [*FAST_DAEMON, "--metrics-bind", "127.0.0.1:0"]
    with running_daemon(tmp_path, tiny_model_dir, daemon_args=args) as c:
        addr = c.status()["daemon"]["metrics_addr"]
        assert addr and addr.startswith("127.0.0.1:")
        # the gauges come from the snapshot the loop publishes every tick
        m = until(lambda: (mm := scrape(addr)) and value(mm, "weightsync_engines", state="STALE") == 2 and mm)
        assert value(m, "weightsync_engines", state="STALE") == 2  # registered, nothing served yet
        assert value(m, "weightsync_served_version") == -1

        release = threading.Event()
        items = list(perturbed(tiny_state, 1))

        def slow():
            for i, item in enumerate(items):
                if i == len(items) // 2:
                    release.wait(20)  # hold the sync in LOADING_BUCKETS while we look
                yield item

        result = {}
        with c.client(timeout=30.0) as trainer:
            t = threading.Thread(
                target=lambda: result.update(
                    r=trainer.push(slow(), 1, bucket_bytes=32 * 1024, transport="inline")
                )
            )
            t.start()
            try:

                def loading():
                    st = c.status()
                    mm = scrape(addr)
                    return (
                        st["state"] == "LOADING_BUCKETS"
                        and value(mm, "weightsync_state", state="LOADING_BUCKETS") == 1
                        and value(mm, "weightsync_engines", state="LOADING") == 2
                        and (st, mm)
                    )

                st, mm = until(loading)
                assert value(mm, "weightsync_received_bytes_total") > 0
                assert value(mm, "weightsync_queue_depth", queue="pending_buckets") is not None
            finally:
                release.set()
                t.join(60)
        r = result["r"]
        assert r.state == "READY" and r.digest == digest(items)

        def settled():
            st, mm = c.status(), scrape(addr)
            return value(mm, "weightsync_served_version") == st["version"] == 1 and (st, mm)

        st, mm = until(settled)
        for e in st["engines"]:
            eid = e["engine_id"]
            assert value(mm, "weightsync_engine_finalize_count", engine_id=eid) == e["finalize_count"] == 1
            assert value(mm, "weightsync_engine_version", engine_id=eid) == e["version"] == 1
            assert value(mm, "weightsync_engine_version_skew", engine_id=eid) == 0
            assert value(mm, "weightsync_buckets_applied_total", engine_id=eid) == r.buckets
            assert value(mm, "weightsync_bucket_apply_seconds_total", engine_id=eid) > 0
            assert value(mm, "weightsync_engine_heartbeat_age_seconds", engine_id=eid) < 5
        assert value(mm, "weightsync_engines", state="READY") == 2
        assert value(mm, "weightsync_syncs_total", outcome="ready", kind="sync") == 1
        assert (
            value(mm, "weightsync_sync_bytes_total", outcome="ready") == st["last_sync"]["bytes"] == r.bytes
        )
        assert (
            value(
                mm,
                "weightsync_sync_duration_seconds_count",
                transport=r.detail["transport"],
                outcome="ready",
                kind="sync",
            )
            == 1
        )

        with c.client(timeout=30.0) as trainer:  # a failure is counted by its code
            with pytest.raises(Exception):
                trainer.push(perturbed(tiny_state, 1), 1)
        mm = scrape(addr)
        assert (
            value(mm, "weightsync_sync_failures_total", code="STALE_VERSION") is None
        )  # refused at begin: no sync
        sid = None
        with c.client(timeout=30.0) as trainer:
            sid = trainer.begin(2).sync_id
            trainer.abort(sid, "test")
        mm = until(
            lambda: (
                (x := scrape(addr)) and value(x, "weightsync_sync_failures_total", code="ABORTED") == 1 and x
            )
        )
        assert value(mm, "weightsync_syncs_total", outcome="aborted", kind="sync") == 1
