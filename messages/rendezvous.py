"""A group's rendezvous store, over ZeroMQ: bound to one address, closed to
anyone without the group's token, encrypted and server-authenticated with CURVE when the
deployment uses keys.

Why not torch's TCPStore: it listens on every interface (`::`) whatever host it is given,
and answers anyone who reaches the port, so any host could write into the rendezvous of a
group that carries the model's weights. This store is a `torch.distributed.Store` (gloo
and NCCL rendezvous through it unchanged) whose server is the trainer (rank 0).

Rules:
- The server binds `tcp://HOST:0` on the trainer's group host only. Its thread owns
  the socket; every request is answered, a blocking `get`/`wait` is parked until its keys
  exist or its deadline passes (then it is answered with a timeout).
- Every request carries the token (32 random bytes, hex) the trainer offered in `begin`;
  the daemon hands it to the group's members over its own (CURVE-protected, with keys)
  sockets. A request without it gets no answer but a refusal, and changes nothing.
- With keys, the server has a fresh CURVE keypair per store; its public key travels
  beside the token, so members know they talk to the trainer and nobody reads the
  rendezvous. Without keys, the token still keeps strangers out (in clear text, like the
  control plane it travels on).
- Wire: MessagePack lists, no pickle. Request [token, op, key, arg, timeout_s]; reply
  [status, value] with status "ok" | "timeout" | "refused" | "error".
- A client's socket is owned by the thread that uses it (one per thread, made on first
  use): gloo calls the store from the thread that builds the process group.
"""

from __future__ import annotations

import contextlib
import datetime
import hmac
import math
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import torch.distributed as dist
import zmq

from messages.liblog import get_logger

log = get_logger("group")

OPS = ("set", "get", "add", "check", "wait", "compare_set", "delete", "num_keys")
MAX_KEY = 1024
MAX_VALUE = 1 << 20
MAX_KEYS = 1 << 16
MAX_WAIT = 86400.0  # seconds a request may wait for its keys

# What an answer carries: an op's result (`StoreServer._apply`) or, with another status, why.
Answer = bytes | int | bool | str | None


class StoreError(RuntimeError):
    """A store request failed (refused, timed out, or the server is gone)."""


