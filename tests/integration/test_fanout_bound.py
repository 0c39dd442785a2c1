"""The fan-out's memory is bounded whatever a subscriber does: a frozen engine, or a SUB
that connects and never reads, costs the daemon at most the fan-out's per-connection
bound, not a model per push (real processes, 256 MiB sink model)."""

from __future__ import annotations

import os
import signal

import psutil
import pytest
import zmq

from engines.sink import random_weights, synthetic_spec, write_spec
from examples.launch import Cluster

from .helpers import wait_for

MODEL_BYTES = 256 << 20
BOUND = 300 << 20  # the bound on the daemon's growth over four pushes


def _engine(cluster: Cluster, eid: str) -> dict:
    return next(e for e in cluster.status()["engines"] if e["engine_id"] == eid)


def _rss(pid: int) -> int:
    return psutil.Process(pid).memory_info().rss


@pytest.mark.slow
def test_frozen_engine_and_idle_subscriber_cost_the_daemon_a_bounded_amount(tmp_path):
    spec = synthetic_spec(MODEL_BYTES, tensor_bytes=16 << 20)
    model = write_spec(tmp_path / "sink", spec)
    c = Cluster(
        tmp_path / "d",
        model,
        engines=2,
        backend="sink",
        min_engines=1,
        daemon_args=["--engine-timeout", "2", "--log-level", "info", "--spool", str(tmp_path / "spool")],
        engine_args=["--heartbeat-interval", "0.5"],
    )
    version = 0

    def push(client) -> None:
        nonlocal version
        version += 1
        r = client.push(random_weights(spec, seed=version), version, transport="inline")
        assert r.state == "READY", r

    with c, c.client(timeout=60.0) as client:
        push(client)
        daemon = c.daemon.popen.pid
        frozen = next(p for p in c.procs if p.name == "engine-1")
        os.kill(frozen.popen.pid, signal.SIGSTOP)

        def four_pushes(what: str) -> None:
            before = _rss(daemon)
            for _ in range(4):
                push(client)
            grew = _rss(daemon) - before
            print(f"{what}: the daemon grew {grew >> 20} MiB over four pushes")
            assert grew < BOUND, f"daemon grew {grew >> 20} MiB with {what}"

        try:
            wait_for(lambda: _engine(c, "engine-1")["state"] == "LOST", 30, "engine-1 LOST")
            four_pushes("a frozen engine")

            # a SUB that subscribes to everything and never reads
            fan = c.status()["daemon"]["fanout_addr"]
            ctx = zmq.Context()
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.RCVHWM, 1)
            sub.setsockopt(zmq.RCVBUF, 4096)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(fan)
            try:
                wait_for(lambda: c.status()["daemon"]["fanout_subscribers"] >= 1, 10, "subscribed")
                four_pushes("an idle subscriber")
            finally:
                sub.close(linger=0)
                ctx.term()
        finally:
            os.kill(frozen.popen.pid, signal.SIGCONT)
        # resumed, the engine rejoins and the spool brings it to the fleet's version
        wait_for(
            lambda: (e := _engine(c, "engine-1"))["state"] == "READY" and e["version"] == version,
            60,
            f"engine-1 READY at v{version}",
        )
        assert c.status()["state"] == "READY"


