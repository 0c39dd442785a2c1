"""The bucket pipeline of a push: pack, send (a frame, a reference or a broadcast), keep at most
`window` buckets unacknowledged, resend on timeout. `Stream` works through the client's
`Connection`, on the thread that owns its socket.

Rules: a bucket's slot is reused only after that bucket was acknowledged by every engine
(through the daemon). On a group's path the bucket's metadata goes to the daemon
first, then its bytes go to the engines by broadcast; replies that arrive while a
broadcast runs are kept, in order, for the stream, and an error for this sync stops the
broadcast at once.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import msgspec
import torch

from messages import schema
from messages.buckets import Digester, Item, PackedBucket, iter_buckets
from messages.distgroup import GroupError
from messages.errors import ErrorCode, make_error
from messages.liblog import get_logger
from messages.link import Reconnected
from messages.replies import BucketAck
from messages.replies import decode as decode_reply
from messages.stream import (
    MAC_BYTES,
    Chain,
    bucket_header,
    bucket_mac,
    encode_metas,
    end_header,
    load_mac,
)
from messages.transports import Slots
from orchestrator.trainer.connection import Connection, error_from_reply
from orchestrator.trainer.group import TrainerGroup
from orchestrator.trainer.rings import FrameRing

log = get_logger("trainer")

# A push's progress callback: called with each bucket's bytes as it goes.
Progress = Callable[[int], object]
# The automatic window keeps at most this many bytes in flight (and never over MAX_WINDOW
# buckets): the trainer's ring, and the daemon's frames in flight, are window x bucket.
AUTO_INFLIGHT_BYTES = 128 << 20
MAX_WINDOW = 8
META_RESERVE = 64 << 10  # room after a framed bucket's bytes for its tensor metadata


def window_limit(window: int | None, bucket_bytes: int) -> int:
    """Slots a push needs: the fixed window, or the automatic window's ceiling."""
    if window is not None:
        return window
    return max(2, min(MAX_WINDOW, AUTO_INFLIGHT_BYTES // max(bucket_bytes, 1)))


class WindowSizer:
    """How many buckets to keep unacknowledged: enough to cover one round trip at the rate
    acknowledgements come back (a bandwidth-delay product, measured during the push), so
    the engines never wait for the trainer's next bucket, and no more. A fixed window
    stays as given."""

    def __init__(self, fixed: int | None, limit: int) -> None:
        self.fixed, self.limit = fixed, limit
        self.size = fixed if fixed is not None else min(2, limit)
        self.min_rtt = math.inf  # the fastest send -> ack seen: the pipeline's latency
        self.gap: float | None = None  # smoothed time between acks: its throughput
        self._last: float | None = None

    def acked(self, rtt: float, now: float) -> None:
        if self.fixed is not None:
            return
        self.min_rtt = min(self.min_rtt, rtt)
        if self._last is not None:
            g = now - self._last
            self.gap = g if self.gap is None else 0.75 * self.gap + 0.25 * g
        self._last = now
        if self.gap is not None and self.gap > 0:
            need = math.ceil(self.min_rtt / self.gap) + 1
            # at least two (one acked while the next crosses), never past the limit: the
            # daemon's cap is what its fan-out queue is sized for (a window of 1 that grew
            # to 2 made 8 sources overrun it and lose buckets)
            self.size = min(self.limit, max(2, need))


@dataclass(slots=True)
class Streamed:
    """What `_stream` did: buckets, bytes, resends, the trainer's phases, the window reached
    (and, on a group's stream, the chain over the buckets' checksums)."""

    buckets: int
    nbytes: int
    retries: int
    phases: dict[str, float]
    window: int
    chain: int | None = None
    # the bytes packing's passes went over: pack_copy written, pack_hash fed to the hashes
    # (counted by messages.buckets as it copies and hashes)
    pass_bytes: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class _Frame:
    """A framed stream's broadcast: a header or a payload of bucket `seq`."""

    seq: int
    data: torch.Tensor


@dataclass(slots=True)
class _InFlight:
    bucket: PackedBucket
    sent_at: float
    attempts: int = 1
    broadcast: bool = False  # its bytes went to the group (once: a resend is for the daemon)


class Stream:
    """The bucket pipeline of one client: its connection and its source index."""

    def __init__(self, conn: Connection, source: int = 0, seat: int | None = None) -> None:
        self.conn = conn
        self.source = source
        self.seat = seat  # the client's token: its buckets are taken only from its seat
        # the connection came back while a collective sync's buckets were in flight (taken
        # by the ack loop): a broadcast still waiting on its group gives up on it too
        self.relinked: str | None = None

    def bucket_msg(
        self,
        sync_id: str,
        b: PackedBucket,
        rid: int,
        checksum: int | None = None,
        ref: schema.Ref | None = None,
        mac: bytes | None = None,
    ) -> schema.Bucket:
        return schema.Bucket(
            sync_id=sync_id,
            seq=b.seq,
            tensors=b.tensors,
            checksum=b.checksum if checksum is None else checksum,
            id=rid,
            source=self.source,
            ref=ref,
            mac=mac,
            seat=self.seat,
        )

    def broadcast(self, sync_id: str, coll: TrainerGroup, bucket: PackedBucket | _Frame | None) -> None:
        """Wait for the broadcast in flight, then start `bucket`'s (None: only wait). The
        next bucket is packed while this one travels. Replies that arrive meanwhile are kept
        for the stream. An error from the daemon for this sync ends the broadcast at once; a
        failed broadcast raises the daemon's account of it (it names the engine) if one
        comes within 5 s."""
        failure: list[schema.Error] = []
        lost: list[bool] = []

        def ours(reply: schema.Message) -> bool:
            return isinstance(reply, schema.Error) and reply.sync_id in (sync_id, None)

        def take_replies() -> str | None:
            reply = self.conn.take_replies(ours)
            if isinstance(reply, schema.Error):
                failure.append(reply)
                return f"{reply.code}: {reply.message}"
            self.conn.link.pump()
            if self.conn.link.reconnected or self.relinked == sync_id:  # (the flag is left set:
                lost.append(True)  # the stream resends what was in flight)
                return "the connection to the daemon was re-established mid-sync"
            return None

        seq = coll.pending_seq
        try:
            coll.wait(take_replies)
            if bucket is not None:
                seq = bucket.seq
                coll.start(bucket.data, bucket.seq, give_up=take_replies)
        except GroupError as exc:
            deadline = time.monotonic() + 5.0
            while not failure and time.monotonic() < deadline:
                self.conn.sock.poll(50)
                take_replies()
            if failure:
                raise error_from_reply(failure[0]) from None
            if lost:  # a daemon that restarted has no record of the sync (it says UNKNOWN_SYNC)
                raise make_error(
                    ErrorCode.UNKNOWN_SYNC,
                    f"bucket seq {seq}: the daemon's connection dropped and came back while this "
                    f"trainer waited on its group (the daemon restarted?); the sync cannot go on: {exc}",
                    sync_id=sync_id,
                    state="LOADING_BUCKETS",
                ) from None
            raise make_error(
                exc.code, f"bucket seq {seq}: {exc}", sync_id=sync_id, state="LOADING_BUCKETS"
            ) from None

    def framed(
        self,
        sync_id: str,
        named: Iterable[tuple[str, Item]],
        bucket_bytes: int,
        progress: Progress | None,
        coll: TrainerGroup,
        digester: Digester | None = None,
        partial: bool = False,
    ) -> Streamed:
        """A group's stream (protocol v3): each bucket is framed (a fixed header, then
        its bytes followed by its tensor metadata) and broadcast to the engines; the
        daemon hears nothing until `finish`, which carries the chain. A bucket's slot is
        reused once its broadcast completed (its bytes left this process), so two slots
        suffice. An error the daemon pushes for this sync stops the stream at once."""
        ring = FrameRing(2)
        key = coll.mac_key(sync_id)  # with keys: every bucket carries a MAC (messages/stream.py)
        slots: dict[int, torch.Tensor] = {}
        spool = bool((coll.planned or {}).get("spool_copy"))
        copies: set[int] = set()  # request ids of spool copies not yet acknowledged
        acked = -1

        def spooled(through: int) -> None:
            """Wait until the daemon spooled every bucket up to `through` (its copy is
            sent from the slot, zero-copy: the slot is reused only after that)."""
            nonlocal acked
            while acked < through:
                reply = self.conn.recv(self.conn.timeout)
                if reply is None or isinstance(reply, Reconnected):
                    raise make_error(
                        ErrorCode.TIMEOUT,
                        f"spool copy of bucket seq {acked + 1} not acknowledged within {self.conn.timeout}s",
                        sync_id=sync_id,
                        state="LOADING_BUCKETS",
                    )
                rid = getattr(reply, "id", None)
                if isinstance(reply, schema.Error) and (rid in copies or reply.sync_id == sync_id):
                    raise error_from_reply(reply)
                if isinstance(reply, schema.Ok) and rid in copies:
                    copies.discard(rid)
                    done = decode_reply(reply.body, BucketAck).through
                    acked = max(acked, done if done is not None else -1)

        def alloc(seq: int, n: int) -> torch.Tensor:
            if spool:
                spooled(seq - 2)
            full = ring.slot(seq, n + META_RESERVE + MAC_BYTES)
            slots[seq % 2] = full
            return full[:n]

        chain = Chain()
        phases = {"pack": 0.0, "send": 0.0, "pack_copy": 0.0, "pack_hash": 0.0}
        counted = {"pack_copy": 0, "pack_hash": 0}
        t_loop = time.perf_counter()
        for b in iter_buckets(named, bucket_bytes, alloc=alloc, digester=digester):
            phases["pack_copy"] += b.copy_s
            phases["pack_hash"] += b.hash_s
            counted["pack_copy"] += b.copied
            counted["pack_hash"] += b.hashed
            t0 = time.perf_counter()
            metas = encode_metas(b.tensors)
            h = bucket_header(b.seq, metas, b.nbytes, b.checksum, mac=key is not None)
            tail = metas if key is None else metas + bucket_mac(key, h, b.data.numpy(), metas)
            full = slots[b.seq % 2]
            if b.nbytes + len(tail) <= full.numel():
                payload = full[: b.nbytes + len(tail)]
                payload[b.nbytes :].copy_(torch.frombuffer(bytearray(tail), dtype=torch.uint8))
            else:  # metadata past the reserve (thousands of tensors in a bucket): one copy
                payload = torch.cat([b.data, torch.frombuffer(bytearray(tail), dtype=torch.uint8)])
            head = torch.frombuffer(bytearray(h.encode()), dtype=torch.uint8)
            # each waits for the broadcast before it (the previous bucket's bytes are out)
            self.broadcast(sync_id, coll, _Frame(b.seq, head))
            self.broadcast(sync_id, coll, _Frame(b.seq, payload))
            chain.add(b.checksum, b.nbytes)
            if spool:  # the daemon keeps the version to roll back to and catch engines up
                rid = self.conn.new_id()
                copies.add(rid)
                msg = msgspec.structs.replace(self.bucket_msg(sync_id, b, rid), size=b.nbytes)
                self.conn.send(msg, [b.frame()])
            phases["send"] += time.perf_counter() - t0
            if progress is not None:
                progress(b.nbytes)
        t0 = time.perf_counter()
        end = end_header(chain.buckets, chain.nbytes, chain.value, partial=partial)
        end_frame = torch.frombuffer(bytearray(end.encode()), dtype=torch.uint8)
        self.broadcast(sync_id, coll, _Frame(chain.buckets, end_frame))
        self.broadcast(sync_id, coll, None)
        if spool:
            spooled(chain.buckets - 1)
        phases["send"] += time.perf_counter() - t0
        phases["pack"] = time.perf_counter() - t_loop - phases["send"]
        return Streamed(chain.buckets, chain.nbytes, 0, phases, 2, chain.value, counted)

    def run(
        self,
        sync_id: str,
        named: Iterable[tuple[str, Item]],
        bucket_bytes: int,
        window: int | None,
        progress: Progress | None,
        ring: Slots | None = None,
        digester: Digester | None = None,
        coll: TrainerGroup | None = None,
        max_pending: int | None = None,
    ) -> Streamed:
        # slots: bucket seq goes to slot seq % limit (a transport's ring may have fewer than asked)
        limit = ring.slots if ring is not None else window_limit(window, bucket_bytes)
        cap = min(limit, max_pending or limit)  # the daemon's cap too, for a fixed window as well
        sizer = WindowSizer(None if window is None else min(window, cap), cap)
        key = coll.mac_key(sync_id) if coll is not None else None  # with keys: a MAC per bucket
        inflight: dict[int, _InFlight] = {}  # seq -> bucket
        by_id: dict[int, int] = {}  # request id -> seq
        count = nbytes = retries = 0

        def send(f: _InFlight) -> None:
            rid = self.conn.new_id()
            by_id[rid] = f.bucket.seq
            if coll is not None:
                b = f.bucket
                mac = load_mac(key, self.source, b.seq, b.data.numpy()) if key is not None else None
                msg = msgspec.structs.replace(self.bucket_msg(sync_id, b, rid, mac=mac), size=b.nbytes)
                self.conn.send(msg, [b.frame()] if (coll.planned or {}).get("spool_copy") else [])
                if not f.broadcast:  # a resend (a timeout, a reconnect) is for the daemon:
                    f.broadcast = True  # the engines have the bytes
                    self.broadcast(sync_id, coll, b)
            elif ring is not None:
                ref = ring.ref(f.bucket.seq, f.bucket.nbytes)
                self.conn.send(self.bucket_msg(sync_id, f.bucket, rid, ref=ref))
            else:
                self.conn.send(self.bucket_msg(sync_id, f.bucket, rid), [f.bucket.frame()])

        phases = {"pack": 0.0, "send": 0.0, "wait_acks": 0.0, "pack_copy": 0.0, "pack_hash": 0.0}
        counted = {"pack_copy": 0, "pack_hash": 0}

        def wait_one() -> None:
            t0 = time.perf_counter()
            try:
                _wait_one()
            finally:
                phases["wait_acks"] += time.perf_counter() - t0

        def _wait_one() -> None:
            nonlocal retries
            oldest = min(inflight.values(), key=lambda f: f.sent_at)
            reply = self.conn.recv(max(0.0, oldest.sent_at + self.conn.timeout - time.monotonic()))
            if isinstance(reply, Reconnected):  # what was in flight died with the old connection
                if coll is not None:
                    self.relinked = sync_id
                for f in sorted(inflight.values(), key=lambda f: f.bucket.seq):
                    f.sent_at = time.monotonic()
                    send(f)
                log.warning("buckets_resent_after_reconnect", sync_id=sync_id, buckets=len(inflight))
                return
            if reply is None:  # the oldest timed out: resend it (same sync_id and seq)
                if oldest.attempts > self.conn.retries:
                    raise make_error(
                        ErrorCode.TIMEOUT,
                        f"bucket seq {oldest.bucket.seq} not acknowledged after "
                        f"{oldest.attempts} attempt(s) of {self.conn.timeout}s",
                        sync_id=sync_id,
                        state="LOADING_BUCKETS",
                    )
                oldest.attempts += 1
                oldest.sent_at = time.monotonic()
                retries += 1
                log.warning("bucket_resent", sync_id=sync_id, seq=oldest.bucket.seq, attempt=oldest.attempts)
                send(oldest)
                return
            seq = by_id.pop(getattr(reply, "id", -1), None)
            if isinstance(reply, schema.Error):
                if seq is None:
                    return  # a reply to an earlier attempt already handled
                raise error_from_reply(reply)
            # cumulative: `through` acknowledges every bucket of this source up to it
            through = decode_reply(reply.body, BucketAck).through if isinstance(reply, schema.Ok) else None
            if seq is None and through is None:
                return  # a reply to an earlier attempt already handled
            if through is not None:
                acked = sorted(s for s in inflight if s <= through)
            else:
                acked = [seq] if seq is not None else []
            if through is not None:  # their requests need no reply of their own now
                for rid in [rid for rid, s in by_id.items() if s <= through]:
                    del by_id[rid]
            now = time.monotonic()
            for s in acked:
                done = inflight.pop(s, None)
                if done is not None and done.attempts == 1 and s == acked[-1]:
                    sizer.acked(now - done.sent_at, now)
                if done is not None and progress is not None:
                    progress(done.bucket.nbytes)

        slots: Slots | FrameRing = ring if ring is not None else FrameRing(limit)

        def alloc(seq: int, n: int) -> torch.Tensor:
            # Room first: slot seq % limit belongs to bucket seq - limit until that bucket
            # is acknowledged (every engine has copied it out), whatever order acks come in.
            while len(inflight) >= sizer.size or (seq - limit) in inflight:
                wait_one()
            return slots.slot(seq, n)

        t_loop = time.perf_counter()
        # frames and references: a tensor larger than a bucket is split, so no bucket exceeds
        # the size the daemon sized its fan-out for (and engines assemble it)
        split = coll is None
        for bucket in iter_buckets(named, bucket_bytes, alloc=alloc, digester=digester, split=split):
            f = _InFlight(bucket, time.monotonic())
            inflight[bucket.seq] = f
            phases["pack_copy"] += bucket.copy_s
            phases["pack_hash"] += bucket.hash_s
            counted["pack_copy"] += bucket.copied
            counted["pack_hash"] += bucket.hashed
            t0 = time.perf_counter()
            send(f)
            phases["send"] += time.perf_counter() - t0
            count += 1
            nbytes += bucket.nbytes
        # packing (copy + checksum + digest) is what the loop spent outside send and acks
        phases["pack"] = time.perf_counter() - t_loop - phases["send"] - phases["wait_acks"]
        t0 = time.perf_counter()
        if coll is not None:
            self.broadcast(sync_id, coll, None)  # the last bucket's broadcast
        phases["send"] += time.perf_counter() - t0
        while inflight:
            wait_one()
        return Streamed(count, nbytes, retries, phases, sizer.size, pass_bytes=counted)
