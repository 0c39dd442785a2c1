"""A trainer's connection to the daemon: one DEALER socket, its monitor, request ids,
resends.

Rules: the socket is used only by the thread that created the client. A send never
blocks for good (no connection: it waits while the monitor can say why, then TIMEOUT).
A request that gets no reply in `timeout` is resent with a new id (requests are
idempotent on the daemon: the same sync_id and seq). Every error reply raises the
`WeightSyncError` subclass of its code, carrying the daemon's state and version; one that
says this address is the daemon's engine socket (WRONG_SOCKET) raises at once, naming the
trainer socket to use, without the daemon's state (it says nothing of a sync). Replies
read while a broadcast runs are kept, in order, for whoever reads next.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence

import zmq

from messages import codec, schema
from messages.errors import ErrorCode, WeightSyncError, make_error, wrong_socket_line
from messages.keys import ClientKeys
from messages.liblog import get_logger
from messages.link import RECONNECTED, AddressError, Link, Reconnected, address_hint
from messages.replies import JsonObject

log = get_logger("trainer")


def error_from_reply(msg: schema.Error) -> WeightSyncError:
    try:
        code = ErrorCode(msg.code)
    except ValueError:
        code = ErrorCode.INTERNAL
    return make_error(
        code, msg.message, state=msg.state, version=msg.version, sync_id=msg.sync_id, details=msg.details
    )


class Connection:
    def __init__(
        self,
        addr: str,
        *,
        timeout: float,
        retries: int,
        ctx: zmq.SyncContext,
        keys: ClientKeys | None,
        connect_timeout: float,
    ) -> None:
        self.addr = addr
        self.timeout = timeout
        self.retries = retries
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        if keys is not None:
            keys.apply(self.sock)
        # Before connect, so the monitor sees the first attempt (tells no daemon from a
        # refused key within connect_timeout instead of after every retry's timeout).
        self.link = Link(self.sock, addr, connect_timeout, reconnect_timeout=max(timeout, connect_timeout))
        try:
            self.sock.connect(addr)
        except zmq.ZMQError as exc:
            self.close()
            raise AddressError(f"invalid address {addr!r} ({exc}); {address_hint(addr)}") from None
        self._next_id = 0
        self._early: deque[schema.Message] = deque()  # replies read while a broadcast ran
        self._pushed: deque[schema.Error] = deque(maxlen=16)  # errors sent unasked (id 0)

    def close(self) -> None:
        self.link.close()
        self.sock.close(linger=0)

    def new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def send(self, msg: schema.Message, payload: Sequence[codec.Frame] = ()) -> None:
        """Send without ever blocking for good: a DEALER with no live connection (nothing
        listens, or each CURVE handshake fails) has no pipe to queue on, and a plain send
        would wait forever. Wait for room while the socket monitor can still say why not."""
        frames = codec.encode(msg, payload)
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                self.sock.send_multipart(frames, copy=False, flags=zmq.NOBLOCK)
                return
            except zmq.Again:
                self.link.check()  # UNREACHABLE / UNAUTHORIZED as soon as the monitor knows
                if time.monotonic() >= deadline:
                    raise make_error(
                        ErrorCode.TIMEOUT,
                        f"could not send to {self.addr} within {self.timeout}s (no connection)",
                    ) from None
                self.sock.poll(100, zmq.POLLOUT)

    def recv(self, timeout: float) -> schema.Message | Reconnected | None:
        """The next reply; None when `timeout` passes; RECONNECTED when the connection was
        re-established (requests in flight died with the old one: resend them now).
        Raises UNREACHABLE / UNAUTHORIZED as soon as the socket monitor shows it."""
        if self._early:
            return self._early.popleft()
        deadline = time.monotonic() + timeout
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.link.monitor, zmq.POLLIN)
        while True:
            self.link.check()
            if self.link.take_reconnect():
                return RECONNECTED
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            events = dict(poller.poll(int(min(left, 0.5) * 1000)))
            if self.sock in events:
                frames = self.sock.recv_multipart()
                return codec.decode(frames, allowed=schema.TO_TRAINER).msg

    def take_replies(self, stop_on: Callable[[schema.Message], bool]) -> schema.Message | None:
        """Read what has arrived without waiting, keeping it for `recv`; the first reply for
        which `stop_on` holds is returned too (e.g. an error for the running sync)."""
        while True:
            try:
                frames = self.sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return None
            reply = codec.decode(frames, allowed=schema.TO_TRAINER).msg
            self._early.append(reply)
            if stop_on(reply):
                return reply

    def pushed_error(self, sync_id: str, wait: float = 0.0) -> schema.Error | None:
        """An error the daemon sent unasked (id 0) about `sync_id`, waiting up to `wait`
        seconds for it: how a sync on a group's stream, which has no request in
        flight, hears of its failure (the push follows the failure's journal write, so a
        refusal answered at once can overtake it)."""
        deadline = time.monotonic() + wait
        while True:
            self.take_replies(lambda _r: False)
            for r in (*self._pushed, *self._early):
                if isinstance(r, schema.Error) and r.id == 0 and r.sync_id == sync_id:
                    return r
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self.sock.poll(int(min(left, 0.05) * 1000) + 1)

    def request(
        self,
        make: Callable[[int], schema.Message],
        timeout: float | None = None,
        payload: Sequence[codec.Frame] = (),
        retries: int | None = None,
    ) -> JsonObject:
        """Send `make(id)`; resend with a new id on timeout; return the ok body or raise."""
        timeout = self.timeout if timeout is None else timeout
        retries = self.retries if retries is None else retries
        ids: set[int] = set()
        for attempt in range(retries + 1):
            rid = self.new_id()
            ids.add(rid)
            self.send(make(rid), payload)
            deadline = time.monotonic() + timeout
            while (left := deadline - time.monotonic()) > 0:
                reply = self.recv(left)
                if reply is None or isinstance(reply, Reconnected):
                    break
                if getattr(reply, "id", None) not in ids:
                    if isinstance(reply, schema.Error) and reply.id == 0:
                        self._pushed.append(reply)  # unasked: kept for `pushed_error`
                    continue  # a late reply to an earlier request
                if isinstance(reply, schema.Error):
                    if reply.code == ErrorCode.WRONG_SOCKET.value:  # this address is the engine socket
                        raise make_error(
                            ErrorCode.WRONG_SOCKET,
                            wrong_socket_line(self.addr, reply.details or {}),
                            details=reply.details,
                        )
                    raise error_from_reply(reply)
                return reply.body if isinstance(reply, schema.Ok) else {}
            if attempt < retries:
                log.warning("request_resent", attempt=attempt + 2, timeout=timeout, type=make(0).TYPE)
        raise make_error(
            ErrorCode.TIMEOUT, f"no reply from {self.addr} after {retries + 1} attempt(s) of {timeout}s"
        )