class StoreServer:
    """The trainer's side: a thread serving one group session's keys."""

    def __init__(self, host: str, *, curve: bool = False) -> None:
        self.token = secrets.token_hex(32)
        self.public_key = ""
        sock: zmq.SyncSocket = zmq.Context.instance().socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, 4 * MAX_VALUE)
        if curve:
            public, secret = zmq.curve_keypair()
            sock.setsockopt(zmq.CURVE_SERVER, 1)
            sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
            self.public_key = public.decode()
        bracket = f"[{host}]" if ":" in host else host
        if ":" in host:
            sock.setsockopt(zmq.IPV6, 1)
        sock.bind(f"tcp://{bracket}:0")
        self.host = host
        self.port = int(sock.get_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
        self._sock: zmq.SyncSocket | None = sock  # handed to the thread, never used here again
        self._stop = threading.Event()
        self._data: dict[str, bytes] = {}
        self._parked: list[tuple[float, list[bytes], str, list[str]]] = []
        self._changed = False
        self._thread = threading.Thread(target=self._run, name="weightsync-store", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5.0)

    # -- the server thread --------------------------------------------------------------
    def _run(self) -> None:
        sock, self._sock = self._sock, None
        if sock is None:
            return
        try:
            while not self._stop.is_set():
                timeout = 100
                if self._parked:
                    soonest = min(p[0] for p in self._parked)
                    timeout = max(0, min(timeout, int((soonest - time.monotonic()) * 1000) + 1))
                if sock.poll(timeout):
                    self._handle(sock, sock.recv_multipart())
                self._answer_parked(sock)
        finally:
            sock.close(linger=0)

    def _reply(self, sock: zmq.SyncSocket, route: list[bytes], status: str, value: Answer = None) -> None:
        sock.send_multipart([*route, msgspec.msgpack.encode([status, value])])

    def _handle(self, sock: zmq.SyncSocket, frames: list[bytes]) -> None:
        route, body = frames[:-1], frames[-1]
        try:
            req = msgspec.msgpack.decode(body)
            token, op, key, arg, timeout = req
            if not isinstance(token, str) or not hmac.compare_digest(token, self.token):
                log.warning("store_refused", reason="wrong token")
                return self._reply(sock, route, "refused", "wrong token")
            if op not in OPS:
                return self._reply(sock, route, "error", f"unknown op {op!r}")
            if (
                isinstance(timeout, bool)
                or not isinstance(timeout, int | float)
                or not math.isfinite(timeout)
                or not 0 <= timeout <= MAX_WAIT
            ):
                return self._reply(sock, route, "error", f"bad timeout {timeout!r} (0 to {MAX_WAIT} s)")
            keys = key if op in ("check", "wait") else [key]
            if (
                not isinstance(keys, list)
                or len(keys) > MAX_KEYS
                or not all(isinstance(k, str) and len(k) <= MAX_KEY for k in keys)
            ):
                return self._reply(sock, route, "error", "bad key")
            if op in ("get", "wait") and not all(k in self._data for k in keys):
                self._parked.append((time.monotonic() + float(timeout), route, op, keys))
                return None
            return self._reply(sock, route, "ok", self._apply(op, keys, arg))
        except (msgspec.DecodeError, ValueError, TypeError) as exc:
            return self._reply(sock, route, "error", f"bad request: {exc}")

    def _apply(self, op: str, keys: list[str], arg: Any) -> bytes | int | bool | None:
        # `arg`: whatever the request decoded to, unchecked (a wrong one raises, answered as an error)
        d, key = self._data, keys[0]
        if op in ("set", "add", "compare_set"):
            self._changed = True  # parked requests may be answerable now
        if op == "set":
            d[key] = _value(arg)
        elif op == "get":
            return d[key]
        elif op == "add":
            d[key] = str(int(d.get(key, b"0")) + int(arg)).encode()
            return int(d[key])
        elif op == "check":
            return all(k in d for k in keys)
        elif op == "wait":
            return None
        elif op == "compare_set":
            expected, desired = _value(arg[0]), _value(arg[1])
            cur = d.get(key)
            if (cur is None and expected == b"") or cur == expected:
                d[key] = desired
                return desired
            return expected if cur is None else cur
        elif op == "delete":
            return d.pop(key, None) is not None
        elif op == "num_keys":
            return len(d)
        return None

    def _answer_parked(self, sock: zmq.SyncSocket) -> None:
        """Answer the parked requests whose keys now exist, or whose deadline passed."""
        if not self._parked:
            return
        now = time.monotonic()
        if not self._changed and now < min(p[0] for p in self._parked):
            return
        self._changed, keep = False, []
        for deadline, route, op, keys in self._parked:
            if all(k in self._data for k in keys):
                self._reply(sock, route, "ok", self._data[keys[0]] if op == "get" else None)
            elif now >= deadline:
                self._reply(sock, route, "timeout", f"keys {keys[:3]} not set in time")
            else:
                keep.append((deadline, route, op, keys))
        self._parked = keep


def _value(v: object) -> bytes:
    if isinstance(v, bytes):
        if len(v) > MAX_VALUE:
            raise ValueError("value too large")
        return v
    if isinstance(v, str):
        return _value(v.encode())
    if isinstance(v, (list, tuple)):  # torch hands values as lists of ints (std::vector<uint8_t>)
        return _value(bytes(v))
    raise TypeError(f"value of type {type(v).__name__}")


class StoreClient(dist.Store):
    """A member's side: a torch.distributed Store whose keys live on the trainer's server."""

    def __init__(
        self,
        host: str,
        port: int,
        token: str,
        server_key: str = "",
        timeout: float = 300.0,
        source: str = "",
    ) -> None:
        """source: the local address to connect from ("": the route's)."""
        super().__init__()
        bracket = f"[{host}]" if ":" in host else host
        self.endpoint = f"tcp://{bracket}:{port}"
        self._connect = self.endpoint
        if source:
            src = f"[{source}]" if ":" in source else source
            self._connect = f"tcp://{src}:0;{bracket}:{port}"
        self.token = token
        self.server_key = server_key
        self._timeout = timeout
        self._local = threading.local()
        self._sockets: list[zmq.SyncSocket] = []
        self._lock = threading.Lock()  # guards the list of sockets only, never a socket

    # -- transport ------------------------------------------------------------------------
    def _socket(self) -> zmq.SyncSocket:
        have: zmq.SyncSocket | None = getattr(self._local, "sock", None)
        if have is not None:
            return have
        sock: zmq.SyncSocket = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if ":" in self.endpoint.split("//", 1)[1].rsplit(":", 1)[0]:
            sock.setsockopt(zmq.IPV6, 1)
        if self.server_key:
            public, secret = zmq.curve_keypair()
            sock.setsockopt(zmq.CURVE_SERVERKEY, self.server_key.encode())
            sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
        sock.connect(self._connect)
        self._local.sock = sock
        with self._lock:
            self._sockets.append(sock)
        return sock

    @contextlib.contextmanager
    def interruptible(self, give_up: Callable[[], str | None] | None) -> Iterator[None]:
        """While inside, this thread's waits on the store end as soon as `give_up()` says
        why (StoreError): a rendezvous (the backend's own, which waits through this store)
        is left when the sync it is for has ended, not at the group's deadline."""
        before = getattr(self._local, "give_up", None)
        self._local.give_up = give_up
        try:
            yield
        finally:
            self._local.give_up = before

    def _call(
        self,
        op: str,
        key: str | list[str],
        arg: bytes | int | list[bytes] | None = None,
        wait: float | None = None,
    ) -> Any:  # the answer as decoded, unchecked: each caller converts it
        timeout = self._timeout if wait is None else wait
        sock = self._socket()
        sock.send(msgspec.msgpack.encode([self.token, op, key, arg, timeout]))
        give_up: Callable[[], str | None] | None = getattr(self._local, "give_up", None)
        deadline = time.monotonic() + timeout + 2.0
        while not sock.poll(int(max(0.0, min(deadline - time.monotonic(), 0.05 if give_up else 1e9)) * 1000)):
            why = give_up() if give_up is not None else None
            if why is None and time.monotonic() < deadline:
                continue
            self._drop(sock)  # a late answer must not be read as the next request's
            raise StoreError(
                f"rendezvous store {self.endpoint}: {op} given up: {why}"
                if why is not None
                else f"rendezvous store {self.endpoint}: no answer to {op} within {timeout + 2.0:.1f}s"
            )
        status, value = msgspec.msgpack.decode(sock.recv())
        if status == "ok":
            return value
        if status == "timeout":
            raise StoreError(f"rendezvous store {self.endpoint}: timed out waiting for {value}")
        raise StoreError(f"rendezvous store {self.endpoint}: {status}: {value}")

    def _drop(self, sock: zmq.SyncSocket) -> None:
        self._local.sock = None
        with self._lock:
            self._sockets.remove(sock)
        sock.close(linger=0)

    def close(self) -> None:
        """Close every thread's socket (call when no thread uses the store any more)."""
        with self._lock:
            socks, self._sockets = self._sockets, []
        for s in socks:
            s.close(linger=0)

    # -- torch.distributed.Store ------------------------------------------------------------
    def set(self, key: str, value: str | bytes | list[int]) -> None:
        self._call("set", key, _value(value))

    def get(self, key: str) -> bytes:
        return bytes(self._call("get", key))

    def add(self, key: str, amount: int) -> int:
        return int(self._call("add", key, int(amount)))

    def check(self, keys: list[str]) -> bool:
        return bool(self._call("check", list(keys)))

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        self._call("wait", list(keys), None, None if timeout is None else timeout.total_seconds())

    def compare_set(
        self, key: str, expected: str | bytes | list[int], desired: str | bytes | list[int]
    ) -> bytes:
        return bytes(self._call("compare_set", key, [_value(expected), _value(desired)]))

    def delete_key(self, key: str) -> bool:
        return bool(self._call("delete", key))

    def num_keys(self) -> int:
        return int(self._call("num_keys", ""))
