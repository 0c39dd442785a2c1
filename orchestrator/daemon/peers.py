"""Which peers of a ROUTER socket are still connected.

Rules: ZeroMQ hides connections behind routing ids, and libzmq's ROUTER_NOTIFY is a
draft API the released wheels lack. So each received message's source fd (`SRCFD`)
is noted against its routing id, and the socket's monitor reports `DISCONNECTED` by
fd: the routing ids last seen on that fd are gone. The monitor socket is read by the
task that owns the ROUTER, like the ROUTER itself. A disconnect is a fact about a
connection, never a verdict: callers decide what it means (a grace period, a check).
"""

from __future__ import annotations

import zmq
from zmq.utils.monitor import parse_monitor_message

from messages.link import close_monitor


class PeerTracker:
    def __init__(self, sock: zmq.SyncSocket) -> None:
        self.monitor: zmq.SyncSocket = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._sock = sock
        self._fd_of: dict[bytes, int] = {}
        self._on_fd: dict[int, set[bytes]] = {}
        self._gone: list[bytes] = []  # read from the monitor early (an fd was reused), not yet drained

    def seen(self, ident: bytes, frame: zmq.Frame) -> None:
        """A message from `ident` arrived in `frame` (a zmq.Frame received copy=False)."""
        try:
            fd = frame.get(zmq.SRCFD)
        except (zmq.ZMQError, AttributeError, TypeError):
            return
        old = self._fd_of.get(ident)
        if old == fd:
            return
        holders = self._on_fd.get(fd)
        if holders and ident not in holders:
            # Another connection on a known fd: the old one closed and the kernel reused its
            # fd, and its DISCONNECTED is queued on the monitor already (libzmq reports it
            # before it closes the fd). Read it now, so it never takes the new holder along.
            self._gone += self._read_events()
        if old is not None:
            self._on_fd.get(old, set()).discard(ident)
        self._fd_of[ident] = fd
        self._on_fd.setdefault(fd, set()).add(ident)

    def connected(self, ident: bytes) -> bool:
        """False once a disconnect of `ident`'s last connection was reported."""
        return ident in self._fd_of

    @property
    def pending(self) -> bool:
        """Disconnects read early, waiting for `drain`."""
        return bool(self._gone)

    def drain(self) -> list[bytes]:
        """Routing ids whose connection closed since the last call."""
        gone, self._gone = self._gone, []
        return gone + self._read_events()

    def _read_events(self) -> list[bytes]:
        gone: list[bytes] = []
        while True:
            try:
                frames = self.monitor.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return gone
            event = parse_monitor_message(frames)
            if event["event"] != zmq.EVENT_DISCONNECTED:
                continue
            for ident in self._on_fd.pop(int(event["value"]), set()):
                self._fd_of.pop(ident, None)
                gone.append(ident)

    def close(self) -> None:
        close_monitor(self._sock, self.monitor)
