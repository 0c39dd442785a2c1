"""Fuzzing a daemon that holds a registered engine and a sync in every state.

The old fuzzers could only reach IDLE with no engine. Here a scripted engine is
registered and, before every case, the daemon is brought to one target state
(LOADING_BUCKETS, FINALIZING, READY, or a rollback running from the spool); then one
message is sent on the trainer or the engine socket: a real header of the right sync
with one to three fields set to extreme but well-formed values (2**63-1, 2**64-1, -1,
path-like and NUL ids, huge strings and lists) or to garbage. After each case the
daemon answers `status` within a second, never replies INTERNAL, and its process lives.
The report (how many cases reached each state) is printed and checked.
"""

from __future__ import annotations

import time
from collections import Counter

import msgpack
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from examples.launch import Cluster
from messages import schema
from messages.errors import ErrorCode
from messages.schema import PROTOCOL_VERSION

from .scripted import HOST, Peer, ScriptedEngine, bucket_frames

pytestmark = pytest.mark.slow
CODES = {c.value for c in ErrorCode}
TARGETS = ("LOADING_BUCKETS", "FINALIZING", "READY", "ROLLBACK")

extreme_ints = st.sampled_from([0, 1, -1, 2**31, 2**62, 2**63 - 1, 2**63, 2**64 - 1, -(2**63)])
extreme_strs = st.sampled_from(
    [
        "",
        "../x",
        "a/b",
        "a\x00b",
        "x" * 200,
        ".",
        "weightsync.trainer.1.0123456789ab",
        "../../etc/passwd",
        "ok-id",
        "\n",
    ]
)
extreme = st.one_of(
    extreme_ints,
    extreme_strs,
    st.none(),
    st.booleans(),
    st.floats(allow_nan=True),
    st.lists(extreme_ints, max_size=5),
    st.binary(max_size=16),
    st.dictionaries(st.text(max_size=4), extreme_ints, max_size=2),
)


