"""Receive group buckets ahead of the applier, so bucket N+1 crosses the network
while bucket N is verified and copied into the model.

Rules: one thread owns the group (it alone joins, receives and closes it), receiving in
the order the daemon announced the buckets, at most `depth` buckets ahead: a buffer is
reused only after the applier released the bucket received into it. Each announced
bucket gets a future; the applier takes them in the same order and releases each one
after use, also when it skips a bucket of a failed sync. Closing is queued like a
receive, so it never races a broadcast in progress.
"""

from __future__ import annotations

import os
import queue
import signal
import threading
from concurrent.futures import Future
from typing import Literal, TypeAlias

import torch

from messages import schema, stream
from messages.distgroup import GroupError, Member

# What a stream's receiver hands the applier, in order: each bucket (its header, the
# payload past its bytes: metadata then the MAC if any, and a view of its bytes in the
# receive buffer), then the end (its header); or the failure that ended it.
StreamItem: TypeAlias = (
    "tuple[Literal['bucket'], stream.Header, bytes, torch.Tensor]"
    " | tuple[Literal['end'], stream.Header, None, None]"
    " | tuple[Literal['error'], BaseException, None, None]"
)
# The group thread's jobs, in order: receive an announced bucket, receive a whole stream,
# close the groups, keep only those a sync used.
_Job: TypeAlias = (
    "tuple[Literal['receive'], tuple[schema.Load, threading.Event | None], Future[torch.Tensor]]"
    " | tuple[Literal['stream'], tuple[schema.OpenStream, queue.Queue[StreamItem], threading.Event,"
    " threading.Semaphore], None]"
    " | tuple[Literal['close'], None, None]"
    " | tuple[Literal['keep'], str, None]"
)


class Prefetcher(threading.Thread):
    def __init__(self, bind: str = "", depth: int = 2, failpoints: dict[str, float] | None = None) -> None:
        super().__init__(name="engine-group-receiver", daemon=True)
        self.member = Member(bind, slots=depth)
        self.failpoints = failpoints or {}
        self._slots = threading.Semaphore(depth)
        self._jobs: queue.Queue[_Job | None] = queue.Queue()

    def submit(self, msg: schema.Load, cancelled: threading.Event | None = None) -> Future[torch.Tensor]:
        """Receive this announced bucket (a `load` with `group`) as soon as a buffer is free;
        `cancelled` set (the sync ended here) ends the wait, joining included."""
        fut: Future[torch.Tensor] = Future()
        self._jobs.put(("receive", (msg, cancelled), fut))
        return fut

    def release(self) -> None:
        """The applier is done with the oldest received bucket: its buffer may be reused."""
        self._slots.release()

    def submit_stream(
        self,
        msg: schema.OpenStream,
        out: queue.Queue[StreamItem],
        cancelled: threading.Event,
        free: threading.Semaphore,
    ) -> None:
        """Receive a whole group stream (`stream` message): each framed bucket goes to
        `out` as ("bucket", header, metas bytes, payload view) once `free` (this stream's
        own count of free buffers, released by the applier) allows, then ("end", header);
        a failure goes as ("error", exception) and ends it. A stream given up with buckets
        still queued leaks only its own count, never the next stream's."""
        self._jobs.put(("stream", (msg, out, cancelled, free), None))

    def close_group(self) -> None:
        self._jobs.put(("close", None, None))

    def keep_used(self, sync_id: str) -> None:
        """Once the receives queued before it ran: close the groups `sync_id` did not use."""
        self._jobs.put(("keep", sync_id, None))

    def stop(self) -> None:
        self._jobs.put(None)

    def run(self) -> None:
        while (job := self._jobs.get()) is not None:
            if job[0] == "stream":
                self._stream(*job[1])
                continue
            if job[0] == "keep":
                self.member.keep_used(job[1])
                continue
            if job[0] == "close" or job[2] is None:
                self.member.close()
                continue
            (msg, cancelled), fut = job[1], job[2]
            self._slots.acquire()

            def give_up(ev: threading.Event | None = cancelled) -> str | None:
                return "the sync ended here" if ev is not None and ev.is_set() else None

            try:
                group, size = msg.group, msg.size
                if group is None or size is None:  # the applier submits group loads only (typing)
                    raise GroupError(f"bucket seq {msg.seq}: not a group load")
                if self.failpoints.get("kill_in_broadcast", -1) == msg.seq:  # fault injection
                    self.member.ensure(group.to_wire())
                    os.kill(os.getpid(), signal.SIGKILL)
                fut.set_result(self.member.receive(group.to_wire(), size, give_up, msg.sync_id))
            except BaseException as exc:  # handed to the applier, which reports it typed
                fut.set_exception(exc)
        self.member.close()

    def _stream(
        self,
        msg: schema.OpenStream,
        out: queue.Queue[StreamItem],
        cancelled: threading.Event,
        free: threading.Semaphore,
    ) -> None:
        """The receive loop of one group stream, on this (the group's) thread."""
        ref = msg.group.to_wire()

        def give_up() -> str | None:
            return "the sync ended here" if cancelled.is_set() else None

        try:
            g = self.member.ensure(ref, give_up, msg.sync_id)
            head = torch.empty(stream.HEADER_BYTES, dtype=torch.uint8, device=g.device)
            while True:
                g.wait(g.start(head), give_up=give_up)
                h = stream.decode_header(bytes(head.cpu().numpy()))
                if h.kind == stream.END:
                    out.put(("end", h, None, None))
                    return
                if self.failpoints.get("kill_in_broadcast", -1) == h.seq:  # fault injection
                    os.kill(os.getpid(), signal.SIGKILL)
                while not free.acquire(timeout=0.05):  # a buffer the applier released
                    if cancelled.is_set():
                        raise GroupError("the sync ended here")
                view = self.member.buffer(h.payload_len, g.device)  # bytes, metadata, MAC
                work = g.start(view)
                if self.failpoints.get("kill_in_receive", -1) == h.seq:  # fault injection:
                    os.kill(os.getpid(), signal.SIGKILL)  # dies with the receive posted
                g.wait(work, give_up=give_up)
                out.put(("bucket", h, bytes(view[h.data_len :].cpu().numpy()), view[: h.data_len]))
        except BaseException as exc:  # handed to the applier, which reports it typed
            self.member.close()  # the stream is broken: the trainer's broadcast fails at once
            out.put(("error", exc, None, None))
