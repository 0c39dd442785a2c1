"""Simulated engines: many per process, each a DEALER that speaks the real engine protocol
to a real daemon over ZeroMQ, with no torch and no model.

    python -m bench.simengine --connect ipc:///tmp/w/engine.sock --ids sim-0,sim-1 \
        --digests /tmp/w/digests [--fault sim-1=fail_at:100]

Each engine registers (inline and collective, one collective rank, gloo), heartbeats,
verifies every inline frame against its checksum, reports its progress as a real engine
does (cumulative `loaded`, at most one per REPORT_INTERVAL), and decides what each
message means with the real engine's state machine (`engines.session.Session`: which sync
starts or supersedes, the finalize guard, resent buckets, refusals), carrying out its
jobs the way a real engine's applier does, but simulated; it answers canary
probes with their expected tokens and reports the digest of the tensors it received
inline in that sync (each tensor's part hashed from the bytes that arrived, as a real
engine's digest is), or, for a sync whose bytes never reached it (a collective bucket's:
the data plane is simulated, the control plane is real), the digest the trainer wrote
for that version to `--digests/<version>`. `--no-digest-bytes` (the fleet benchmark)
skips the hashing and reports the file's digest for every sync. With `--data-plane`,
the engines take the collective stream: they subscribe to the frame headers the
trainer publishes there, chain their checksums as a real engine does, and answer
`prepared` at the END header.

Faults, for the fleet tests: `fail_at:SEQ` (report a failed load of bucket SEQ),
`exit_at:SEQ` (close the socket and stop answering at bucket SEQ, as a killed process),
`wrong_digest` (prepare and finalize with a digest the trainer never sent),
`no_prepare` (never answer a collective stream), `no_finalize` (never answer finalize), `restart_after:SECONDS` (exit like a killed process, then register
again as a new process after SECONDS).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket as pysocket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq

from engines.session import Action, Begin, Send, Session, Stop
from messages import codec, fanout, replies, schema, stream
from messages.checksums import bucket_checksum, combine, part_hasher
from messages.errors import ErrorCode, MessageError
from messages.schema import REPORT_INTERVAL
from messages.stream import Chain

KEPT_STREAMS = 16  # streams whose headers a simulator keeps (a late `stream` finds them)


@dataclass
class StreamSeen:
    """The headers of one sync's collective stream, as the trainer published them."""

    chain: Chain = field(default_factory=Chain)
    end: stream.Header | None = None
    bad: str = ""  # why the stream is not what its END says (an engine then fails)


@dataclass
class SimEngine:
    engine_id: str
    fault: str = ""
    sock: Any = None
    session: Session = field(default_factory=Session)  # the real engine's guards and served version
    failed: set[str] = field(default_factory=set)  # syncs its simulated applier failed
    finalize_count: int = 0
    loads: int = 0
    next_id: int = 0
    register_ids: set[int] = field(default_factory=set)  # their Ok is a RegisterReply
    dead_until: float | None = None  # killed; registers again as a new process at this time
    last_report: float = 0.0
    reregister_sent: bool = False  # as a real engine: one re-registration until acknowledged
    stream: schema.OpenStream | None = None  # the collective stream it takes part in, until it answers
    fan: fanout.Receiver | None = None  # its subscription to the daemon's fan-out
    parts: dict[str, bytes] = field(default_factory=dict)  # the running sync's received tensors

    def unreported(self) -> bool:
        s = self.session.reporting()
        return s is not None and s.progress.unreported()

    def fault_seq(self, kind: str) -> int | None:
        if self.fault.startswith(kind + ":"):
            return int(self.fault.split(":", 1)[1])
        return None


