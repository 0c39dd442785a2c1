"""The daemon's sockets: two ROUTERs, and the only code that sends on them.

Rules: mixed into `service.Service`; every method runs on the daemon's one event-loop
task, which owns both sockets (pyzmq sockets are not thread-safe). Sends never block:
HWMs are 0 and traffic is bounded by each trainer's window, so a send completes at once;
ROUTER_MANDATORY turns an unknown peer into an error here, not a silent drop.
"""

from __future__ import annotations

import socket as pysocket
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog
import zmq

from messages import codec, schema
from messages.errors import MessageError, WeightSyncError, make_error

log = structlog.get_logger()


@dataclass(slots=True)
class Waiter:
    ident: bytes
    req_id: int
    # Set for the daemon's own requests (rollback): the reply goes here, not to a socket.
    on_reply: Callable[[dict[str, Any] | None, WeightSyncError | None], None] | None = None


@dataclass(slots=True)
class Pending:
    """Frames of a bucket between its arrival and its forwarding."""

    msg: schema.Bucket
    frame: Any


@dataclass(slots=True)
class Stats:
    buckets: int = 0
    bytes_in: int = 0  # bucket bytes that passed through the daemon
    bytes_announced: int = 0  # bucket bytes of every sync, however they travelled
    errors: dict[str, int] = field(default_factory=lambda: defaultdict(int))


def refuse_live_ipc(addr: str) -> None:
    """ZeroMQ silently takes over an ipc:// path another process is bound to (it unlinks
    the file), which would split engines between two daemons. Refuse if someone answers."""
    if not addr.startswith("ipc://"):
        return
    path = addr[len("ipc://"):]
    probe = pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_STREAM)
    try:
        probe.connect(path)
    except (FileNotFoundError, ConnectionRefusedError):
        return  # nobody there (or a stale file ZeroMQ will replace)
    except OSError:
        return
    finally:
        probe.close()
    raise OSError(f"{addr} is in use by another process")


class Transport:
    def _router(self, addr: str, max_msg: int, role: str) -> zmq.Socket:
        refuse_live_ipc(addr)
        sock = self.ctx.socket(zmq.ROUTER)
        if self.auth is not None:
            self.auth.apply(sock, role)
        sock.setsockopt(zmq.MAXMSGSIZE, max_msg)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unknown peer is an error, not a drop
        sock.setsockopt(zmq.LINGER, 500)
        sock.setsockopt(zmq.SNDHWM, 0)  # bounded by the window, not by a silent drop
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.bind(addr)
        return sock

    @staticmethod
    def _send_now(sock: zmq.Socket, frames: list[Any]) -> None:
        """Send without blocking; a send error is raised here, to the caller.

        HWMs are 0 and messages are bounded by the client's window, so a send completes
        at once; ROUTER_MANDATORY makes an unknown peer an error (EHOSTUNREACH).
        """
        sock.send_multipart(frames, copy=False, flags=zmq.NOBLOCK)

    def _send_trainer(self, ident: bytes, msg: schema.Message) -> None:
        try:
            self._send_now(self.trainer_sock, [ident, codec.encode_header(msg)])
        except zmq.ZMQError as exc:  # the trainer went away; its sync's deadline handles it
            log.warning("reply_undeliverable", error=str(exc), type=msg.TYPE)

    def _reply_engine(self, ident: bytes, msg: schema.Message) -> None:
        try:
            self._send_now(self.engine_sock, [ident, codec.encode_header(msg)])
        except zmq.ZMQError as exc:  # the engine went away; its heartbeat deadline handles it
            log.warning("reply_undeliverable", error=str(exc), type=msg.TYPE, src="engine")

    def _reply_ok(self, w: Waiter, body: dict[str, Any]) -> None:
        if w.on_reply is not None:
            w.on_reply(body, None)
            return
        self._send_trainer(w.ident, schema.Ok(id=w.req_id, body=body))

    def _reply_error(self, w: Waiter, err: WeightSyncError | MessageError) -> None:
        if isinstance(err, MessageError):
            err = make_error(err.code, err.reason, state=self.core.state.value,
                             version=self.core.served_version,
                             sync_id=self.core.sync.sync_id if self.core.sync else None)
        if w.on_reply is not None:
            w.on_reply(None, err)
            return
        self.stats.errors[err.code.value] += 1
        f = err.to_fields()
        self._send_trainer(w.ident, schema.Error(id=w.req_id, code=f["code"], message=f["message"],
                                                 state=f["state"], version=f["version"],
                                                 sync_id=f["sync_id"], details=f.get("details")))

    def _send_engine(self, engine_id: str, frames: list[Any]) -> bool:
        ident = self.engine_ident.get(engine_id)
        if ident is None:
            return False
        try:
            self._send_now(self.engine_sock, [ident, *frames])
            return True
        except zmq.ZMQError as exc:
            log.warning("engine_unreachable", engine_id=engine_id, error=str(exc))
            return False

    def send_engine(self, engine_id: str, frames: list[Any]) -> bool:
        return self._send_engine(engine_id, frames)
