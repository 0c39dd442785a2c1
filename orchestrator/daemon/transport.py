"""The daemon's sockets: two ROUTERs, their peers, the engines' fan-out (an XPUB, see
messages/fanout.py), and the only code that sends on them.

Rules: every method runs on the daemon's one event-loop task, which owns both sockets and
their monitors (pyzmq sockets are not thread-safe). Sends never block: the ROUTERs' HWMs
are 0 and traffic to them is bounded by each trainer's window, so a send completes at once;
the fan-out's XPUB queues a bounded number per connection and drops past it;
ROUTER_MANDATORY turns an unknown peer into an error here, not a silent drop. A reply
that cannot be delivered is logged: the peer's deadline (heartbeats, the sync's) handles
the rest.
"""

from __future__ import annotations

import socket as pysocket
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import structlog
import zmq

from messages import codec, fanout, schema
from messages.errors import WeightSyncError
from messages.replies import JsonObject
from orchestrator.daemon.auth import ServerAuth
from orchestrator.daemon.peers import PeerTracker

log = structlog.get_logger()


# The frames of one message sent: headers as bytes, payloads as received frames or views.
Outgoing = Sequence[bytes | memoryview | zmq.Frame]
# How the daemon's own request is answered: the ok body, or the error.
OnReply = Callable[[JsonObject | None, WeightSyncError | None], None]


@dataclass(slots=True)
class Waiter:
    """Who waits for a reply: a trainer connection and its request id, or (the daemon's own
    requests: a rollback) a callback."""

    ident: bytes
    req_id: int
    on_reply: OnReply | None = None


@dataclass(slots=True)
class Stats:
    buckets: int = 0
    bytes_in: int = 0  # bucket bytes that passed through the daemon
    bytes_announced: int = 0  # bucket bytes of every sync, however they travelled
    errors: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    received: int = 0  # messages received on both sockets
    sent: int = 0  # messages sent on both sockets
    published: int = 0  # of `sent`, published on the fan-out (one for every subscriber)
    heartbeats: int = 0  # engines' heartbeats among `received` (answered only when unknown)


def refuse_live_ipc(addr: str) -> None:
    """ZeroMQ silently takes over an ipc:// path another process is bound to (it unlinks
    the file), which would split engines between two daemons. Refuse if someone answers."""
    if not addr.startswith("ipc://"):
        return
    path = addr[len("ipc://") :]
    probe = pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        return  # nobody there (or a stale file ZeroMQ will replace)
    finally:
        probe.close()
    raise OSError(f"{addr} is in use by another process")