def test_a_first_bucket_larger_than_the_bucket_size_does_not_shrink_the_fanout_queue(tmp_path):
    """The fan-out's queue is sized from the trainer's bucket size (its begin says it), not
    from the first frame: a first tensor of 48 MiB (one oversized bucket), then 4 MiB
    buckets with a window of 8, while one engine is stopped until the whole window waits
    on it. Resumed, it finds every bucket queued and the push is READY (sized from the
    first frame, the queue held 6 messages: the stopped engine missed buckets and the push
    timed out)."""
    import threading

    from messages.schema import ParamSpec

    spec = [ParamSpec("big", "bfloat16", (24 * 1024, 1024))]
    spec += [ParamSpec(f"t{i}", "bfloat16", (2048, 1024)) for i in range(16)]
    model = write_spec(tmp_path / "sink", spec)
    c = Cluster(tmp_path / "d", model, engines=2, backend="sink", daemon_args=["--log-level", "info"])
    with c, c.client(timeout=20.0, retries=0) as client:
        slow = next(p for p in c.procs if p.name == "engine-1")
        out: dict = {}

        def push() -> None:
            try:
                out["r"] = client.push(
                    random_weights(spec, seed=1), 1, transport="inline", bucket_bytes=4 << 20, window=8
                )
            except Exception as exc:  # reported below
                out["err"] = exc

        os.kill(slow.popen.pid, signal.SIGSTOP)
        t = threading.Thread(target=push)
        try:
            t.start()
            wait_for(lambda: c.status()["queues"]["unacked_bucket_requests"] >= 8, 30, "the window waits")
        finally:
            os.kill(slow.popen.pid, signal.SIGCONT)
        t.join(60)
        assert "err" not in out, out.get("err")
        r = out["r"]
        assert r.state == "READY" and r.detail["window"] == 8 and len(r.engines) == 2
        assert {e["digest"] for e in r.engines} == {r.digest}


def test_syncs_of_different_bucket_sizes_each_reach_every_engine(tmp_path):
    """Small buckets, then large, then small, then large again: the fan-out's queue grows
    and shrinks with the bucket size. Shrunk on live connections, libzmq could count an
    idle connection full for good (its reader reports what it took only every half queue:
    17 small buckets read, never reported, against a new queue of 12) and every later
    bucket missed it; the daemon binds the fan-out anew instead (said in its log) and
    that sync goes one send each. Every push is READY on both engines."""
    spec = synthetic_spec(64 << 20, tensor_bytes=4 << 20)
    model = write_spec(tmp_path / "sink", spec)
    c = Cluster(tmp_path / "d", model, engines=2, backend="sink", daemon_args=["--log-level", "info"])
    with c, c.client(timeout=20.0, retries=0) as client:
        published = []
        for v, bucket in enumerate((64 << 10, 16 << 20, 16 << 20, 64 << 10, 16 << 20), start=1):
            wait_for(lambda: c.status()["daemon"]["fanout_subscribers"] == 2, 30, "both subscribed")
            before = client.status()["daemon"]["messages_published"]
            r = client.push(random_weights(spec, seed=v), v, transport="inline", bucket_bytes=bucket)
            assert r.state == "READY" and {e["digest"] for e in r.engines} == {r.digest}, r
            published.append(client.status()["daemon"]["messages_published"] - before)
        # grown (or kept) in place: published; shrunk: bound anew, that sync sent one by one
        assert published[0] > 0 and published[2] > 0 and published[3] > 0
        assert published[1] == 0 and published[4] == 0
        log = c.daemon.log_path.read_text()
        assert log.count('"fanout_rebound"') == 2


FANOUT_BUDGET = 192 << 20  # the daemon's default --fanout-queue-bytes


