"""The daemon's fan-out (protocol v4): one publish per bucket for a whole fleet.

On syncs by frame or by reference the daemon used to send every bucket to every engine, one send
each: O(engines x buckets) of its CPU. With the fan-out it publishes each bucket once on
an XPUB socket beside its engine socket, and libzmq's I/O thread copies it onto each
engine's connection.

Rules:
- An engine subscribes its SUB to DATA (every published message) and then to LIVE + its
  id. The XPUB passes each subscription up to the daemon, so the second one tells it that
  this engine's subscription is in place: a bucket published from then on reaches it.
- A sync's first published message is a `FanoutOpen` naming its participants (by frame and
  by reference). An engine takes a published bucket only if that open named it for the bucket's
  kind; the daemon sends one by one to every other engine (joined late, no fan-out) and,
  once a named participant drops out of a bucket's targets, to everyone for the rest of
  the sync.
- The fan-out and the engine socket are two connections: the order between them is not
  kept. An engine therefore drops published buckets of a sync it saw end (an `abort`, or
  a newer sync begun), so a bucket that arrives late never starts a sync again.
- Each fan-out connection queues a bounded number of published messages (SNDHWM, set
  for each sync from its bucket size: `queue_len`); past it the XPUB drops for that
  connection alone. A frozen engine or a subscriber that never reads so costs the daemon
  about the daemon's `fanout_queue_bytes`, whatever it does. A participant never reaches
  the bound: each source's window stays within `window_cap` of its share of the budget
  (the daemon says it in the begin reply), and a participant's queue holds at most its
  sync's open and the sources' windows. The bound is in bytes: the daemon caps a sync's
  bucket size (`max_bucket`: the begin reply's `bucket_bytes`), a trainer splits a tensor
  larger than that across buckets, and a frame larger is refused (TOO_LARGE). A connection that breaks loses what was queued on it, like a ROUTER peer's, and
  the sync's deadlines handle it.
- Both ends of a fan-out connection send ZMTP heartbeats (`link_options`): a connection
  that carries nothing either way for its timeout (a cut link, a host gone dark: no FIN
  reaches either end) is closed by libzmq, and what was queued on it is dropped, instead
  of draining through the link once it heals ahead of the next sync's buckets. The
  engine's SUB then connects again by itself and subscribes anew. Each end's heartbeats
  travel the direction that carries no buckets, so a slow link that is busy is never taken
  for a dead one.

Torch-free: the engine worker and the fleet benchmark's simulated engines use `Receiver`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

import zmq

from messages import codec, schema
from messages.bounded import LRU
from messages.errors import MessageError
from messages.schema import REPORT_INTERVAL

if TYPE_CHECKING:
    from messages.keys import ClientKeys

DATA = b"F"  # the topic of every published message
LIVE = b"E"  # LIVE + engine id: "this engine's subscription is in place"
KEPT = 8  # syncs whose open an engine remembers: the running one, and late buckets of a few before
ENDED = 64  # syncs an engine remembers as ended
REPORTS_PER_SECOND = 4000  # progress reports a fleet sends the daemon at most, about
REPORT_INTERVAL_MAX = 0.05

Kind = Literal["frame", "ref"]  # what a published bucket carries (messages.transports)
LINK_HEARTBEAT_S = 1.0  # a fan-out connection's ZMTP heartbeat interval, each end
LINK_TIMEOUT_S = 5.0  # silent this long after a heartbeat: the connection is closed


def link_options(sock: zmq.SyncSocket, timeout: float = LINK_TIMEOUT_S) -> None:
    """ZMTP heartbeats on a fan-out socket (see Rules): closed after `timeout` seconds of
    silence from the other end."""
    sock.setsockopt(zmq.HEARTBEAT_IVL, int(min(LINK_HEARTBEAT_S, timeout / 3) * 1000))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(timeout * 1000))


def window_cap(queue_bytes: int | None, bucket_bytes: int, max_pending: int) -> int:
    """The most buckets of `bucket_bytes` a trainer keeps unacknowledged when the daemon's
    fan-out may queue `queue_bytes` per connection (None: no fan-out, `max_pending`):
    `queue_len` of it, and the one frame the daemon is receiving or forwarding besides,
    must fit the budget."""
    if queue_bytes is None:
        return max(1, max_pending)
    fits = queue_bytes // max(bucket_bytes, 1) - 1
    return max(1, min(max_pending, (fits - 2) // 2))


def max_bucket(queue_bytes: int, sources: int = 1) -> int:
    """The largest bucket a sync of `sources` may cut when each connection may queue
    `queue_bytes`: with every source's window at its floor of one bucket, the queue its
    participants need (`queue_len(sources)`), and the frame in flight besides, must fit
    the budget."""
    return max(1, queue_bytes // (queue_len(max(1, sources)) + 1))


def sync_queue(queue_bytes: int, bucket_bytes: int, sources: int, max_pending: int) -> tuple[int, int]:
    """(each source's window cap, the queue a connection needs in messages) for a sync of
    `sources`, each cutting buckets of at most `bucket_bytes` (<= `max_bucket`) with
    `max_pending` requests of its own: the sources share the budget, and a participant's
    queue holds the sync's open and every source's window. Then (queue + 1) x
    bucket_bytes <= queue_bytes (tests/unit/test_fanout_rule.py checks it over sources and sizes)."""
    sources = max(1, sources)
    cap = window_cap(queue_bytes // sources, bucket_bytes, max_pending)
    return cap, queue_len(cap * sources)


def queue_len(cap: int) -> int:
    """Published messages a connection may queue so that a participant never misses one
    with a window of `cap`: libzmq's writer learns what its reader took only every
    (len + 1) // 2 messages, so the queue may look up to half fuller than it is; a
    participant holds the sync's open and the window."""
    return 2 * cap + 2


def bind_address(engine_bind: str) -> str:
    """The fan-out's default address beside the engine socket: `ipc://P` -> `ipc://P.fanout`,
    `tcp://H:P` -> `tcp://H:P+1` (`tcp://H:0` -> `tcp://H:0`, a free port)."""
    if engine_bind.startswith("ipc://"):
        return engine_bind + ".fanout"
    head, _, port = engine_bind.rpartition(":")
    if engine_bind.startswith("tcp://") and port.isdigit():
        return f"{head}:{int(port) + 1 if int(port) else 0}"
    return ""


def connect_address(announced: str, daemon: str) -> str:
    """Where an engine connects for the fan-out the daemon announced: over TCP the host it
    reaches the daemon by (the daemon may be bound to 0.0.0.0 or known by another name)
    and the announced port; over IPC the announced path."""
    if announced.startswith("tcp://") and daemon.startswith("tcp://"):
        return f"{daemon.rpartition(':')[0]}:{announced.rpartition(':')[2]}"
    return announced


def report_interval(participants: int) -> float:
    """Seconds between two progress reports of each of `participants` engines: REPORT_INTERVAL
    up to 8 engines, then longer, so the fleet sends about REPORTS_PER_SECOND at most (each
    costs the daemon tens of microseconds), capped at REPORT_INTERVAL_MAX."""
    return min(REPORT_INTERVAL_MAX, max(REPORT_INTERVAL, participants / REPORTS_PER_SECOND))


def live_topic(engine_id: str) -> bytes:
    return LIVE + engine_id.encode()


def subscription(frame: bytes) -> tuple[bool, str] | None:
    """An XPUB subscription message -> (subscribed?, engine id), or None if it is not a
    LIVE topic (DATA, or anything else a peer subscribed to)."""
    if len(frame) < 2 or frame[0] not in (0, 1) or frame[1:2] != LIVE:
        return None
    try:
        return frame[0] == 1, frame[2:].decode()
    except UnicodeDecodeError:
        return None


def kind_of(msg: schema.Load) -> Kind:
    return "ref" if msg.ref is not None else "frame"


class Receiver:
    """One engine's SUB socket on the daemon's fan-out, and which published buckets it
    takes. Used by the thread that owns the engine's other sockets."""

    def __init__(self, ctx: zmq.SyncContext, engine_id: str, keys: ClientKeys | None = None) -> None:
        self.ctx = ctx
        self.engine_id = engine_id
        self.keys = keys
        self.sock: zmq.SyncSocket | None = None
        self.addr = ""
        self.intervals: dict[str, float] = {}  # sync id -> its report interval (the open's)
        # sync id -> what it takes; its interval goes with it
        self.takes: LRU[str, Kind | None] = LRU(KEPT, lambda sync_id, _: self.intervals.pop(sync_id, None))
        self.ended: deque[str] = deque(maxlen=ENDED)
        self.refused = 0  # published messages that did not decode
        self.dropped = 0  # published buckets this engine does not take
        self.last_dropped: tuple[str, int, int, str] | None = None  # (sync, source, seq, why)

    def open(self, announced: str, daemon: str, poller: zmq.Poller) -> zmq.SyncSocket | None:
        """Subscribe at the announced fan-out, polled by `poller` (the old socket leaves
        it); a new socket only if the address changed. Returns the socket when it is new,
        else None."""
        addr = connect_address(announced, daemon)
        if self.sock is not None and addr == self.addr:
            return None
        if self.sock is not None:
            poller.unregister(self.sock)
        self.close()
        sock: zmq.SyncSocket = self.ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.LINGER, 0)
        link_options(sock)
        if self.keys is not None:
            self.keys.apply(sock)
        sock.setsockopt(zmq.SUBSCRIBE, DATA)
        sock.setsockopt(zmq.SUBSCRIBE, live_topic(self.engine_id))  # after DATA: see Rules
        sock.connect(addr)
        poller.register(sock, zmq.POLLIN)
        self.sock, self.addr = sock, addr
        return sock

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close(linger=0)
        self.sock, self.addr = None, ""

    def report_interval(self, sync_id: str) -> float:
        """The sync's report interval: its open's, else REPORT_INTERVAL."""
        return self.intervals.get(sync_id, REPORT_INTERVAL)

    def end(self, sync_id: str) -> None:
        """The sync is over for this engine (aborted, or superseded by a newer one)."""
        if sync_id not in self.ended:
            self.ended.append(sync_id)

    def take(self, frames: Sequence[codec.Frame]) -> tuple[schema.Load, list[codec.Frame]] | None:
        """A published message -> the bucket to apply (a `load`), or None (an open,
        recorded; a bucket this engine does not take; something that does not decode)."""
        try:
            decoded = codec.decode(frames[1:], allowed=schema.PUBLISHED)
        except MessageError:
            self.refused += 1
            return None
        msg = decoded.msg
        if isinstance(msg, schema.FanoutOpen):
            me = self.engine_id
            self.intervals[msg.sync_id] = msg.report_interval
            self.takes[msg.sync_id] = "frame" if me in msg.frames else "ref" if me in msg.refs else None
            return None
        if not isinstance(msg, schema.Load):
            self.dropped += 1
            return None
        why = (
            "its sync ended here"
            if msg.sync_id in self.ended
            else "no open of its sync named this engine for it"
            if self.takes.get(msg.sync_id) != kind_of(msg)
            else None
        )
        if why is not None:
            self.dropped += 1
            self.last_dropped = (msg.sync_id, msg.source, msg.seq, why)
            return None
        return msg, decoded.payload

    def recv_all(self, budget: int = 256) -> list[tuple[schema.Load, list[codec.Frame]]]:
        """The buckets waiting on the socket that this engine takes (at most `budget`
        messages read)."""
        out: list[tuple[schema.Load, list[codec.Frame]]] = []
        if self.sock is None:
            return out
        for _ in range(budget):
            try:
                frames = self.sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            d = self.take(frames)
            if d is not None:
                out.append(d)
        return out
