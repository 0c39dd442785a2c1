"""A scripted engine and trainer over raw ZeroMQ sockets, speaking the public protocol.

They let tests put a real daemon in any state (a sync loading, finalizing, READY) with
nothing but wire messages, and then send it hostile ones. Each socket is used by the
test thread only.
"""

from __future__ import annotations

import socket
from typing import Any

import msgpack
import zmq

from messages import codec, schema

HOST = socket.gethostname()


class Peer:
    def __init__(self, addr: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(addr)
        self._id = 1000

    def send(self, msg: schema.Message, payload: tuple[Any, ...] = ()) -> None:
        self.sock.send_multipart(codec.encode(msg, payload))

    def send_raw(self, header: dict[str, Any] | bytes, payload: tuple[Any, ...] = ()) -> None:
        raw = header if isinstance(header, bytes) else msgpack.packb(header, use_bin_type=True)
        self.sock.send_multipart([raw, *payload])

    def recv(self, timeout: float = 2.0) -> schema.Message | None:
        if not self.sock.poll(int(timeout * 1000)):
            return None
        frames = self.sock.recv_multipart()
        return codec.decode(frames, allowed=("ok", "error", "load", "finalize", "abort")).msg

    def recv_type(self, kind: type, timeout: float = 5.0) -> Any:
        """The next message of `kind`, skipping others (e.g. heartbeat replies)."""
        while True:
            m = self.recv(timeout)
            if m is None:
                raise AssertionError(f"no {getattr(kind, '__name__', kind)} within {timeout}s")
            if isinstance(m, kind):
                return m

    def request(self, msg: schema.Message, payload: tuple[Any, ...] = (), timeout: float = 5.0) -> Any:
        """Send `msg` under a fresh id; its reply (others still in flight are skipped)."""
        import msgspec

        self._id += 1
        self.send(msgspec.structs.replace(msg, id=self._id), payload)
        while True:
            reply = self.recv_type((schema.Ok, schema.Error), timeout)  # type: ignore[arg-type]
            if reply.id == self._id:
                return reply

    def drain(self) -> None:
        while self.recv(0.0) is not None:
            pass

    def close(self) -> None:
        self.sock.close(linger=0)


class ScriptedEngine(Peer):
    """Registers with a one-tensor spec (`w`: float32[4]) and answers only when told."""

    SPEC = (schema.ParamSpec("w", "float32", (4,)),)

    def __init__(self, addr: str, engine_id: str = "scripted-0", transports: tuple[str, ...] = ("inline",)):
        super().__init__(addr)
        self.engine_id = engine_id
        reply = self.request(
            schema.Register(
                engine_id=engine_id,
                backend="scripted",
                transports=transports,
                host=HOST,
                pid=4242,
                spec=self.SPEC,
            )
        )
        if not isinstance(reply, schema.Ok):
            raise AssertionError(f"register refused: {reply}")

    def heartbeat(self) -> None:
        self.send(schema.Heartbeat(engine_id=self.engine_id))

    def ack_load(self, timeout: float = 5.0, sync_id: str | None = None) -> schema.Load:
        """Acknowledge the next load (of `sync_id`: older syncs' loads are skipped)."""
        while True:
            load = self.recv_type(schema.Load, timeout)
            if sync_id is None or load.sync_id == sync_id:
                break
        self.send(schema.Loaded(sync_id=load.sync_id, seq=load.seq, source=load.source))
        return load

    def finalize(
        self, digest: str = "abc123", timeout: float = 5.0, sync_id: str | None = None
    ) -> schema.Finalize:
        while True:
            fin = self.recv_type(schema.Finalize, timeout)
            if sync_id is None or fin.sync_id == sync_id:
                break
        self.send(schema.Finalized(sync_id=fin.sync_id, version=fin.version, digest=digest, finalize_count=1))
        return fin


def bucket_frames(sync_id: str, seq: int = 0, value: float = 1.0) -> tuple[schema.Bucket, bytes]:
    import struct

    from messages.checksums import bucket_checksum

    frame = struct.pack("<4f", value, value, value, value)
    meta = (schema.TensorMeta("w", "float32", (4,), 0, 16),)
    return schema.Bucket(sync_id=sync_id, seq=seq, tensors=meta, checksum=bucket_checksum(frame, meta)), frame