@pytest.mark.slow
@pytest.mark.parametrize("bucket_bytes", [16 << 20, 64 << 20], ids=["16MiB", "64MiB"])
def test_tensors_larger_than_a_bucket_cost_a_frozen_engines_daemon_the_budget(tmp_path, bucket_bytes):
    """The fan-out's bound holds in bytes whatever the tensors: a model of 128 MiB tensors
    (each larger than a bucket), one of two engines SIGSTOPped until LOST, four inline
    pushes: the daemon grows by at most the fan-out budget + one bucket. The trainer splits
    each tensor across buckets (the engines assemble it), and the daemon caps a sync's
    bucket size at what its queue holds (64 MiB buckets are cut at 38.4 MiB: the begin
    reply's bucket_bytes). Whole 128 MiB frames, the queue sized for 16 MiB buckets held
    12 of them: about 1.5 GiB."""
    spec = synthetic_spec(256 << 20, tensor_bytes=128 << 20)
    model = write_spec(tmp_path / "sink", spec)
    c = Cluster(
        tmp_path / "d",
        model,
        engines=2,
        backend="sink",
        min_engines=1,
        daemon_args=["--engine-timeout", "2", "--log-level", "info"],
        engine_args=["--heartbeat-interval", "0.5"],
    )
    version = 0
    with c, c.client(timeout=60.0) as client:

        def push() -> None:
            nonlocal version
            version += 1
            r = client.push(
                random_weights(spec, seed=version), version, transport="inline", bucket_bytes=bucket_bytes
            )
            assert r.state == "READY" and {e["digest"] for e in r.engines} == {r.digest}, r

        push()  # both engines assemble the split tensors: the same digest as the trainer's
        daemon = c.daemon.popen.pid
        frozen = next(p for p in c.procs if p.name == "engine-1")
        os.kill(frozen.popen.pid, signal.SIGSTOP)
        try:
            wait_for(lambda: _engine(c, "engine-1")["state"] == "LOST", 30, "engine-1 LOST")
            before = _rss(daemon)
            for _ in range(4):
                push()
            grew = _rss(daemon) - before
        finally:
            os.kill(frozen.popen.pid, signal.SIGCONT)
        cut = min(bucket_bytes, FANOUT_BUDGET // 5)
        print(f"bucket {bucket_bytes >> 20} MiB (cut at {cut >> 20}): the daemon grew {grew >> 20} MiB")
        assert grew <= FANOUT_BUDGET + cut, f"the daemon grew {grew >> 20} MiB over four pushes"
        assert c.status()["state"] == "READY"


def test_eight_sources_fill_their_windows_on_a_stopped_engine_and_still_commit(tmp_path):
    """8 sources of one sharded inline push with 16 MiB buckets: the daemon cuts the sync's
    buckets so that open + every source's window fits its queue twice over in messages and
    the budget in bytes (messages.fanout.sync_queue: 192 MiB / 18 messages -> 10.7 MiB
    buckets). One engine is SIGSTOPped until every source's window waits on it, then
    SIGCONTed: READY on both engines with the trainer's digest, three times in a row.

    It failed 6 runs of 36 before the trainer's automatic window kept to the
    daemon's cap: its floor of 2 overrode a cap of 1, so 8 sources kept 16 buckets in
    flight where the queue was sized for 8, and the XPUB dropped the last ones published
    for whichever engine read slowest (a missing piece, or a bucket never acknowledged)."""
    import threading

    spec = synthetic_spec(256 << 20, tensor_bytes=16 << 20)
    model = write_spec(tmp_path / "sink", spec)
    c = Cluster(tmp_path / "d", model, engines=2, backend="sink", daemon_args=["--log-level", "info"])
    sources = 8
    with c:
        slow = next(p for p in c.procs if p.name == "engine-1")
        for version in (1, 2, 3):
            weights = list(random_weights(spec, seed=version))
            out: dict[int, object] = {}

            def run(k: int, v: int = version, w: list = weights) -> None:
                try:
                    with c.client(timeout=60.0, retries=0) as client:
                        out[k] = client.push(w[k::sources], v, transport="inline", source=(k, sources))
                except Exception as exc:  # reported below
                    out[k] = exc

            os.kill(slow.popen.pid, signal.SIGSTOP)
            threads = [threading.Thread(target=run, args=(k,)) for k in range(sources)]
            try:
                for t in threads:
                    t.start()
                wait_for(
                    lambda: c.status()["queues"]["unacked_bucket_requests"] >= sources,
                    60,
                    "every source's window waits on the stopped engine",
                )
            finally:
                os.kill(slow.popen.pid, signal.SIGCONT)
            for t in threads:
                t.join(120)
            errors = [r for r in out.values() if isinstance(r, Exception)]
            assert not errors and len(out) == sources, errors
            results = list(out.values())
            assert {r.state for r in results} == {"READY"}  # type: ignore[attr-defined]
            r0 = results[0]
            assert len(r0.engines) == 2 and {e["digest"] for e in r0.engines} == {r0.digest}  # type: ignore[attr-defined]
            assert r0.detail["bucket_bytes"] <= (192 << 20) // 19  # type: ignore[attr-defined]