class Transport:
    def __init__(self, ctx: zmq.SyncContext, stats: Stats, auth: ServerAuth | None = None) -> None:
        self.ctx = ctx
        self.stats = stats
        self.auth = auth
        self.trainer: zmq.SyncSocket | None = None
        self.engine: zmq.SyncSocket | None = None
        self.trainer_peers: PeerTracker | None = None
        self.engine_peers: PeerTracker | None = None
        self.engine_ident: dict[str, bytes] = {}  # engine id -> the routing id it registered on
        self.ident_engine: dict[bytes, str] = {}
        self.bound: dict[str, str] = {}
        self.fanout: zmq.SyncSocket | None = None
        self.fanout_budget: int | None = None  # bytes a fan-out connection may queue
        self.max_pending = 64
        self.fanout_hwm = 0  # what each fan-out connection may queue now (messages)
        self.retired: list[zmq.SyncSocket] = []  # fan-out sockets replaced, to be closed
        self.fanout_subs: dict[str, int] = defaultdict(int)  # engine id -> live subscriptions
        self.link_timeout = fanout.LINK_TIMEOUT_S

    def bind(self, trainer_addr: str, engine_addr: str, max_trainer_msg: int, max_engine_msg: int) -> None:
        self.trainer = self._router(trainer_addr, max_trainer_msg, "trainer")
        self.engine = self._router(engine_addr, max_engine_msg, "engine")
        self.trainer_peers = PeerTracker(self.trainer)
        self.engine_peers = PeerTracker(self.engine)
        self.bound["trainer"] = self.trainer.getsockopt_string(zmq.LAST_ENDPOINT)
        self.bound["engine"] = self.engine.getsockopt_string(zmq.LAST_ENDPOINT)

    def _router(self, addr: str, max_msg: int, role: str) -> zmq.SyncSocket:
        refuse_live_ipc(addr)
        sock: zmq.SyncSocket = self.ctx.socket(zmq.ROUTER)
        if self.auth is not None:
            self.auth.apply(sock, role)
        sock.setsockopt(zmq.MAXMSGSIZE, max_msg)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unknown peer is an error, not a drop
        sock.setsockopt(zmq.LINGER, 500)
        sock.setsockopt(zmq.SNDHWM, 0)  # bounded by the window, not by a silent drop
        sock.setsockopt(zmq.RCVHWM, 0)
        try:
            sock.bind(addr)
        except zmq.ZMQError:
            sock.close(linger=0)
            raise
        return sock

    def bind_fanout(
        self,
        addr: str,
        explicit: bool,
        budget: int,
        max_pending: int,
        link_timeout: float = fanout.LINK_TIMEOUT_S,
    ) -> None:
        """The fan-out's XPUB. A default address that cannot be bound (a port taken) leaves
        the daemon without one, said in the log: engines then get one send each.

        Each connection queues a bounded number of published messages (SNDHWM, sized for
        each sync's bucket size by `fanout_queue`; the XPUB drops for that connection alone
        past it): a frozen engine or a subscriber that never reads holds that many, not a
        model per push. Participants never reach it (messages.fanout.queue_len)."""
        if not addr:
            return
        self.fanout_budget, self.max_pending = budget, max_pending
        self.link_timeout = link_timeout  # a silent fan-out connection is closed after it
        hwm = fanout.queue_len(fanout.window_cap(budget, schema.DEFAULT_BUCKET_BYTES, max_pending))
        try:
            refuse_live_ipc(addr)
            self.fanout = self._xpub(addr, hwm)
        except (zmq.ZMQError, OSError) as exc:
            if explicit:
                raise
            log.warning("fanout_unavailable", addr=addr, error=str(exc))
            return
        self.fanout_hwm = hwm
        self.bound["fanout"] = self.fanout.getsockopt_string(zmq.LAST_ENDPOINT)

    def _xpub(self, addr: str, hwm: int) -> zmq.SyncSocket:
        sock: zmq.SyncSocket = self.ctx.socket(zmq.XPUB)
        if self.auth is not None:
            self.auth.apply(sock, "engine")
        sock.setsockopt(zmq.SNDHWM, hwm)
        sock.setsockopt(zmq.XPUB_VERBOSE, 1)  # every engine's subscription, not only the first
        sock.setsockopt(zmq.XPUB_VERBOSER, 1)  # and every unsubscription (a closed connection)
        sock.setsockopt(zmq.MAXMSGSIZE, 1024)  # subscriptions only
        sock.setsockopt(zmq.LINGER, 500)
        fanout.link_options(sock, self.link_timeout)
        try:
            sock.bind(addr)
        except zmq.ZMQError:
            sock.close(linger=0)
            raise
        return sock

    def fanout_subscriptions(self) -> int:
        """Read the subscriptions waiting on the fan-out: which engines can take published
        buckets. Returns how many were read."""
        n, joined = 0, False
        while self.fanout is not None:
            try:
                frame = self.fanout.recv(flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            n += 1
            joined = joined or frame[:1] == b"\x01"
            sub = fanout.subscription(frame)
            if sub is None:
                continue
            on, eid = sub
            self.fanout_subs[eid] += 1 if on else -1
            if self.fanout_subs[eid] <= 0:
                del self.fanout_subs[eid]
        if joined and self.fanout is not None:  # new connections: the current bound, not bind's
            self.fanout.setsockopt(zmq.SNDHWM, self.fanout_hwm)
        return n

    def fanout_queue(self, bucket_bytes: int, floor: int = 1, shrink: bool = True, sources: int = 1) -> None:
        """A sync's buckets are cut to `bucket_bytes`: every fan-out connection, present and
        future, queues at most what a participant needs with the largest window a trainer
        keeps for that size (messages.fanout.window_cap), so a non-reader holds about the
        budget. `floor`: the window of the daemon's own replays. `shrink` False (a replay
        of the spool, cut like the trainer's last sync): only ever grown.

        A larger queue is set on every connection (libzmq applies a new SNDHWM to those it
        has; new ones get the bind-time value, so it is set again at each subscription). A
        smaller one cannot be: libzmq's writer learns what a reader took only every
        (queue + 1) // 2 messages, so lowered below that it can count an idle connection
        full for good. The XPUB is bound anew with it instead (its queues dropped; every
        engine's SUB reconnects and subscribes again by itself, and this sync's buckets
        go one send each)."""
        if self.fanout is None:
            return
        if self.fanout_budget is None:
            hwm = fanout.queue_len(max(floor, self.max_pending))
        else:  # every source's window (each within its share: messages.fanout.sync_queue)
            per_source = max(1, self.max_pending // max(1, sources))
            _cap, hwm = fanout.sync_queue(self.fanout_budget, bucket_bytes, sources, per_source)
            hwm = max(hwm, fanout.queue_len(floor))
        if hwm >= self.fanout_hwm or not shrink:
            hwm = max(hwm, self.fanout_hwm)
            self.fanout_hwm = hwm
            self.fanout.setsockopt(zmq.SNDHWM, hwm)
            return
        addr = self.bound["fanout"]
        old, self.fanout = self.fanout, None
        self.fanout_subs.clear()
        try:  # the address is free for the new socket; the old one's connections stay until
            old.unbind(addr)  # the loop closes it (`close_retired`: never under a pending poll)
        except zmq.ZMQError:
            pass
        self.retired.append(old)
        try:
            self.fanout = self._xpub(addr, hwm)
        except zmq.ZMQError as exc:  # the address was taken meanwhile: no fan-out from now
            log.warning("fanout_unavailable", addr=addr, error=str(exc))
            self.bound.pop("fanout", None)
            return
        self.fanout_hwm = hwm
        log.info("fanout_rebound", addr=addr, queue=hwm)

    def close_retired(self) -> None:
        """Close the fan-out sockets replaced since the last call (their connections drop;
        each engine's SUB reconnects to the new one). The loop calls it once no poller
        holds them."""
        for sock in self.retired:
            sock.close(linger=0)
        self.retired.clear()

    def fanout_live(self, engine_id: str) -> bool:
        return self.fanout is not None and self.fanout_subs.get(engine_id, 0) > 0

    def publish(self, frames: Outgoing) -> bool:
        """One message to every engine subscribed to the fan-out (`DATA` prepended).

        The XPUB's mailbox is processed first (`ZMQ_EVENTS` does it unthrottled): libzmq's
        writer learns what a reader took only from `activate_write` commands in that
        mailbox, and `send()` processes it at most once a millisecond, so a burst sent
        right after the reader's reports would judge its queue by a stale count, with no
        bound (libzmq's socket_base_t::process_commands). Processed here, the count lags
        by less than half the queue, as messages.fanout.queue_len assumes."""
        try:
            if self.fanout is not None:
                self.fanout.getsockopt(zmq.EVENTS)
            self._send_now(self.fanout, [fanout.DATA, *frames])
            self.stats.published += 1
            return True
        except zmq.ZMQError as exc:
            log.warning("fanout_unpublishable", error=str(exc))
            return False

    def close(self) -> None:
        for peers in (self.trainer_peers, self.engine_peers):
            if peers is not None:
                peers.close()
        for sock in (self.trainer, self.engine, self.fanout):
            if sock is not None:
                sock.close(linger=500)
        self.close_retired()

    # -- receiving ------------------------------------------------------------------------
    def recv(self, sock: zmq.SyncSocket) -> list[zmq.Frame] | None:
        """One message (routing id first), or None when none is waiting."""
        try:
            frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        peers = self.engine_peers if sock is self.engine else self.trainer_peers
        if peers is not None:
            peers.seen(frames[0].bytes, frames[0])
        self.stats.received += 1
        return frames

    # -- engines' identities --------------------------------------------------------------
    def engine_of(self, ident: bytes) -> str | None:
        return self.ident_engine.get(ident)

    def other_connection(self, engine_id: str, ident: bytes) -> bool:
        """`engine_id` is registered on another connection that is still open."""
        old = self.engine_ident.get(engine_id)
        if old is None or old == ident:
            return False
        return self.engine_peers is None or self.engine_peers.connected(old)

    def registered(self, engine_id: str, ident: bytes) -> None:
        old = self.engine_ident.get(engine_id)
        if old is not None and old != ident:
            self.ident_engine.pop(old, None)
        self.engine_ident[engine_id] = ident
        self.ident_engine[ident] = engine_id

    def forget_engine(self, engine_id: str) -> None:
        """`engine_id`'s record expired: its routing id goes (a live process registering
        under it again is new)."""
        ident = self.engine_ident.pop(engine_id, None)
        if ident is not None and self.ident_engine.get(ident) == engine_id:
            del self.ident_engine[ident]

    # -- sending --------------------------------------------------------------------------
    def _send_now(self, sock: zmq.SyncSocket | None, frames: Outgoing) -> None:
        """Send without blocking; a send error is raised here, to the caller."""
        if sock is None:
            raise zmq.ZMQError(zmq.ENOTSOCK, "socket closed")
        sock.send_multipart(frames, copy=False, flags=zmq.NOBLOCK)
        self.stats.sent += 1

    def send_trainer(self, ident: bytes, msg: schema.Message) -> None:
        try:
            self._send_now(self.trainer, [ident, codec.encode_header(msg)])
        except zmq.ZMQError as exc:  # the trainer went away; its sync's deadline handles it
            log.warning("reply_undeliverable", error=str(exc), type=msg.TYPE)

    def reply_engine(self, ident: bytes, msg: schema.Message) -> None:
        try:
            self._send_now(self.engine, [ident, codec.encode_header(msg)])
        except zmq.ZMQError as exc:  # the engine went away; its heartbeat deadline handles it
            log.warning("reply_undeliverable", error=str(exc), type=msg.TYPE, src="engine")

    def reply_ok(self, w: Waiter, body: JsonObject) -> None:
        if w.on_reply is not None:
            w.on_reply(body, None)
            return
        self.send_trainer(w.ident, schema.Ok(id=w.req_id, body=body))

    def reply_error(self, w: Waiter, err: WeightSyncError) -> None:
        if w.on_reply is not None:
            w.on_reply(None, err)
            return
        self.stats.errors[err.code.value] += 1
        self.send_trainer(w.ident, error_message(err, w.req_id))

    def send_engine(self, engine_id: str, frames: Outgoing) -> bool:
        ident = self.engine_ident.get(engine_id)
        if ident is None:
            return False
        try:
            self._send_now(self.engine, [ident, *frames])
            return True
        except zmq.ZMQError as exc:
            log.warning("engine_unreachable", engine_id=engine_id, error=str(exc))
            return False


def error_message(err: WeightSyncError, req_id: int) -> schema.Error:
    """The `error` message that answers request `req_id` with `err` (its code, message,
    the daemon's state and served version, the sync and details), on either socket."""
    f = err.to_fields()
    return schema.Error(
        id=req_id,
        code=f["code"],
        message=f["message"],
        state=f["state"],
        version=f["version"],
        sync_id=f["sync_id"],
        details=f.get("details"),
    )