class Rig:
    """The daemon, its scripted engine and a trainer peer; `reach(target)` sets the scene."""

    def __init__(self, cluster: Cluster) -> None:
        self.c = cluster
        self.eng = ScriptedEngine(cluster.engine_addr)
        self.trainer = Peer(cluster.addr)
        self.version = 0
        self.sync_id = "none"
        self.reached: Counter[str] = Counter()
        self.cases: list[object] = []  # the cases sent so far, the last few named on a failure

    def stuck(self, what: str) -> AssertionError:
        """A wait that failed, with what the daemon says and the cases that came before."""
        try:
            st_: object = self.c.status(timeout=5.0)
        except Exception as e:  # the failure message reports it
            st_ = f"status failed: {e!r}"
        return AssertionError(
            f"{what}\nlast cases: {self.cases[-3:]}\nstatus: {st_}\ndaemon log:\n{self.c.daemon.log_tail(60)}"
        )

    def settle(self) -> dict:
        """End whatever runs: abort a trainer sync; let a rollback finish."""
        seen: list[str] = []  # what each round found, for the failure message
        deadline = time.monotonic() + 60  # a bound on a failure, not a wait
        while time.monotonic() < deadline:
            self.eng.heartbeat()
            st_ = self.c.status(timeout=5.0)
            s = st_["sync"]
            seen.append(f"{st_['state']} {s and (s['kind'], s['sync_id'])} pending={st_['rollback_pending']}")
            if s is None and st_["rollback_pending"]:  # the timer begins it within a tick
                time.sleep(0.05)
                continue
            if s is None:
                self.trainer.drain()  # late replies of the sync that ended
                return st_
            if s["kind"] == "rollback":  # feed it: ack loads, finalize with the spool's digest
                m = self.eng.recv(0.2)
                if m is not None:
                    self._answer_rollback(m, st_["digest"])
                continue
            self.trainer.request(schema.Abort(sync_id=s["sync_id"], reason="fuzz reset"))
            # drop what the aborted sync left queued, but not a rollback's messages: the
            # rollback may open while this drains (within a tick of the abort), and its
            # load, and even its finalize once the load is answered, may already be here
            while (m := self.eng.recv(0.0)) is not None:
                if isinstance(m, schema.Load | schema.Finalize) and m.sync_id.startswith("rollback-"):
                    self._answer_rollback(m, st_["digest"])
        raise self.stuck(f"could not settle; rounds: {seen[:3]} ... {seen[-12:]}")

    def _answer_rollback(self, m: schema.Message, digest: str | None) -> None:
        """The scripted engine's part in a rollback: ack a load, finalize with `digest`
        (the served digest the rollback restores)."""
        if isinstance(m, schema.Load):
            self.eng.send(schema.Loaded(sync_id=m.sync_id, seq=m.seq, source=m.source))
        elif isinstance(m, schema.Finalize):
            self.eng.send(
                schema.Finalized(sync_id=m.sync_id, version=m.version, digest=digest or "0", finalize_count=1)
            )

    def _sync_to(self, finish: bool, finalize: bool) -> None:
        self.version += 1
        self.sync_id = f"fz-{self.version}"
        ok = self.trainer.request(schema.Begin(sync_id=self.sync_id, version=self.version))
        assert isinstance(ok, schema.Ok), ok
        msg, frame = bucket_frames(self.sync_id, value=float(self.version))
        self.trainer.send(msgspec.structs.replace(msg, id=77), (frame,))
        try:
            self.eng.ack_load(sync_id=self.sync_id)
            assert self.trainer.recv_type(schema.Ok).id == 77
            if finish:
                self.trainer.send(schema.Finish(sync_id=self.sync_id, buckets=1, id=78))
                if finalize:
                    self.eng.finalize(digest=f"{self.version:x}", sync_id=self.sync_id)
                    done = self.trainer.recv_type(schema.Ok)
                    assert done.id == 78 and done.body["status"] == "READY", done
                else:
                    self.eng.recv_type(schema.Finalize)
        except AssertionError as e:
            raise self.stuck(f"sync {self.sync_id} (finish={finish}, finalize={finalize}): {e}") from e

    def reach(self, target: str) -> None:
        self.settle()
        if target == "LOADING_BUCKETS":
            self.version += 1
            self.sync_id = f"fz-{self.version}"
            ok = self.trainer.request(schema.Begin(sync_id=self.sync_id, version=self.version))
            assert isinstance(ok, schema.Ok), ok
        elif target == "FINALIZING":
            self._sync_to(finish=True, finalize=False)
        elif target == "READY":
            self._sync_to(finish=True, finalize=True)
        elif target == "ROLLBACK":  # READY and spooled, then a sync that fails mid-way
            self._sync_to(finish=True, finalize=True)
            self._sync_to(finish=False, finalize=False)
            self.eng.send(schema.Failed(sync_id=self.sync_id, code="ENGINE_FAILED", message="fuzz"))
            deadline = time.monotonic() + 10  # the daemon ticks the core at once: a rollback is due now
            while time.monotonic() < deadline:
                s = self.c.status(timeout=1.0)["sync"]
                if s is not None and s["kind"] == "rollback":
                    self.sync_id = s["sync_id"]
                    break
                time.sleep(0.02)
            else:
                raise AssertionError(f"no rollback started: {self.c.status()}")
        st_ = self.c.status(timeout=1.0)
        got = "ROLLBACK" if st_["sync"] and st_["sync"]["kind"] == "rollback" else st_["state"]
        assert got == target, (target, st_["state"], st_["sync"])
        self.reached[target] += 1


