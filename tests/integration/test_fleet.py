"""A fleet of 64 simulated engines (bench.simengine: the real engine protocol over real
ZeroMQ, no torch) against the real daemon process, driven by the real TrainerClient."""

from __future__ import annotations

import os
import signal
import time

import pytest

from bench.fleet import SimFleet, tiny_weights
from messages.errors import ErrorCode, WeightSyncError

N = 64
BUCKETS = 200


def counts(fleet: SimFleet) -> dict[str, int]:
    return {e["engine_id"]: e["finalize_count"] for e in fleet.cluster.status()["engines"]}


def push(fleet: SimFleet, client, version: int, transport: str):
    weights = tiny_weights(BUCKETS, version)
    # inline, the simulated engines digest the bytes they received: the digest file holds
    # other weights' (were they to report it, the sync would fail); a collective bucket's
    # bytes never reach them, so there they report the file's
    fleet.write_digest(version, tiny_weights(BUCKETS, version + 1000) if transport == "inline" else weights)
    return client.push(weights, version, bucket_bytes=64, window=32, transport=transport)


@pytest.mark.parametrize("transport", ["inline", "collective"])
def test_a_fleet_of_64_commits_once_per_engine(tmp_path, transport):
    with SimFleet(tmp_path, N) as fleet, fleet.client(timeout=60.0) as client:
        for v in (1, 2):
            r = push(fleet, client, v, transport)
            assert (r.state, r.buckets, r.detail["transport"]) == ("READY", BUCKETS, transport)
            assert len(r.engines) == N
            assert {e["digest"] for e in r.engines} == {r.digest}
        assert set(counts(fleet).values()) == {2}  # finalized exactly once per engine per version
        st = fleet.cluster.status()["daemon"]
        assert st["heartbeats_received"] > 0


def test_the_collective_stream_costs_the_daemon_messages_per_engine_not_per_bucket(tmp_path):
    """On the collective stream the daemon exchanges a few messages per engine per sync
    (stream, prepared, finalize, finalized), whatever the bucket count."""
    with SimFleet(tmp_path, N) as fleet, fleet.client(timeout=60.0) as client:
        used = []
        for v, buckets in ((1, 20), (2, 400)):
            weights = tiny_weights(buckets, v)
            fleet.write_digest(v, weights)
            before = client.status()["daemon"]
            r = client.push(weights, v, bucket_bytes=64, transport="collective")
            after = client.status()["daemon"]
            assert r.state == "READY" and r.buckets == buckets and r.detail["stream"] is True
            heartbeats = after["heartbeats_received"] - before["heartbeats_received"]
            msgs = after["messages_received"] + after["messages_sent"]
            msgs -= before["messages_received"] + before["messages_sent"]
            used.append(msgs - heartbeats - 2)  # the status reply before and request after
        assert used[0] <= 4 * N + 16 and used[1] == used[0], used


@pytest.mark.parametrize(
    "transport,fault,code",
    [
        ("inline", "fail_at:120", ErrorCode.ENGINE_FAILED),
        ("inline", "exit_at:120", ErrorCode.ENGINE_FAILED),  # its closed connection, at once
        ("inline", "wrong_digest", ErrorCode.ENGINE_FAILED),
        ("collective", "fail_at:120", ErrorCode.ENGINE_FAILED),
        ("collective", "exit_at:120", ErrorCode.ENGINE_FAILED),
        ("collective", "wrong_digest", ErrorCode.ENGINE_FAILED),
        ("collective", "no_prepare", ErrorCode.TIMEOUT),
    ],
)
def test_one_failing_engine_fails_the_sync_named_and_nothing_is_served(tmp_path, transport, fault, code):
    bad = "sim-37"
    with (
        SimFleet(tmp_path, N, faults={bad: fault}, daemon_args=["--bucket-timeout", "3"]) as fleet,
        fleet.client(timeout=60.0) as client,
    ):
        before = counts(fleet)
        with pytest.raises(WeightSyncError) as info:
            push(fleet, client, 1, transport)
        err = info.value
        assert err.code == code and bad in err.message, err
        st = fleet.cluster.status()
        assert st["state"] == "IDLE" and st["last_ready_version"] is None
        # on the collective stream a wrong digest is caught at prepare, before the commit
        if fault.startswith("fail_at") or transport == "collective":
            assert counts(fleet) == before, "an engine finalized"


def test_an_engine_that_never_finalizes_times_out_named(tmp_path):
    bad = "sim-5"
    with (
        SimFleet(tmp_path, N, faults={bad: "no_finalize"}, daemon_args=["--finalize-timeout", "3"]) as fleet,
        fleet.client(timeout=60.0) as client,
    ):
        with pytest.raises(WeightSyncError) as info:
            push(fleet, client, 1, "inline")
        assert info.value.code == ErrorCode.TIMEOUT and bad in info.value.message, info.value
        assert fleet.cluster.status()["last_ready_version"] is None


def test_a_rejoin_storm_catches_every_engine_up(tmp_path):
    """All 64 engines of one simulator process die at once while READY and come back as new
    processes: each is caught up from the spool, and the next push is not held back."""
    spool = tmp_path / "spool"
    with (
        SimFleet(tmp_path, N, daemon_args=["--spool", str(spool), "--engine-timeout", "3"]) as fleet,
        fleet.client(timeout=60.0) as client,
    ):
        assert push(fleet, client, 1, "inline").state == "READY"
        (proc,) = fleet.sims
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        fleet.sims.clear()
        new = fleet.start_sims(fleet.ids)
        deadline = time.monotonic() + 60
        while True:  # every engine registered from the new process and caught up
            st = fleet.cluster.status()
            ready = [
                e
                for e in st["engines"]
                if e["pid"] == new.pid and e["state"] == "READY" and e["version"] == 1
            ]
            if len(ready) == N and st["state"] == "READY":
                break
            assert time.monotonic() < deadline, st["engines"][:4]
            time.sleep(0.2)
        assert {e["finalize_count"] for e in st["engines"]} == {1}  # the new processes, caught up once
        t0 = time.monotonic()
        r = push(fleet, client, 2, "inline")
        assert r.state == "READY" and len(r.engines) == N
        assert time.monotonic() - t0 < 30


@pytest.mark.parametrize("fan", [True, False], ids=["fanout", "fanout_off"])
def test_inline_buckets_cost_the_daemon_one_publish_each_not_one_send_per_engine(tmp_path, fan):
    """Inline: each bucket is published once on the fan-out, whatever the fleet's size
    (libzmq copies it to each engine); `--fanout-bind off` sends it to each engine."""
    args = [] if fan else ["--fanout-bind", "off"]
    buckets = 400
    with SimFleet(tmp_path, N, daemon_args=args) as fleet, fleet.client(timeout=60.0) as client:
        weights = tiny_weights(buckets, 1)
        fleet.write_digest(1, weights)
        before = client.status()["daemon"]
        r = client.push(weights, 1, bucket_bytes=64, window=32, transport="inline")
        after = client.status()["daemon"]
        assert r.state == "READY" and r.buckets == buckets and {e["digest"] for e in r.engines} == {r.digest}
        sent = after["messages_sent"] - before["messages_sent"]
        if fan:  # a publish per bucket, the trainer's acks, a few messages per engine
            assert sent <= 2 * buckets + 4 * N + 16, sent
        else:
            assert sent >= N * buckets, sent
