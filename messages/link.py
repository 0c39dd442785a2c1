"""What a client's DEALER connection is doing, from its socket monitor.

Rules: ZeroMQ reconnects silently, so a request to a dead address or a refused CURVE
key would otherwise look like a slow daemon. The monitor tells them apart within
seconds: nothing ever accepted the connection (UNREACHABLE), or the security handshake
failed or never completed (UNAUTHORIZED). A handshake that succeeds again after a
disconnect is a reconnect: requests in flight were lost with the old connection and
the caller resends them at once instead of waiting out a timeout. The monitor socket is
used by the thread that owns the client's socket, like the socket itself.
"""

from __future__ import annotations

import re
import time

import zmq
from zmq.utils.monitor import parse_monitor_message

from messages.errors import ErrorCode, make_error

_EVENTS = (
    zmq.EVENT_CONNECTED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
    zmq.EVENT_HANDSHAKE_FAILED_AUTH,
)


class AddressError(ValueError):
    """An address ZeroMQ cannot use (a usage error: the CLI exits 2), naming it and, when
    the scheme is missing, the address that was most likely meant."""


def address_hint(addr: str, bind: bool = False) -> str:
    """What to write instead of `addr`, which ZeroMQ refused: `tcp://HOST:PORT` for a bare
    HOST:PORT (`*:PORT` only where it binds), `ipc://PATH` for a bare path, else the two
    usual forms."""
    host = r"(\*|[\w.-]+|\[[0-9A-Fa-f:.]+\])" if bind else r"([\w.-]+|\[[0-9A-Fa-f:.]+\])"
    if "://" not in addr:
        if re.fullmatch(host + r":\d{1,5}", addr):
            return f"did you mean 'tcp://{addr}'?"
        if addr.startswith(("/", "./", "../")):
            return f"did you mean 'ipc://{addr}'?"
    return "e.g. tcp://HOST:PORT or ipc:///PATH"


class Reconnected:
    """`_recv`'s answer when the connection came back: resend what is in flight."""


RECONNECTED = Reconnected()


class Link:
    def __init__(
        self, sock: zmq.SyncSocket, addr: str, connect_timeout: float, reconnect_timeout: float
    ) -> None:
        self.monitor: zmq.SyncSocket = sock.get_monitor_socket(_EVENTS)
        self.sock = sock
        self.addr = addr
        self.connect_timeout = connect_timeout
        self.reconnect_timeout = reconnect_timeout
        self.up = False  # handshake done and no disconnect since
        self.tcp_seen = False  # something accepted a connection since we started waiting
        self.ever_up = False
        self.reconnected = False  # up again after a disconnect: resend what was in flight
        self.failure: str | None = None
        self.down_since = time.monotonic()
        self.drops = 0  # connections lost after their handshake (a daemon restart is one)

    def pump(self) -> None:
        while True:
            try:
                frames = self.monitor.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            ev = parse_monitor_message(frames)["event"]
            if ev == zmq.EVENT_CONNECTED:
                self.tcp_seen = True
            elif ev == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.reconnected = self.ever_up
                self.up = self.ever_up = True
                self.failure = None
            elif ev == zmq.EVENT_DISCONNECTED:
                if self.up:
                    self.down_since = time.monotonic()
                    self.tcp_seen = False
                    self.drops += 1
                self.up = False
            elif ev in _FAILED:
                why: dict[int, str] = {
                    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "the daemon refused this client's key",
                    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "security mechanism mismatch (CURVE on "
                    "one side only?)",
                }
                self.failure = why.get(int(ev), "the daemon's public key does not match --keys")

    def check(self) -> None:
        """Raise UNAUTHORIZED or UNREACHABLE once the monitor has shown it."""
        self.pump()
        if self.up:
            return
        if self.failure is not None:
            raise make_error(
                ErrorCode.UNAUTHORIZED, f"{self.addr}: security handshake failed: {self.failure}"
            )
        waited = time.monotonic() - self.down_since
        limit = self.reconnect_timeout if self.ever_up else self.connect_timeout
        if waited < limit:
            return
        if self.tcp_seen:
            raise make_error(
                ErrorCode.UNAUTHORIZED,
                f"{self.addr} accepted the connection but the "
                f"handshake did not complete in {limit:g}s (wrong --keys?)",
            )
        what = "lost the daemon at" if self.ever_up else "no daemon at"
        raise make_error(
            ErrorCode.UNREACHABLE, f"{what} {self.addr}: nothing accepted a connection for {waited:.1f}s"
        )

    def take_reconnect(self) -> bool:
        hit, self.reconnected = self.reconnected, False
        return hit

    def close(self) -> None:
        close_monitor(self.sock, self.monitor)


def close_monitor(sock: zmq.SyncSocket, monitor: zmq.SyncSocket) -> None:
    """Stop a socket's monitor and close its PAIR end (before the socket itself closes)."""
    try:
        sock.disable_monitor()
    except zmq.ZMQError:
        pass
    monitor.close(linger=0)
