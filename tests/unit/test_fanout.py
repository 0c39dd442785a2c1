"""The fan-out's rules, each on its own: where it listens, what an engine takes from it,
which buckets the daemon publishes, and the core's cached live participants."""

from __future__ import annotations

import zmq

from messages import codec, fanout, schema
from messages.checksums import bucket_checksum
from orchestrator.core.records import EngineRecord, Epoch, SyncRecord
from orchestrator.core.states import EngineState
from orchestrator.daemon.fanout import Audience, audience

META = (schema.TensorMeta(name="w", dtype="float32", shape=(4,), offset=0, nbytes=16),)


def load(sync_id: str, seq: int, shm: bool = False) -> list[bytes]:
    frame = bytes(16)
    msg = schema.Load(
        sync_id=sync_id,
        version=1,
        seq=seq,
        tensors=META,
        checksum=bucket_checksum(frame, META),
        ref=schema.Ref(name="weightsync.trainer.1.0123456789ab", offset=0, size=16) if shm else None,
    )
    return [fanout.DATA, codec.encode_header(msg), *(() if shm else (frame,))]


def opening(sync_id: str, inline=(), shm=(), interval=0.002) -> list[bytes]:
    msg = schema.FanoutOpen(sync_id=sync_id, version=1, frames=inline, refs=shm, report_interval=interval)
    return [fanout.DATA, codec.encode_header(msg)]


def test_the_default_address_sits_beside_the_engine_socket():
    assert fanout.bind_address("ipc:///run/ws/engine.sock") == "ipc:///run/ws/engine.sock.fanout"
    assert fanout.bind_address("tcp://0.0.0.0:5556") == "tcp://0.0.0.0:5557"
    assert fanout.bind_address("tcp://127.0.0.1:0") == "tcp://127.0.0.1:0"
    # an engine reaches the fan-out by the host it reaches the daemon by
    assert fanout.connect_address("tcp://0.0.0.0:5557", "tcp://daemon.internal:5556") == (
        "tcp://daemon.internal:5557"
    )
    assert fanout.connect_address("ipc:///run/ws/engine.sock.fanout", "ipc:///x") == (
        "ipc:///run/ws/engine.sock.fanout"
    )


def test_only_live_topics_name_an_engine():
    assert fanout.subscription(b"\x01" + fanout.live_topic("engine-3")) == (True, "engine-3")
    assert fanout.subscription(b"\x00" + fanout.live_topic("engine-3")) == (False, "engine-3")
    assert fanout.subscription(b"\x01" + fanout.DATA) is None
    assert fanout.subscription(b"\x01Ex\xff") is None  # not UTF-8


def test_an_engine_takes_only_the_buckets_its_open_named_it_for():
    r = fanout.Receiver(zmq.Context.instance(), "e1")
    assert r.take(load("s1", 0)) is None  # no open seen: not ours (we get it one by one)
    assert r.take(opening("s1", inline=("e0", "e1"), interval=0.02)) is None
    got = r.take(load("s1", 0))
    assert got is not None and got[0].seq == 0 and len(got[1]) == 1
    assert r.report_interval("s1") == 0.02 and r.report_interval("s9") == 0.002
    assert r.take(load("s1", 1, shm=True)) is None  # named inline, not by reference
    r.take(opening("s2", inline=("e0",)))
    assert r.take(load("s2", 0)) is None  # a sync whose open did not name it
    r.take(opening("s3", shm=("e1",)))
    assert r.take(load("s3", 0, shm=True)) is not None
    r.end("s3")  # aborted: a published bucket arriving late starts nothing
    assert r.take(load("s3", 1, shm=True)) is None
    assert r.take([fanout.DATA, b"\xc1garbage"]) is None and r.refused == 1
    assert r.dropped == 4


def test_a_plan_publishes_while_every_named_participant_is_a_target():
    live = {"a", "b", "c"}.__contains__
    p = audience(("a", "b", "c", "late"), (), live)  # "late" subscribed after the sync began
    assert p == Audience(frozenset({"a", "b", "c"}), frozenset())
    assert p.route(("a", "b", "c", "late"), ()) == (True, False, ["late"])
    # "b" dropped out (lost, failed): it would take the bucket all the same; one by one now
    assert p.route(("a", "c", "late"), ()) == (False, False, ["a", "c", "late"])
    assert p.broken and p.route(("a", "b", "c", "late"), ()) == (False, False, ["a", "b", "c", "late"])
    mixed = audience(("a", "b"), ("b",), live)
    assert mixed.route(("a", "b"), ("b",)) == (True, True, [])
    assert not audience(("x",), (), live).used  # nobody subscribed: nothing is published


def test_the_report_interval_grows_with_the_fleet_within_bounds():
    assert fanout.report_interval(1) == schema.REPORT_INTERVAL
    assert fanout.report_interval(8) == schema.REPORT_INTERVAL
    assert fanout.report_interval(64) > fanout.report_interval(16) > schema.REPORT_INTERVAL
    assert fanout.report_interval(100_000) == fanout.REPORT_INTERVAL_MAX


def test_the_cached_live_participants_follow_every_engine_change():
    epoch = Epoch()  # the core's: its records share it
    engines = {e: EngineRecord(e, "torch", state=EngineState.LOADING, epoch=epoch) for e in ("a", "b", "c")}
    s = SyncRecord("s1", 1, 1, None, (), ("a", "b", "c"), 0.0, 0.0)
    assert s.alive(engines, epoch) == (("a", "b", "c"), frozenset("abc"))
    engines["b"].move("lose")
    assert s.alive(engines, epoch)[0] == ("a", "c")
    engines["b"] = EngineRecord("b", "torch", state=EngineState.STALE, epoch=epoch)  # registered again
    assert s.alive(engines, epoch)[1] == frozenset("abc")
    # another core's engines do not touch this core's epoch
    EngineRecord("z", "torch", epoch=Epoch()).move("lose")
    assert epoch.value == 5


def test_the_window_a_trainer_keeps_fits_the_fanout_budget_twice_over():
    """A participant needs its window plus the open, doubled (libzmq's late credit); a
    non-reader holds the whole queue: so the queue of `window_cap` buckets fits the budget,
    and small buckets keep the daemon's max_pending."""
    from messages.fanout import queue_len, window_cap

    mib = 1 << 20
    for budget, bucket in (
        (192 * mib, 16 * mib),
        (192 * mib, 4 * mib),
        (1 << 30, 64 * mib),
        (64 * mib, 1 * mib),
    ):
        cap = window_cap(budget, bucket, 64)
        assert cap >= 1 and (queue_len(cap) + 1) * bucket <= budget, (budget, bucket, cap)
        assert queue_len(cap) >= 2 * (cap + 1)
    assert window_cap(192 * mib, 16 * mib, 64) == 4
    assert window_cap(192 * mib, 64, 64) == 64  # tiny buckets: the count limit decides
    assert window_cap(None, 16 * mib, 64) == 64  # no fan-out
    assert window_cap(8 * mib, 16 * mib, 64) == 1  # a bucket past the budget: one at a time