class Fleet:
    """Every simulated engine of this process, driven by one thread and one poller."""

    def __init__(
        self,
        connect: str,
        ids: list[str],
        digests: Path,
        heartbeat: float = 1.0,
        faults: dict[str, str] | None = None,
        ctx: zmq.Context[Any] | None = None,
        data_plane: str = "",
        use_fanout: bool = True,
        digest_bytes: bool = True,
    ) -> None:
        self.connect = connect
        self.digest_bytes = digest_bytes
        self.digests = digests
        self.heartbeat = heartbeat
        self.ctx = ctx or zmq.Context.instance()
        self.engines = [SimEngine(i, (faults or {}).get(i, "")) for i in ids]
        self.by_sock: dict[Any, SimEngine] = {}
        self.by_sub: dict[Any, SimEngine] = {}
        self.use_fanout = use_fanout
        self.poller = zmq.Poller()
        self.stopped = False
        self.host = pysocket.gethostname()
        self.streams: dict[str, StreamSeen] = {}  # sync_id -> headers seen (the last few)
        self.sub: Any = None
        if data_plane:
            self.sub = self.ctx.socket(zmq.SUB)
            self.sub.setsockopt(zmq.RCVHWM, 0)
            self.sub.setsockopt(zmq.SUBSCRIBE, b"")
            self.sub.connect(data_plane)
            self.poller.register(self.sub, zmq.POLLIN)

    # -- sockets ------------------------------------------------------------------------
    def _open(self, e: SimEngine) -> None:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.connect(self.connect)
        e.sock = sock
        self.by_sock[sock] = e
        self.poller.register(sock, zmq.POLLIN)
        self._send(e, self._register(e))

    def _close(self, e: SimEngine) -> None:
        if e.fan is not None and e.fan.sock is not None:
            self.poller.unregister(e.fan.sock)
            del self.by_sub[e.fan.sock]
            e.fan.close()
        if e.sock is None:
            return
        self.poller.unregister(e.sock)
        del self.by_sock[e.sock]
        e.sock.close(linger=0)
        e.sock = None

    def _register(self, e: SimEngine) -> schema.Register:
        rid = self._id(e)
        e.register_ids.add(rid)
        return schema.Register(
            engine_id=e.engine_id,
            backend="sim",
            id=rid,
            model="sim",
            transports=("inline", "collective"),
            version=e.session.version,
            digest=e.session.digest,
            finalize_count=e.finalize_count,
            pid=os.getpid(),
            host=self.host,
            collective_ranks=1,
            collective_backends=("gloo",),
            collective_stream=self.sub is not None,
            fanout=self.use_fanout,
        )

    @staticmethod
    def _id(e: SimEngine) -> int:
        e.next_id += 1
        return e.next_id

    def _send(self, e: SimEngine, msg: schema.Message) -> None:
        if e.sock is not None:
            e.sock.send_multipart(codec.encode(msg), copy=False)

    # -- the loop -----------------------------------------------------------------------
    def run(self) -> None:
        for e in self.engines:
            self._open(e)
        n = max(1, len(self.engines))
        next_hb = [time.monotonic() + self.heartbeat * (i + 1) / n for i in range(n)]  # staggered
        while not self.stopped:
            now = time.monotonic()
            wait = min(next_hb) - now
            if any(e.unreported() for e in self.engines):
                wait = min(wait, min(self._interval(e) for e in self.engines if e.unreported()))
            for sock, _ in self.poller.poll(max(0, int(min(wait, 0.2) * 1000))):
                if sock is self.sub:
                    self._headers()
                    continue
                sub_of = self.by_sub.get(sock)
                if sub_of is not None and sub_of.fan is not None:
                    for load, payload in sub_of.fan.recv_all():
                        self._load(sub_of, load, payload)
                    continue
                e = self.by_sock.get(sock)
                while e is not None and e.sock is sock:
                    try:
                        frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._on_message(e, frames)
            now = time.monotonic()
            for i, e in enumerate(self.engines):
                if e.unreported() and now - e.last_report >= self._interval(e):
                    self._report(e, now)
                if e.dead_until is not None and now >= e.dead_until:
                    e.dead_until = None
                    e.session, e.failed, e.parts = Session(), set(), {}
                    e.fault, e.reregister_sent = "", False  # a restarted process is healthy
                    self._open(e)
                if now >= next_hb[i]:
                    next_hb[i] = now + self.heartbeat
                    self._send(e, schema.Heartbeat(engine_id=e.engine_id, id=self._id(e)))

    @staticmethod
    def _interval(e: SimEngine) -> float:
        """Seconds between two reports of `e` in its running sync (the fan-out's, if any)."""
        c = e.session.current
        if e.fan is None or c is None:
            return REPORT_INTERVAL
        return e.fan.report_interval(c.sync_id)

    def stop(self) -> None:
        self.stopped = True

    def close(self) -> None:
        for e in self.engines:
            self._close(e)
        if self.sub is not None:
            self.sub.close(linger=0)

    # -- the collective stream (its headers are real, its bytes simulated) -----------------
    def _headers(self) -> None:
        ended: set[str] = set()
        while True:
            try:
                sync_b, head = self.sub.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            sync_id = sync_b.decode()
            seen = self.streams.get(sync_id)
            if seen is None:
                seen = self.streams[sync_id] = StreamSeen()
                while len(self.streams) > KEPT_STREAMS:
                    self.streams.pop(next(iter(self.streams)))
            h = stream.decode_header(head)
            if h.kind == stream.END:
                seen.end = h
                ended.add(sync_id)
                continue
            if h.seq != seen.chain.buckets and not seen.bad:
                seen.bad = f"stream bucket seq {h.seq} arrived where {seen.chain.buckets} was due"
            seen.chain.add(h.checksum, h.data_len)
            for e in self.faulty:  # only engines with a fault react to single buckets
                if e.stream is not None and e.stream.sync_id == sync_id:
                    self._advance(e)
        for e in self.engines:
            if e.stream is not None and e.stream.sync_id in ended:
                self._advance(e)

    @property
    def faulty(self) -> list[SimEngine]:
        return [e for e in self.engines if e.fault]

    def _advance(self, e: SimEngine) -> None:
        """Take engine `e` as far as the headers seen allow: a fault, or `prepared`."""
        msg = e.stream
        seen = self.streams.get(msg.sync_id) if msg is not None else None
        if msg is None or seen is None:
            return
        received = seen.chain.buckets
        if e.fault.startswith("restart_after:") and received > 0:
            e.stream = None
            self._close(e)
            e.dead_until = time.monotonic() + float(e.fault.split(":", 1)[1])
            return
        at = e.fault_seq("exit_at")
        if at is not None and received > at:
            e.stream = None
            self._close(e)
            return
        at = e.fault_seq("fail_at")
        if at is not None and received > at:
            e.stream = None
            self._result(
                e,
                schema.Failed(sync_id=msg.sync_id, code="ENGINE_FAILED", message="simulated failure", seq=at),
            )
            return
        end = seen.end
        if end is None or e.fault == "no_prepare":
            return
        e.stream = None
        if seen.bad or end.seq != received or end.checksum != seen.chain.value:
            why = seen.bad or f"received {received} buckets, the trainer sent {end.seq}"
            self._result(e, schema.Failed(sync_id=msg.sync_id, code="CHECKSUM_MISMATCH", message=why))
            return
        digest = self._digest_of(msg.version)
        if e.fault == "wrong_digest":
            digest = format(int(digest, 16) ^ 1, f"0{len(digest)}x")  # one bit off
        self._result(
            e,
            schema.Prepared(
                sync_id=msg.sync_id,
                buckets=received,
                nbytes=seen.chain.nbytes,
                chain=seen.chain.value,
                digest=digest,
            ),
        )

    def _on_message(self, e: SimEngine, frames: list[Any]) -> None:
        try:
            decoded = codec.decode(frames, allowed=schema.TO_ENGINE)
        except MessageError:
            return
        msg = decoded.msg
        if isinstance(msg, schema.Load):
            self._load(e, msg, decoded.payload)
        elif isinstance(
            msg, (schema.OpenStream, schema.Finalize, schema.Commit, schema.Served, schema.Abort)
        ):
            self._do(e, e.session.feed(msg))
        elif isinstance(msg, schema.Ok) and msg.id in e.register_ids:
            r = replies.decode(msg.body, replies.RegisterReply)
            e.reregister_sent = False
            if r.fanout is not None:
                e.fan = e.fan or fanout.Receiver(self.ctx, e.engine_id)
                old = e.fan.sock
                if e.fan.open(r.fanout, self.connect, self.poller) is not None:
                    self.by_sub.pop(old, None)
                    self.by_sub[e.fan.sock] = e
        elif isinstance(msg, schema.Ok) and not replies.decode(msg.body, replies.HeartbeatReply).known:
            if not e.reregister_sent:  # heartbeats sent before the daemon knew us
                e.reregister_sent = True
                self._send(e, self._register(e))
        elif isinstance(msg, schema.Error) and msg.code == ErrorCode.DUPLICATE_ENGINE.value:
            self._close(e)

    def _load(self, e: SimEngine, msg: schema.Load, payload: list[Any]) -> None:
        """A bucket arrives: a killed process never sees it; else the session decides."""
        e.loads += 1
        if e.fault_seq("exit_at") == msg.seq:
            self._close(e)
            return
        if e.fault.startswith("restart_after:"):
            self._close(e)
            e.dead_until = time.monotonic() + float(e.fault.split(":", 1)[1])
            return
        self._do(e, e.session.feed(msg, payload))

    def _do(self, e: SimEngine, actions: list[Action]) -> None:
        """Carry out what the engine's session decided, as a real engine's worker does
        (its applier's jobs simulated)."""
        for a in actions:
            if isinstance(a, Send):
                self._send(e, a.msg)
            elif isinstance(a, Stop):
                if a.published and e.fan is not None:
                    e.fan.end(a.sync_id)  # its published buckets come no more
                if a.stream and e.stream is not None and e.stream.sync_id == a.sync_id:
                    e.stream = None
            elif isinstance(a.job, Begin):
                e.parts = {}
            elif isinstance(a.job, schema.Load):
                self._apply(e, a.job, a.payload)
            elif isinstance(a.job, schema.OpenStream):
                e.stream = a.job
                self._advance(e)
            elif isinstance(a.job, schema.Finalize):
                self._finalize(e, a.job)
            # an abort, a commit or a served notice changes nothing more here: the sim
            # holds no weights, labels no outputs and hands no version to readers

    def _result(self, e: SimEngine, msg: schema.Message) -> None:
        """What the simulated applier reports, through the session as a real one's."""
        self._do(e, e.session.result(msg))

    def _apply(self, e: SimEngine, msg: schema.Load, payload: list[Any]) -> None:
        """The applier's part of a bucket: verify it, hash what arrived, report it loaded."""
        if e.fault_seq("fail_at") == msg.seq:
            self._failed(e, msg, ErrorCode.ENGINE_FAILED, "simulated failure")
            return
        if payload and bucket_checksum(payload[0].buffer, msg.tensors) != msg.checksum:
            self._failed(e, msg, ErrorCode.CHECKSUM_MISMATCH, f"bucket seq {msg.seq} arrived corrupted")
            return
        if payload and self.digest_bytes:  # the digest is of what arrived
            buf = memoryview(payload[0].buffer).cast("B")
            for t in msg.tensors:
                h = part_hasher(t.name, t.dtype, tuple(t.shape))
                h.update(buf[t.offset : t.offset + t.nbytes])
                e.parts[t.name] = h.digest()
        self._result(e, schema.Loaded(sync_id=msg.sync_id, seq=msg.seq, source=msg.source))

    def _report(self, e: SimEngine, now: float) -> None:
        s = e.session.reporting()
        for loaded in s.progress.reports() if s is not None else ():
            e.last_report = now
            self._send(e, loaded)

    def _failed(self, e: SimEngine, msg: schema.Load, code: ErrorCode, text: str) -> None:
        e.failed.add(msg.sync_id)
        self._result(
            e,
            schema.Failed(sync_id=msg.sync_id, code=code.value, message=text, seq=msg.seq, source=msg.source),
        )

    def _finalize(self, e: SimEngine, msg: schema.Finalize) -> None:
        """The post-load step, simulated: the session ran the guard (this runs once)."""
        if e.fault == "no_finalize" or msg.sync_id in e.failed:
            return  # a failed sync's finalize only releases what it held
        e.finalize_count += 1
        digest = combine(e.parts) if e.parts else self._digest_of(msg.version)
        if e.fault == "wrong_digest":
            digest = format(int(digest, 16) ^ 1, f"0{len(digest)}x")  # one bit off
        self._result(
            e,
            schema.Finalized(
                sync_id=msg.sync_id,
                version=msg.version,
                digest=digest,
                finalize_count=e.finalize_count,
                probes=tuple(p.expected or () for p in msg.probes),
            ),
        )

    def _digest_of(self, version: int) -> str:
        try:
            return (self.digests / str(version)).read_text().strip()
        except OSError:
            return f"{version:016x}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.simengine", description=__doc__.split("\n\n")[0])
    ap.add_argument("--connect", required=True, help="the daemon's engine address")
    ap.add_argument("--ids", required=True, help="comma-separated engine ids")
    ap.add_argument("--digests", required=True, type=Path, help="directory of <version> digest files")
    ap.add_argument("--heartbeat", type=float, default=1.0, help="seconds between heartbeats")
    ap.add_argument("--fault", action="append", default=[], help="ENGINE_ID=KIND[:ARG]")
    ap.add_argument("--data-plane", default="", help="the trainer's PUB address of stream headers")
    ap.add_argument("--no-fanout", action="store_true", help="take every bucket one send at a time")
    ap.add_argument(
        "--no-digest-bytes", action="store_true", help="report --digests' digest, hash nothing received"
    )
    args = ap.parse_args(argv)
    faults = dict(f.split("=", 1) for f in args.fault)
    fleet = Fleet(
        args.connect,
        args.ids.split(","),
        args.digests,
        args.heartbeat,
        faults,
        data_plane=args.data_plane,
        use_fanout=not args.no_fanout,
        digest_bytes=not args.no_digest_bytes,
    )
    signal.signal(signal.SIGTERM, lambda *_: fleet.stop())
    signal.signal(signal.SIGINT, lambda *_: fleet.stop())
    try:
        fleet.run()
    finally:
        fleet.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