def base_headers(sync_id: str, version: int) -> dict[str, dict]:
    msg, _ = bucket_frames(sync_id)
    bucket = {
        "type": "bucket",
        "sync_id": sync_id,
        "seq": 0,
        "checksum": msg.checksum,
        "tensors": [t.to_wire() for t in msg.tensors],
    }
    return {
        "begin": {"type": "begin", "sync_id": sync_id + "-n", "version": version + 1},
        "bucket": bucket,
        "finish": {"type": "finish", "sync_id": sync_id, "buckets": 1},
        "abort": {"type": "abort", "sync_id": sync_id + "-other", "reason": "r"},
        "status": {"type": "status"},
        "loaded": {"type": "loaded", "sync_id": sync_id, "seq": 0},
        "finalized": {"type": "finalized", "sync_id": sync_id, "version": version, "digest": "ab"},
        "failed": {"type": "failed", "sync_id": sync_id + "-other", "code": "X", "message": "m"},
        "heartbeat": {"type": "heartbeat", "engine_id": "scripted-0"},
        "register": {
            "type": "register",
            "engine_id": "scripted-0",
            "backend": "t",
            "host": HOST,
            "pid": 4242,
        },
    }


TRAINER = ("begin", "bucket", "finish", "abort", "status")
ENGINE = ("loaded", "finalized", "failed", "heartbeat", "register")


@st.composite
def cases(draw):
    target = draw(st.sampled_from(TARGETS))
    kind = draw(st.sampled_from(TRAINER + ENGINE))
    edits = draw(
        st.lists(
            st.tuples(
                st.sampled_from(
                    [
                        "sync_id",
                        "version",
                        "seq",
                        "buckets",
                        "checksum",
                        "source",
                        "engine_id",
                        "digest",
                        "reason",
                        "tensors",
                        "shm",
                        "id",
                        "v",
                        "pid",
                        "message",
                    ]
                ),
                extreme,
            ),
            min_size=1,
            max_size=3,
        )
    )
    payload = draw(st.sampled_from([(), "frame", (b"",), (b"x" * 40,)]))
    return target, kind, edits, payload


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz-states")
    c = Cluster(
        d,
        None,
        engines=0,
        min_engines=1,
        daemon_args=["--spool", str(d / "spool"), "--engine-timeout", "120", "--log-level", "warning"],
    )
    with c:
        r = Rig(c)
        yield r
        r.eng.close()
        r.trainer.close()


def test_fuzz_every_state_with_extreme_values_on_both_sockets(rig, request):
    codes: Counter[str] = Counter()

    @settings(
        max_examples=max(40, request.config.getoption("--fuzz-cases") // 3),
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=cases())
    def one(case):
        target, kind, edits, payload = case
        rig.cases.append(case)
        rig.reach(target)
        h = {"v": PROTOCOL_VERSION, "id": 5, **base_headers(rig.sync_id, rig.version)[kind]}
        for field, value in edits:
            if (field == "v" and value == 1) or (kind == "register" and field == "engine_id"):
                continue  # a second, silent engine would stall every later sync (as it should)
            h[field] = value
        frames = (bucket_frames(rig.sync_id)[1],) if payload == "frame" else payload
        peer = rig.trainer if kind in TRAINER else rig.eng
        try:
            raw = msgpack.packb(h, use_bin_type=True)
        except (OverflowError, TypeError):
            return  # not representable in MessagePack: nothing a peer could send
        peer.send_raw(raw, frames)
        if kind in TRAINER:
            # a typed reply or an ok; a bucket that is well-formed may wait for its ack
            reply = peer.recv(1.0)
            if reply is None:
                assert kind in ("bucket", "finish"), (kind, h)
            elif isinstance(reply, schema.Error):
                codes[reply.code] += 1
                assert reply.code in CODES - {"INTERNAL"}, reply
        st_ = rig.c.status(timeout=1.0)  # answered within a second, whatever came before
        assert st_["state"] in ("IDLE", "LOADING_BUCKETS", "FINALIZING", "READY")
        assert rig.c.daemon.popen.poll() is None
        assert st_["last_sync"] is None or st_["last_sync"].get("code") != "INTERNAL", st_["last_sync"]

    one()
    print(f"\nfuzz report: cases per state {dict(rig.reached)}; error codes {dict(codes)}")
    assert all(rig.reached[t] > 0 for t in TARGETS), rig.reached
    assert codes["BAD_MESSAGE"] > 0
